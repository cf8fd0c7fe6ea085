"""Subprocesses that run this checkout: its root, and the environment that makes them import its embark_torchrec."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def checkout_env(**extra: str) -> dict[str, str]:
    """os.environ with this checkout first on PYTHONPATH (not an installed embark_torchrec) and `extra` set."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}
