"""What the search minimises: the estimated step time, ties broken by the sum of squared per-rank
loads (a flatter plan leaves more room for the next move)."""

from __future__ import annotations

import numpy as np

from .model import StepCost

Objective = tuple[float, float]


def objective(step: StepCost) -> Objective:
    loads = step.rank_load_ms
    return step.step_ms, float(np.dot(loads, loads))


def better(a: Objective, b: Objective) -> bool:
    """a beats b: a lower step time, or the same step time with flatter per-rank loads."""
    tol = 1e-9 * max(abs(b[0]), 1e-12)
    if a[0] < b[0] - tol:
        return True
    return abs(a[0] - b[0]) <= tol and a[1] < b[1] * (1 - 1e-9)
