"""The sequence example (examples/sequence/train.py) runs as users run it, under torchrun on 2 gloo ranks, for a few
steps: EmbarkPlanner plans the history (sequence) table and the pooled tables together, and picks unique-based for
the Zipf history."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.support.processes import ROOT, checkout_env

TRAIN = ROOT / "examples" / "sequence" / "train.py"
RESULT_KEYS = {
    "planner", "history_layout", "history_sharding", "world_size", "local_world_size", "batch_size", "steps",
    "samples_per_s", "first_loss", "final_loss", "comm_bytes", "inter_node_bytes", "comm_bytes_by_rank",
    "history_bytes", "comm_bytes_per_step", "inter_node_bytes_per_step", "history_bytes_per_step",
}  # fmt: skip


def _torchrun(*flags: str, timeout_s: float = 120.0) -> tuple[dict[str, Any], str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(TRAIN), *flags]
    env = checkout_env()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 1, proc.stdout[-3000:]
    return json.loads(results[0][len("RESULT ") :]), proc.stdout


def test_example_trains_ub_history_and_prints_progress_and_one_result_line() -> None:
    """Rank 0 prints the plan (the planner put the history table on embark_ub over both ranks), a progress line
    every --log-every steps and exactly one RESULT line with every documented key; the loss falls; counted bytes
    cover both ranks, the history table's among them (UB bytes, both directions), and nothing crosses nodes on one
    node."""
    result, out = _torchrun(
        "--steps", "30", "--batch-size", "64", "--log-every", "10", "--warmup-steps", "5", "--history-rows", "100000"
    )
    assert "| model.history | history | embark_ub | [0, 1] |" in out, out[-3000:]
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == ["step 10", "step 20", "step 30"], steps
    assert all(line.endswith("samples/s") for line in steps), steps
    assert RESULT_KEYS <= set(result), RESULT_KEYS - set(result)
    assert (result["planner"], result["history_layout"], result["history_sharding"]) == (
        "embark",
        "planned",
        "embark_ub",
    )
    assert (result["world_size"], result["local_world_size"], result["steps"]) == (2, 2, 30)
    assert result["samples_per_s"] > 0
    assert result["final_loss"] < result["first_loss"], result
    assert len(result["comm_bytes_by_rank"]) == 2 and min(result["comm_bytes_by_rank"]) > 0
    # every rank's history bytes sent, together, fit in the busiest rank's sent + received bytes (2 ranks)
    assert 0 < result["history_bytes"] <= result["comm_bytes"]
    assert result["inter_node_bytes"] == 0
