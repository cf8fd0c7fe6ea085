"""The suite's layers and the fixtures more than one test file uses.

Each test is marked with its layer, the folder it lives in, so that `make test` can run the quick planning layer
first (tests/plan) and everything else after it (`-m "not plan"`); `-m sharding`, `-m e2e` ... select a layer
anywhere. A test outside the layers' folders is a collection error: it would belong to no layer.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import checkout_env

TESTS = Path(__file__).resolve().parent
#: folder -> marker (registered in pyproject.toml)
LAYERS = ("plan", "sharding", "e2e", "compat", "docs")

_HOLD = """
import sys
from embark_torchrec.checkpoint import claim_checkpoint_directory
claim_checkpoint_directory(sys.argv[1])
print("held", flush=True)
sys.stdin.read()
"""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    outside = []
    for item in items:
        layer = item.path.relative_to(TESTS).parts[0]
        if layer in LAYERS:
            item.add_marker(layer)
        else:
            outside.append(item.nodeid)
    if outside:
        raise pytest.UsageError(f"tests outside the layers' folders {list(LAYERS)}: {outside}")


@pytest.fixture
def checkpoint_holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process that has made tmp_path/ckpt its own checkpoint directory and keeps running until killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path / "ckpt")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=checkout_env(),
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()
