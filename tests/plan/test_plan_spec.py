"""Model specs: shipped models, error messages naming the table, JSON/YAML/dict round trips,
specs from torchrec modules, and the expected unique ratio against Monte-Carlo sampling."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from embark_torchrec.plan.model import ranges
from embark_torchrec.plan.cost.bound import step_lower_bound
from embark_torchrec.plan.cost.model import CostModel
from embark_torchrec.plan.plan_model import plan_model
from embark_torchrec.plan.model.spec import (
    IdDistribution,
    ModelSpec,
    SpecError,
    TableSpec,
    builtin_model,
    load_model_spec,
)
from embark_torchrec.plan.model.topology import PRESETS, Topology
from tests.support.specs import spec_document

SHIPPED = {"dcnv2": 26, "t180": 177, "t200": 200, "t510": 510}


def _base() -> dict[str, Any]:
    """The shared spec document and two tables more: one of uniform IDs, one of a given unique ratio."""
    d = spec_document()
    d["tables"] += [
        {"name": "flat", "rows": 5000, "dim": 8, "pooling": 3, "id_distribution": {"kind": "uniform"}},
        {"name": "fixed", "rows": 7000, "dim": 4, "pooling": 1, "unique_ratio": 0.25},
    ]
    return d


# ---- shipped models --------------------------------------------------------------------------


@pytest.mark.parametrize("name,count", sorted(SHIPPED.items()))
def test_shipped_models_load_with_their_table_counts(name: str, count: int) -> None:
    """Each shipped benchmark model loads by name, has its documented number of distinct tables,
    and every table is a valid TableSpec (positive rows, dim multiple of 4, pooling > 0)."""
    spec = builtin_model(name)
    assert len(spec.tables) == count
    assert len({t.name for t in spec.tables}) == count
    assert spec.batch_size > 0
    for t in spec.tables:
        assert t.rows > 0 and t.dim % 4 == 0 and t.pooling > 0


def test_unknown_builtin_model_lists_the_known_ones() -> None:
    """Asking for a model that is not shipped is a SpecError that lists the shipped ones."""
    with pytest.raises(SpecError) as e:
        builtin_model("no-such-model")
    for name in SHIPPED:
        assert name in str(e.value)


# ---- errors name the table -------------------------------------------------------------------


def _set(i: int, key: str, value: Any) -> Callable[[dict], None]:
    def f(d: dict) -> None:
        d["tables"][i][key] = value

    return f


def _drop(i: int, key: str) -> Callable[[dict], None]:
    def f(d: dict) -> None:
        del d["tables"][i][key]

    return f


def _dup_table(d: dict) -> None:
    d["tables"].append({"name": "big", "rows": 10, "dim": 4, "pooling": 1})


ERROR_CASES = {
    "unknown table key": (_set(1, "colour", "red"), ["'big'", "colour"]),
    "negative rows": (_set(1, "rows", -5), ["'big'", "rows"]),
    "zero rows": (_set(1, "rows", 0), ["'big'", "rows"]),
    "non-integer rows": (_set(1, "rows", 10.5), ["'big'", "rows"]),
    "dim not multiple of 4": (_set(1, "dim", 30), ["'big'", "dim"]),
    "negative dim": (_set(1, "dim", -8), ["'big'", "dim"]),
    "negative pooling": (_set(1, "pooling", -1), ["'big'", "pooling"]),
    "unique_ratio above 1": (_set(1, "unique_ratio", 1.5), ["'big'", "unique_ratio"]),
    "duplicate table name": (_dup_table, ["'big'"]),
    "missing rows": (_drop(1, "rows"), ["'big'", "rows"]),
    "missing dim": (_drop(1, "dim"), ["'big'", "dim"]),
    "missing pooling": (_drop(1, "pooling"), ["'big'", "pooling"]),
    "zipf without alpha": (_set(1, "id_distribution", {"kind": "zipf"}), ["'big'", "alpha"]),
    "unknown distribution kind": (_set(1, "id_distribution", {"kind": "poisson"}), ["'big'", "poisson"]),
    "unknown distribution key": (
        _set(1, "id_distribution", {"kind": "zipf", "alpha": 1, "beta": 2}),
        ["'big'", "beta"],
    ),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_spec_errors_name_the_table(case: str, tmp_path: Path) -> None:
    """A broken table is refused with a SpecError whose message names the table (and the problem),
    both from a dict and from a spec file (whose message also names the file)."""
    mutate, needles = ERROR_CASES[case]
    d = _base()
    mutate(d)
    with pytest.raises(SpecError) as e:
        ModelSpec.from_dict(d)
    for needle in needles:
        assert needle in str(e.value), (case, str(e.value))
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(d))
    with pytest.raises(SpecError) as e:
        load_model_spec(path)
    assert "broken.json" in str(e.value)
    for needle in needles:
        assert needle in str(e.value), (case, str(e.value))


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda d: d.update(colour=1), "colour"),
        (lambda d: d.pop("tables"), "tables"),
        (lambda d: d.pop("batch_size"), "batch_size"),
        (lambda d: d.update(batch_size=-3), "batch_size"),
        (lambda d: d.update(tables=[]), "no tables"),
        (lambda d: d.update(id_distribution={"kind": "zipf"}), "alpha"),
    ],
)
def test_model_level_errors(mutate: Callable[[dict], Any], needle: str) -> None:
    """Model-level problems (unknown or missing keys, bad batch size, no tables, zipf without
    alpha) are SpecErrors that say what is wrong."""
    d = _base()
    mutate(d)
    with pytest.raises(SpecError, match=needle):
        ModelSpec.from_dict(d)


def test_a_feature_may_feed_several_tables() -> None:
    """As in TorchRec, one feature may be looked up in several tables (explicitly or by a table's
    implicit feature): the spec loads with each table keeping its feature names."""
    d = _base()
    d["tables"].append({"name": "other", "rows": 10, "dim": 4, "pooling": 1, "feature_names": ["g_big", "small"]})
    spec = ModelSpec.from_dict(d)
    assert spec.table("other").feature_names == ("g_big", "small")
    assert "g_big" in spec.table("big").feature_names and spec.table("small").feature_names == ("small",)


def test_valid_base_spec_loads() -> None:
    """The base spec the error cases mutate is itself valid (so each error comes from its mutation)."""
    spec = ModelSpec.from_dict(_base())
    assert [t.name for t in spec.tables] == ["small", "big", "flat", "fixed"]
    assert spec.table("big").feature_names == ("f_big", "g_big")
    assert spec.table("small").feature_names == ("small",)
    assert spec.distribution(spec.table("flat")) == IdDistribution("uniform")
    assert spec.distribution(spec.table("big")) == IdDistribution("zipf", 1.05)


# ---- plannable ranges ----------------------------------------------------------------------------

# "field and end" -> (where the field is in _base(), the value at that end of its range, the first one beyond it);
# the low ends listed are those beside the type's own (rows >= 1, dim >= 4, ...)
_TABLE = ("tables", 3)
RANGES: dict[str, tuple[tuple[Any, ...], Any, Any]] = {
    "rows high": (_TABLE, ranges.MAX_ROWS, ranges.MAX_ROWS + 1),
    "dim high": (_TABLE, ranges.MAX_DIM, ranges.MAX_DIM + 4),
    "pooling high": (_TABLE, ranges.MAX_POOLING, 1e308),
    "pooling low": (_TABLE, 5e-324, 0.0),
    "unique_ratio high": (_TABLE, 1.0, 1.0000001),
    "unique_ratio low": (_TABLE, ranges.MIN_UNIQUE_RATIO, ranges.MIN_UNIQUE_RATIO / 2),
    "batch_size high": ((), ranges.MAX_BATCH_SIZE, ranges.MAX_BATCH_SIZE + 1),
    "alpha high": (("id_distribution",), ranges.MAX_ZIPF_ALPHA, 1e308),
}


def _with_value(where: tuple[Any, ...], key: str, value: Any) -> dict[str, Any]:
    d = _base()
    target: Any = d
    for step in where:
        target = target[step]
    target[key] = value
    return d


@pytest.mark.parametrize("case", sorted(RANGES))
def test_numbers_are_bounded_to_plannable_ranges(case: str) -> None:
    """Every size and rate of a spec is refused beyond its plannable range (ranges.py), naming the table and the
    field (pooling 1e308 used to make every cost NaN and the plan was written anyway); its edge is accepted."""
    where, accepted, refused = RANGES[case]
    key = case.split()[0]
    assert getattr(_loaded_value(where, key, accepted), key) == accepted
    with pytest.raises(SpecError) as e:
        ModelSpec.from_dict(_with_value(where, key, refused))
    field = f"id_distribution.{key}" if where == ("id_distribution",) else key
    assert f"field {field!r}" in str(e.value), str(e.value)
    if where == _TABLE:
        assert "table 'fixed'" in str(e.value), str(e.value)


def _loaded_value(where: tuple[Any, ...], key: str, value: Any) -> Any:
    """The object holding `key` in the spec loaded with that value: the table, the model or its distribution."""
    spec = ModelSpec.from_dict(_with_value(where, key, value))
    return {(): spec, ("id_distribution",): spec.id_distribution}.get(where, spec.tables[-1])


def test_the_ends_of_every_range_plan_to_finite_costs() -> None:
    """A model at the ends of every range at once (the largest batch, pooling, width and Zipf exponent, the
    smallest unique ratio and pooling) plans to a finite cost and lower bound: the ranges are narrow enough."""
    ws = 4
    spec = ModelSpec(
        "edges",
        ranges.MAX_BATCH_SIZE - ranges.MAX_BATCH_SIZE % ws,
        (
            TableSpec("wide", 1000, ranges.MAX_DIM, ranges.MAX_POOLING),
            TableSpec("long", 10**6, 4, ranges.MAX_POOLING, unique_ratio=ranges.MIN_UNIQUE_RATIO, kind="sequence"),
            TableSpec("rare", ranges.MAX_ROWS // 2**20, 4, 5e-324),
        ),
        IdDistribution("zipf", ranges.MAX_ZIPF_ALPHA),
    )
    topology = Topology(ws, 2, PRESETS["dgx-h100"].with_overrides(hbm_gb=ranges.MAX_HBM_GB))
    planned = plan_model(spec, topology, progress=False)
    assert all(np.isfinite(v) for v in planned.cost.parts().values()), planned.cost.parts()
    assert np.isfinite(planned.cost.rank_load_ms).all() and np.isfinite(planned.cost.rank_memory).all()
    assert np.isfinite(step_lower_bound(CostModel(spec, topology)))


# ---- file formats and round trips --------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_yaml_spec_loads_the_same_as_json(tmp_path: Path, suffix: str) -> None:
    """The same spec written as YAML and as JSON loads to equal ModelSpecs (synthetic and dcnv2)."""
    yaml = pytest.importorskip("yaml")
    shipped = json.loads((Path(__file__).resolve().parents[2] / "embark_torchrec/models/dcnv2.json").read_text())
    for i, d in enumerate([_base(), shipped]):
        (tmp_path / f"m{i}.json").write_text(json.dumps(d))
        (tmp_path / f"m{i}{suffix}").write_text(yaml.safe_dump(d))
        from_json = load_model_spec(tmp_path / f"m{i}.json")
        from_yaml = load_model_spec(tmp_path / f"m{i}{suffix}")
        assert from_yaml == from_json
    assert load_model_spec(tmp_path / "m1.json") == builtin_model("dcnv2")


@pytest.mark.parametrize("name", ["synthetic"] + sorted(SHIPPED))
def test_to_dict_from_dict_round_trip(name: str) -> None:
    """ModelSpec -> to_dict -> JSON text -> from_dict gives an equal spec, keeping feature names,
    per-table distributions and explicit unique ratios."""
    spec = ModelSpec.from_dict(_base()) if name == "synthetic" else builtin_model(name)
    again = ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    if name == "synthetic":
        assert again.table("fixed").unique_ratio == 0.25
        assert again.table("flat").id_distribution == IdDistribution("uniform")
        assert again.table("big").feature_names == ("f_big", "g_big")


def test_from_dict_does_not_modify_its_input() -> None:
    """from_dict leaves the dict it reads untouched."""
    d = _base()
    before = copy.deepcopy(d)
    ModelSpec.from_dict(d)
    assert d == before


# ---- from a torchrec module ------------------------------------------------------------------


def _meta_ebc(tables: list[tuple[str, int, int, list[str]]]) -> Any:
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=f) for n, r, d, f in tables
        ],
        device=torch.device("meta"),
    )


def test_from_module_reads_rows_dim_pooling_and_features() -> None:
    """ModelSpec.from_module on a meta-device EmbeddingBagCollection takes rows, dim and feature
    names from the configs and pooling from ParameterConstraints.pooling_factors (1.0 without one)."""
    from torchrec.distributed.planner.types import ParameterConstraints

    ebc = _meta_ebc([("ta", 1000, 16, ["fa"]), ("tb", 50, 8, ["fb1", "fb2"]), ("tc", 77, 4, ["fc"])])
    constraints = {
        "ta": ParameterConstraints(pooling_factors=[3.5]),
        "tb": ParameterConstraints(pooling_factors=[2.0, 2.0]),
    }
    spec = ModelSpec.from_module(
        ebc, constraints, batch_size=1024, name="m", id_distribution=IdDistribution("zipf", 1.2)
    )
    assert spec.name == "m" and spec.batch_size == 1024
    assert spec.id_distribution == IdDistribution("zipf", 1.2)
    assert [t.name for t in spec.tables] == ["ta", "tb", "tc"]
    ta, tb, tc = spec.tables
    assert (ta.rows, ta.dim, ta.pooling, ta.feature_names) == (1000, 16, 3.5, ("fa",))
    assert (tb.rows, tb.dim, tb.feature_names) == (50, 8, ("fb1", "fb2"))
    assert (tc.rows, tc.dim, tc.pooling, tc.feature_names) == (77, 4, 1.0, ("fc",))


def test_from_module_round_trips_multi_feature_pooling() -> None:
    """spec -> (meta_module, torchrec_constraints) -> from_module gives back the spec's pooling, also for a
    table with several features, so the cost model sees the same IDs per sample as torchrec's planner."""
    from embark_torchrec.planner.torchrec_plans import meta_module, torchrec_constraints

    spec = ModelSpec.from_dict(_base())
    back = ModelSpec.from_module(meta_module(spec)["pooled"], torchrec_constraints(spec), batch_size=spec.batch_size)
    assert [(t.name, t.rows, t.dim, t.feature_names) for t in back.tables] == [
        (t.name, t.rows, t.dim, t.feature_names) for t in spec.tables
    ]
    assert [t.pooling for t in back.tables] == [t.pooling for t in spec.tables]


@pytest.mark.parametrize("field", ["pooling_factors", "num_poolings"])
def test_from_module_bounds_the_pooling_its_constraints_give(field: str) -> None:
    """ParameterConstraints whose IDs per sample go beyond the plannable pooling (here 2e6 over two features) are
    a SpecError naming the table and pooling_factors (the field the user wrote), not the derived `pooling`."""
    from torchrec.distributed.planner.types import ParameterConstraints

    ebc = _meta_ebc([("ta", 1000, 16, ["fa", "fb"])])
    at_most = {field: [ranges.MAX_POOLING, ranges.MAX_POOLING]}
    assert ModelSpec.from_module(ebc, {"ta": ParameterConstraints(**at_most)}).tables[0].pooling == ranges.MAX_POOLING
    beyond = {field: [ranges.MAX_POOLING, 3 * ranges.MAX_POOLING]}
    with pytest.raises(SpecError, match=r"table 'ta': field 'pooling_factors': the IDs per sample .* are 2e\+06"):
        ModelSpec.from_module(ebc, {"ta": ParameterConstraints(**beyond)})


# ---- expected unique ratio vs Monte-Carlo ------------------------------------------------------


def _monte_carlo_distinct(dist: IdDistribution, rows: int, draws: int, rng: np.random.Generator, trials: int) -> float:
    if dist.kind == "uniform":
        samples = [rng.integers(0, rows, size=draws) for _ in range(trials)]
    else:
        weights = np.arange(1, rows + 1, dtype=np.float64) ** -dist.alpha
        cdf = np.cumsum(weights)
        cdf /= cdf[-1]
        samples = [np.minimum(np.searchsorted(cdf, rng.random(draws), side="right"), rows - 1) for _ in range(trials)]
    return float(np.mean([np.unique(s).size for s in samples]))


@pytest.mark.parametrize("kind", ["uniform", "zipf"])
@pytest.mark.parametrize("rows", [10_000, 2_000_000])
@pytest.mark.parametrize("draws", [10_000, 100_000, 1_000_000])
def test_expected_unique_ratio_matches_monte_carlo(kind: str, rows: int, draws: int) -> None:
    """ModelSpec.expected_unique_ratio (one rank's draws = batch / world x pooling) is within 3% of
    the distinct fraction counted in sampled IDs, for uniform and Zipf(1.1) IDs."""
    dist = IdDistribution("uniform") if kind == "uniform" else IdDistribution("zipf", 1.1)
    world, pooling = 4, 2.0
    batch = int(draws * world / pooling)
    spec = ModelSpec("mc", batch, (TableSpec("t", rows, 4, pooling),), id_distribution=dist)
    predicted = spec.expected_unique_ratio(spec.tables[0], world)
    rng = np.random.default_rng(1234 + rows + draws)
    measured = _monte_carlo_distinct(dist, rows, draws, rng, trials=3 if draws <= 100_000 else 1) / draws
    assert 0 < predicted <= 1
    assert predicted == pytest.approx(measured, rel=0.03), (predicted, measured)


def test_expected_unique_ratio_orders_sensibly() -> None:
    """More draws give a lower unique ratio; Zipf repeats more than uniform; and more ranks (fewer
    draws each) give a higher ratio."""
    zipf, uni = IdDistribution("zipf", 1.1), IdDistribution("uniform")
    t = TableSpec("t", 1_000_000, 4, 1.0)
    ratios = [ModelSpec("m", b, (t,), zipf).expected_unique_ratio(t, 1) for b in (1000, 10_000, 100_000)]
    assert ratios[0] > ratios[1] > ratios[2]
    assert ModelSpec("m", 100_000, (t,), zipf).expected_unique_ratio(t, 1) < ModelSpec(
        "m", 100_000, (t,), uni
    ).expected_unique_ratio(t, 1)
    spec = ModelSpec("m", 65536, (t,), zipf)
    assert spec.expected_unique_ratio(t, 16) > spec.expected_unique_ratio(t, 2)


def test_explicit_unique_ratio_wins() -> None:
    """A table's explicit unique_ratio is returned as is, whatever the distribution and world size;
    a per-table distribution overrides the model's default."""
    spec = ModelSpec.from_dict(_base())
    fixed = spec.table("fixed")
    for world in (1, 8, 64):
        assert spec.expected_unique_ratio(fixed, world) == 0.25
    flat = spec.table("flat")
    draws = spec.batch_size / 8 * flat.pooling
    assert spec.expected_unique_ratio(flat, 8) == pytest.approx(
        IdDistribution("uniform").expected_distinct(flat.rows, draws) / draws
    )
    assert spec.expected_unique_ratio(flat, 8) != pytest.approx(
        IdDistribution("zipf", 1.05).expected_distinct(flat.rows, draws) / draws
    )
