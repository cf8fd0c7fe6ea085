"""Bad input gets a clear error naming rank, feature (and table), never a crash or silent corruption.

One 2-rank spawn runs a model with a table-wise table (TorchRec's own sharding), a grid, a UB table and a DP table
through every bad batch (each rank gets its own bad slice: the error names both; test_one_bad_rank.py covers one bad
rank among good ones); then the opt-in policies: clamp and drop must equal the unsharded model fed the clamped /
filtered batch. Plan files and model specs
with bad values are refused by name. A rank that dies mid-step makes the other fail within the process-group timeout;
a rank that raises on its bad batch and dies gives the other the same named error within seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan.layout.tables import Plan, PlanError, TableLayout
from embark_torchrec.plan.model.spec import ModelSpec, SpecError
from embark_torchrec.planner.load_plan import load_plan
from embark_torchrec.testing import copy_global_weights, run_ranks
from embark_torchrec.testing.training import SparseArch, sharded_model
from tests.support.processes import checkout_env

TABLES = [
    EmbeddingBagConfig(name="tw", num_embeddings=20, embedding_dim=8, feature_names=["t"]),
    EmbeddingBagConfig(name="grid", num_embeddings=30, embedding_dim=8, feature_names=["g"]),
    EmbeddingBagConfig(name="ub", num_embeddings=25, embedding_dim=4, feature_names=["u"]),
    EmbeddingBagConfig(name="dp", num_embeddings=10, embedding_dim=4, feature_names=["d"]),
]
LAYOUTS = {
    "tw": TableLayout.table_wise(20, 8, 1),
    "grid": TableLayout("rb", (0, 11, 30), (0, 4, 8), ((0, 1), (1, 0))),
    "ub": TableLayout("ub", (0, 12, 25), (0, 4), ((1,), (0,))),
    "dp": TableLayout.data_parallel(),
}
KEYS = ["t", "g", "u", "d"]


def _kjt(
    values: list[int], lengths: list[int], keys: list[str] = KEYS, weights: list[float] | None = None
) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int32),
        weights=torch.tensor(weights) if weights is not None else None,
    )


# batch of 2 per rank: lengths per key are [bag0, bag1]; the bad ID is in feature "g" (rows 30) or "t" (rows 20)
GOOD = ([1, 2, 3, 4, 29, 5, 24, 0, 9], [1, 1, 2, 1, 1, 1, 1, 1])
BAD = {
    "id_too_big": (([1, 2, 3, 30, 29, 5, 24, 0, 9], GOOD[1]), "InvalidIdError", ["'g'", "'grid'", "[30]", "rank"]),
    "id_negative": (([-1, 2, 3, 4, 29, 5, 24, 0, 9], GOOD[1]), "InvalidIdError", ["'t'", "'tw'", "[-1]", "rank"]),
    "lengths_exceed_values": (([1, 2, 3, 4], GOOD[1]), "InvalidInputError", ["add up to 9", "4 values", "rank"]),
    "negative_length": ((GOOD[0], [1, 1, 2, 1, 1, 1, 3, -1]), "InvalidInputError", ["negative", "rank"]),
}


def _feed(model: Any, kjt: KeyedJaggedTensor) -> str:
    try:
        model(kjt)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _bad_batches() -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = sharded_model(TABLES, LAYOUTS, 2)
    out: dict[str, Any] = {name: _feed(model, _kjt(*batch)) for name, (batch, _, _) in BAD.items()}
    out["missing_feature"] = _feed(model, _kjt([1, 2, 3, 4, 29, 5], [1, 1, 2, 1, 1, 0], keys=["t", "g", "u"]))
    out["weights_disagree"] = _feed(model, _kjt(GOOD[0], GOOD[1], weights=[1.0] * 5))
    # the model still works after refusing bad batches (nothing half-done)
    out["good_after"] = _feed(model, _kjt(*GOOD))
    # opt-in policies, against the unsharded model fed the repaired batch
    bad_values, lengths = [1, 2, 3, 30 + rank, 29, 5, 24, 0, 99], GOOD[1]
    clamped = [1, 2, 3, 29, 29, 5, 24, 0, 9]
    dropped_values, dropped_lengths = [1, 2, 3, 29, 5, 24, 0], [1, 1, 1, 1, 1, 1, 1, 0]
    for policy, (values, lens) in (("clamp", (clamped, lengths)), ("drop", (dropped_values, dropped_lengths))):
        torch.manual_seed(0)
        reference = SparseArch(TABLES, False, torch.device("cpu"))
        model = sharded_model(TABLES, LAYOUTS, 2, invalid_ids=policy)
        copy_global_weights(model, reference)
        got = model(_kjt(bad_values, lengths))
        got = (got.wait() if hasattr(got, "wait") else got).to_dict()
        want = reference(_kjt(values, lens)).to_dict()
        out[policy] = max(float((got[k] - want[k]).abs().max()) for k in KEYS)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_bad_batches, 2, timeout_s=300)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_batches_are_refused_by_name(results: list[dict[str, Any]], case: str) -> None:
    """IDs out of range (any sharding, TorchRec's table-wise included) and lengths that disagree with the values
    raise before any collective, naming the rank and the feature (and table for IDs)."""
    _, error, words = BAD[case]
    for rank, r in enumerate(results):
        assert r[case].startswith(error), (rank, r[case])
        for w in words:
            assert w in r[case], (rank, w, r[case])
        assert f"rank {rank}" in r[case]


def test_missing_features_and_weights_are_refused(results: list[dict[str, Any]]) -> None:
    """A feature missing from the KJT is refused by name; so are weights (here also not matching the values) sent to
    this unweighted module, which some sharding types would apply and others drop."""
    for r in results:
        assert r["missing_feature"].startswith("InvalidInputError") and "['d']" in r["missing_feature"], r[
            "missing_feature"
        ]
        assert r["weights_disagree"].startswith("InvalidInputError"), r["weights_disagree"]
        assert "unweighted EmbeddingBagCollection got per-sample weights" in r["weights_disagree"]
        assert "is_weighted=False" in r["weights_disagree"]
        assert r["good_after"] == "no error"


@pytest.mark.parametrize("policy", ["clamp", "drop"])
def test_opt_in_policies_equal_the_repaired_batch(results: list[dict[str, Any]], policy: str) -> None:
    """invalid_ids="clamp" / "drop" give exactly what the unsharded model gives for the clamped / filtered batch."""
    for r in results:
        assert r[policy] <= 1e-6, r[policy]


def test_bad_plan_files_are_refused() -> None:
    """A plan for another world size or model, and plans edited so that shards overlap or leave a gap."""
    module = SparseArch(TABLES, False, torch.device("meta"))
    plan = Plan(2, 2, dict(LAYOUTS))
    with pytest.raises(PlanError, match="world size 2"):
        load_plan(plan, module, world_size=4)
    other = dict(LAYOUTS)
    del other["dp"]
    with pytest.raises(PlanError, match="dp"):
        load_plan(Plan(2, 2, other), module, world_size=2)
    doc = plan.to_dict()
    doc["tables"]["grid"]["shards"][0]["rows"] = [0, 12]  # overlaps the next row slice
    with pytest.raises(PlanError, match="grid"):
        load_plan(doc, module, world_size=2)
    doc = plan.to_dict()
    doc["tables"]["ub"]["shards"] = doc["tables"]["ub"]["shards"][:1]  # rows 12..25 uncovered
    with pytest.raises(PlanError, match="ub"):
        load_plan(doc, module, world_size=2)


@pytest.mark.parametrize(
    "table, message",
    [
        ({"name": "a", "rows": -5, "dim": 8, "pooling": 1.0}, "'a'"),
        ({"name": "a", "rows": 10, "dim": 6, "pooling": 1.0}, "'a'"),
        ({"name": "a", "rows": 10, "dim": 8, "pooling": -1.0}, "'a'"),
        ({"name": "a", "rows": 10, "dim": 8, "pooling": 1.0, "unique_ratio": 2.0}, "'a'"),
        ({"name": "a", "rows": 10, "dim": 8, "pooling": 1.0, "colour": "red"}, "'a'"),
    ],
)
def test_bad_model_specs_are_refused_by_table(table: dict[str, Any], message: str) -> None:
    """Negative sizes, dims not a multiple of 4, bad pooling or unique ratio, unknown keys: an error naming the
    table."""
    with pytest.raises(SpecError, match=message):
        ModelSpec.from_dict({"name": "m", "batch_size": 8, "tables": [table]})


def _script(*bodies: str) -> str:
    """A 2-rank script: argv rank, store port, tests dir; both ranks build the model and take one good step together,
    then run the bodies."""
    head = """
    import os, sys, time, datetime
    import torch, torch.distributed as dist
    rank = int(sys.argv[1])
    store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    sys.path.insert(0, sys.argv[3])
    import test_bad_input as T
    from embark_torchrec.testing.training import sharded_model
    model = sharded_model(T.TABLES, T.LAYOUTS, 2)
    model(T._kjt(*T.GOOD))  # one good step together
    dist.barrier()
    """
    return "".join(textwrap.dedent(part) for part in (head, *bodies))


_SURVIVOR = """
start = time.monotonic()
try:
    model(T._kjt(*T.GOOD))
    print("NO ERROR")
except Exception as exc:
    print(f"ERROR after {time.monotonic() - start:.1f} s: {type(exc).__name__}: {exc}")
    sys.stdout.flush()
    os._exit(3)  # skip interpreter teardown: gloo threads of a broken group may abort it (torch 2.13)
"""
_DYING = _script(
    """
    if rank == 1:
        os._exit(7)  # dies mid-training
    """,
    _SURVIVOR,
)
_BAD_AND_DYING = _script(
    """
    if rank == 1:
        model(T._kjt(*T.BAD["id_too_big"][0]))  # raises, uncaught: the process dies with its traceback
    """,
    _SURVIVOR,
)


def _run_pair(tmp_path: Any, source: str) -> tuple[list[int], list[str], float]:
    """Runs a 2-rank script in two processes: their exit codes, their outputs, and how long they took."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "ranks.py"
    script.write_text(source)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(port), os.path.dirname(__file__)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=checkout_env(),
        )
        for r in range(2)
    ]
    start = time.monotonic()
    outs = [p.communicate(timeout=240)[0] for p in procs]
    return [p.returncode for p in procs], outs, time.monotonic() - start


def _survivor_line(out: str) -> str:
    return next(ln for ln in out.splitlines() if ln.startswith("ERROR after"))


def test_a_dying_rank_fails_the_others_within_the_timeout(tmp_path: Any) -> None:
    """When a rank dies mid-training, the surviving rank's next step raises within the process-group timeout
    (20 s here) instead of hanging."""
    codes, outs, took = _run_pair(tmp_path, _DYING)
    assert codes[1] == 7, outs[1][-2000:]
    assert codes[0] == 3, outs[0][-2000:]
    line = _survivor_line(outs[0])
    assert float(line.split()[2]) <= 25.0, line
    assert took < 240


def test_a_bad_rank_that_raises_and_dies_names_itself_on_the_others(tmp_path: Any) -> None:
    """A rank whose batch has an ID out of range raises, uncaught, and its process dies; the good rank gets the same
    named error (the bad rank, the feature and table, the ID) within seconds, not "Connection closed by peer"."""
    codes, outs, _ = _run_pair(tmp_path, _BAD_AND_DYING)
    named = "InvalidIdError: rank 1: feature 'g' of table 'grid' has IDs [30] outside [0, 30)"
    assert codes[1] == 1 and named in outs[1], outs[1][-2000:]
    assert codes[0] == 3, outs[0][-2000:]
    line = _survivor_line(outs[0])
    assert named in line, line
    assert float(line.split()[2]) <= 5.0, line
