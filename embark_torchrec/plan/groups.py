"""Sharding groups: the sharding-type string each layout runs under, and what a group costs in collectives.

TorchRec builds one EmbeddingSharding (one input dist and one output dist, each with its own
collectives) per distinct sharding-type string in a module. So every distinct string a plan uses
adds a fixed number of collectives per training step, whatever its tables' sizes; on a transport with
a high launch cost (gloo) that count matters as much as the bytes. Each sharded module (EBC or EC) adds
one more per step, whatever its groups: its split exchange (sharding/input_exchange.py), which carries
every group's split sizes. The counts below are those the runtime issues (counted by wrapping
torch.distributed's collectives around a training step, in tests/test_plan_groups.py). Weighted
features (and MEAN pooling on our RB types, which send 1 / length as weights) add one all-to-all,
their weights, to the input dist; model specs do not say which features are weighted, so that one
is not priced.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from functools import lru_cache

from .layout import (
    TableLayout,
    ceil_row_bounds,
    parse_sharding_type,
    precision_suffix,
    sharding_type_name,
    split_precision,
)
from .wire import EMBARK_ID_BYTES, ROW_SCALED_PRECISIONS, TORCHREC_ID_BYTES

DATA_PARALLEL = "data_parallel"
# collectives per training step of one group, forward and backward: the KJT input dist's tensors
# (lengths, values: their split sizes travel in the module's split exchange), then the pooled output
# and its gradient; hierarchical (and TWRW) reductions add an intra-node stage each way; UB sends its
# de-duplicated IDs through the same KJT all-to-all (its counts are the KJT's lengths), then vectors
# and their gradients; a data-parallel group has no dists, but TorchRec wraps its lookups in a
# DistributedDataParallel of their own, whose reducer all-reduces their gradients in the backward
# (one all-reduce per DDP bucket of 25 MB; priced as one)
DATA_PARALLEL_COLLECTIVES = 1
# the dense modules' DDP all-reduces their gradients alike, once per step for any plan
DENSE_COLLECTIVES = 1
FLAT_COLLECTIVES = 4
HIERARCHICAL_COLLECTIVES = 6
UNIQUE_COLLECTIVES = 4
# once per sharded module and step, whatever its groups (data-parallel ones only included): the split
# exchange of every group's split sizes and every rank's input check
INPUT_EXCHANGE_COLLECTIVES = 1
# TorchRec's EmbeddingCollection runs these built-in types exactly; every other layout of a sequence
# table runs as ours (TorchRec's sequence column-wise needs one width for all its tables)
SEQUENCE_BUILTIN_TYPES = (DATA_PARALLEL, "table_wise", "row_wise")
_BUILTIN_COLLECTIVES = {
    DATA_PARALLEL: DATA_PARALLEL_COLLECTIVES,
    "table_wise": FLAT_COLLECTIVES,
    "column_wise": FLAT_COLLECTIVES,
    "row_wise": FLAT_COLLECTIVES,
    "table_row_wise": HIERARCHICAL_COLLECTIVES,
}


def builtin_sharding_type(layout: TableLayout, rows: int, world_size: int, local_world_size: int) -> str | None:
    """The torchrec sharding type that runs this layout exactly, or None.

    RW and TWRW only when the row bounds are torchrec's own ceil blocks on the ranks it would use
    (its bucketizer ignores our bounds), none of them empty (a 0-row shard crashes the CPU TBE).
    At any element-wise wire precision (fp32, fp16, bf16: the codecs reach TorchRec's dists as a
    registry per group, see sharding_type); a row-scaled one (fp8) runs on ours (plan/wire.py).
    """
    if layout.cluster == "dp":
        return DATA_PARALLEL
    if layout.cluster != "rb" or {layout.precision.forward, layout.precision.backward} & ROW_SCALED_PRECISIONS:
        return None
    n_r, n_c = layout.num_row_slices, layout.num_col_slices
    if n_r == 1:
        return "table_wise" if n_c == 1 else "column_wise"
    if n_c != 1:
        return None
    ranks = [row[0] for row in layout.ranks]
    if n_r == world_size and ranks == list(range(world_size)) and not layout.hierarchical:
        return "row_wise" if layout.row_bounds == ceil_row_bounds(rows, world_size) else None
    first = ranks[0]
    node_ranks = list(range(first, first + local_world_size))
    if n_r == local_world_size and first % local_world_size == 0 and ranks == node_ranks and layout.hierarchical:
        return "table_row_wise" if layout.row_bounds == ceil_row_bounds(rows, local_world_size) else None
    return None


def sharding_type(
    layout: TableLayout, rows: int, world_size: int, local_world_size: int, sequence: bool = False
) -> str:
    """The sharding-type string the layout runs under: a built-in one where it exists (for a
    sequence table, one of SEQUENCE_BUILTIN_TYPES), else ours; a sequence table's is never
    hierarchical, as there are no partial sums to reduce (its grid runs flat).

    A built-in type below fp32 carries its precision ("table_wise:fp16-fp16"): TorchRec builds one
    sharding per distinct string in a module, so its fp32 and its compressed table-wise tables are two
    groups, each with its own codecs, as two modules with two QCommsConfigs would be."""
    builtin = builtin_sharding_type(layout, rows, world_size, local_world_size)
    if builtin is not None and builtin != DATA_PARALLEL and (not sequence or builtin in SEQUENCE_BUILTIN_TYPES):
        return builtin + precision_suffix(layout.precision)
    if builtin == DATA_PARALLEL:
        return builtin
    return sharding_type_name(replace(layout, hierarchical=False) if sequence else layout)


def torchrec_type(kind: str) -> str | None:
    """The TorchRec sharding type that runs a group of this sharding-type string ("table_wise:fp16-fp16":
    "table_wise"), None for ours."""
    base, _ = split_precision(kind)
    return base if base in _BUILTIN_COLLECTIVES else None


def id_bytes(kind: str) -> int:
    """Bytes per ID that a group of this sharding type sends in its input dist."""
    return TORCHREC_ID_BYTES if torchrec_type(kind) is not None else EMBARK_ID_BYTES


@lru_cache(maxsize=None)
def collectives_per_step(kind: str) -> int:
    """Collectives one sharding group issues per training step (forward and backward), its module's split
    exchange aside (module_collectives_per_step)."""
    builtin = torchrec_type(kind)
    if builtin is not None:
        return _BUILTIN_COLLECTIVES[builtin]
    cluster, hierarchical, _ = parse_sharding_type(kind)
    if cluster == "ub":
        return UNIQUE_COLLECTIVES
    return HIERARCHICAL_COLLECTIVES if hierarchical else FLAT_COLLECTIVES


def module_collectives_per_step(kinds: Iterable[str]) -> int:
    """Collectives one sharded module issues per training step, its tables in the sharding groups `kinds`: each
    distinct group's own and the module's split exchange (none for a module without tables)."""
    distinct = set(kinds)
    return sum(collectives_per_step(k) for k in distinct) + (INPUT_EXCHANGE_COLLECTIVES if distinct else 0)
