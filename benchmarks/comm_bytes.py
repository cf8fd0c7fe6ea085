"""Counted communication bytes of one table, reduction-based vs unique-based, fp32 vs fp16, in one run.

One table of 1M rows with Zipf(1.1) IDs (hot IDs hashed over the rows) on 4 gloo ranks as 2 nodes x 2, placed
table-wise and row-wise over the 4 ranks, for a few (dim, pooling, batch per rank) cases. Each layout trains one
step with comm_stats on; the bytes are the sum over ranks of what each sent (IDs, lengths / counts, embeddings
and gradients). Bytes are counted, not timed, so one run is exact. Writes benchmarks/comm_bytes.md.

UB sends one vector per distinct ID of a rank, RB one pooled vector per sample: UB wins when the distinct IDs
per sample (unique ratio x pooling) are well below one, or when IDs dominate (small dims).

    .venv/bin/python benchmarks/comm_bytes.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan.layout.tables import TableLayout, WirePrecision
from embark_torchrec.sharding.comm_stats import enable_comm_stats
from embark_torchrec.testing import run_ranks
from embark_torchrec.testing.training import sharded_model

ROWS, ALPHA, WS, LWS = 1_000_000, 1.1, 4, 2
CASES = [(64, 50, 1024), (4, 50, 65536), (64, 1, 1024)]  # (dim, pooling, batch per rank)
QUARTERS = tuple(ROWS * i // 4 for i in range(5))
KINDS = ("ids", "lengths", "embeddings", "gradients")


def _layouts(dim: int) -> dict[str, TableLayout]:
    return {
        f"{cluster} {kind} {precision}": TableLayout(
            cluster, rows, (0, dim), ranks, WirePrecision(precision, precision)
        )
        for cluster in ("rb", "ub")
        for kind, rows, ranks in (
            ("table-wise", (0, ROWS), ((1,),)),
            ("row-wise", QUARTERS, tuple((k,) for k in range(4))),
        )
        for precision in ("fp32", "fp16")
    }


def _batch(rank: int, batch: int, pooling: int) -> KeyedJaggedTensor:
    """Zipf(1.1) over the rows, hot IDs hashed to random rows (a fixed permutation), `pooling` IDs per bag."""
    gen = torch.Generator().manual_seed(1234)
    permutation = torch.randperm(ROWS, generator=gen)
    p = torch.arange(1, ROWS + 1, dtype=torch.float64) ** -ALPHA
    gen.manual_seed(rank)
    ids = permutation[torch.multinomial(p, batch * pooling, replacement=True, generator=gen)]
    return KeyedJaggedTensor(
        keys=["f"], values=ids, lengths=torch.full((batch,), pooling, dtype=torch.int32), stride=batch
    )


def _measure(dim: int, pooling: int, batch: int) -> dict[str, dict[str, int]]:
    rank = dist.get_rank()
    kjt = _batch(rank, batch, pooling)
    table = EmbeddingBagConfig(name="t", num_embeddings=ROWS, embedding_dim=dim, feature_names=["f"])
    out: dict[str, dict[str, int]] = {}
    for name, layout in _layouts(dim).items():
        model = sharded_model([table], {"t": layout}, LWS)
        stats = enable_comm_stats(model)
        pooled = model(kjt)
        pooled = pooled.wait() if hasattr(pooled, "wait") else pooled
        pooled["f"].sum().backward()
        out[name] = {kind: stats.totals([k for k in stats.keys() if k.kind == kind])["sent"] for kind in KINDS}
        out[name]["distinct"] = int(torch.unique(kjt.values()).numel())
        del model, stats, pooled
    return out


def _table(dim: int, pooling: int, batch: int, per_rank: list[dict[str, dict[str, int]]]) -> list[str]:
    names = list(_layouts(dim))
    total = {name: {kind: sum(r[name][kind] for r in per_rank) for kind in KINDS} for name in names}
    ratio = sum(r[names[0]]["distinct"] for r in per_rank) / (WS * batch * pooling)
    lines = [
        f"## dim {dim}, pooling {pooling}, batch {batch:,} per rank (measured unique ratio {ratio:.3f})",
        "",
        "| layout | IDs | lengths / counts | embeddings | gradients | total | UB / RB (total) "
        "| fp16 / fp32 (embeddings) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, t in total.items():
        cluster, kind, precision = name.split()
        all_bytes = sum(t.values())
        rb, fp32 = total[f"rb {kind} {precision}"], total[f"{cluster} {kind} fp32"]
        lines.append(
            f"| {name} | {t['ids']:,} | {t['lengths']:,} | {t['embeddings']:,} | {t['gradients']:,} | {all_bytes:,} "
            f"| {all_bytes / sum(rb.values()):.3f} | {t['embeddings'] / fp32['embeddings']:.3f} |"
        )
    return lines + [""]


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    lines = [
        f"# Counted bytes of one table: {ROWS:,} rows, Zipf({ALPHA}) IDs, {WS} ranks as 2 nodes x 2",
        "",
        "Bytes sent, summed over ranks, in one training step (forward + backward). "
        "Command: `.venv/bin/python benchmarks/comm_bytes.py`",
        "",
    ]
    for dim, pooling, batch in CASES:
        per_rank = run_ranks(_measure, WS, args=(dim, pooling, batch), local_world_size=LWS, timeout_s=1800)
        lines += _table(dim, pooling, batch, per_rank)
    text = "\n".join(lines)
    print(text)
    Path(__file__).with_name("comm_bytes.md").write_text(text)


if __name__ == "__main__":
    main()
