"""plan/ is pure: every module except the EmbarkPlanner facade (planner.py) imports without torch (so without
torch.distributed) and without torchrec or fbgemm, module by module, in a fresh interpreter: the planner CLI and a
laptop need none of them, and the CLI starts in well under a second."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import embark_torchrec.plan as plan_package

FACADE = {"planner", "__main__"}  # the torchrec facade; the CLI entry point (it runs on import; cli.py is checked)
MODULES = sorted(m.name for m in pkgutil.iter_modules(plan_package.__path__) if m.name not in FACADE)


@pytest.mark.parametrize("module", MODULES)
def test_plan_module_imports_without_torch_or_torchrec(module: str) -> None:
    code = (
        "import sys, importlib; importlib.import_module('embark_torchrec.plan.{m}'); "
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'torchrec', 'fbgemm_gpu')); "
        "print(bad); sys.exit(1 if bad else 0)"
    ).format(m=module)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"embark_torchrec.plan.{module} pulls in {proc.stdout.strip()} {proc.stderr[-2000:]}"
