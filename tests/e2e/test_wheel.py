"""The wheel installs like any TorchRec add-on (slow: minutes; needs a package index, skipped without one).

`python -m build` makes a wheel and an sdist; a clean venv (no system site packages) then gets exactly what README.md's
"Install with pip" tells a CPU user to type: torch and fbgemm-gpu-cpu by their usual names, torchrec with --no-deps
(its metadata requires the CUDA fbgemm-gpu, which plain pip would install over fbgemm-gpu-cpu: both write the
fbgemm_gpu package), then `pip install <wheel>`. From outside the checkout, without PYTHONPATH, the installed package
imports, the planner CLI plans a built-in model (the package's models/*.json) and the DLRM example from the sdist runs
a few steps on 2 ranks under the venv's torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: README.md's CPU steps before the wheel, one pip command each
CPU_PREREQUISITES = (("torch==2.13.0", "fbgemm-gpu-cpu==1.8.0"), ("--no-deps", "torchrec==1.8.0"))
STEP_TIMEOUT_S = 900


def _env() -> dict[str, str]:
    """The environment without this checkout on PYTHONPATH, so that only what was installed is imported."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _run(cmd: list[str], cwd: Path, timeout_s: float = STEP_TIMEOUT_S) -> str:
    """Runs `cmd`; its output, or a failure that shows the command and the output's end."""
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout_s, check=False)
    said = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{said}"
    return proc.stdout


def _venv(where: Path) -> Path:
    """A new venv at `where` (the base interpreter's, without system site packages); its bin directory."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=300)
    assert "include-system-site-packages = false" in (where / "pyvenv.cfg").read_text()
    return where / "bin"


def _index_reachable(tmp: Path) -> bool:
    """Whether pip's configured index answers for torchrec (the test installs from it)."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", "torchrec"]
    proc = subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=120, check=False)
    return proc.returncode == 0 and "1.8.0" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_wheel_installs_with_pip_beside_cpu_torchrec_and_runs(tmp_path: Path) -> None:
    """The wheel carries the built-in models and no torchrec requirement (so plain pip keeps fbgemm-gpu-cpu and
    installs no CUDA fbgemm-gpu), the sdist carries the example; installed with README's CPU commands in a clean venv,
    the package is imported from the venv, `python -m embark_torchrec.plan dcnv2` writes a plan and the example trains
    4 steps on 2 ranks and reports its AUC."""
    if not _index_reachable(tmp_path):
        pytest.skip("no package index reachable (pip index versions torchrec failed)")
    tools = _venv(tmp_path / "tools")
    _run([str(tools / "pip"), "install", "--quiet", "build"], tmp_path)
    dist = tmp_path / "dist"
    _run([str(tools / "python"), "-m", "build", "--outdir", str(dist), str(ROOT)], tmp_path)
    (wheel,) = dist.glob("embark_torchrec-*.whl")
    (sdist,) = dist.glob("embark_torchrec-*.tar.gz")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    models = {f"embark_torchrec/models/{p.name}" for p in (ROOT / "embark_torchrec" / "models").glob("*.json")}
    assert models and models <= names, sorted(models - names)
    required = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    unconditional = [r for r in required if "extra ==" not in r]
    assert not [r for r in unconditional if r.startswith(("torchrec", "fbgemm"))], unconditional
    example = tmp_path / "example"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/examples/dlrm/" in m.name and m.name.endswith(".py")]
        assert {Path(m.name).name for m in members} >= {"train.py", "dlrm_data.py"}, [m.name for m in members]
        for m in members:
            m.name = Path(m.name).name
            tar.extract(m, example, filter="data")

    venv = _venv(tmp_path / "venv")
    for args in CPU_PREREQUISITES:
        _run([str(venv / "pip"), "install", "--quiet", *args], tmp_path)
    _run([str(venv / "pip"), "install", "--quiet", str(wheel)], tmp_path)
    installed = _run([str(venv / "pip"), "list", "--format", "json"], tmp_path)
    versions = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(installed)}
    assert versions.get("fbgemm-gpu-cpu") == "1.8.0" and "fbgemm-gpu" not in versions, versions
    assert versions.get("torchrec") == "1.8.0" and versions.get("embark-torchrec"), versions

    where = _run([str(venv / "python"), "-c", "import embark_torchrec; print(embark_torchrec.__file__)"], tmp_path)
    assert Path(where.strip()).is_relative_to(tmp_path / "venv"), where
    plan_file = tmp_path / "plan.json"
    cli = [str(venv / "python"), "-m", "embark_torchrec.plan", "dcnv2", "--world-size", "8", "--local-world-size", "4"]
    summary = json.loads(_run([*cli, "--out", str(plan_file), "--json"], tmp_path))
    assert summary["world_size"] == 8 and "embark" in summary["plans"], summary
    assert json.loads(plan_file.read_text())["world_size"] == 8

    torchrun = [str(venv / "torchrun"), "--standalone", "--nproc_per_node", "2", str(example / "train.py")]
    out = _run([*torchrun, "--steps", "4", "--log-every", "1", "--warmup-steps", "0", "--eval-batches", "2"], example)
    (result,) = [json.loads(line[len("RESULT ") :]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert result["steps_run"] == 4 and result["world_size"] == 2 and 0.0 <= result["auc"] <= 1.0, result
