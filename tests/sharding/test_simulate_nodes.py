"""simulate_nodes regroups a torchrun job's ranks into nodes before the process group starts, setting what TorchRec
and the planner read; bad sizes and a late call are refused by name."""

from __future__ import annotations

import pytest

from embark_torchrec import simulate_nodes


def test_regroups_ranks_into_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    simulate_nodes(2)
    import os

    assert (os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"]) == ("2", "1", "2")
    with pytest.raises(ValueError, match="local world size 3 does not divide world size 8"):
        simulate_nodes(3)


def test_needs_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="needs \\['RANK'\\]"):
        simulate_nodes(1)
