"""Where the plan is TorchRec's own (every table table-wise, as TorchRec's planner gives dlrm_main.py), our sharder
costs no more per step than TorchRec's: the same collectives, none blocking, no more host syncs, and no more aten ops
than TorchRec's input dist around them (our input check and split exchange included). benchmarks/sharder_tax.py
measures the same on dlrm_main.py's model under TrainPipelineSparseDist, with times.

The input check's cheap path (every key of one row count: the IDs' least and greatest instead of a bound per ID)
must find every fault the bound per ID finds, and name it alike.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan.layout.tables import Plan, TableLayout
from embark_torchrec.plan.model.spec import ModelSpec
from embark_torchrec.planner.parameter_sharding import module_sharding_plan
from embark_torchrec.sharding.sharder import EmbarkEmbeddingBagCollectionSharder
from embark_torchrec.sharding.validation import InputValidator
from embark_torchrec.testing import global_kjt_batch, run_ranks
from embark_torchrec.testing.host_work import HostWorkCounter
from embark_torchrec.testing.training import SparseArch

WS, TABLES, ROWS, DIM, BATCH = 2, 8, 1000, 16, 32
FUSED = {"learning_rate": 0.1}
SHARDERS = {
    "torchrec": lambda: EmbeddingBagCollectionSharder(fused_params=FUSED),
    "ours": lambda: EmbarkEmbeddingBagCollectionSharder(fused_params=FUSED),
}


def _step(model: torch.nn.Module, kjt: KeyedJaggedTensor) -> None:
    out = model(kjt)
    out = out.wait() if hasattr(out, "wait") else out
    out.values().sum().backward()


def _counts_per_sharder() -> dict[str, dict[str, Any]]:
    """Rank 0's counts of the third step (the first two build the lazily created dists) for each sharder, on TorchRec's
    table-wise plan of one-hot tables (rows alike, as dlrm_main.py's) and of tables of differing rows."""
    torch.manual_seed(0)
    rank = dist.get_rank()
    found = {}
    for rows_kind in ("alike", "differing"):
        tables = [
            EmbeddingBagConfig(
                name=f"t{i}",
                num_embeddings=ROWS if rows_kind == "alike" else ROWS + 100 * i,
                embedding_dim=DIM,
                feature_names=[f"f{i}"],
            )
            for i in range(TABLES)
        ]
        meta = SparseArch(tables, False, torch.device("meta"))
        spec = ModelSpec.from_module(meta.ebc, batch_size=WS)
        plan = Plan(
            WS, WS, {t.name: TableLayout.table_wise(t.num_embeddings, DIM, i % WS) for i, t in enumerate(tables)}
        )
        sharding = ShardingPlan({"ebc": module_sharding_plan(plan, spec, "cpu")})
        assert {p.sharding_type for p in sharding.plan["ebc"].values()} == {"table_wise"}  # type: ignore[union-attr]
        batches = [
            global_kjt_batch(tables, WS, BATCH, seed=s, max_bag_size=1, empty_fraction=0.0)[rank] for s in range(3)
        ]
        for name, make in SHARDERS.items():
            model = DistributedModelParallel(
                SparseArch(tables, False, torch.device("meta")),
                env=ShardingEnv.from_process_group(dist.group.WORLD),
                plan=sharding,
                sharders=[make()],
                device=torch.device("cpu"),
            )
            for kjt in batches[:2]:
                _step(model, kjt)
            with HostWorkCounter() as counter:
                _step(model, batches[2])
            found[f"{name}:{rows_kind}"] = counter.summary() | {"collective_ops": dict(counter.collective_ops)}
    return found


@pytest.fixture(scope="module")
def counts() -> dict[str, dict[str, Any]]:
    return run_ranks(_counts_per_sharder, WS, timeout_s=600)[0]


@pytest.mark.parametrize("rows", ["alike", "differing"])
def test_our_sharder_on_torchrecs_plan_adds_no_collective_sync_or_op(
    counts: dict[str, dict[str, Any]], rows: str
) -> None:
    """Our sharder on a TorchRec-only plan issues the same collectives per step as TorchRec's sharder (its split
    exchange in place of TorchRec's, carrying the input check), none blocking, no more host syncs (the check's one
    read and the exchange's, where TorchRec reads each split tensor), and no more aten ops where the tables' rows are
    alike; where they differ, the bound per ID costs a few ops more (a fixed number, whatever the tables)."""
    ours, torchrec = counts[f"ours:{rows}"], counts[f"torchrec:{rows}"]
    assert ours["collective_ops"] == torchrec["collective_ops"], (ours, torchrec)
    assert ours["blocking_collectives"] == torchrec["blocking_collectives"] == 0
    assert ours["host_syncs"] <= torchrec["host_syncs"], (ours["sync_ops"], torchrec["sync_ops"])
    extra = 0 if rows == "alike" else 4
    assert ours["aten_ops"] <= torchrec["aten_ops"] + extra, (ours["aten_ops"], torchrec["aten_ops"])


def _with_unread_key(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """`kjt` plus a key no table reads, one ID per sample far past every table's rows: which makes the check bound
    each ID (a key outside the module's tables) and must not be a fault."""
    stride = kjt.stride()
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(
        keys=kjt.keys() + ["unread"],
        values=torch.cat([kjt.values(), torch.full((stride,), 10**9)]),
        lengths=torch.cat([kjt.lengths(), torch.ones(stride, dtype=kjt.lengths().dtype)]),
        weights=None if weights is None else torch.cat([weights, torch.ones(stride)]),
        stride=stride,
    )


def _batch(values: list[int], lengths: list[int], weights: list[float] | None = None) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths),
        weights=None if weights is None else torch.tensor(weights),
        stride=2,
    )


BATCHES = {  # keys a, b of one table each, ROWS rows; two samples
    "good": ([0, ROWS - 1, 5], [1, 1, 1, 0], None),
    "id_at_rows": ([0, ROWS, 5], [1, 1, 1, 0], None),
    "negative_id": ([0, 3, -1, 7], [1, 1, 1, 1], None),
    "both_ends": ([ROWS + 7, -2, 5, ROWS], [2, 0, 1, 1], None),
    "negative_length": ([0, 3, 5], [2, 1, 1, -1], None),
    "nan_weight": ([0, 3, 5], [1, 1, 1, 0], [1.0, math.nan, 2.0]),
    "nan_weight_and_bad_id": ([0, ROWS, 5], [1, 1, 1, 0], [1.0, 1.0, math.inf]),
    "no_ids": ([], [0, 0, 0, 0], None),
}


@pytest.mark.parametrize("policy", ["raise", "clamp", "drop"])
@pytest.mark.parametrize("case", sorted(BATCHES))
def test_one_row_count_check_finds_what_the_bound_per_id_finds(case: str, policy: str) -> None:
    """Tables of one row count take the cheap check; the same batch with a key the module does not read takes the
    bound per ID: both give the same fault (kind, feature, counts, shown IDs), and under clamp / drop the same repaired
    IDs and lengths of the module's keys."""
    values, lengths, weights = BATCHES[case]
    weighted = weights is not None
    validator = InputValidator({"ta": ["a"], "tb": ["b"]}, {"ta": ROWS, "tb": ROWS}, policy, weighted=weighted)
    batch = _batch(values, lengths, weights)
    cheap, cheap_fault = validator.check(batch)
    bounded, bounded_fault = validator.check(_with_unread_key(batch))
    assert cheap_fault == bounded_fault, (cheap_fault, bounded_fault)
    if cheap_fault is None:
        ids = cheap.lengths().sum()
        assert torch.equal(cheap.values(), bounded.values()[:ids])
        assert torch.equal(cheap.lengths(), bounded.lengths()[: cheap.lengths().numel()])
    expected_fault = case != "good" and case != "no_ids" and (policy == "raise" or "weight" in case or "length" in case)
    assert (cheap_fault is not None) == expected_fault, cheap_fault


def test_one_row_count_check_runs_fewer_ops() -> None:
    """The cheap check is cheaper: fewer aten ops than the bound per ID on the same good batch (the reason it
    exists), and the same one host read."""
    validator = InputValidator({"ta": ["a"], "tb": ["b"]}, {"ta": ROWS, "tb": ROWS}, weighted=False)
    batch = _batch(*BATCHES["good"][:2])
    counted = {}
    for name, kjt in (("cheap", batch), ("bounded", _with_unread_key(batch))):
        validator.check(kjt)  # the key order's rows, built once
        kjt.length_per_key()  # TorchRec's input dist reads it anyway
        with HostWorkCounter() as counter:
            validator.check(kjt)
        counted[name] = counter
    assert counted["cheap"].aten_ops < counted["bounded"].aten_ops, (counted["cheap"].ops, counted["bounded"].ops)
    assert counted["cheap"].host_syncs == counted["bounded"].host_syncs == 1
