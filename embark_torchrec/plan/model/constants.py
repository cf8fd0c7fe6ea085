"""The cost model's fixed figures, pure constants: cost/model.py and the cluster kinds (layout/kinds.py) price
with them."""

from __future__ import annotations

WEIGHT_BYTES = 4  # an fp32 weight in the table (lookup work, not wire)
BACKWARD_COMPUTE_MULTIPLIER = 2.0  # backward lookup work / forward's
