"""A batch's sharding contexts: each sharding's output dist gets the context made for it in the same batch's input
dist, ours carrying the state their own input dist cut from that batch, in a sharded EBC and EC that mix TorchRec's
sharding types with ours (EmbarkShardedModule). TorchRec's input_dist appends one context per sharding and its
output dists read the i-th; ours are swapped in and read back only through `EmbarkShardedModule.sharding_contexts`.

One 2-rank spawn builds a sharded EBC and a sharded EC, each with TorchRec's table-wise and row-wise tables and our
grid and unique-based ones, and records one training step (after the first, which builds the lazy input dists).
"""

from __future__ import annotations

import ast
import pathlib
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import embark_torchrec.sharding as sharding_package
from embark_torchrec.plan.layout.groups import ShardingGroup
from embark_torchrec.plan.layout.tables import TableLayout
from embark_torchrec.plan.layout.torchrec_types import ceil_row_bounds
from embark_torchrec.sharding.sharded_module import EmbarkShardedModule
from embark_torchrec.sharding.torchrec_compat import module_input_dists, module_output_dists
from embark_torchrec.testing import global_kjt_batch, run_ranks
from embark_torchrec.testing.sequence import sharded_sequence_model
from embark_torchrec.testing.training import sharded_model

pytestmark = pytest.mark.torchrec_version

WS, BATCH, DIM = 2, 4, 8
STATES = ("unique", "placement")  # where our contexts carry their input dist's state (UB; the sequence grid)


def _layouts() -> dict[str, tuple[int, TableLayout]]:
    """name -> (rows, layout): TorchRec's table-wise and row-wise, our grid and unique-based."""
    return {
        "tw": (20, TableLayout.table_wise(20, DIM, 1)),
        "grid": (40, TableLayout("rb", (0, 13, 40), (0, 4, DIM), ((0, 1), (1, 0)))),
        "rw": (31, TableLayout("rb", ceil_row_bounds(31, WS), (0, DIM), ((0,), (1,)))),
        "ub": (24, TableLayout("ub", (0, 12, 24), (0, DIM), ((1,), (0,)))),
    }


def _step(model: torch.nn.Module, kjt: KeyedJaggedTensor, sequence: bool) -> None:
    out = model(kjt)
    out = out.wait() if hasattr(out, "wait") else out
    loss = sum(jt.values().sum() for jt in out.values()) if sequence else out.values().sum()
    loss.backward()


def _record(module: EmbarkShardedModule, step: Callable[[], None]) -> dict[str, Any]:
    """One step of `module`, recording the contexts its input dist filed, the state each of our input dists handed
    over, and the context each output dist got."""
    filed: list[Any] = []
    taken: dict[int, Any] = {}
    seen: dict[int, Any] = {}

    def input_dist(ctx: Any, features: Any) -> Any:
        request = type(module).input_dist(module, ctx, features)
        filed.extend(ctx.sharding_contexts)
        return request

    def taking(i: int, take: Callable[[], Any]) -> Callable[[], Any]:
        def take_state() -> Any:
            taken[i] = take()
            return taken[i]

        return take_state

    def seeing(i: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        def output_dist(local_embs: Any, sharding_ctx: Any = None) -> Any:
            seen[i] = sharding_ctx
            return forward(local_embs, sharding_ctx)

        return output_dist

    module.input_dist = input_dist  # type: ignore[method-assign]
    for i, d in enumerate(module_input_dists(module)):
        if hasattr(d, "take_state"):
            d.take_state = taking(i, d.take_state)
    for i, d in enumerate(module_output_dists(module)):
        d.forward = seeing(i, d.forward)
    step()
    del module.input_dist
    types = module.embedding_sharding_types()
    return {
        "types": types,
        "same": [seen[i] is filed[i] for i in range(len(types))],
        "context": [type(seen[i]).__name__ for i in range(len(types))],
        "own_state": {i: any(getattr(seen[i], a, None) is state for a in STATES) for i, state in taken.items()},
        "received_counts": {i: getattr(seen[i], "received_counts", None) is not None for i in range(len(types))},
    }


def _refused(module: EmbarkShardedModule, kjt: KeyedJaggedTensor) -> str:
    """input_dist on a batch context that already holds a context: the error, or "" if it went through."""
    ctx = module.create_context()
    ctx.sharding_contexts.append(None)
    try:
        module.input_dist(ctx, kjt)
    except RuntimeError as e:
        return str(e)
    return ""


def _contexts() -> dict[str, dict[str, Any]]:
    rank = dist.get_rank()
    result = {}
    for kind in ("pooled", "sequence"):
        sequence = kind == "sequence"
        config = EmbeddingConfig if sequence else EmbeddingBagConfig
        tables = [
            config(name=name, num_embeddings=rows, embedding_dim=DIM, feature_names=[f"{name}_f"])
            for name, (rows, _) in _layouts().items()
        ]
        layouts = {name: layout for name, (_, layout) in _layouts().items()}
        model = sharded_sequence_model(tables, layouts, WS) if sequence else sharded_model(tables, layouts, WS)
        (module,) = [m for m in model.modules() if isinstance(m, EmbarkShardedModule)]
        batches = [global_kjt_batch(tables, WS, BATCH, seed=s)[rank] for s in range(4)]
        _step(model, batches[0], sequence)
        result[kind] = _record(module, lambda: _step(model, batches[1], sequence))
        result[kind]["refused"] = _refused(module, batches[2])
        _step(model, batches[3], sequence)  # a refused batch context leaves the module in step with its peers
    return result


@pytest.fixture(scope="module")
def contexts() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_contexts, WS, local_world_size=WS, timeout_s=300)


@pytest.mark.parametrize("kind", ["pooled", "sequence"])
def test_each_output_dist_gets_its_shardings_context_of_the_batch(
    contexts: list[dict[str, dict[str, Any]]], kind: str
) -> None:
    """Every sharding's output dist gets the context its module's input dist filed at that sharding's index for the
    same batch; ours are our own contexts, holding the state their own input dist handed over for that batch (and,
    for UB, the received counts compute_and_output_dist filed), TorchRec's keep TorchRec's (on every rank)."""
    for rank, result in enumerate(contexts):
        r = result[kind]
        ours = [ShardingGroup.parse(t).torchrec_type is None for t in r["types"]]
        unique = ["embark_ub" in t for t in r["types"]]
        assert any(ours) and not all(ours), r["types"]
        assert all(r["same"]), (rank, r)
        own_type = ours if kind == "sequence" else unique  # a pooled grid keeps TorchRec's context
        own_name = "EmbarkSequenceContext" if kind == "sequence" else "UniqueShardingContext"
        assert [name == own_name for name in r["context"]] == own_type, (rank, r)
        assert sorted(r["own_state"]) == [i for i, own in enumerate(own_type) if own], (rank, r)
        assert all(r["own_state"].values()), (rank, r)
        assert [r["received_counts"][i] for i in range(len(ours))] == unique, (rank, r)


@pytest.mark.parametrize("kind", ["pooled", "sequence"])
def test_a_batch_context_holding_other_contexts_is_refused(
    contexts: list[dict[str, dict[str, Any]]], kind: str
) -> None:
    """A batch context that already holds a context when TorchRec's input dist appends the module's is refused on
    every rank before any collective, by name (TorchRec's output dists would read another sharding's context at
    each index); the module then trains on."""
    for result in contexts:
        assert "holds 5 sharding contexts for this module's 4 shardings" in result[kind]["refused"], result[kind]


def test_only_sharding_contexts_touches_a_batchs_sharding_contexts() -> None:
    """In sharding/, a batch context's `sharding_contexts` list is read or written only inside
    EmbarkShardedModule.sharding_contexts (everything else calls it), so no other read can index it differently."""
    touched = []
    for path in sorted(pathlib.Path(sharding_package.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        owners = {
            id(node): f"{cls.name}.{fn.name}"
            for cls in ast.walk(tree)
            if isinstance(cls, ast.ClassDef)
            for fn in cls.body
            if isinstance(fn, ast.FunctionDef)
            for node in ast.walk(fn)
        }
        for node in ast.walk(tree):
            is_call = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            if isinstance(node, ast.Attribute) and node.attr == "sharding_contexts" and not is_call:
                touched.append((path.name, owners.get(id(node)), node.lineno))
    assert [(name, owner) for name, owner, _ in touched] == [
        ("sharded_module.py", "EmbarkShardedModule.sharding_contexts")
    ], touched
