"""Writes the adversarial model specs of benchmarks/plan_quality.py (issue 26), from a fixed seed, so
that they can be regenerated and changed in one place:

- skewed_dcnv2: DCNv2's 26 Criteo tables (dim 128), three of them taking 85% of the lookups;
- tiny_big: 400 tiny tables (4 to 20,000 rows, dim 16-64, pooling 1-2) beside 4 big ones (10M-50M rows,
  dim 128, pooling 10-40);
- mixed300: 300 tables of every size (1k to 50M rows, dim 16-256), heavy-tailed pooling (one table at
  300 IDs a sample), uniform and Zipf(0.8-1.3) IDs.

    python benchmarks/models/make_adversarial.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
SEED = 26
BATCH = 65536
# DCNv2's rows (MLPerf Criteo 1TB, /work/shared/models/dcnv2.json)
DCNV2_ROWS = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)  # fmt: skip
SKEWED_POOLING = {0: 120.0, 9: 60.0, 10: 30.0}  # the hot tables; the others look up 1-2 IDs a sample


def table(name: str, rows: int, dim: int, pooling: float, alpha: float | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "rows": int(rows), "dim": int(dim), "pooling": round(float(pooling), 2)}
    if alpha is not None:
        entry["id_distribution"] = {"kind": "zipf", "alpha": round(float(alpha), 2)} if alpha else {"kind": "uniform"}
    return entry


def skewed_dcnv2(rng: np.random.Generator) -> dict[str, Any]:
    tables = [
        table(f"t{i}", rows, 128, SKEWED_POOLING.get(i, float(rng.integers(1, 3)))) for i, rows in enumerate(DCNV2_ROWS)
    ]
    return {
        "name": "skewed-dcnv2",
        "description": "DCNv2's 26 tables (dim 128, Criteo rows) with skewed pooling: t0 120, t9 60, t10 30 IDs a "
        "sample (85% of the lookups), the others 1-2; Zipf(1.05) IDs (issue 26's skewed DCNv2)",
        "batch_size": BATCH,
        "id_distribution": {"kind": "zipf", "alpha": 1.05},
        "tables": tables,
    }


def tiny_big(rng: np.random.Generator) -> dict[str, Any]:
    tiny = [
        table(
            f"tiny{i}",
            int(np.exp(rng.uniform(np.log(4), np.log(20000)))),
            int(rng.choice([16, 32, 64])),
            float(rng.integers(1, 3)),
        )
        for i in range(400)
    ]
    big = [
        table(f"big{i}", rows, 128, pooling)
        for i, (rows, pooling) in enumerate(((50_000_000, 40), (30_000_000, 30), (20_000_000, 20), (10_000_000, 10)))
    ]
    return {
        "name": "tiny-big",
        "description": "400 tiny tables (4-20,000 rows log-uniform, dim 16/32/64, pooling 1-2) and 4 big ones "
        "(50M, 30M, 20M, 10M rows, dim 128, pooling 40, 30, 20, 10); Zipf(1.1) IDs (issue 26's many tiny tables "
        "plus a few big ones)",
        "batch_size": BATCH,
        "id_distribution": {"kind": "zipf", "alpha": 1.1},
        "tables": big + tiny,
    }


def mixed300(rng: np.random.Generator) -> dict[str, Any]:
    tables = []
    for i in range(300):
        rows = int(np.exp(rng.uniform(np.log(1_000), np.log(50_000_000))))
        dim = int(rng.choice([16, 32, 64, 128, 256], p=[0.2, 0.3, 0.25, 0.2, 0.05]))
        pooling = min(150.0, float(rng.lognormal(1.0, 1.2)))
        alpha = 0.0 if rng.random() < 0.3 else float(rng.uniform(0.8, 1.3))
        tables.append(table(f"m{i}", rows, dim, max(1.0, pooling), alpha))
    tables[0] = table("m0", 20_000_000, 128, 300.0, 1.05)  # the hottest table
    return {
        "name": "mixed300",
        "description": "300 tables: rows log-uniform 1k-50M, dim 16-256, pooling lognormal(1, 1.2) capped at 150 "
        "with m0 (20M x 128) at 300; 30% uniform IDs, the rest Zipf(0.8-1.3) (issue 26's 300-table mixed model)",
        "batch_size": BATCH,
        "tables": tables,
    }


def main() -> None:
    rng = np.random.default_rng(SEED)
    for make in (skewed_dcnv2, tiny_big, mixed300):
        spec = make(rng)
        path = HERE / f"{make.__name__}.json"
        path.write_text(json.dumps(spec, indent=1) + "\n")
        print(f"wrote {path} ({len(spec['tables'])} tables)")


if __name__ == "__main__":
    main()
