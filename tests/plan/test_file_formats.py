"""Model spec and plan files are read field by field: one test per way a file used to be misread
(a wrong type silently converted, a typo ignored, a crash deep inside TorchRec, a traceback that
does not name the file). Every refusal is a SpecError / PlanError whose one-line message names the
file, the table and the field."""

from __future__ import annotations

import copy
import json
import pickle
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from embark_torchrec.plan.layout.constraints import TableConstraints, from_torchrec
from embark_torchrec.plan.model.fields import MODULE_DICT_ATTRIBUTES
from embark_torchrec.plan.model.hardware_file import HardwareError, check_document, hardware_fields, load_hardware
from embark_torchrec.plan.layout.tables import Plan, PlanError, TableLayout, WirePrecision
from embark_torchrec.plan.model.ranges import HARDWARE_RANGES
from embark_torchrec.plan.model.spec import IdDistribution, ModelSpec, SpecError, TableSpec, load_model_spec
from embark_torchrec.plan.model.topology import PRESETS
from tests.support.specs import spec_document

ROOT = Path(__file__).resolve().parents[2]


def _plan() -> dict[str, Any]:
    return Plan(
        4,
        2,
        {
            "dp": TableLayout.data_parallel(),
            "t3": TableLayout("rb", (0, 50, 100), (0, 16), ((0,), (1,)), WirePrecision("fp16", "bf16"), True),
        },
    ).to_dict()


def _refused(error: type[Exception], load: Callable[[], Any], *needles: str) -> str:
    """Loading raises `error` with a one-line message holding every needle; the message."""
    with pytest.raises(error) as e:
        load()
    message = str(e.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def _write(tmp_path: Path, name: str, doc: Any) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


# ---- model specs ---------------------------------------------------------------------------------


SPEC_FINDINGS: dict[str, tuple[Callable[[dict], None], list[str]]] = {
    # a string is not read as a list of its letters
    "feature_names a string": (
        lambda d: d["tables"][1].update(feature_names="user_id"),
        ["table 'big'", "field 'feature_names'", "'user_id'"],
    ),
    "pooling Infinity": (lambda d: d["tables"][0].update(pooling=float("inf")), ["table 'small'", "field 'pooling'"]),
    "pooling NaN": (lambda d: d["tables"][0].update(pooling=float("nan")), ["table 'small'", "field 'pooling'"]),
    "pooling a bool": (lambda d: d["tables"][0].update(pooling=True), ["table 'small'", "field 'pooling'"]),
    # beyond the plannable ranges (ranges.py): 1e308 used to make every cost NaN, and the plan was written
    "pooling 1e308": (lambda d: d["tables"][0].update(pooling=1e308), ["table 'small'", "field 'pooling'", "1e+308"]),
    "rows 2**62": (lambda d: d["tables"][1].update(rows=2**62), ["table 'big'", "field 'rows'"]),
    "batch_size 2**40": (lambda d: d.update(batch_size=2**40), ["field 'batch_size'"]),
    "pooling a string": (lambda d: d["tables"][0].update(pooling="2"), ["table 'small'", "field 'pooling'"]),
    "zipf alpha Infinity": (
        lambda d: d.update(id_distribution={"kind": "zipf", "alpha": float("inf")}),
        ["field 'id_distribution.alpha'"],
    ),
    "table zipf alpha NaN": (
        lambda d: d["tables"][1].update(id_distribution={"kind": "zipf", "alpha": float("nan")}),
        ["table 'big'", "field 'id_distribution.alpha'"],
    ),
    "uniform with alpha": (
        lambda d: d.update(id_distribution={"kind": "uniform", "alpha": 1.1}),
        ["field 'id_distribution.alpha'", "zipf"],
    ),
    "rows true": (lambda d: d["tables"][1].update(rows=True), ["table 'big'", "field 'rows'", "True"]),
    "rows a float": (lambda d: d["tables"][1].update(rows=100.0), ["table 'big'", "field 'rows'"]),
    "dim a string": (lambda d: d["tables"][1].update(dim="64"), ["table 'big'", "field 'dim'"]),
    "batch_size a float": (lambda d: d.update(batch_size=4096.0), ["field 'batch_size'"]),
    "unique_ratio a bool": (lambda d: d["tables"][0].update(unique_ratio=True), ["field 'unique_ratio'"]),
    "name null": (lambda d: d["tables"][1].update(name=None), ["table #1", "field 'name'"]),
    "model name null": (lambda d: d.update(name=None), ["field 'name'"]),
    "optional field null": (lambda d: d["tables"][0].update(unique_ratio=None), ["field 'unique_ratio'", "null"]),
    "feature_names empty": (lambda d: d["tables"][0].update(feature_names=[]), ["field 'feature_names'"]),
    "feature name not a string": (lambda d: d["tables"][0].update(feature_names=[3]), ["field 'feature_names'"]),
    # formerly TypeError / RecursionError tracebacks
    "tables a number": (lambda d: d.update(tables=5), ["field 'tables'"]),
    "tables a string": (lambda d: d.update(tables="small"), ["field 'tables'"]),
    "table a list": (lambda d: d["tables"].__setitem__(0, ["small", 100]), ["table #0"]),
    "id_distribution a string": (lambda d: d.update(id_distribution="zipf"), ["field 'id_distribution'"]),
    "nested garbage": (
        lambda d: d["tables"][0].update(rows=_nested(50_000)),
        ["table 'small'", "field 'rows'"],
    ),
    "misspelt table key": (
        lambda d: d["tables"][1].update(polling=2),
        ["table 'big'", "field 'polling'", "did you mean 'pooling'?"],
    ),
    "misspelt model key": (lambda d: d.update(batchsize=2), ["field 'batchsize'", "did you mean 'batch_size'?"]),
    "misspelt distribution key": (
        lambda d: d.update(id_distribution={"kind": "zipf", "alpah": 1.1}),
        ["field 'id_distribution.alpah'", "did you mean 'alpha'?"],
    ),
}


def _nested(depth: int) -> list[Any]:
    """[[[...]]], `depth` lists deep, built without recursion."""
    out: list[Any] = []
    for _ in range(depth):
        out = [out]
    return out


@pytest.mark.parametrize("case", sorted(SPEC_FINDINGS))
def test_spec_fields_are_typed(case: str, tmp_path: Path) -> None:
    """Each mutation of a valid spec is a SpecError naming the table and the field, from a dict and,
    where JSON can hold the value, from a file whose name the message starts with."""
    mutate, needles = SPEC_FINDINGS[case]
    doc = spec_document()
    mutate(doc)
    _refused(SpecError, lambda: ModelSpec.from_dict(doc), *needles)
    if case != "nested garbage":  # too deep for json.dumps; the file path is tested below
        path = _write(tmp_path, "spec.json", doc)
        assert _refused(SpecError, lambda: load_model_spec(path), *needles).startswith(f"{path}: ")


def test_the_unmutated_spec_loads() -> None:
    """The document the findings mutate is valid, so each refusal comes from its mutation."""
    spec = ModelSpec.from_dict(spec_document())
    assert spec.table("big").feature_names == ("f_big", "g_big") and spec.table("small").pooling == 1.0


def test_error_message_names_file_table_and_field(tmp_path: Path) -> None:
    """The message is exactly 'file: table: field: what was expected, what was found'."""
    doc = spec_document()
    doc["tables"][1]["feature_names"] = "user_id"
    path = _write(tmp_path, "spec.json", doc)
    with pytest.raises(SpecError) as e:
        load_model_spec(path)
    assert str(e.value) == (
        f"{path}: table 'big': field 'feature_names': expected a non-empty list of non-empty strings, got 'user_id'"
    )


FILE_CONTENTS: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "empty"),
    "blank": (b" \n\t\n", "empty"),
    "not UTF-8": (b'{"name": "m\xff"}', "UTF-8"),
    "latin-1": ('{"name": "caf\u00e9"}'.encode("latin-1"), "UTF-8"),
    "invalid JSON": (b'{"name": "m",', "invalid JSON"),
    "truncated": (json.dumps(spec_document()).encode()[:40], "invalid JSON"),
    "too deep": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "huge integer": (b'{"batch_size": ' + b"9" * 5000 + b"}", "invalid JSON"),
    "duplicate key": (b'{"batch_size": 1, "batch_size": 2}', "'batch_size' appears twice"),
    "a list": (b"[1, 2]", "expected an object"),
}


@pytest.mark.parametrize("case", sorted(FILE_CONTENTS))
def test_unreadable_spec_files_are_refused_naming_the_file(case: str, tmp_path: Path) -> None:
    """Empty, non-UTF-8, invalid, too deeply nested JSON and a key given twice: a SpecError that
    starts with the file's name (before: UnicodeDecodeError, JSONDecodeError, RecursionError)."""
    content, needle = FILE_CONTENTS[case]
    path = tmp_path / "spec.json"
    path.write_bytes(content)
    assert _refused(SpecError, lambda: load_model_spec(path), needle).startswith(f"{path}: ")


def test_missing_file_and_directory_are_refused_naming_them(tmp_path: Path) -> None:
    """A path that is not a readable file is a SpecError / PlanError naming it, not an OSError."""
    for path in (tmp_path / "absent.json", tmp_path):
        assert _refused(SpecError, lambda: load_model_spec(path), "cannot read").startswith(f"{path}: ")
        assert _refused(PlanError, lambda: Plan.load(path), "cannot read").startswith(f"{path}: ")


# YAML 1.1's surprises, as PyYAML's SafeLoader reads them: each is the string written, which a number field refuses
YAML_11_NUMBERS = {
    "0100": "octal: 64 rows",
    "1:30": "base 60: 90 rows",
    "0x100": "hex: 256 rows",
    "0o100": "YAML 1.2's octal: 64 rows",
    "1_000": "digits grouped: 1000 rows",
    "yes": "True",
    "on": "True",
    "off": "False",
    ".inf": "infinite",
    "-.Inf": "-infinite",
    ".nan": "NaN",
    "+12": "12",
    "2024-01-01": "a date",
}
YAML_CASES: dict[str, tuple[dict[str, str], list[str]]] = {
    **{
        f"rows {written} ({meaning})": ({"rows": written}, ["table 't'", "field 'rows'", repr(written)])
        for written, meaning in YAML_11_NUMBERS.items()
    },
    **{
        f"pooling {written}": ({"pooling": written}, ["table 't'", "field 'pooling'", repr(written)])
        for written in (".inf", ".nan", "1:30", "on", "2024-01-01")
    },
    "tagged !!int 0100": ({"rows": "!!int 0100"}, ["invalid YAML", "'0100'", "line 4"]),
    "tagged !!float .inf": ({"pooling": "!!float .inf"}, ["invalid YAML", "'.inf'"]),
    "tagged !!bool yes": ({"dim": "!!bool yes"}, ["invalid YAML", "'yes'"]),
    "a !!timestamp": ({"pooling": "!!timestamp 2024-01-01"}, ["invalid YAML", "timestamp"]),
    "a python object": ({"rows": "!!python/object/apply:os.getpid []"}, ["invalid YAML", "python/object"]),
    "a duplicate key": ({"rows": "10\n    rows: 20"}, ["'rows' appears twice"]),
    "invalid YAML": ({"rows": "[10"}, ["invalid YAML"]),
}


@pytest.mark.parametrize("case", sorted(YAML_CASES))
def test_yaml_specs_are_read_as_strictly_as_json(case: str, tmp_path: Path) -> None:
    """YAML is read under YAML 1.2's JSON schema: the scalars YAML 1.1 reads as numbers or booleans (0100 as 64,
    1:30 as 90, 0x100 as 256, yes, .inf, dates) are strings, which a number field refuses, naming the file, the
    table, the field and the value as written; tagged ones, other types, a key given twice and invalid YAML are
    SpecErrors naming the file."""
    pytest.importorskip("yaml")
    overrides, needles = YAML_CASES[case]
    path = _yaml_spec(tmp_path, overrides)
    assert _refused(SpecError, lambda: load_model_spec(path), *needles).startswith(f"{path}: ")


def _yaml_spec(tmp_path: Path, overrides: dict[str, str]) -> Path:
    """A one-table YAML spec, its table's values written unquoted as given."""
    table = {"name": "t", "rows": "10", "dim": "4", "pooling": "1", **overrides}
    path = tmp_path / "spec.yaml"
    path.write_text("batch_size: 8\ntables:\n  - " + "\n    ".join(f"{k}: {v}" for k, v in table.items()) + "\n")
    return path


def test_yaml_text_is_read_as_written(tmp_path: Path) -> None:
    """Where a string is expected, YAML 1.1's numbers and booleans are the text written (a feature named `on` or
    `0100` stays so), and YAML 1.2's numbers are read as JSON reads them (1e2 is 100.0; YAML 1.1 made it a
    string)."""
    pytest.importorskip("yaml")
    names = sorted(YAML_11_NUMBERS)
    path = _yaml_spec(tmp_path, {"name": "no", "pooling": "1e2", "feature_names": f"[{', '.join(names)}]"})
    (table,) = load_model_spec(path).tables
    assert (table.name, table.pooling, table.feature_names) == ("no", 100.0, tuple(names))


def test_the_unmutated_yaml_spec_loads(tmp_path: Path) -> None:
    """The YAML document the cases above mutate is valid."""
    pytest.importorskip("yaml")
    path = tmp_path / "spec.yaml"
    path.write_text("batch_size: 8\ntables:\n  - name: t\n    rows: 10\n    dim: 4\n    pooling: 1\n")
    assert load_model_spec(path) == ModelSpec("model", 8, (TableSpec("t", 10, 4, 1.0),))


# ---- table names TorchRec cannot hold ---------------------------------------------------------


def test_module_dict_attributes_are_torchs() -> None:
    """The reserved names are exactly the attributes of torch's nn.ModuleDict, and torch refuses
    each of them as a key (so the list neither misses nor adds a name)."""
    torch = pytest.importorskip("torch")
    assert MODULE_DICT_ATTRIBUTES == set(dir(torch.nn.ModuleDict()))
    for name in sorted(MODULE_DICT_ATTRIBUTES) + ["a.b", ""]:
        with pytest.raises(KeyError):
            torch.nn.ModuleDict()[name] = torch.nn.Identity()


@pytest.mark.parametrize(
    "name", ["items", "keys", "values", "update", "pop", "clear", "training", "half", "__init__", "a.b", ""]
)
def test_table_names_torch_refuses_are_spec_errors(name: str, tmp_path: Path) -> None:
    """A table named like an nn.ModuleDict attribute, with a '.', or empty is refused naming the
    field, from a file, a dict, a TableSpec and a plan file (before: a KeyError inside torch when the
    model was built)."""
    doc = spec_document()
    doc["tables"][0]["name"] = name
    path = _write(tmp_path, "spec.json", doc)
    _refused(SpecError, lambda: load_model_spec(path), str(path), "table #0", "field 'name'")
    _refused(SpecError, lambda: TableSpec(name, 10, 4, 1.0), "field 'name'")
    plan = _plan()
    plan["tables"][name] = plan["tables"].pop("t3")
    _refused(PlanError, lambda: Plan.from_dict(plan), f"table {name!r}")


def test_table_names_torch_accepts_are_accepted() -> None:
    """Names nn.ModuleDict takes are not refused, however odd: the rule is torch's, not ours."""
    torch = pytest.importorskip("torch")
    for name in ["t0", "_t", "__t", "item", "Items", "table-1", "caf\u00e9", " ", "0"]:
        torch.nn.ModuleDict()[name] = torch.nn.Identity()
        assert TableSpec(name, 10, 4, 1.0).name == name


# ---- plan files ----------------------------------------------------------------------------------


def _t3(d: dict) -> dict:
    return d["tables"]["t3"]


PLAN_FINDINGS: dict[str, tuple[Callable[[dict], None], list[str]]] = {
    "hierarchical a string": (
        lambda d: _t3(d).update(hierarchical="false"),
        ["table 't3'", "field 'hierarchical'", "'false'"],
    ),
    "hierarchical on dp": (lambda d: d["tables"]["dp"].update(hierarchical=True), ["table 'dp'", "hierarchical"]),
    "rank a float": (lambda d: _t3(d)["shards"][1].update(rank=1.7), ["table 't3'", "field 'shards[1].rank'"]),
    "rank a bool": (lambda d: _t3(d)["shards"][1].update(rank=True), ["table 't3'", "field 'shards[1].rank'"]),
    "rank a string": (lambda d: _t3(d)["shards"][1].update(rank="1"), ["field 'shards[1].rank'"]),
    "rank out of range": (lambda d: _t3(d)["shards"][1].update(rank=4), ["field 'shards[1].rank'", "world size 4"]),
    "world_size a float": (lambda d: d.update(world_size=2.9), ["field 'world_size'", "2.9"]),
    "world_size zero": (lambda d: d.update(world_size=0), ["field 'world_size'"]),
    "local_world_size not a divisor": (lambda d: d.update(local_world_size=3), ["field 'local_world_size'"]),
    "local_world_size zero": (lambda d: d.update(local_world_size=0), ["field 'local_world_size'"]),
    "local_world_size a bool": (lambda d: d.update(local_world_size=True), ["field 'local_world_size'"]),
    "version a bool": (lambda d: d.update(version=True), ["embark-plan"]),
    "version a float": (lambda d: d.update(version=1.0), ["embark-plan"]),
    "misspelt layout key": (
        lambda d: _t3(d).update(hierachical=True),
        ["table 't3'", "field 'hierachical'", "did you mean 'hierarchical'?"],
    ),
    "misspelt top key": (lambda d: d.update(world_sise=4), ["field 'world_sise'", "did you mean 'world_size'?"]),
    "misspelt shard key": (
        lambda d: _t3(d)["shards"][0].update(rnak=0),
        ["field 'shards[0].rnak'", "did you mean 'rank'?"],
    ),
    "misspelt precision key": (
        lambda d: _t3(d)["precision"].update(foward="fp16"),
        ["field 'precision.foward'", "did you mean 'forward'?"],
    ),
    "rows with a float": (lambda d: _t3(d)["shards"][0].update(rows=[0, 60.5]), ["field 'shards[0].rows'"]),
    # formerly: ValueError: invalid literal for int(), too many values to unpack, AttributeError, KeyError
    "rank not a number": (lambda d: _t3(d)["shards"][0].update(rank="x"), ["field 'shards[0].rank'"]),
    "rows of three": (lambda d: _t3(d)["shards"][0].update(rows=[0, 25, 50]), ["field 'shards[0].rows'"]),
    "rows a number": (lambda d: _t3(d)["shards"][0].update(rows=50), ["field 'shards[0].rows'"]),
    "entry a list": (lambda d: d["tables"].update(t3=["rb"]), ["table 't3'"]),
    "precision a string": (lambda d: _t3(d).update(precision="fp16"), ["table 't3'", "field 'precision'"]),
    "shard a string": (lambda d: _t3(d)["shards"].__setitem__(0, "0:50"), ["field 'shards[0]'"]),
    "shards a mapping": (lambda d: _t3(d).update(shards={"rows": [0, 100]}), ["field 'shards'"]),
    "tables a list": (lambda d: d.update(tables=[]), ["field 'tables'"]),
    "world_size missing": (lambda d: d.pop("world_size"), ["field 'world_size'", "missing"]),
    "tables missing": (lambda d: d.pop("tables"), ["field 'tables'", "missing"]),
    "cluster missing": (lambda d: _t3(d).pop("cluster"), ["table 't3'", "field 'cluster'", "missing"]),
    "rank missing": (lambda d: _t3(d)["shards"][0].pop("rank"), ["field 'shards[0].rank'", "missing"]),
    "cluster a number": (lambda d: _t3(d).update(cluster=1), ["table 't3'", "field 'cluster'"]),
}


@pytest.mark.parametrize("case", sorted(PLAN_FINDINGS))
def test_plan_fields_are_typed(case: str, tmp_path: Path) -> None:
    """Each mutation of a valid plan file is a PlanError naming the table and field, from a dict and
    from a file (whose name the message starts with)."""
    mutate, needles = PLAN_FINDINGS[case]
    doc = _plan()
    mutate(doc)
    _refused(PlanError, lambda: Plan.from_dict(doc), *needles)
    path = _write(tmp_path, "plan.json", doc)
    assert _refused(PlanError, lambda: Plan.load(path), *needles).startswith(f"{path}: ")


def test_the_unmutated_plan_loads() -> None:
    """The plan the findings mutate is valid and keeps its precision and hierarchical flag."""
    plan = Plan.from_dict(_plan())
    assert plan["t3"].hierarchical and plan["t3"].precision == WirePrecision("fp16", "bf16")


def test_plan_error_names_file_table_and_field(tmp_path: Path) -> None:
    """The message of a fractional row bound is exactly 'file: table: field: expected, got'."""
    doc = _plan()
    _t3(doc)["shards"][0]["rows"] = [0, 60.5]
    path = _write(tmp_path, "plan.json", doc)
    with pytest.raises(PlanError) as e:
        Plan.load(path)
    assert (
        str(e.value) == f"{path}: table 't3': field 'shards[0].rows': expected a list of 2 integers >= 0, got [0, 60.5]"
    )


def test_load_plan_refuses_a_fractional_row_bound() -> None:
    """load_plan reads a plan dict through the same checks, so rows [0, 60.5] is a PlanError before
    any module is sharded (before: it passed and DistributedModelParallel died in torch.zeros)."""
    torch = pytest.importorskip("torch")
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from embark_torchrec.planner.load_plan import load_plan

    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="dp", num_embeddings=10, embedding_dim=4, feature_names=["a"]),
            EmbeddingBagConfig(name="t3", num_embeddings=100, embedding_dim=16, feature_names=["b"]),
        ],
        device=torch.device("meta"),
    )
    assert set(load_plan(_plan(), ebc, world_size=4, compute_device="cpu").plan[""]) == {"dp", "t3"}
    doc = _plan()
    _t3(doc)["shards"][0]["rows"] = [0, 60.5]
    _refused(PlanError, lambda: load_plan(doc, ebc, world_size=4, compute_device="cpu"), "field 'shards[0].rows'")


@pytest.mark.parametrize("content", [b"", b"\xff\xfe{}", b'{"format": "embark-plan"', b"[" * 100_000])
def test_unreadable_plan_files_are_refused_naming_the_file(content: bytes, tmp_path: Path) -> None:
    """Empty, non-UTF-8, truncated and too deeply nested plan files are PlanErrors naming the file."""
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    assert _refused(PlanError, lambda: Plan.load(path)).startswith(f"{path}: ")


def test_every_file_in_the_repository_loads() -> None:
    """The shipped model specs, the benchmark specs and hardware files and the cached plans are valid files: the
    strict reader accepts what the writers (ModelSpec.to_dict, Plan.to_dict, from_sharding_plan, calibrate) wrote."""
    specs = sorted((ROOT / "embark_torchrec/models").glob("*.json")) + sorted(
        (ROOT / "benchmarks/models").glob("*.json")
    )
    assert specs
    for path in specs:
        spec = load_model_spec(path)
        assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    hardware = sorted((ROOT / "benchmarks").glob("*.hardware.json"))
    assert hardware
    for path in hardware:  # calibrated on real ranks: inside every range
        load_hardware(path)
    plans = [json.loads(p.read_text()).get("plan") for p in sorted((ROOT / "benchmarks/cache").glob("*.json"))]
    assert any(plans)
    for doc in filter(None, plans):
        plan = Plan.from_dict(doc)
        assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


# ---- hardware files: every figure in its plannable range ------------------------------------------


def _hardware_doc(**figures: Any) -> dict[str, Any]:
    return {"format": "embark-hardware", "version": 1, "hardware": {**asdict(PRESETS["cpu-gloo"]), **figures}}


def test_every_hardware_figure_has_a_range() -> None:
    """HARDWARE_RANGES bounds exactly the Hardware figures a file holds (all but the name), so a figure added to
    Hardware cannot come in unbounded, and every preset is inside its ranges."""
    assert set(HARDWARE_RANGES) == set(hardware_fields()) - {"name"}
    for name, preset in PRESETS.items():
        assert check_document(_hardware_doc(**asdict(preset)), name) == preset


HARDWARE_EDGES = [
    (name, value, accepted)
    for name, (low, high, low_allowed) in sorted(HARDWARE_RANGES.items())
    for value, accepted in (
        (high, True),
        (high * 1.01 if isinstance(high, float) else high + 1, False),
        (low, low_allowed),
        (low / 2 if low > 0 else -1, False),
    )
    if name != "hbm_reserve_gb" or value < PRESETS["cpu-gloo"].hbm_gb  # the reserve stays below the memory
]


@pytest.mark.parametrize("name, value, accepted", HARDWARE_EDGES)
def test_hardware_figures_are_bounded_to_plannable_ranges(name: str, value: Any, accepted: bool) -> None:
    """Each figure of a hardware file at either end of its range loads; beyond it (a bandwidth of 1e-320 GB/s
    that makes a cost infinite, a petabyte more than the range allows, a negative time) is a HardwareError naming
    the file and the field."""
    doc = _hardware_doc(**{name: value})
    if accepted:
        assert getattr(check_document(doc, "box.json"), name) == value
    else:
        message = _refused(HardwareError, lambda: check_document(doc, "box.json"), "box.json", f"hardware.{name}")
        assert "in [" in message or "in (" in message, message


def test_a_hardware_file_with_both_bands_of_the_plan_error_is_refused_by_field() -> None:
    """plan_error (points of speedup) and plan_error_below/above (fractions of it) are one error two ways: a file
    giving both is a HardwareError naming the file and plan_error, not a band the planner picks between."""
    both = _hardware_doc(plan_error=0.1, plan_error_above=0.05)
    _refused(HardwareError, lambda: check_document(both, "box.json"), "box.json", "hardware.plan_error", "two bands")
    either = check_document(_hardware_doc(plan_error_below=0.05, plan_error_above=0.1), "box.json")
    assert either.speedup_band(1.2) == pytest.approx((1.14, 1.32))


# ---- TorchRec constraints and direct construction -----------------------------------------------


def test_parameter_constraints_go_through_the_same_checks() -> None:
    """TorchRec's ParameterConstraints are checked by the same typed fields as files: a string of
    sharding types is not a list of types, and pooling factors must be finite and positive."""
    _refused(
        SpecError,
        lambda: from_torchrec({"t": SimpleNamespace(sharding_types="table_wise")}),
        "table 't'",
        "field 'sharding_types'",
    )
    assert from_torchrec({"t": SimpleNamespace(sharding_types=["table_wise"])})["t"].cluster == "rb"
    module = SimpleNamespace(
        embedding_bag_configs=lambda: [
            SimpleNamespace(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f", "g"])
        ]
    )
    assert ModelSpec.from_module(module, {"t": SimpleNamespace(pooling_factors=[2, 3.0])}).tables[0].pooling == 2.5
    for bad in ([float("inf")], [0.0], [True], "2", [], 0, [1.0, 2.0, 3.0]):
        constraints = {"t": SimpleNamespace(pooling_factors=bad)}
        _refused(SpecError, lambda: ModelSpec.from_module(module, constraints), "table 't'", "field 'pooling_factors'")


def test_constructors_check_types_too() -> None:
    """TableSpec, ModelSpec, IdDistribution and TableConstraints refuse the same wrong types as the
    files (a bool row count, a string batch size, a NaN alpha, a string of ranks)."""
    _refused(SpecError, lambda: TableSpec("t", True, 4, 1.0), "table 't'", "field 'rows'")
    _refused(SpecError, lambda: ModelSpec("m", "8", (TableSpec("t", 10, 4, 1.0),)), "model 'm'", "field 'batch_size'")
    _refused(SpecError, lambda: IdDistribution("zipf", float("nan")), "field 'alpha'")
    _refused(SpecError, lambda: TableConstraints(ranks="01"), "field 'ranks'")
    _refused(SpecError, lambda: TableConstraints(row_cuts="no"), "field 'row_cuts'")
    _refused(PlanError, lambda: WirePrecision("fp16", "int4"), "field 'backward'", "'int4'")


def test_errors_keep_their_parts_across_processes() -> None:
    """A SpecError / PlanError pickles (ranks send errors to the launcher) with its class and message."""
    for error in (SpecError("bad", "rows", "table 't'", "m.json"), PlanError("no")):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)
    assert str(SpecError("bad", "rows", "table 't'", "m.json")) == "m.json: table 't': field 'rows': bad"


def test_from_dict_leaves_its_input_alone() -> None:
    """Reading never edits the document (normalised values go into the objects only)."""
    spec, plan = spec_document(), _plan()
    before = copy.deepcopy((spec, plan))
    ModelSpec.from_dict(spec)
    Plan.from_dict(plan)
    assert (spec, plan) == before
