"""benchmarks/model_generator.py, the sweep's models: one seed, one model, the same on every machine; drawn within
their ranges, with the mix of shapes the sweep is meant to cover; and every one plannable as the sweep plans it."""

from __future__ import annotations


import pytest

from embark_torchrec.plan import ModelSpec, Topology, plan_model
from tests.support.benchmarks import load_benchmark

gen = load_benchmark("model_generator")

SEEDS = range(200)


def test_a_seed_draws_one_model_and_seeds_draw_different_ones() -> None:
    assert gen.generate_model(7).to_dict() == gen.generate_model(7).to_dict()
    assert len({str(gen.generate_model(s).to_dict()) for s in range(20)}) == 20


def test_every_model_is_within_its_ranges_with_one_width() -> None:
    ranges = gen.ModelRanges()
    for seed in SEEDS:
        spec = gen.generate_model(seed, ranges)
        assert ranges.tables[0] <= len(spec.tables) <= ranges.tables[1]
        assert len({t.dim for t in spec.tables}) == 1 and spec.tables[0].dim in gen.WIDTHS
        giant = ranges.rows[1] * gen.GIANT_ROWS_FACTOR
        for t in spec.tables:
            assert ranges.rows[0] <= t.rows <= ranges.rows[1] or t.rows == giant, (seed, t)
            assert t.pooling == 1.0 or ranges.pooling[0] <= t.pooling <= ranges.pooling[1], (seed, t)
        assert spec.batch_size == ranges.batch_size


def test_the_models_mix_the_shapes_the_sweep_covers() -> None:
    """Over 200 seeds each drawn share lands near its probability, and giants, shared features, Zipf and uniform
    tables all occur: a generator stuck on one shape would make a sweep that tests one shape."""
    specs = [gen.generate_model(s) for s in SEEDS]
    tables = [t for spec in specs for t in spec.tables]
    one_hot = sum(t.pooling == 1.0 for t in tables) / len(tables)
    zipf = sum(t.id_distribution is not None and t.id_distribution.kind == "zipf" for t in tables) / len(tables)
    assert abs(one_hot - gen.ONE_HOT_SHARE) < 0.05 and abs(zipf - gen.ZIPF_SHARE) < 0.05
    with_giants = sum(any(t.rows > gen.ModelRanges().rows[1] for t in spec.tables) for spec in specs)
    assert 0.4 * len(specs) < with_giants < 0.9 * len(specs)
    shared = sum(
        sum(len(t.feature_names) for t in s.tables) > len({f for t in s.tables for f in t.feature_names}) for s in specs
    )
    assert shared > 0.2 * len(specs)
    assert {spec.tables[0].dim for spec in specs} == set(gen.WIDTHS)


def test_bad_ranges_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="ModelRanges.rows"):
        gen.ModelRanges(rows=(10, 5))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_generated_model_plans_at_the_sweeps_shape(seed: int) -> None:
    spec: ModelSpec = gen.generate_model(seed)
    planned = plan_model(spec.with_batch_size(spec.batch_size * 4), Topology(4, 2), progress=False)
    assert set(planned.plan.tables) == {t.name for t in spec.tables}
