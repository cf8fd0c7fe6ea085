"""Host work of a sequence (EmbeddingCollection) training step under our grid and UB shardings: no blocking
collectives, and host work that does not grow with the number of tables, as test_host_work.py requires of bags.

One 2-rank spawn trains our EC types and TorchRec's EC table-wise at 4 and at 16 tables (sequences of 0-4 IDs) and
counts the second step with HostWorkCounter (the first builds the lazily created dists).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan.layout.tables import TableLayout
from embark_torchrec.testing import run_ranks
from embark_torchrec.testing.sequence import sharded_sequence_model
from tests.support import toy
from tests.support.host_work import second_step_work, show

pytestmark = pytest.mark.torchrec_version

WS, BATCH, ROWS, DIM = 2, 4, 40, 8
TABLE_COUNTS = (4, 16)
OURS = ("embark_rb", "embark_ub")
BASELINE = "table_wise"
OPS_SLACK = 10  # extra aten ops (ours minus table-wise) at 16 tables <= those at 4 tables + slack


def _layout(kind: str, i: int) -> TableLayout:
    """Table i's layout; placements rotate with i, so both ranks hold cells of several tables."""
    if kind == BASELINE:
        return TableLayout.table_wise(ROWS, DIM, i % WS)
    if kind == "embark_rb":  # a 2x2 grid over the two ranks
        return TableLayout(
            "rb", (0, 15, ROWS), (0, 4, DIM), tuple(tuple((i + r + c) % WS for c in range(2)) for r in range(2))
        )
    return TableLayout("ub", (0, 25, ROWS), (0, DIM), ((i % WS,), ((i + 1) % WS,)))


def _step(model: torch.nn.Module, kjt: KeyedJaggedTensor) -> None:
    out = model(kjt)
    out = out.wait() if hasattr(out, "wait") else out
    sum(jt.values().sum() for jt in out.values()).backward()


def _count_steps() -> dict[str, dict[str, Any]]:
    """On each rank: {"<type>:<tables>": HostWorkCounter summary of the second training step}."""
    result = {}
    for n in TABLE_COUNTS:
        tables = toy.equal_tables(EmbeddingConfig, n, ROWS, DIM)
        for kind in (BASELINE, *OURS):
            model = sharded_sequence_model(tables, {t.name: _layout(kind, i) for i, t in enumerate(tables)}, WS)
            result[f"{kind}:{n}"] = second_step_work(model, tables, WS, BATCH, _step)
    return result


@pytest.fixture(scope="module")
def counts() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_count_steps, WS, local_world_size=WS, timeout_s=300)


@pytest.mark.parametrize("kind", OURS)
def test_no_blocking_collectives(counts: list[dict[str, dict[str, Any]]], kind: str) -> None:
    """Every collective of an EC training step is issued with async_op=True, on every rank; and there are some
    (the counter saw the step's all-to-alls)."""
    for n in TABLE_COUNTS:
        for rank, c in enumerate(counts):
            summary = c[f"{kind}:{n}"]
            assert summary["collectives"] > 0, (kind, n, rank)
            assert not summary["blocking_ops"], f"{kind}, {n} tables, rank {rank}: blocking {summary['blocking_ops']}"


@pytest.mark.parametrize("kind", OURS)
def test_host_work_does_not_grow_with_tables(counts: list[dict[str, dict[str, Any]]], kind: str) -> None:
    """Host work is O(sharding groups), not O(tables): from 4 to 16 tables, our aten ops beyond TorchRec's EC
    table-wise step (whose per-feature JaggedTensor outputs cost a few ops per feature in every type) grow by at most
    OPS_SLACK, and host syncs and collectives not at all (rank 0)."""
    few, many = (counts[0][f"{kind}:{n}"] for n in TABLE_COUNTS)
    base_few, base_many = (counts[0][f"{BASELINE}:{n}"] for n in TABLE_COUNTS)
    detail = f"{kind}: 4 tables {show(few)}; 16 tables {show(many)}; table-wise {show(base_few)}, {show(base_many)}"
    assert many["aten_ops"] - base_many["aten_ops"] <= few["aten_ops"] - base_few["aten_ops"] + OPS_SLACK, detail
    assert many["host_syncs"] == few["host_syncs"], detail
    assert many["collectives"] == few["collectives"], detail
