"""How far the plan's estimated step is from the measured one on the DLRM demo: `make demo`'s command (2 gloo ranks)
and the same at 4 ranks as 2 simulated nodes x 2, each run several times, interleaved; per run the RESULT line's
estimated_step_ms / step_ms, and the medians. The planner's hardware is the default (`cpu-gloo` on CPU) unless
--hardware names another; the 1-min load average at each run's start is printed with it (the estimate is of an
otherwise idle box).

    python benchmarks/demo_estimate.py [--runs 3] [--ranks 2,4] [--steps 300] [--hardware PRESET|FILE] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LOCAL_WORLD_SIZE = 2  # the simulated node: 4 ranks run as 2 nodes x 2


def _run(ranks: int, steps: int, hardware: str | None) -> dict[str, Any]:
    """One run of the example; its RESULT line's step and estimate, and the load average when it started."""
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={ranks}"]
    command += [
        str(ROOT / "examples/dlrm/train.py"),
        "--steps",
        str(steps),
        "--local-world-size",
        str(LOCAL_WORLD_SIZE),
    ]
    command += ["--hardware", hardware] if hardware else []
    load = os.getloadavg()[0]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    found = re.search(r"^RESULT (\{.*\})$", out.stdout, re.MULTILINE)
    if out.returncode or not found:
        raise RuntimeError(f"{ranks} ranks: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    result = json.loads(found.group(1))
    measured, estimated = result["step_ms"], result["estimated_step_ms"]
    return {
        "ranks": ranks,
        "step_ms": measured,
        "estimated_step_ms": estimated,
        "ratio": estimated / measured,
        "load": load,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--ranks", default="2,4", help="comma-separated world sizes (nodes of 2 ranks)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--hardware", help="the planner's hardware (default: the example's, cpu-gloo on CPU)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    sizes = [int(x) for x in args.ranks.split(",") if x]
    runs = []
    for r in range(args.runs):
        for ranks in sizes if r % 2 == 0 else sizes[::-1]:
            runs.append(_run(ranks, args.steps, args.hardware))
            run = runs[-1]
            print(
                f"{ranks} ranks: measured {run['step_ms']:.2f} ms, estimated {run['estimated_step_ms']:.2f} ms, "
                f"estimate / measured {run['ratio']:.3f} (load {run['load']:.2f})",
                flush=True,
            )
    for ranks in sizes:
        mine = [run for run in runs if run["ranks"] == ranks]
        print(
            f"{ranks} ranks: median measured {statistics.median(r['step_ms'] for r in mine):.2f} ms, estimated "
            f"{statistics.median(r['estimated_step_ms'] for r in mine):.2f} ms, median estimate / measured "
            f"{statistics.median(r['ratio'] for r in mine):.3f} over {len(mine)} runs (load "
            f"{min(r['load'] for r in mine):.2f}-{max(r['load'] for r in mine):.2f})"
        )
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
