"""The planner CLI (`python -m embark_torchrec.plan`, run in-process through cli.main): every user
error is one line on stderr, exit code 2, no traceback, and nothing on stdout; argument and output
path errors come before any planning; --json prints valid JSON."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from embark_torchrec.plan import cli
from embark_torchrec.plan.layout.tables import Plan
from embark_torchrec.plan.model.ranges import (
    HARDWARE_RANGES,
    MAX_BATCH_SIZE,
    MAX_DIM,
    MAX_PLANNED_WORLD_SIZE,
    MAX_POOLING,
    MAX_ZIPF_ALPHA,
    MIN_UNIQUE_RATIO,
)
from embark_torchrec.plan.model.topology import PRESETS

SIZES = ["--world-size", "2", "--local-world-size", "2"]


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    """A valid two-table spec that plans in milliseconds."""
    path = tmp_path / "spec.json"
    tables = [
        {"name": "a", "rows": 1000, "dim": 16, "pooling": 2},
        {"name": "b", "rows": 100, "dim": 8, "pooling": 1, "feature_names": ["f"]},
    ]
    path.write_text(json.dumps({"name": "m", "batch_size": 64, "tables": tables}))
    return path


@pytest.fixture
def no_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if the CLI starts planning (the error must come first)."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("planned before refusing the arguments")

    monkeypatch.setattr(cli, "plan_model", refuse)


def _user_error(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    """main(argv) exits 2 with one 'error: ...' line on stderr holding every needle, and no output."""
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (argv, out, err)
    assert out == "", out
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


ARGUMENT_ERRORS: dict[str, tuple[list[str], list[str]]] = {
    "batch size 0": (["--batch-size", "0"], ["--batch-size", "'0'"]),
    "negative batch size": (["--batch-size", "-8"], ["--batch-size", "'-8'"]),
    "fractional batch size": (["--batch-size", "1.5"], ["--batch-size"]),
    "hbm nan": (["--hbm-gb", "nan"], ["--hbm-gb", "'nan'"]),
    "hbm inf": (["--hbm-gb", "inf"], ["--hbm-gb", "'inf'"]),
    "hbm zero": (["--hbm-gb", "0"], ["--hbm-gb"]),
    "hbm negative": (["--hbm-gb", "-80"], ["--hbm-gb"]),
    "batch size beyond its range": (["--batch-size", str(MAX_BATCH_SIZE + 1)], ["--batch-size", str(MAX_BATCH_SIZE)]),
    "hbm beyond its range": (["--hbm-gb", "1e7"], ["--hbm-gb", "'1e7'"]),
    "hbm within the reserve": (["--hardware", "cpu-gloo", "--hbm-gb", "4"], ["--hbm-gb 4", "reserve of 4 GB"]),
    "unknown hardware": (["--hardware", "tpu"], ["--hardware"]),
    "unknown baseline": (["--compare", "trw,fancy"], ["'fancy'"]),
    # this command imports no torchrec: TorchRec's planner is refused by the command that has it, not dropped
    "torchrec baseline": (["--compare", "trw,torchrec"], ["--compare torchrec", "python -m embark_torchrec.planner"]),
    "unknown option": (["--wrld-size", "2"], ["--wrld-size"]),
}


@pytest.mark.parametrize("case", sorted(ARGUMENT_ERRORS))
def test_bad_arguments_are_one_line_before_planning(
    case: str, spec_file: Path, capsys: pytest.CaptureFixture[str], no_planning: None
) -> None:
    """A batch size that is not a positive integer (0 used to fall back to the spec's), a memory that is
    not finite and positive (nan used to plan without a memory check), and other bad options."""
    extra, needles = ARGUMENT_ERRORS[case]
    _user_error(capsys, [str(spec_file), *SIZES, *extra], *needles)


@pytest.mark.parametrize("sizes", [["--world-size", "0", "--local-world-size", "1"], ["--world-size", "2"]])
def test_bad_world_sizes_are_one_line(
    sizes: list[str], spec_file: Path, capsys: pytest.CaptureFixture[str], no_planning: None
) -> None:
    """A world size of 0 and a missing --local-world-size are argument errors (one line, no usage dump)."""
    _user_error(capsys, [str(spec_file), *sizes], "world-size")


def test_a_world_size_beyond_what_plans_in_minutes_is_one_line_before_planning(
    spec_file: Path, capsys: pytest.CaptureFixture[str], no_planning: None
) -> None:
    """--world-size 1000000 passed the argument check (2**20) and then planned for longer than anyone waits."""
    argv = [str(spec_file), "--world-size", "1000000", "--local-world-size", "8"]
    _user_error(capsys, argv, "--world-size", f"at most {MAX_PLANNED_WORLD_SIZE} ranks", "1000000")


def test_local_world_size_must_divide_world_size(spec_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _user_error(capsys, [str(spec_file), "--world-size", "4", "--local-world-size", "3"], "must divide")


@pytest.mark.parametrize("flag", ["--out", "--plot"])
def test_output_paths_are_checked_before_planning(
    flag: str, spec_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_planning: None
) -> None:
    """An output whose directory does not exist, or that is a directory, is refused before planning
    (--out /nonexistent/plan.json used to fail only after the plan was made)."""
    _user_error(capsys, [str(spec_file), *SIZES, flag, "/nonexistent/plan.json"], flag, "/nonexistent")
    _user_error(capsys, [str(spec_file), *SIZES, flag, str(tmp_path)], flag, "directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_read_only_output_directory_is_refused(
    spec_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_planning: None
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        _user_error(capsys, [str(spec_file), *SIZES, "--out", str(locked / "plan.json")], "not writable")
    finally:
        locked.chmod(0o700)


SPEC_CONTENTS: dict[str, tuple[bytes, list[str]]] = {
    "feature_names a string": (
        b'{"batch_size": 8, "tables": [{"name": "t", "rows": 10, "dim": 4, "pooling": 1, "feature_names": "u"}]}',
        ["table 't'", "field 'feature_names'"],
    ),
    "pooling Infinity": (
        b'{"batch_size": 8, "tables": [{"name": "t", "rows": 10, "dim": 4, "pooling": Infinity}]}',
        ["table 't'", "field 'pooling'"],
    ),
    "pooling 1e308": (  # every cost was NaN, the plan written and the exit code 0; --json crashed
        b'{"batch_size": 8, "tables": [{"name": "t", "rows": 10, "dim": 4, "pooling": 1e308}]}',
        ["table 't'", "field 'pooling'", "1e+308"],
    ),
    "tables a number": (b'{"batch_size": 8, "tables": 3}', ["field 'tables'"]),
    "too deep": (b'{"tables": ' + b"[" * 100_000, ["nested too deeply"]),
    "not UTF-8": (b'{"name": "\xff"}', ["UTF-8"]),
    "empty": (b"", ["empty"]),
    "table named items": (
        b'{"batch_size": 8, "tables": [{"name": "items", "rows": 10, "dim": 4, "pooling": 1}]}',
        ["field 'name'", "'items'"],
    ),
}


@pytest.mark.parametrize("case", sorted(SPEC_CONTENTS))
def test_bad_spec_files_are_one_line_naming_the_file(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_planning: None
) -> None:
    """A malformed spec file (before: TypeError / RecursionError / UnicodeDecodeError tracebacks) is
    one line naming the file, the table and the field."""
    content, needles = SPEC_CONTENTS[case]
    path = tmp_path / "spec.json"
    path.write_bytes(content)
    _user_error(capsys, [str(path), *SIZES], str(path), *needles)


@pytest.mark.parametrize("rows", ["0100", "1:30", "0x100"])
def test_yaml_numbers_of_yaml_1_1_are_one_line(
    rows: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_planning: None
) -> None:
    """`rows: 0100`, `1:30` and `0x100` in a YAML spec were planned as 64, 90 and 256 rows (YAML 1.1); they are
    refused, naming the file, the table, the field and the value as written."""
    pytest.importorskip("yaml")
    path = tmp_path / "spec.yaml"
    path.write_text(f"batch_size: 8\ntables:\n  - name: t\n    rows: {rows}\n    dim: 4\n    pooling: 1\n")
    _user_error(capsys, [str(path), *SIZES], str(path), "table 't'", "field 'rows'", repr(rows))


@pytest.mark.parametrize("model", ["missing.json", "no/such/dir/spec.yaml", "no-such-model"])
def test_missing_models_are_one_line(model: str, capsys: pytest.CaptureFixture[str], no_planning: None) -> None:
    """A spec file that does not exist is named as such; an unknown name lists the built-in models."""
    _user_error(capsys, [model, *SIZES], model)


def test_a_model_that_does_not_fit_is_one_line(spec_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Planning's own refusal (memory too small for the tables) is a user error too."""
    hbm_gb = str(PRESETS["cpu-gloo"].hbm_reserve_gb + 1e-6)  # a kilobyte beside the reserve
    _user_error(capsys, [str(spec_file), *SIZES, "--hardware", "cpu-gloo", "--hbm-gb", hbm_gb], "do not fit")


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_json_output_is_valid_json_and_out_writes_the_plan(
    spec_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--json prints one strict JSON object (no NaN / Infinity), and --out writes a plan file that
    loads back; --batch-size overrides the spec's."""
    batch_sizes: list[int] = []
    plan_model = cli.plan_model

    def recording(spec: Any, topology: Any, **options: Any) -> Any:
        batch_sizes.append(spec.batch_size)
        return plan_model(spec, topology, **options)

    monkeypatch.setattr(cli, "plan_model", recording)
    out = tmp_path / "plan.json"
    assert cli.main([str(spec_file), *SIZES, "--json", "--batch-size", "32", "--out", str(out)]) == 0
    assert batch_sizes == [32]
    stdout, _ = capsys.readouterr()
    result = _strict_json(stdout)
    assert result["model"] == "m" and result["world_size"] == 2 and "embark" in result["plans"]
    assert set(Plan.load(out).tables) == {"a", "b"}


@pytest.mark.parametrize("where", ["lookup_ms", "rank 1"])
@pytest.mark.parametrize("output", ["--out", "--json"])
def test_a_plan_whose_cost_is_not_finite_is_neither_written_nor_printed(
    where: str,
    output: str,
    spec_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The backstop behind the ranges: a plan whose estimated step (or a part, or one rank's load) is NaN is a
    one-line error naming the part or the rank, exit 2, and no plan file (it used to be written with exit 0, and
    --json crashed with "Out of range float values are not JSON compliant")."""
    plan_model = cli.plan_model

    def nan_cost(spec: Any, topology: Any, **options: Any) -> Any:
        planned = plan_model(spec, topology, **options)
        if where == "lookup_ms":
            return replace(planned, cost=replace(planned.cost, lookup_ms=math.nan))
        rank_lookup_ms = planned.cost.rank_lookup_ms.copy()
        rank_lookup_ms[1] = math.nan
        return replace(planned, cost=replace(planned.cost, rank_lookup_ms=rank_lookup_ms))

    monkeypatch.setattr(cli, "plan_model", nan_cost)
    out = tmp_path / "plan.json"
    argv = [str(spec_file), *SIZES, "--out", str(out)] + (["--json"] if output == "--json" else [])
    _user_error(capsys, argv, "embark plan", where, "not a finite number", "no plan written")
    assert not out.exists()


def _hardware_at(tmp_path: Path, end: str) -> Path:
    """A hardware file with every figure at one end of its range: "slow" (the least memory bandwidth, the most
    work per ID, a petabyte of HBM) or "fast" (the most bandwidth, no per-ID work, the fewest GB that fit)."""
    figures: dict[str, Any] = {}
    for name, (low, high, low_allowed) in HARDWARE_RANGES.items():
        slow_end = low if name.endswith("_gbps") else high
        fast_end = high if name.endswith("_gbps") else (low if low_allowed else 1.0)
        figures[name] = slow_end if end == "slow" else fast_end
    # the error on plan differences in one form at a time: the fractions at their ends (plan_error's are the edges')
    figures.update(name=end, hbm_reserve_gb=0.0, plan_error=0.0)
    path = tmp_path / f"{end}.json"
    path.write_text(json.dumps({"format": "embark-hardware", "version": 1, "hardware": figures}))
    return path


@pytest.mark.parametrize("end", ["slow", "fast"])
def test_the_ends_of_every_range_plan_to_strict_json(
    end: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model at the ends of the spec ranges, on hardware at either end of every hardware range, plans (ours and
    the table-row-wise baseline, with the lower bound) to finite costs printed as strict JSON: the ranges are
    narrow enough that the backstop never fires on what the files allow."""
    ws = 4
    tables = [
        {"name": "wide", "rows": 1000, "dim": MAX_DIM, "pooling": MAX_POOLING},
        {"name": "long", "rows": 10**6, "dim": 4, "pooling": MAX_POOLING, "unique_ratio": MIN_UNIQUE_RATIO},
        {"name": "rare", "rows": 100, "dim": 4, "pooling": 5e-324, "kind": "sequence"},
    ]
    spec = {
        "batch_size": MAX_BATCH_SIZE - MAX_BATCH_SIZE % ws,
        "id_distribution": {"kind": "zipf", "alpha": MAX_ZIPF_ALPHA},
        "tables": tables,
    }
    path = tmp_path / "edges.json"
    path.write_text(json.dumps(spec))
    argv = [str(path), "--world-size", str(ws), "--local-world-size", "2", "--json", "--compare", "trw"]
    assert cli.main([*argv, "--hardware", str(_hardware_at(tmp_path, end))]) == 0, capsys.readouterr().err
    result = _strict_json(capsys.readouterr().out)
    assert set(result["plans"]) == {"embark", "trw"}
