"""python -m embark_torchrec.planner MODEL --world-size W --local-world-size L [...]: the planner CLI
(plan/cli.py, the same arguments) with TorchRec's default planner as one more baseline, --compare torchrec."""

from __future__ import annotations

from typing import Sequence

from ..plan.cli import BASELINES, main as plan_main
from .torchrec_plans import torchrec_default_plan

PROG = "python -m embark_torchrec.planner"


def main(argv: Sequence[str] | None = None) -> int:
    return plan_main(argv, {**BASELINES, "torchrec": torchrec_default_plan}, PROG)
