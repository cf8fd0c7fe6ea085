"""Property tests of the spec and plan readers: valid documents (the shipped models, the benchmark
specs, planned, baseline, hand-made and cached TorchRec plans) are mutated (a value of another kind,
a number changed in kind or sign, a key dropped or misspelt, deep garbage, truncated text, bytes that
are not UTF-8) and the reader must either raise its SpecError / PlanError (never another exception)
or, for a mutation that keeps the meaning, return exactly what the unmutated document gives (never a
silent change). Fixed seed, bounded examples, so the file runs in seconds."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embark_torchrec.plan.search.baselines import table_row_wise_plan
from embark_torchrec.plan.layout.constraints import TORCHREC_SHARDING_TYPES, from_torchrec
from embark_torchrec.plan.model.fields import FieldError
from embark_torchrec.plan.layout.tables import Plan, PlanError, TableLayout, WirePrecision
from embark_torchrec.plan.plan_model import plan_model
from embark_torchrec.plan.model.ranges import MAX_POOLING
from embark_torchrec.plan.model.spec import ModelSpec, SpecError, builtin_model, load_model_spec
from embark_torchrec.plan.model.topology import Topology, hardware_preset

ROOT = Path(__file__).resolve().parents[2]
FUZZ = settings(derandomize=True, max_examples=120, deadline=None)
Path_ = tuple[Any, ...]  # keys and indices from the document's root to a value
DROP = object()


# ---- the formats, as docs/files.md documents them --------------------------------------------------

SAME = object()  # dropping the key leaves the meaning unchanged
UNSET = object()  # dropping the key sets the object's attribute to None
NAMED = object()  # dropping the key drops that table


@dataclass(frozen=True, repr=False)
class Format:
    """A file format: its reader, its error, its documents, and what each kind of object in it holds:
    kind -> {key: default when dropped}; keys not listed there are required."""

    name: str
    error: type[FieldError]
    from_dict: Callable[[Any], Any]
    load: Callable[[Path], Any]
    keys: dict[str, tuple[str, ...]]
    defaults: dict[str, dict[str, Any]]
    kind_of: Callable[[Path_], str]
    float_fields: frozenset[str] = frozenset()

    def __repr__(self) -> str:  # hypothesis prints the draws of a failing example
        return self.name


def _spec_kind(path: Path_) -> str:
    if path == ():
        return "model"
    if path[-1] == "id_distribution":
        return "distribution"
    return "table" if len(path) == 2 and path[0] == "tables" else "other"


def _plan_kind(path: Path_) -> str:
    if path == ():
        return "plan"
    if path == ("tables",):
        return "tables"
    if len(path) == 2:
        return "layout"
    if path[-1] == "precision":
        return "precision"
    return "shard" if len(path) == 4 and path[2] == "shards" else "other"


SPEC = Format(
    "spec",
    SpecError,
    ModelSpec.from_dict,
    load_model_spec,
    keys={
        "model": ("name", "description", "source", "batch_size", "id_distribution", "tables"),
        "table": ("name", "rows", "dim", "pooling", "feature_names", "id_distribution", "unique_ratio"),
        "distribution": ("kind", "alpha"),
    },
    defaults={
        "model": {"name": "model", "description": SAME, "source": SAME, "id_distribution": {"kind": "uniform"}},
        "table": {"feature_names": NAMED, "id_distribution": UNSET, "unique_ratio": UNSET},
        "distribution": {"kind": "uniform"},
    },
    kind_of=_spec_kind,
    float_fields=frozenset({"pooling", "alpha", "unique_ratio"}),
)
PLAN = Format(
    "plan",
    PlanError,
    Plan.from_dict,
    Plan.load,
    keys={
        "plan": ("format", "version", "world_size", "local_world_size", "tables"),
        "layout": ("cluster", "precision", "shards", "hierarchical"),
        "precision": ("forward", "backward"),
        "shard": ("rows", "cols", "rank"),
    },
    defaults={
        "tables": NAMED,  # any table may be left out: the plan without it
        "layout": {"precision": {"forward": "fp32", "backward": "fp32"}, "hierarchical": False, "shards": []},
        "precision": {"forward": "fp32", "backward": "fp32"},
    },
    kind_of=_plan_kind,
)


@lru_cache(maxsize=None)
def _documents(fmt: str) -> tuple[Any, ...]:
    """Valid documents, as JSON text (so each test gets a fresh copy)."""
    if fmt == "spec":
        files = sorted((ROOT / "embark_torchrec/models").glob("*.json")) + sorted(
            (ROOT / "benchmarks/models").glob("*.json")
        )
        synthetic = {
            "name": "toy",
            "description": "every optional field",
            "source": "test",
            "batch_size": 4096,
            "id_distribution": {"kind": "zipf", "alpha": 1.05},
            "tables": [
                {"name": "small", "rows": 100, "dim": 16, "pooling": 1},
                {"name": "big", "rows": 10**6, "dim": 64, "pooling": 2.5, "feature_names": ["f", "g"]},
                {"name": "flat", "rows": 5000, "dim": 8, "pooling": 3, "id_distribution": {"kind": "uniform"}},
                {"name": "fixed", "rows": 7000, "dim": 4, "pooling": 1, "unique_ratio": 0.25},
            ],
        }
        return tuple([json.dumps(synthetic)] + [p.read_text() for p in files])
    hardware = hardware_preset("dgx-h100")
    dcnv2 = builtin_model("dcnv2")
    made = Plan(
        8,
        4,
        {
            "dp": TableLayout.data_parallel(WirePrecision("fp32", "bf16")),
            "tw": TableLayout.table_wise(1000, 32, 5),
            "cw": TableLayout("rb", (0, 500), (0, 12, 40, 64), ((2, 7, 0),), WirePrecision("fp16", "fp16")),
            "ub": TableLayout("ub", (0, 1, 400, 1001), (0, 16), ((3,), (3,), (6,)), WirePrecision("fp8", "bf16")),
            "grid": TableLayout("rb", (0, 333, 334, 999), (0, 8, 24), ((1, 3), (4, 3), (1, 3)), hierarchical=True),
        },
    )
    plans = [
        made,
        plan_model(dcnv2, Topology(8, 4, hardware)).plan,
        table_row_wise_plan(dcnv2, Topology(16, 8, hardware)),
    ]
    cached = json.loads((ROOT / "benchmarks/cache/torchrec_dcnv2_8x8_dgx-h100.json").read_text())["plan"]
    return tuple([json.dumps(p.to_dict()) for p in plans] + [json.dumps(cached)])


@lru_cache(maxsize=None)
def _paths(fmt: str, index: int) -> tuple[Path_, ...]:
    """Every path in document `index`, the root included, in document order."""
    out: list[Path_] = []

    def walk(value: Any, path: Path_) -> None:
        out.append(path)
        children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, child in children:
            walk(child, path + (key,))

    walk(json.loads(_documents(fmt)[index]), ())
    return tuple(out)


def _get(doc: Any, path: Path_) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _with(doc: Any, path: Path_, value: Any) -> Any:
    """`doc` with the value at `path` set (or dropped, for DROP); containers copied along the path."""
    if not path:
        return value
    out = dict(doc) if isinstance(doc, dict) else list(doc)
    if len(path) > 1:
        out[path[0]] = _with(doc[path[0]], path[1:], value)
    elif value is DROP:
        del out[path[0]]
    else:
        out[path[0]] = value
    return out


def _outcome(fmt: Format, load: Callable[[], Any]) -> Any:
    """What loading gives: the object, or the reader's own error (any other exception fails the test);
    every error message is one line."""
    try:
        return load()
    except fmt.error as e:
        assert "\n" not in str(e), str(e)
        return e


def _same_outcome(fmt: Format, got: Any, expected: Any) -> None:
    if isinstance(expected, FieldError):
        assert isinstance(got, fmt.error), f"expected a {fmt.error.__name__}, loaded {got!r}"
    else:
        assert got == expected, "a valid mutation changed what was loaded"


def _draw_document(data: st.DataObject) -> tuple[Format, int, Any]:
    fmt = data.draw(st.sampled_from([SPEC, PLAN]), label="format")
    index = data.draw(st.integers(0, len(_documents(fmt.name)) - 1), label="document")
    return fmt, index, json.loads(_documents(fmt.name)[index])


def _kind(value: Any) -> str:
    """The JSON kind of a value: ints and floats are both numbers."""
    if value is None or isinstance(value, bool):
        return repr(value) if value is None else "bool"
    return {int: "number", float: "number", str: "string", list: "list", dict: "object"}[type(value)]


def _nested(depth: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(depth):
        out = [out]
    return out


OTHER_KINDS = [None, True, False, 0, 7, -3, 2.5, math.nan, math.inf, -math.inf, "", "x", "7", [], [1], {}, {"a": 1}]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


# ---- the properties ----------------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_a_value_of_another_kind_is_refused(data: st.DataObject) -> None:
    """Any value (a number, a name, a list, an object, the whole document) replaced by one of another
    JSON kind (null, a bool, a number, NaN, a string, a list, an object, deep garbage) is refused."""
    fmt, index, doc = _draw_document(data)
    path = data.draw(st.sampled_from(_paths(fmt.name, index)), label="path")
    original = _get(doc, path)
    pool = [v for v in OTHER_KINDS + [_nested(200)] if _kind(v) != _kind(original)]
    value = data.draw(st.sampled_from(pool), label="value")
    got = _outcome(fmt, lambda: fmt.from_dict(_with(doc, path, value)))
    assert isinstance(got, fmt.error), f"{path} = {value!r} was accepted"


@FUZZ
@given(data=st.data())
def test_numbers_keep_their_kind_and_sign(data: st.DataObject) -> None:
    """A count (rows, ranks, sizes, bounds) written as a float, a fraction, a bool, NaN, infinite or
    negative is refused; a measure (pooling, alpha, unique_ratio) written as a float loads equal."""
    fmt, index, doc = _draw_document(data)
    numeric = [p for p in _paths(fmt.name, index) if _kind(_get(doc, p)) == "number"]
    path = data.draw(st.sampled_from(numeric), label="path")
    value = _get(doc, path)
    field = next(k for k in reversed(path) if isinstance(k, str))
    changes = {
        "as float": float(value),
        "negative": -value - 1,
        "bool": value != 0,
        "nan": math.nan,
        "inf": math.inf,
        "-inf": -math.inf,
    }
    if field not in fmt.float_fields:
        changes["fraction"] = value + 0.5
    change = data.draw(st.sampled_from(sorted(changes)), label="change")
    got = _outcome(fmt, lambda: fmt.from_dict(_with(doc, path, changes[change])))
    if change == "as float" and field in fmt.float_fields:
        _same_outcome(fmt, got, fmt.from_dict(doc))
    else:
        assert isinstance(got, fmt.error), f"{path} = {changes[change]!r} was accepted"


def _expected_without(fmt: Format, doc: Any, path: Path_, key: Any) -> Any:
    """What the document means without `key` in the object at `path`, by docs/files.md: its default
    written out, the same meaning, the attribute unset, the plan without that table, or an error."""
    kind = fmt.kind_of(path)
    default = fmt.defaults.get(kind, {})
    if default is NAMED:  # a plan's table
        plan = fmt.from_dict(doc)
        return Plan(plan.world_size, plan.local_world_size, {k: v for k, v in plan.tables.items() if k != key})
    if key not in default:
        return fmt.error("required")
    value = default[key]
    if value is SAME:
        return _outcome(fmt, lambda: fmt.from_dict(doc))
    if value is NAMED:  # feature_names: the table's own name
        return _outcome(fmt, lambda: fmt.from_dict(_with(doc, path + (key,), [_get(doc, path)["name"]])))
    if value is UNSET:
        spec = fmt.from_dict(doc)
        name = _get(doc, path)["name"]
        return replace(spec, tables=tuple(replace(t, **{key: None}) if t.name == name else t for t in spec.tables))
    return _outcome(fmt, lambda: fmt.from_dict(_with(doc, path + (key,), value)))


@FUZZ
@given(data=st.data())
def test_a_dropped_key_is_required_or_means_its_default(data: st.DataObject) -> None:
    """Dropping a required key is refused; dropping an optional one loads what its documented default
    written out loads (the same object, not a silently different one)."""
    fmt, index, doc = _draw_document(data)
    objects = [p for p in _paths(fmt.name, index) if isinstance(_get(doc, p), dict) and _get(doc, p)]
    path = data.draw(st.sampled_from(objects), label="path")
    key = data.draw(st.sampled_from(sorted(_get(doc, path))), label="key")
    got = _outcome(fmt, lambda: fmt.from_dict(_with(doc, path + (key,), DROP)))
    _same_outcome(fmt, got, _expected_without(fmt, doc, path, key))


@FUZZ
@given(data=st.data())
def test_a_misspelt_key_is_refused_with_the_right_suggestion(data: st.DataObject) -> None:
    """A key with two neighbouring letters swapped, added beside the real one, is refused naming the
    typo and suggesting the key it misspells (before: silently ignored, e.g. 'hierachical')."""
    fmt, index, doc = _draw_document(data)
    objects = [p for p in _paths(fmt.name, index) if fmt.kind_of(p) in fmt.keys and _get(doc, p)]
    path = data.draw(st.sampled_from(objects), label="path")
    key = data.draw(st.sampled_from(sorted(_get(doc, path))), label="key")
    at = data.draw(st.integers(0, len(key) - 2), label="at")
    typo = key[:at] + key[at + 1] + key[at] + key[at + 2 :]
    if typo in fmt.keys[fmt.kind_of(path)]:
        return
    got = _outcome(fmt, lambda: fmt.from_dict(_with(doc, path + (typo,), _get(doc, path)[key])))
    assert isinstance(got, fmt.error), f"{path}: {typo!r} was accepted"
    assert f"{typo}': unknown field; did you mean {key!r}?" in str(got), str(got)


@FUZZ
@given(data=st.data())
def test_truncated_files_are_refused_naming_the_file(data: st.DataObject, workdir: Path) -> None:
    """A file cut short anywhere is an error that starts with the file's name."""
    fmt, index, doc = _draw_document(data)
    content = json.dumps(doc)
    cut = data.draw(st.integers(0, len(content) - 1), label="cut")
    path = workdir / f"{fmt.name}.json"
    path.write_text(content[:cut])
    got = _outcome(fmt, lambda: fmt.load(path))
    assert isinstance(got, fmt.error) and str(got).startswith(f"{path}: "), got


@FUZZ
@given(data=st.data())
def test_bytes_that_are_not_utf8_are_refused_naming_the_file(data: st.DataObject, workdir: Path) -> None:
    """Bytes that are not UTF-8 anywhere in a file are an error naming the file (before: a
    UnicodeDecodeError that did not)."""
    fmt, index, doc = _draw_document(data)
    content = json.dumps(doc).encode()
    at = data.draw(st.integers(0, len(content)), label="at")
    junk = data.draw(st.sampled_from([b"\xff", b"\xfe\xff", b"\x80", b"\xc3\x28", b"\xed\xa0\x80", b"\xe9"]))
    path = workdir / f"{fmt.name}.json"
    path.write_bytes(content[:at] + junk + content[at:])
    got = _outcome(fmt, lambda: fmt.load(path))
    assert isinstance(got, fmt.error) and str(got).startswith(f"{path}: ") and "UTF-8" in str(got), got


@FUZZ
@given(data=st.data())
def test_nested_garbage_in_a_file_is_refused(data: st.DataObject, workdir: Path) -> None:
    """Any value of a file replaced by lists nested 2 to 100 000 deep is refused (too deep to parse,
    or of the wrong kind), never a RecursionError."""
    fmt, index, doc = _draw_document(data)
    path = data.draw(st.sampled_from(_paths(fmt.name, index)), label="path")
    depth = data.draw(st.sampled_from([2, 3, 50, 100_000]), label="depth")
    content = json.dumps(_with(doc, path, "@GARBAGE@")).replace('"@GARBAGE@"', "[" * depth + "]" * depth)
    file = workdir / f"{fmt.name}.json"
    file.write_text(content)
    got = _outcome(fmt, lambda: fmt.load(file))
    assert isinstance(got, fmt.error) and str(got).startswith(f"{file}: "), got


@FUZZ
@given(data=st.data())
def test_each_value_round_trips_through_its_file(data: st.DataObject, workdir: Path) -> None:
    """Loading a document from a file gives what loading it from a dict gives, and writing the result
    out again reads back equal: the strict reader accepts exactly what the writers write."""
    fmt, index, doc = _draw_document(data)
    path = workdir / f"{fmt.name}.json"
    path.write_text(json.dumps(doc))
    loaded = fmt.load(path)
    assert loaded == fmt.from_dict(doc)
    assert fmt.from_dict(json.loads(json.dumps(loaded.to_dict()))) == loaded


# ---- YAML specs: YAML 1.1's numbers and booleans are the text written ------------------------------

# Text YAML 1.1 (PyYAML's SafeLoader) reads as a number or a boolean when unquoted, and YAML 1.2's JSON schema as
# the string written: octal-looking (0100: 64), base 60 (1:30: 90), hex, 0o octal, digit groups, a sign, yes/on,
# .inf/.nan, dates.
YAML_11_SCALARS = st.one_of(
    st.integers(0, 10**6).map(lambda n: f"0{n}"),
    st.tuples(st.integers(1, 59), st.integers(0, 59)).map(lambda t: f"{t[0]}:{t[1]:02d}"),
    st.integers(0, 10**6).map(lambda n: f"{n:#x}"),
    st.integers(0, 10**6).map(lambda n: f"{n:#o}"),
    st.integers(1000, 10**7).map(lambda n: f"{n:_}"),
    st.integers(0, 10**6).map(lambda n: f"+{n}"),
    st.sampled_from(["yes", "No", "ON", "off", ".inf", "-.Inf", "+.inf", ".nan", ".NaN", ".5", "2024-01-01"]),
)
_SMALL_SPECS = tuple(i for i, d in enumerate(_documents("spec")) if len(json.loads(d)["tables"]) <= 30)


@FUZZ
@given(data=st.data())
def test_yaml_reads_yaml_1_1_numbers_as_the_text_written(data: st.DataObject, workdir: Path) -> None:
    """Any number or text of a spec, written in a YAML file as text YAML 1.1 would read as a number or a boolean,
    loads exactly as the JSON document with that text as a string does: a number field refuses it naming the
    field and the text (YAML 1.1 planned `rows: 0100` as 64 rows), a text field keeps it as written."""
    yaml = pytest.importorskip("yaml")
    index = data.draw(st.sampled_from(_SMALL_SPECS), label="document")
    doc = json.loads(_documents("spec")[index])
    scalars = [p for p in _paths("spec", index) if type(_get(doc, p)) in (int, float, str)]
    path = data.draw(st.sampled_from(scalars), label="path")
    written = data.draw(YAML_11_SCALARS, label="written")
    file = workdir / "spec.yaml"
    file.write_text(yaml.safe_dump(_with(doc, path, "__SCALAR__")).replace("__SCALAR__", written))
    got = _outcome(SPEC, lambda: load_model_spec(file))
    _same_outcome(SPEC, got, _outcome(SPEC, lambda: ModelSpec.from_dict(_with(doc, path, written))))
    if type(_get(doc, path)) is not str:
        field = next(k for k in reversed(path) if isinstance(k, str))
        assert isinstance(got, SpecError) and field in str(got) and repr(written) in str(got), got


# ---- TorchRec's ParameterConstraints go through the same fields -----------------------------------

ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.sampled_from(TORCHREC_SHARDING_TYPES), max_size=4),
    st.lists(st.one_of(st.sampled_from(TORCHREC_SHARDING_TYPES), st.text(max_size=5), st.integers()), max_size=3),
    st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=3),
    st.lists(st.integers(-2, 5), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(value=ANY_VALUE)
def test_sharding_types_are_a_list_of_known_names(value: Any) -> None:
    """ParameterConstraints.sharding_types: None or a list of TorchRec's type names is read (and a
    name given twice means what it means once); anything else is a SpecError naming the table."""
    got = _outcome(SPEC, lambda: from_torchrec({"t": SimpleNamespace(sharding_types=value)}))
    valid = value is None or (isinstance(value, list) and all(v in TORCHREC_SHARDING_TYPES for v in value))
    if not valid:
        assert isinstance(got, SpecError) and "table 't'" in str(got), got
        return
    assert got == from_torchrec({"t": SimpleNamespace(sharding_types=sorted(set(value or [])))})


@settings(derandomize=True, max_examples=200, deadline=None)
@given(value=ANY_VALUE)
def test_pooling_factors_are_finite_positive_numbers(value: Any) -> None:
    """ParameterConstraints.pooling_factors: one finite number in (0, MAX_POOLING] per feature of the table (here
    one) gives the table's pooling; None TorchRec's default of 1.0; anything else (1e308 too: its costs are NaN)
    is a SpecError naming the table and the field."""
    config = SimpleNamespace(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"])
    module = SimpleNamespace(embedding_bag_configs=lambda: [config])
    got = _outcome(SPEC, lambda: ModelSpec.from_module(module, {"t": SimpleNamespace(pooling_factors=value)}))
    numbers = (
        isinstance(value, list)
        and len(value) == 1
        and all(type(v) in (int, float) and math.isfinite(v) and 0 < v <= MAX_POOLING for v in value)
    )
    if value is None:
        assert got.tables[0].pooling == 1.0
    elif numbers:
        assert got.tables[0].pooling == pytest.approx(sum(value) / len(value))
    else:
        assert isinstance(got, SpecError) and "table 't'" in str(got) and "pooling_factors" in str(got), got
