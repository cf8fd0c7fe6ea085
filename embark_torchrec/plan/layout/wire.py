"""What each message element costs on the wire: the one definition the cost model, the traffic
model, the runtime's codecs and its byte counters all use, so a planner estimate and a counted byte
cannot drift apart.

- IDs: TorchRec's own input dists send the input's int64 IDs; ours send row-local IDs as int32, so a
  row slice of our sharding holds fewer than MAX_SLICE_ROWS rows.
- bag lengths (and UB's per-group counts, which travel as KJT lengths): int32.
- embedding and gradient rows: ELEMENT_BYTES per value at the cluster's wire precision; fp8 adds one
  fp32 scale per row (sharding/codecs.py's row-wise e4m3 codec). A row-scaled precision needs each row's
  width, which TorchRec's own dists do not tell a codec (they size a message by its element count), so
  TorchRec's shardings run a row-scaled precision only for rows of one width, told in the group's row width
  (groups.ShardingGroup, a layout's torchrec_at_fp8).
- a hierarchical reduction's intra-node hop (stage 1: partial sums, summed again at the node's
  aggregator) runs at intra_node_reduction_precision of the layout's precision, its cross-node hop at
  the layout's: a row-scaled precision's partial sums travel at fp32 inside the node.
- the split exchange (sharding/input_exchange.py): once per sharded module (EBC or EC) and batch, every
  rank sends every other rank one row of int64: per sharding group of the module, a layout code and
  SPLIT_ROWS split sizes, then its INPUT_FAULT_INTS-integer input-fault record.
"""

from __future__ import annotations

from typing import Union

import numpy as np

TORCHREC_ID_BYTES = 8
EMBARK_ID_BYTES = 4
MAX_SLICE_ROWS = 2**31
LENGTH_BYTES = 4
ELEMENT_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0}
FP8_SCALE_BYTES = 4  # one fp32 scale per row vector
ROW_SCALED_PRECISIONS = frozenset({"fp8"})
SPLIT_INT_BYTES = 8  # the split exchange's integers are int64
SPLIT_ROWS = 4  # split sizes per group: lengths, values, then two of: strides, weights, batch size
INPUT_FAULT_INTS = 11  # sharding/validation.py's InputFault.FIELDS

Count = Union[float, np.ndarray]


def rows_bytes(elements: Count, rows: Count, precision: str) -> Count:
    """Wire bytes of `rows` embedding (or gradient) rows holding `elements` values in all."""
    return elements * ELEMENT_BYTES[precision] + (rows * FP8_SCALE_BYTES if precision in ROW_SCALED_PRECISIONS else 0.0)


def intra_node_reduction_precision(precision: str) -> str:
    """The precision of a hierarchical reduction's intra-node hop for a layout's wire `precision`. fp8 there would
    quantize each partial sum twice (once per hop, errors adding up) to save bytes on the fastest link, at the
    highest host cost per codec call (a scale per row); EMBark compresses the cross-node link. So a row-scaled
    precision's stage 1 sends fp32; element-wise precisions (fp16, bf16: one cheap cast) apply to both hops."""
    return "fp32" if precision in ROW_SCALED_PRECISIONS else precision


def vector_bytes(width: int, precision: str) -> float:
    """Wire bytes of one embedding (or gradient) row of `width` elements."""
    return float(rows_bytes(float(width), 1.0, precision))


def split_exchange_ints(groups: int) -> int:
    """Integers each rank sends each other rank in the split exchange of a module of `groups` sharding groups."""
    return groups * (1 + SPLIT_ROWS) + INPUT_FAULT_INTS


def split_exchange_bytes(groups: int) -> int:
    """Wire bytes each rank sends each other rank in that exchange, once per module and batch."""
    return split_exchange_ints(groups) * SPLIT_INT_BYTES
