"""Host work per training step of sharded EmbeddingCollections (sequence embeddings): aten ops, host syncs,
blocking collectives, as host_overhead.py counts them for bags.

Why: on a GPU a step is only as fast as its host side; host work that grows with the number of tables, a host sync
or a collective without async_op=True would make sequence sharding host-bound however few bytes it sends. Counted
with embark_torchrec.testing.host_work.HostWorkCounter on rank 0, for one step (forward, then backward with the fused
SGD optimizer in backward) after warm-up.

Types: "ec_table_wise" (TorchRec's EC table-wise, table i on rank i mod ranks: the baseline), "ec_embark_rb" (each
table a 2x2 grid of row x column slices spread over the ranks) and "ec_embark_ub" (unique-based, rows split over two
ranks). Tables: 1,000 rows x dim 16, one feature each, sequences of 0-4 IDs, batch 256 per rank; gloo ranks on one
node.

    python benchmarks/host_overhead_ec.py [--tables 8,64] [--ranks 2] [--batch-per-rank 256] [--warmup 2]
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan.layout.tables import TableLayout
from embark_torchrec.testing import global_kjt_batch, run_ranks
from embark_torchrec.testing.host_work import HostWorkCounter
from embark_torchrec.testing.sequence import sharded_sequence_model

ROWS, DIM, ROW_CUT = 1_000, 16, 400
TYPES = ("ec_table_wise", "ec_embark_rb", "ec_embark_ub")


def ec_layout(kind: str, i: int, ws: int, rows: int = ROWS, dim: int = DIM, row_cut: int = ROW_CUT) -> TableLayout:
    """Table i's layout for a type; the placement rotates with i so that every rank holds work."""
    if kind == "ec_table_wise":
        return TableLayout.table_wise(rows, dim, i % ws)
    if kind == "ec_embark_rb":
        return TableLayout(
            "rb",
            (0, row_cut, rows),
            (0, dim // 2, dim),
            tuple(tuple((i + 2 * r + c) % ws for c in range(2)) for r in range(2)),
        )
    return TableLayout("ub", (0, row_cut, rows), (0, dim), ((i % ws,), ((i + 1) % ws,)))


def ec_step(model: torch.nn.Module, kjt: KeyedJaggedTensor) -> None:
    """Forward, then backward of the sum of every vector; the fused optimizer updates the tables in backward."""
    out = model(kjt)
    out = out.wait() if hasattr(out, "wait") else out
    sum(jt.values().sum() for jt in out.values()).backward()


def count_ec_steps(table_counts: list[int], types: list[str], batch: int, warmup: int) -> list[dict[str, Any]]:
    """On every rank: per table count and type, the HostWorkCounter summary of the step after `warmup` steps."""
    warnings.filterwarnings("ignore", message=".*is deprecated", category=FutureWarning)
    rank, ws = dist.get_rank(), dist.get_world_size()
    rows = []
    for n in table_counts:
        tables = [
            EmbeddingConfig(name=f"t{i}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f"f{i}"])
            for i in range(n)
        ]
        batches = [global_kjt_batch(tables, ws, batch, seed=s)[rank] for s in range(warmup + 1)]
        for kind in types:
            model = sharded_sequence_model(tables, {t.name: ec_layout(kind, i, ws) for i, t in enumerate(tables)}, ws)
            for s in range(warmup):
                ec_step(model, batches[s])
            with HostWorkCounter() as counter:
                ec_step(model, batches[warmup])
            rows.append({"type": kind, "tables": n, "ranks": ws, **counter.summary()})
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    base = {(r["tables"], r["ranks"]): r["aten_ops"] for r in rows if r["type"] == "ec_table_wise"}
    lines = [
        "| type | tables | ranks | aten ops | x tw | host syncs | collectives | blocking |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        tw = base.get((r["tables"], r["ranks"]))
        ratio = f"{r['aten_ops'] / tw:.2f}" if tw else "—"
        lines.append(
            f"| {r['type']} | {r['tables']} | {r['ranks']} | {r['aten_ops']} | {ratio} | {r['host_syncs']} "
            f"| {r['collectives']} | {r['blocking_collectives']} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64])
    p.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[2])
    p.add_argument("--types", type=lambda s: s.split(","), default=list(TYPES))
    p.add_argument("--batch-per-rank", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2, help="steps before counting (the first builds lazy dists)")
    args = p.parse_args()
    for kind in args.types:
        if kind not in TYPES:
            p.error(f"unknown type {kind!r}; choose from {TYPES}")
    rows: list[dict[str, Any]] = []
    for ws in args.ranks:
        rows += run_ranks(
            count_ec_steps,
            ws,
            local_world_size=ws,
            timeout_s=3600,
            args=(args.tables, args.types, args.batch_per_rank, args.warmup),
        )[0]
    print(
        f"EC host work per training step on rank 0: {ROWS} rows x dim {DIM} per table, batch {args.batch_per_rank}/rank"
        f", gloo ranks on one node, step after {args.warmup} warm-up steps"
    )
    print(_table(rows))


if __name__ == "__main__":
    main()
