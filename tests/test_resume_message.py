"""examples/dlrm/train.py's line when --resume loads nothing says what resume found: steps that failed their manifest
check, steps that verified but did not load into the model, or no finished step at all (each folder's own reason is
printed above it)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from embark_torchrec import checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _nothing_resumed(directory: Path) -> str:
    sys.path.insert(0, str(ROOT / "examples" / "dlrm"))
    import train

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
