"""Seeded model specs that nobody tuned the planner for: the models of the sweep (benchmarks/sweep.py).

A model is drawn from one seed, so a result names its models by seed and a new run draws new ones. What is drawn,
per model, after the shapes of public DLRM-style models (Criteo's 26 one-hot features, multi-hot Zipf features,
a few giant ID tables):
- one embedding width for every table (DLRM_DCN, the example's model, needs one), from WIDTHS;
- a table count, uniform in `tables`;
- rows log-uniform in `rows`, and a few giant tables (GIANT_SHARE of the count, at least one in half the
  models) with GIANT_ROWS_FACTOR times the largest ordinary row count;
- pooling: one-hot with probability ONE_HOT_SHARE, else log-uniform in `pooling`;
- IDs: per table Zipf(alpha), alpha uniform in ZIPF_ALPHA, with probability ZIPF_SHARE, else uniform;
- shared features: with probability `shared_feature_share` a table reads another table's feature (as TorchRec
  allows: one feature, a lookup per table). The sweep draws none: TorchRec's DLRM, the example's model, looks a
  pooled embedding up by its feature's name, which a shared feature does not have.
The default ranges fit the emulated cluster on a 2-core box (4-8 CPU ranks, seconds per step); pass larger ones
for a model of a real cluster.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embark_torchrec.plan import IdDistribution, ModelSpec, TableSpec

WIDTHS = (16, 32, 64)
ONE_HOT_SHARE = 0.4
ZIPF_SHARE = 0.6
ZIPF_ALPHA = (0.8, 1.3)
GIANT_SHARE = 0.1
GIANT_ROWS_FACTOR = 10


@dataclass(frozen=True)
class ModelRanges:
    """The ranges a model is drawn from: inclusive (low, high) pairs."""

    tables: tuple[int, int] = (6, 16)
    rows: tuple[int, int] = (100, 50_000)
    pooling: tuple[float, float] = (2.0, 100.0)
    batch_size: int = 2048
    shared_feature_share: float = 0.1

    def __post_init__(self) -> None:
        for field, (low, high) in (("tables", self.tables), ("rows", self.rows), ("pooling", self.pooling)):
            if not 0 < low <= high:
                raise ValueError(f"ModelRanges.{field}: expected 0 < low <= high, got ({low}, {high})")
        if not 0.0 <= self.shared_feature_share <= 1.0:
            raise ValueError(f"ModelRanges.shared_feature_share: expected 0 to 1, got {self.shared_feature_share}")
        if self.batch_size < 1:
            raise ValueError(f"ModelRanges.batch_size: expected >= 1, got {self.batch_size}")


def _log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def generate_model(seed: int, ranges: ModelRanges = ModelRanges()) -> ModelSpec:
    """The model of one seed: the same seed and ranges give the same spec, on any machine (numpy's PCG64)."""
    rng = np.random.default_rng(seed)
    width = int(rng.choice(WIDTHS))
    count = int(rng.integers(ranges.tables[0], ranges.tables[1] + 1))
    giants = int(rng.binomial(count, GIANT_SHARE)) or int(rng.random() < 0.5)
    tables: list[TableSpec] = []
    for i in range(count):
        rows = round(_log_uniform(rng, *ranges.rows))
        if i < giants:
            rows = ranges.rows[1] * GIANT_ROWS_FACTOR
        one_hot = rng.random() < ONE_HOT_SHARE
        pooling = 1.0 if one_hot else round(_log_uniform(rng, *ranges.pooling), 1)
        zipf = rng.random() < ZIPF_SHARE
        ids = IdDistribution("zipf", round(float(rng.uniform(*ZIPF_ALPHA)), 2)) if zipf else IdDistribution()
        shared = tables and rng.random() < ranges.shared_feature_share
        feature = tables[int(rng.integers(len(tables)))].feature_names[0] if shared else f"f{i}"
        tables.append(TableSpec(f"t{i}", rows, width, pooling, (feature,), ids))
    return ModelSpec(f"generated-{seed}", ranges.batch_size, tuple(tables))


def describe(spec: ModelSpec) -> str:
    """One line a result table can show: tables, rows, pooling, IDs and shared features."""
    rows = [t.rows for t in spec.tables]
    one_hot = sum(t.pooling == 1.0 for t in spec.tables)
    zipf = sum(t.id_distribution is not None and t.id_distribution.kind == "zipf" for t in spec.tables)
    features = {f for t in spec.tables for f in t.feature_names}
    shared = sum(len(t.feature_names) for t in spec.tables) - len(features)
    return (
        f"{len(rows)} tables x {spec.tables[0].dim}, rows {min(rows):,}-{max(rows):,}, {one_hot} one-hot, "
        f"{zipf} Zipf, {shared} shared features"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write the model spec of each seed (benchmarks/model_generator.py).")
    p.add_argument("seeds", type=int, nargs="+", help="one model per seed")
    p.add_argument("--out-dir", type=Path, default=Path("."), help="writes generated-<seed>.json there")
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        spec = generate_model(seed)
        path = args.out_dir / f"{spec.name}.json"
        path.write_text(json.dumps(spec.to_dict(), indent=1) + "\n")
        print(f"{path}: {describe(spec)}")


if __name__ == "__main__":
    main()
