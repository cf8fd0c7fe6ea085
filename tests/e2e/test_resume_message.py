"""examples/dlrm/train.py's line when --resume loads nothing says what resume found: steps that failed their manifest
check, steps that verified but did not load into the model, or no finished step at all (each folder's own reason is
printed above it); and the flags it resumes and trains with are refused by name when out of range."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from embark_torchrec import checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _train() -> ModuleType:
    sys.path.insert(0, str(ROOT / "examples" / "dlrm"))
    import train

    return train


def _nothing_resumed(directory: Path) -> str:
    train = _train()
    found = checkpoint.resume_checkpoint(directory, {"other_model": torch.zeros(2)})
    assert found.path is None and found.skipped, found
    return train.nothing_resumed(directory, found.skipped)


def test_the_line_names_what_resume_found(tmp_path: Path) -> None:
    """Only unfinished saves: no finished checkpoint; a step without a manifest: none verifies; a verified step of
    another model next to it: it loads into nothing, naming how many verified and how many did not."""
    (tmp_path / "step_00000003.partial").mkdir()
    assert _nothing_resumed(tmp_path) == (
        f"no finished checkpoint in {tmp_path} (only unfinished saves, or names that are not step_<int>)"
    )
    (tmp_path / "step_00000005").mkdir()
    assert _nothing_resumed(tmp_path) == f"no checkpoint in {tmp_path} verifies"
    checkpoint.save_checkpoint(tmp_path, {"weights": torch.ones(3)}, 4)
    assert _nothing_resumed(tmp_path) == (
        f"no checkpoint in {tmp_path} loads into this model (1 verified but did not load; 1 did not verify)"
    )


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--steps", "-5", "an integer >= 0"),
        ("--batch-size", "0", "an integer >= 1"),
        ("--eval-batches", "0", "an integer >= 1"),
        ("--save-every", "-1", "an integer >= 0"),
        ("--local-world-size", "0", "an integer >= 1"),
        ("--log-every", "2.5", "an integer >= 0"),
        ("--embedding-lr", "nan", "a finite number >= 0"),
        ("--dense-lr", "-0.1", "a finite number >= 0"),
        ("--pg-timeout-s", "0", "a finite number > 0"),
        ("--pg-timeout-s", "inf", "a finite number > 0"),
    ],
)
def test_flags_out_of_range_are_refused_by_name(flag: str, value: str, expected: str, capsys: Any) -> None:
    """The example's counts and measures are checked before anything starts: --steps -5 ran no step and reported -5
    as the step reached, --batch-size 0 and --eval-batches 0 failed deep inside the data and the metric, a NaN
    learning rate trained on NaN."""
    train = _train()
    with pytest.raises(SystemExit) as exit_:
        train.parse_args([flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: expected {expected}, got '{value}'" in capsys.readouterr().err
    assert train.parse_args([flag, "3"]) is not None  # in range: accepted
