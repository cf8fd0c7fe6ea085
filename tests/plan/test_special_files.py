"""Plan, spec and hardware files are regular files of bounded size: a FIFO is refused by name at once (it blocked
every rank that opened it until killed), as are a character device (/dev/zero never ends), a folder, and a file over
DOCUMENT_MAX_BYTES; the same helper (plan/model/files.py) guards the checkpoint's manifests and data files."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from embark_torchrec.plan.model.fields import FieldError
from embark_torchrec.plan.model.files import DOCUMENT_MAX_BYTES
from embark_torchrec.plan.model.hardware_file import load_hardware
from embark_torchrec.plan.layout.tables import Plan
from embark_torchrec.plan.model.spec import load_model_spec

READERS: dict[str, Callable[[Path], Any]] = {"plan": Plan.load, "spec": load_model_spec, "hardware": load_hardware}
WAIT_S = 20.0


def _refusal(reader: Callable[[Path], Any], path: Path) -> str:
    """The reader's FieldError message for `path`, read on a thread so that a reader that blocks fails the test
    (after WAIT_S) instead of hanging it."""
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            reader(path)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    if not outcome and path.is_fifo():  # a writer lets the blocked reader return, so the test run can end
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert outcome, f"reading {path} had not returned after {WAIT_S} s"
    error = outcome[0]
    assert isinstance(error, FieldError), f"{path}: expected a FieldError naming it, got {error!r}"
    assert str(path) in str(error), error
    return str(error)


@pytest.mark.parametrize("kind", READERS)
def test_a_fifo_is_refused_by_name_without_blocking(kind: str, tmp_path: Path) -> None:
    fifo = tmp_path / f"{kind}.json"
    os.mkfifo(fifo)
    assert "FIFO" in _refusal(READERS[kind], fifo)


@pytest.mark.parametrize("kind", READERS)
def test_a_device_or_a_folder_is_refused_by_name(kind: str, tmp_path: Path) -> None:
    assert "character device" in _refusal(READERS[kind], Path(os.devnull))
    assert "folder" in _refusal(READERS[kind], tmp_path)


@pytest.mark.parametrize("kind", READERS)
def test_a_file_over_the_size_limit_is_refused_by_name(kind: str, tmp_path: Path) -> None:
    big = tmp_path / f"{kind}.json"
    with open(big, "wb") as fh:  # sparse: no disk used
        fh.truncate(DOCUMENT_MAX_BYTES + 1)
    assert f"larger than {DOCUMENT_MAX_BYTES} bytes" in _refusal(READERS[kind], big)


def test_a_link_to_a_plan_file_is_followed(tmp_path: Path) -> None:
    """Links are how users keep plan files: the reader follows them (checkpoints do not)."""
    plan = Plan(1, 1, {})
    plan.save(tmp_path / "plan.json")
    (tmp_path / "link.json").symlink_to(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "link.json") == plan
