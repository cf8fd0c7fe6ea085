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

from .kinds import cluster_kind
from .tables import (
    TableLayout,
    parse_sharding_type,
    precision_suffix,
    row_width_suffix,
    sharding_type_name,
    split_precision,
)
from .torchrec_types import BUILTIN_COLLECTIVES, DATA_PARALLEL, SEQUENCE_BUILTIN_TYPES
from .wire import EMBARK_ID_BYTES, TORCHREC_ID_BYTES

# the dense modules' DDP all-reduces their gradients once per step for any plan (DDP's all-reduce of the
# data-parallel tables: torchrec_types.DATA_PARALLEL_COLLECTIVES)
DENSE_COLLECTIVES = 1
# once per sharded module and step, whatever its groups (data-parallel ones only included): the split
# exchange of every group's split sizes and every rank's input check
INPUT_EXCHANGE_COLLECTIVES = 1


def builtin_sharding_type(layout: TableLayout, rows: int, world_size: int, local_world_size: int) -> str | None:
    """The torchrec sharding type that runs this layout exactly, or None: its cluster kind's answer
    (kinds.py). At an element-wise wire precision the codecs reach TorchRec's dists as a registry
    per group (see sharding_type)."""
    return layout.kind.builtin_sharding_type(layout, rows, world_size, local_world_size)


def sharding_type(
    layout: TableLayout, rows: int, world_size: int, local_world_size: int, sequence: bool = False
) -> str:
    """The sharding-type string the layout runs under: a built-in one where it exists (for a
    sequence table, one of SEQUENCE_BUILTIN_TYPES), else ours; a sequence table's is never
    hierarchical, as there are no partial sums to reduce (its grid runs flat).

    A built-in type below fp32 carries its precision ("table_wise:fp16-fp16"): TorchRec builds one
    sharding per distinct string in a module, so its fp32 and its compressed table-wise tables are two
    groups, each with its own codecs, as two modules with two QCommsConfigs would be. At fp8 it also carries its
    rows' width ("table_wise:fp8-fp8@128"), which its row-scaled codec is told (layout.row_width_suffix)."""
    builtin = builtin_sharding_type(layout, rows, world_size, local_world_size)
    if builtin is not None and builtin != DATA_PARALLEL and (not sequence or builtin in SEQUENCE_BUILTIN_TYPES):
        width = layout.col_bounds[1] - layout.col_bounds[0]
        return builtin + precision_suffix(layout.precision) + row_width_suffix(layout.precision, width)
    if builtin == DATA_PARALLEL:
        return builtin
    return sharding_type_name(replace(layout, hierarchical=False) if sequence else layout)


def torchrec_type(kind: str) -> str | None:
    """The TorchRec sharding type that runs a group of this sharding-type string ("table_wise:fp16-fp16":
    "table_wise"), None for ours."""
    base, _ = split_precision(kind)
    return base if base in BUILTIN_COLLECTIVES else None


def id_bytes(kind: str) -> int:
    """Bytes per ID that a group of this sharding type sends in its input dist."""
    return TORCHREC_ID_BYTES if torchrec_type(kind) is not None else EMBARK_ID_BYTES


@lru_cache(maxsize=None)
def collectives_per_step(kind: str) -> int:
    """Collectives one sharding group issues per training step (forward and backward), its module's split
    exchange aside (module_collectives_per_step)."""
    builtin = torchrec_type(kind)
    if builtin is not None:
        return BUILTIN_COLLECTIVES[builtin]
    cluster, hierarchical, _ = parse_sharding_type(kind)
    return cluster_kind(cluster).collectives_per_step(hierarchical)


def module_collectives_per_step(kinds: Iterable[str]) -> int:
    """Collectives one sharded module issues per training step, its tables in the sharding groups `kinds`: each
    distinct group's own and the module's split exchange (none for a module without tables)."""
    distinct = set(kinds)
    return sum(collectives_per_step(k) for k in distinct) + (INPUT_EXCHANGE_COLLECTIVES if distinct else 0)
