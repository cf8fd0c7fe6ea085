"""Sharding groups: the group each layout runs in, its TorchRec sharding-type string, and what it costs in collectives.

TorchRec builds one EmbeddingSharding (one input dist and one output dist, each with its own
collectives) per distinct sharding-type string in a module. So every distinct group a plan uses
adds a fixed number of collectives per training step, whatever its tables' sizes; on a transport with
a high launch cost (gloo) that count matters as much as the bytes. Each sharded module (EBC or EC) adds
one more per step, whatever its groups: its split exchange (sharding/input_exchange.py), which carries
every group's split sizes. The counts below are those the runtime issues (counted by wrapping
torch.distributed's collectives around a training step, in tests/sharding/test_plan_groups.py). Weighted
features (and MEAN pooling on our RB types, which send 1 / length as weights) add one all-to-all,
their weights, to the input dist; model specs do not say which features are weighted, so that one
is not priced.

A group is a ShardingGroup value everywhere in the planner and the runtime; its string (ShardingGroup.name) exists
only where TorchRec reads it (ParameterSharding.sharding_type, which the sharded modules parse back once per
sharding they build). The string's grammar, for TorchRec's types: "<type>[:<forward>-<backward>][@<row width>]"
(the precision part below fp32, the row width at a row-scaled precision); for ours:
"embark_<cluster kind>[_hier][:<forward>-<backward>]".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..model.fields import POOLED, SEQUENCE
from .kinds import ClusterKind, cluster_kind, cluster_kind_names
from .tables import PlanError, TableLayout, WirePrecision
from .torchrec_types import BUILTIN_COLLECTIVES, DATA_PARALLEL, SEQUENCE_BUILTIN_TYPES
from .wire import EMBARK_ID_BYTES, TORCHREC_ID_BYTES

# the dense modules' DDP all-reduces their gradients once per step for any plan (DDP's all-reduce of the
# data-parallel tables: torchrec_types.DATA_PARALLEL_COLLECTIVES)
DENSE_COLLECTIVES = 1
# once per sharded module and step, whatever its groups (data-parallel ones only included): the split
# exchange of every group's split sizes and every rank's input check
INPUT_EXCHANGE_COLLECTIVES = 1
_SHARDING_TYPE_PREFIX = "embark_"
_HIERARCHICAL_SUFFIX = "_hier"
_PRECISION_SEPARATOR = ":"
_ROW_WIDTH_SEPARATOR = "@"
# one instance per distinct group the planner meets, so that a dict keyed by groups finds its key by identity
# (a dataclass compares field by field)
_GROUPS: dict[ShardingGroup, ShardingGroup] = {}


@dataclass(frozen=True)
class ShardingGroup:
    """One sharding group of a sharded module: the tables TorchRec runs through one EmbeddingSharding.

    `module`: the TorchRec module it lives in, POOLED (an EmbeddingBagCollection) or SEQUENCE (an
    EmbeddingCollection); the same string in two modules is two groups. `runner`: TorchRec's sharding type that
    runs it ("table_wise", "data_parallel"), or for ours the cluster kind's name ("rb"); every TorchRec type's name
    holds a '_' and no kind's may (kinds.register_cluster_kind), so the two never meet. `hierarchical`: ours reduces
    partial sums inside each node first (TorchRec's types say so by their name). `row_width`: of every row a
    TorchRec dist of the group sends at a row-scaled precision (fp8), which its codec must be told, as TorchRec's
    dists size a message by its element count alone; 0 otherwise. So TorchRec's type at fp8 runs one group per row
    width (wire.py)."""

    module: str
    runner: str
    hierarchical: bool = False
    precision: WirePrecision = WirePrecision()
    row_width: int = 0
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        values = (self.module, self.runner, self.hierarchical, self.precision, self.row_width)
        object.__setattr__(self, "_hash", hash(values))

    def __hash__(self) -> int:
        """Computed once: RankLoad.groups is looked up at every load the search adds, as a string's cached hash was."""
        return self._hash

    @classmethod
    def ours(cls, layout: TableLayout, module: str = POOLED) -> ShardingGroup:
        """The group of our sharding that runs this layout, whichever TorchRec type could: one per cluster kind,
        reduction and precision; a sequence table's runs flat, as nothing is summed."""
        return cls(module, layout.cluster, layout.hierarchical and module == POOLED, layout.precision)

    @classmethod
    def parse(cls, name: str, module: str = POOLED) -> ShardingGroup:
        """The group a sharding-type string names in `module`: the inverse of `name`."""
        body, _, width = name.partition(_ROW_WIDTH_SEPARATOR)
        if width and not width.isdigit():
            raise PlanError(f"sharding type {name!r}: its row width {width!r} is not a whole number")
        runner, _, wire = body.partition(_PRECISION_SEPARATOR)
        forward, _, backward = (wire or "fp32-fp32").partition("-")
        precision = WirePrecision(forward, backward or forward)
        if not runner.startswith(_SHARDING_TYPE_PREFIX):
            if precision.row_scaled != bool(width):
                raise PlanError(f"sharding type {name!r}: a row width goes with a row-scaled precision, and only there")
            return cls(module, runner, False, precision, int(width or 0))
        cluster, _, variant = runner[len(_SHARDING_TYPE_PREFIX) :].partition("_")
        if cluster not in cluster_kind_names() or cluster_kind(cluster).replicated or variant not in ("", "hier"):
            raise PlanError(f"unknown embark sharding type {name!r}")
        if width:
            raise PlanError(f"sharding type {name!r}: ours takes no row width")
        return cls(module, cluster, variant == "hier", precision)

    @property
    def name(self) -> str:
        """TorchRec's sharding-type string of the group, e.g. "table_wise:fp8-fp8@64", "embark_rb_hier:fp16-bf16"."""
        p = self.precision
        wire = "" if (p.forward, p.backward) == ("fp32", "fp32") else f"{_PRECISION_SEPARATOR}{p.forward}-{p.backward}"
        if self.torchrec_type is not None:
            width = f"{_ROW_WIDTH_SEPARATOR}{self.row_width}" if self.row_width else ""
            return self.runner + wire + width
        return _SHARDING_TYPE_PREFIX + self.runner + (_HIERARCHICAL_SUFFIX if self.hierarchical else "") + wire

    @property
    def torchrec_type(self) -> str | None:
        """The TorchRec sharding type that runs the group ("table_wise:fp16-fp16": "table_wise"), None for ours."""
        return self.runner if "_" in self.runner else None

    @property
    def cluster_kind(self) -> ClusterKind:
        """The cluster kind of ours that runs the group (kinds.py)."""
        return cluster_kind(self.runner)

    @property
    def id_bytes(self) -> int:
        """Bytes per ID that the group sends in its input dist."""
        return TORCHREC_ID_BYTES if self.torchrec_type is not None else EMBARK_ID_BYTES

    @property
    def collectives_per_step(self) -> int:
        """Collectives the group issues per training step (forward and backward), its module's split exchange
        aside (module_collectives_per_step)."""
        if self.torchrec_type is None:
            return self.cluster_kind.collectives_per_step(self.hierarchical)
        if self.runner not in BUILTIN_COLLECTIVES:
            raise PlanError(f"TorchRec's sharding type {self.runner!r} is not one the planner prices")
        return BUILTIN_COLLECTIVES[self.runner]


def sharding_group(
    layout: TableLayout, rows: int, world_size: int, local_world_size: int, sequence: bool = False
) -> ShardingGroup:
    """The group the layout runs in: TorchRec's type where one runs it exactly (its cluster kind's answer,
    kinds.py; for a sequence table, one of SEQUENCE_BUILTIN_TYPES), else ours (ShardingGroup.ours).

    TorchRec's type below fp32 keeps its precision ("table_wise:fp16-fp16"): TorchRec builds one sharding per
    distinct string in a module, so its fp32 and its compressed table-wise tables are two groups, each with its own
    codecs, as two modules with two QCommsConfigs would be. At fp8 it also keeps its rows' width
    ("table_wise:fp8-fp8@128"), which its row-scaled codec is told."""
    module = SEQUENCE if sequence else POOLED
    builtin = layout.kind.builtin_sharding_type(layout, rows, world_size, local_world_size)
    if builtin == DATA_PARALLEL:
        group = ShardingGroup(module, DATA_PARALLEL)
    elif builtin is not None and (not sequence or builtin in SEQUENCE_BUILTIN_TYPES):
        width = layout.col_bounds[1] - layout.col_bounds[0] if layout.precision.row_scaled else 0
        group = ShardingGroup(module, builtin, False, layout.precision, width)
    else:
        group = ShardingGroup.ours(layout, module)
    return _GROUPS.setdefault(group, group)


def module_collectives_per_step(groups: Iterable[ShardingGroup]) -> int:
    """Collectives one sharded module issues per training step, its tables in `groups`: each distinct group's own
    and the module's split exchange (none for a module without tables)."""
    distinct = set(groups)
    return sum(g.collectives_per_step for g in distinct) + (INPUT_EXCHANGE_COLLECTIVES if distinct else 0)
