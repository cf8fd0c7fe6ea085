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


@pytest.mark.parametrize("missing", ["torchrec", "fbgemm_gpu"])
def test_runtime_without_torchrec_or_fbgemm_says_what_to_install(missing: str) -> None:
    """The wheel does not require torchrec or fbgemm (torchrec's metadata would pull the CUDA fbgemm-gpu onto CPU
    users), so where one is missing the runtime's first use says which package to install and where the README says
    how, instead of a bare "No module named"."""
    code = (
        "import sys\n"
        "class Gone:  # the package is not installed\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {missing!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Gone())\n"
        "import embark_torchrec\n"
        "try:\n    embark_torchrec.EmbarkEmbeddingBagCollectionSharder\n"
        "except ModuleNotFoundError as e:\n    print(e.name, '|', e)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    name, _, message = proc.stdout.strip().partition(" | ")
    assert name == missing, proc.stdout + proc.stderr[-2000:]
    assert f"needs {missing}, which pip does not install with embark-torchrec" in message, message
    assert "'Install with pip'" in message, message
