"""Host work per training step, our sharding types against TorchRec's: aten ops, host syncs, blocking collectives, ms.

On a GPU a step is only as fast as its host side lets it be: the host must launch fewer ops than the device runs,
never wait on the device (a host sync) and never wait on the network (a collective without async_op=True), and
its work must not grow with the number of tables. Those costs are invisible in CPU timings, so this benchmark
counts them (embark_torchrec.testing.host_work.HostWorkCounter) on rank 0, for one training step (forward, then
backward with the fused SGD optimizer in backward) after warm-up, and also times steps.

Types: TorchRec's "table_wise" (table i on rank i mod ranks) and "row_wise" (rows in ceil blocks over all ranks),
the baselines, at fp32 and, from the plan, fp16 (TorchRec's shardings with the plan's codecs as their registry) and
fp8 (table-wise on TorchRec's sharding, the plan's torchrec_at_fp8; row-wise on ours, as TorchRec's reduce-scatter
cannot send fp8); "table_wise_qcomms" and "row_wise_qcomms": the same at fp32 in the plan with the sharder's codec
registry at the row's precision, TorchRec's own way to compress (QCommsConfig at fp16, so each pair should count
alike; at fp8 table-wise takes our codec told the width, as fbgemm's FP8 row-wise has no CPU kernel, and row-wise
QCommsConfig(FP8)'s registry, which sends the reduce-scatter at fp16); our flat grid "embark_rb"
(each table a 2x2 grid of row x column slices spread over the ranks, which TorchRec cannot express), hierarchical
grid "embark_rb_hier" (row slices of a column on one node, reduced there first; only with 2 or more nodes, i.e. 4
ranks) and unique-based "embark_ub" (rows split over two ranks) and "embark_ub_tw" (each table whole on one rank,
placed as table-wise: UB's own cost), each at wire precision fp32, fp16 and fp8. Tables: 1,000 rows x dim 16, one
feature each, batch 256 per rank; --bags multi-hot: ~2 IDs per bag (1-4, a quarter of the bags empty), one-hot: one
ID per bag (as Criteo's DLRM; UB then sends as many vectors as table-wise when IDs do not repeat, so its time is its
own host work); --ids nonrepeating: no ID twice in a rank's batch of a feature, zipf: Zipf(1.1). Ranks: gloo, 2 (one
node) or 4 (2 nodes x 2). All configurations of one world size run in one spawn of ranks; step times are medians
over steps, then over --rounds rounds that interleave all types.
Ratios (x tw) are against TorchRec's table-wise at the same tables and ranks.

    python benchmarks/host_overhead.py [--tables 8,64,512] [--ranks 2,4] [--types table_wise,row_wise,embark_rb,...]
        [--precisions fp32,fp16,fp8] [--ids nonrepeating|zipf] [--bags multi-hot|one-hot] [--rounds 3] [--steps 5]
        [--warmup 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan.layout.groups import ShardingGroup, sharding_group
from embark_torchrec.plan.layout.tables import TableLayout, WirePrecision
from embark_torchrec.plan.layout.wire import ROW_SCALED_PRECISIONS
from embark_torchrec.plan.model.fields import POOLED
from embark_torchrec.sharding.codecs import wire_codecs
from embark_torchrec.testing import global_kjt_batch, run_ranks
from embark_torchrec.testing.host_work import HostWorkCounter
from embark_torchrec.testing.training import sharded_model

ROWS, DIM, LOCAL_WORLD_SIZE = 1_000, 16, 2
ROW_CUT = 400  # our grids cut rows unevenly, at 400
BASELINE = "table_wise"
TORCHREC_TYPES = ("table_wise", "row_wise")
QCOMMS = "_qcomms"  # TorchRec's type with the sharder's QCommsConfig at the row's precision
QCOMMS_TYPES = tuple(t + QCOMMS for t in TORCHREC_TYPES)
# (on CPU TorchRec runs bf16 as fp16; its FP8 all-to-all codec has no CPU kernel, its reduce-scatter sends FP8 at fp16)
QCOMMS_PRECISIONS = {"fp16": CommType.FP16, "fp8": CommType.FP8}
# at fp8 a plan runs TorchRec's table-wise on TorchRec's sharding (torchrec_at_fp8), its row-wise on ours (TorchRec's
# reduce-scatter sends FP8 at fp16 / bf16); their _qcomms pairs: table-wise with our codec told the width as the
# registry (fbgemm's FP8 row-wise codec has no CPU kernel), row-wise with QCommsConfig(FP8)'s own registry
FP8_ON_TORCHREC, FP8_ON_OURS = ("table_wise",), ("row_wise",)
OUR_TYPES = ("embark_rb", "embark_rb_hier", "embark_ub", "embark_ub_tw")
PRECISIONS = ("fp32", "fp16", "fp8")
IDS = {"nonrepeating": "distinct", "zipf": "zipf"}  # --ids -> global_kjt_batch's ids
BAGS = {"multi-hot": {}, "one-hot": {"max_bag_size": 1, "empty_fraction": 0.0}}  # --bags -> global_kjt_batch's bags
BATCHES = 4  # distinct batches cycled through the steps
COUNTS = ("aten_ops", "host_syncs", "blocking_collectives", "ms")


def _layout(kind: str, i: int, ws: int) -> TableLayout:
    """Table i's layout for a sharding type; the placement rotates with i so that every rank holds work."""
    kind = kind.removesuffix(QCOMMS)
    if kind == "table_wise":
        return TableLayout.table_wise(ROWS, DIM, i % ws)
    if kind == "row_wise":
        block = -(-ROWS // ws)
        bounds = tuple(min(k * block, ROWS) for k in range(ws + 1))
        return TableLayout("rb", bounds, (0, DIM), tuple((k,) for k in range(ws)))
    rows, cols = (0, ROW_CUT, ROWS), (0, DIM // 2, DIM)
    if kind == "embark_rb":
        return TableLayout("rb", rows, cols, tuple(tuple((i + 2 * r + c) % ws for c in range(2)) for r in range(2)))
    if kind == "embark_rb_hier":  # column c of table i on node (i + c) mod nodes, its row slices on the node's ranks
        nodes = ws // LOCAL_WORLD_SIZE
        ranks = tuple(tuple(((i + c) % nodes) * LOCAL_WORLD_SIZE + r for c in range(2)) for r in range(2))
        return TableLayout("rb", rows, cols, ranks, hierarchical=True)
    if kind == "embark_ub_tw":  # table-wise placement, as TorchRec's: what de-duplication alone costs
        return TableLayout("ub", (0, ROWS), (0, DIM), ((i % ws,),))
    return TableLayout("ub", rows, (0, DIM), ((i % ws,), ((i + 1) % ws,)))


def _configs(types: list[str], precisions: list[str], ws: int) -> list[tuple[str, str]]:
    """(type, precision) pairs to run at this world size: the QCommsConfig types at the precisions they compress to,
    every other type at every precision, hier only across nodes."""
    out = []
    for kind in types:
        if kind == "embark_rb_hier" and ws // LOCAL_WORLD_SIZE < 2:
            continue
        chosen = [p for p in precisions if p in QCOMMS_PRECISIONS] if kind in QCOMMS_TYPES else precisions
        out += [(kind, precision) for precision in chosen]
    return out


def _qcomms(kind: str, precision: str) -> dict[str, Any] | None:
    """The sharder's codec registry of a QCommsConfig type, None for the others."""
    if kind not in QCOMMS_TYPES:
        return None
    if precision in ROW_SCALED_PRECISIONS and kind.removesuffix(QCOMMS) in FP8_ON_TORCHREC:
        return wire_codecs(WirePrecision(precision, precision), row_width=DIM)
    p = QCOMMS_PRECISIONS[precision]
    return get_qcomm_codecs_registry(QCommsConfig(forward_precision=p, backward_precision=p))


def _layouts(tables: list[EmbeddingBagConfig], kind: str, precision: str, ws: int) -> dict[str, TableLayout]:
    layouts = {}
    plan_precision = WirePrecision() if kind in QCOMMS_TYPES else WirePrecision(precision, precision)
    for i, t in enumerate(tables):
        layout = dataclasses.replace(
            _layout(kind, i, ws),
            precision=plan_precision,
            torchrec_at_fp8=kind in FP8_ON_TORCHREC and precision == "fp8",
        )
        runs_as = sharding_group(layout, ROWS, ws, LOCAL_WORLD_SIZE)
        width = DIM if {plan_precision.forward, plan_precision.backward} & ROW_SCALED_PRECISIONS else 0
        builtin = ShardingGroup(POOLED, kind.removesuffix(QCOMMS), precision=plan_precision, row_width=width)
        ours = kind in OUR_TYPES or (kind in FP8_ON_OURS and precision in ROW_SCALED_PRECISIONS)
        expected = ShardingGroup.ours(layout) if ours else builtin
        assert runs_as == expected, f"{kind} {precision}: table {t.name} would run as {runs_as}"
        layouts[t.name] = layout
    return layouts


def _step(model: torch.nn.Module, kjt: KeyedJaggedTensor) -> None:
    """Forward, then backward; the fused optimizer updates the tables during backward."""
    out = model(kjt)
    out = out.wait() if hasattr(out, "wait") else out
    out.values().sum().backward()


def _timed_steps(model: torch.nn.Module, batches: list[KeyedJaggedTensor], steps: int) -> float:
    """Median ms of a step on this rank, each step started together on every rank."""
    times = []
    for s in range(steps):
        dist.barrier()
        start = time.perf_counter()
        _step(model, batches[s % len(batches)])
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _run(
    table_counts: list[int],
    configs: list[tuple[str, str]],
    ids: str,
    batch: int,
    rounds: int,
    steps: int,
    warmup: int,
    bags: str,
) -> list[dict[str, Any]]:
    """On every rank: per table count, build every config's model, count one step, then time interleaved rounds."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*is deprecated", category=FutureWarning)  # torch's collective renames
    rank, ws = dist.get_rank(), dist.get_world_size()
    rows: list[dict[str, Any]] = []
    for n in table_counts:
        tables = [
            EmbeddingBagConfig(name=f"t{i}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f"f{i}"])
            for i in range(n)
        ]
        batches = [
            global_kjt_batch(tables, ws, batch, seed=s, ids=IDS[ids], **BAGS[bags])[rank] for s in range(BATCHES)
        ]
        models = {}
        found = {}
        for kind, precision in configs:
            model = sharded_model(
                tables,
                _layouts(tables, kind, precision, ws),
                LOCAL_WORLD_SIZE,
                qcomm_codecs_registry=_qcomms(kind, precision),
            )
            for s in range(warmup):
                _step(model, batches[s % BATCHES])
            with HostWorkCounter() as counter:
                _step(model, batches[warmup % BATCHES])
            models[(kind, precision)] = model
            found[(kind, precision)] = {
                "type": kind,
                "precision": precision,
                "tables": n,
                "ranks": ws,
                **counter.summary(),
            }
        times: dict[tuple[str, str], list[float]] = {c: [] for c in configs}
        for _ in range(rounds):
            for config, model in models.items():
                times[config].append(_timed_steps(model, batches, steps))
        for config in configs:
            found[config]["ms"] = statistics.median(times[config])
            found[config]["ms_per_round"] = times[config]
            rows.append(found[config])
        del models
        gc.collect()
    return rows


def _ratios(rows: list[dict[str, Any]]) -> None:
    """Adds "<count>_x_tw": each count over TorchRec table-wise's at the same tables and ranks (None: no baseline)."""
    base = {(r["tables"], r["ranks"]): r for r in rows if r["type"] == BASELINE and r["precision"] == "fp32"}
    for r in rows:
        b = base.get((r["tables"], r["ranks"]))
        for key in COUNTS:
            r[f"{key}_x_tw"] = r[key] / b[key] if b is not None and b[key] else None


def _fmt(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| type | wire | tables | ranks | aten ops | x tw | host syncs | x tw | collectives | blocking | x tw "
        "| ms/step | x tw |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['type']} | {r['precision']} | {r['tables']} | {r['ranks']} | {r['aten_ops']} "
            f"| {_fmt(r['aten_ops_x_tw'])} "
            f"| {r['host_syncs']} | {_fmt(r['host_syncs_x_tw'])} | {r['collectives']} | {r['blocking_collectives']} "
            f"| {_fmt(r['blocking_collectives_x_tw'])} | {r['ms']:.1f} | {_fmt(r['ms_x_tw'])} |"
        )
    return "\n".join(lines)


def _csv(text: str, cast: type = str) -> list[Any]:
    return [cast(x) for x in text.split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", type=lambda s: _csv(s, int), default=[8, 64, 512])
    p.add_argument("--ranks", type=lambda s: _csv(s, int), default=[2, 4])
    p.add_argument("--types", type=_csv, default=list(TORCHREC_TYPES + QCOMMS_TYPES + OUR_TYPES))
    p.add_argument("--precisions", type=_csv, default=list(PRECISIONS))
    p.add_argument("--ids", choices=sorted(IDS), default="nonrepeating")
    p.add_argument("--bags", choices=sorted(BAGS), default="multi-hot")
    p.add_argument("--batch-per-rank", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before counting (the first builds lazy dists)")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per spawn of ranks")
    p.add_argument("--json", type=Path, help="also write the rows (with per-op sync counts) here")
    args = p.parse_args()
    for kind in args.types:
        if kind not in TORCHREC_TYPES + QCOMMS_TYPES + OUR_TYPES:
            p.error(f"unknown type {kind!r}; choose from {TORCHREC_TYPES + QCOMMS_TYPES + OUR_TYPES}")
    for precision in args.precisions:
        if precision not in PRECISIONS:
            p.error(f"unknown precision {precision!r}; choose from {PRECISIONS}")
    for ws in args.ranks:
        if ws % LOCAL_WORLD_SIZE:
            p.error(f"--ranks {ws}: must be a multiple of the local world size {LOCAL_WORLD_SIZE}")
    types = list(args.types) if BASELINE in args.types else [BASELINE, *args.types]  # the ratios need it
    rows: list[dict[str, Any]] = []
    for ws in args.ranks:
        configs = _configs(types, args.precisions, ws)
        rows += run_ranks(
            _run,
            ws,
            local_world_size=LOCAL_WORLD_SIZE,
            timeout_s=args.timeout,
            args=(args.tables, configs, args.ids, args.batch_per_rank, args.rounds, args.steps, args.warmup, args.bags),
        )[0]
    _ratios(rows)
    rows.sort(key=lambda r: (r["ranks"], r["tables"]))
    print(
        f"host work per training step on rank 0: {ROWS} rows x dim {DIM} per table, batch {args.batch_per_rank}/rank, "
        f"{args.ids} IDs, {args.bags} bags, gloo ranks in nodes of {LOCAL_WORLD_SIZE}; "
        f"ms: median of {args.rounds} interleaved rounds "
        f"of {args.steps} steps after {args.warmup} warm-up steps"
    )
    print(_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
