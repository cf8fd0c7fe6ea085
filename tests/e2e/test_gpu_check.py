"""benchmarks/gpu_check.py --dry-run-cpu: the GPU check's logic, run where there is no GPU, so that the one script a
lent device runs is known to pass here first (every sharding type exact at world size 1, every one running its
multi-rank code paths as rank 0 of a fake 4-rank world, the DLRM example, and the TBE lookups set against the
presets)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.processes import ROOT, checkout_env


def test_gpu_check_passes_every_check_on_cpu() -> None:
    env = checkout_env()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run-cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT, check=False)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed, total = summary.split()[0].split("/")
    assert summary.endswith("passed") and passed == total and int(total) >= 32, summary
    for kind in ("lookups:exact_sgd", "lookups:exact_rowwise_adagrad"):
        assert f"d/{kind}: pass" in proc.stdout, proc.stdout[-4000:]
