"""Communication accounting: the bytes every embedding collective moves, per rank.

`enable_comm_stats(model)` turns counting on for every EmbarkShardedEmbeddingBagCollection and
EmbarkShardedEmbeddingCollection in a model and returns this rank's `CommStats`. Our own collectives
(hierarchical reduction, unique-based dists) record each call's bytes per peer, sharding type, table
and kind; the TorchRec all-to-alls our grid borrows, and TorchRec's own pooled shardings run by our
sharder (table-wise, column-wise, row-wise, table-row-wise), are counted by hooks
(torchrec_counting.py); TorchRec's own sequence (EC) shardings are not counted. Each module's split exchange
(input_exchange.py) is counted by `SplitsExchangeCounter`. Off by default: a dist that is not counting pays one
`is None` check.

Kinds: "ids", "lengths" (int32 bag lengths; for UB the per-group counts), "weights", "metadata"
(the split exchange: once per module and batch, every sharding group's split sizes and the rank's
input-fault record, filed under sharding type INPUT_EXCHANGE and table ALL_TABLES), "embeddings"
(forward) and "gradients" (backward). A message to oneself is not on the wire and is not counted.
The gradients of TorchRec's pooled all-to-alls mirror their forward messages and are recorded at
forward time; ours are recorded when backward sends them. Data-parallel tables are all-reduced by
DDP with the dense part and are not counted here (a module of data-parallel tables only still
sends its split exchange, which is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.comm import get_local_size

from ..plan.layout.wire import rows_bytes
from .codecs import encoded_size
from .torchrec_compat import module_env, module_input_dists, module_output_dists

KINDS = ("metadata", "lengths", "ids", "weights", "embeddings", "gradients")
_DIRECTIONS = ("sent", "received")
ALL_TABLES = "*"  # bytes of a sharding group's (or a module's) tables together
INPUT_EXCHANGE = "input_exchange"  # the sharding type under which a module's split exchange is filed


@dataclass(frozen=True)
class CommKey:
    sharding_type: str  # the sharding group's type string, e.g. "table_wise", "embark_ub:fp16-fp16"
    table: str
    kind: str


class CommStats:
    """This rank's bytes, kept per (sharding type, table, kind) as per-peer sent/received arrays."""

    def __init__(self, rank: int, world_size: int, local_world_size: int) -> None:
        self.rank, self.world_size, self.local_world_size = rank, world_size, local_world_size
        self._bytes: Dict[CommKey, np.ndarray] = {}  # [2, world_size]: sent to / received from each peer
        node = np.arange(world_size) // local_world_size
        self._inter = node != rank // local_world_size
        self._self = np.arange(world_size) == rank
        self._sources: List[Any] = []  # counters that sum on the device until read (flush / discard)

    def add_source(self, source: Any) -> None:
        """A counter that keeps device-side sums; they are recorded when the statistics are read."""
        self._sources.append(source)

    def _flush(self) -> None:
        for source in self._sources:
            source.flush()

    def record(
        self, sharding_type: str, table: str, kind: str, sent: Sequence[float], received: Sequence[float]
    ) -> None:
        """Bytes sent to and received from each global rank (index = rank) in one collective."""
        if kind not in KINDS:
            raise ValueError(f"unknown communication kind {kind!r}; known: {KINDS}")
        key = CommKey(sharding_type, table, kind)
        entry = self._bytes.get(key)
        if entry is None:
            entry = self._bytes[key] = np.zeros((2, self.world_size))
        entry[0] += np.asarray(sent, dtype=np.float64)
        entry[1] += np.asarray(received, dtype=np.float64)
        entry[:, self._self] = 0.0

    def reset(self) -> None:
        for source in self._sources:
            source.discard()
        self._bytes.clear()

    def keys(self) -> List[CommKey]:
        self._flush()
        return sorted(self._bytes, key=lambda k: (k.sharding_type, k.table, KINDS.index(k.kind)))

    def per_peer(self, key: CommKey) -> np.ndarray:
        """[2, world_size] bytes sent to / received from each rank for one (sharding type, table, kind)."""
        self._flush()
        return self._bytes.get(key, np.zeros((2, self.world_size))).copy()

    def totals(self, keys: Optional[Iterable[CommKey]] = None) -> Dict[str, int]:
        """Bytes sent and received, in all and split intra / inter node (over `keys`, default all)."""
        self._flush()
        arr = np.zeros((2, self.world_size))
        for key in self._bytes if keys is None else keys:
            if key in self._bytes:
                arr += self._bytes[key]
        out: Dict[str, int] = {}
        for i, direction in enumerate(_DIRECTIONS):
            out[direction] = int(arr[i].sum())
            out[f"{direction}_intra"] = int(arr[i][~self._inter].sum())
            out[f"{direction}_inter"] = int(arr[i][self._inter].sum())
        return out

    def by(self, field: str) -> Dict[str, Dict[str, int]]:
        """totals() grouped by "sharding_type", "table" or "kind"."""
        groups: Dict[str, List[CommKey]] = {}
        for key in self.keys():
            groups.setdefault(getattr(key, field), []).append(key)
        return {name: self.totals(keys) for name, keys in groups.items()}

    def render(self) -> str:
        """A table of this rank's bytes per sharding type, table and kind."""
        head = (
            f"{'sharding type':<26} {'table':<14} {'kind':<10} {'sent':>13} {'received':>13} "
            f"{'inter sent':>13} {'inter recv':>13}"
        )
        lines = [f"communication bytes of rank {self.rank}", head, "-" * len(head)]
        rows = [(f"{k.sharding_type:<26} {k.table:<14} {k.kind:<10}", self.totals([k])) for k in self.keys()]
        rows.append((f"{'total':<52}", self.totals()))
        for label, t in rows:
            lines.append(
                f"{label} {t['sent']:>13,} {t['received']:>13,} {t['sent_inter']:>13,} {t['received_inter']:>13,}"
            )
        return "\n".join(lines)


class CountsComm:
    """Mixin of our dists that record their own collectives: `comm_stats` is set by
    enable_comm_stats (None: off); `comm_sharding_type` names the sharding type."""

    comm_stats: Optional[CommStats] = None
    comm_sharding_type: str = ""


class CountedModule:
    """A sharded module that counts its bytes (our sharded EBC and EC, sharded_module.py): a CommStats for the
    module's process group, and counting its dists into one (each class's `_count_dists` says how)."""

    comm_stats: Optional[CommStats]
    _count_dists: Callable[[Any], None]

    def new_comm_stats(self) -> CommStats:
        pg = module_env(self).process_group
        world = dist.get_world_size(pg)
        return CommStats(dist.get_rank(pg), world, get_local_size(world))

    def count_comm(self, stats: CommStats) -> None:
        """Counts this module's collectives into `stats` (see enable_comm_stats)."""
        if self.comm_stats is not None:
            if self.comm_stats is not stats:
                raise ValueError("this module already counts into another CommStats")
            return
        self.comm_stats = stats
        self._count_dists(module_output_dists(self))
        self._count_dists(module_input_dists(self))  # empty until the first batch builds them (_create_input_dist)


def per_peer_bytes(world_size: int, peers: Sequence[int], nbytes: Sequence[float]) -> np.ndarray:
    """Scatter bytes exchanged with `peers` (global ranks, in a subgroup's order) into a world array."""
    out = np.zeros(world_size)
    np.add.at(out, np.asarray(peers, dtype=np.int64), np.asarray(nbytes, dtype=np.float64))
    return out


def group_ranks(pg: Any) -> List[int]:
    """The global rank of each member of a process group, in group order."""
    return [dist.get_global_rank(pg, i) for i in range(dist.get_world_size(pg))]


class SplitsExchangeCounter:
    """Counts a module's split exchanges (input_exchange.SplitsExchange) as "metadata", from the tensors it hands
    to all_to_all_single: each member gets, and sends back, an equal share of their first dimension (read off
    their shapes: no host sync)."""

    def __init__(self, stats: CommStats, pg: Any) -> None:
        self._stats, self._peers = stats, group_ranks(pg)

    def __call__(self, sent: torch.Tensor, received: torch.Tensor) -> None:
        n = len(self._peers)
        sent_bytes, received_bytes = ([t.numel() // n * t.element_size()] * n for t in (sent, received))
        world = self._stats.world_size
        self._stats.record(
            INPUT_EXCHANGE,
            ALL_TABLES,
            "metadata",
            per_peer_bytes(world, self._peers, sent_bytes),
            per_peer_bytes(world, self._peers, received_bytes),
        )


def enable_comm_stats(model: torch.nn.Module) -> CommStats:
    """Count every embedding collective of the sharded EBCs and ECs in `model` from now on; returns
    this rank's counters (one object shared by all of the model's sharded collections; calling it
    again returns the same object). Of an EC, only its embark sharding types are counted (see
    EmbarkShardedEmbeddingCollection)."""
    modules = [m for m in model.modules() if isinstance(m, CountedModule)]
    if not modules:
        raise ValueError(
            "the model has no EmbarkShardedEmbeddingBagCollection or EmbarkShardedEmbeddingCollection: shard it "
            "with EmbarkEmbeddingBagCollectionSharder or EmbarkEmbeddingCollectionSharder"
        )
    stats = next((m.comm_stats for m in modules if m.comm_stats is not None), None) or modules[0].new_comm_stats()
    for module in modules:
        module.count_comm(stats)
    return stats


def wire_bytes(codec: Any, elems: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Bytes on the wire for `elems` elements in `rows` row vectors (of one width per entry), after an
    optional codec: ours name their precision (plan/wire.py prices it); any other of TorchRec's protocol
    (fbgemm's, a user's) is asked its size of each entry's rows, in its quantized dtype."""
    if codec is None:
        return rows_bytes(elems, rows, "fp32")
    precision = getattr(codec, "wire_precision", None)
    if precision is not None:
        return rows_bytes(elems, rows, precision)
    element = float(torch.empty(0, dtype=codec.quantized_dtype).element_size())
    sizes = [encoded_size(codec, [(int(e), int(e) // int(r))]) if e else 0 for e, r in zip(elems, rows)]
    return np.asarray(sizes, dtype=np.float64) * element


class Ledger:
    """Per table, the elements and rows one embedding all-to-all exchanges with each member of its
    group; recorded as "embeddings" when forward sends them and as "gradients" (the same messages
    reversed) when backward does, from the payload handed to the collective: record() checks that
    the tables' bytes add up, member by member, to what is sent and received, and refuses to
    count otherwise."""

    def __init__(self, stats: CommStats, sharding_type: str, peers: Sequence[int]) -> None:
        self._stats, self._sharding_type, self._peers = stats, sharding_type, list(peers)
        self._blocks: Dict[str, np.ndarray] = {}  # [4, members]: sent elems, sent rows, received elems, received rows

    def add(self, table: str, member: int, received: bool, elems: float, rows: float) -> None:
        block = self._blocks.get(table)
        if block is None:
            block = self._blocks[table] = np.zeros((4, len(self._peers)))
        block[2 * received, member] += elems
        block[2 * received + 1, member] += rows

    def add_many(
        self,
        tables: Sequence[str],
        table: np.ndarray,
        member: np.ndarray,
        received: bool,
        elems: np.ndarray,
        rows: np.ndarray,
    ) -> None:
        """add() for many (table index into `tables`, member) pairs at once."""
        for t in np.unique(table).tolist():
            pick = table == t
            block = self._blocks.get(tables[t])
            if block is None:
                block = self._blocks[tables[t]] = np.zeros((4, len(self._peers)))
            np.add.at(block[2 * received], member[pick], elems[pick])
            np.add.at(block[2 * received + 1], member[pick], rows[pick])

    def add_columns(self, widths: Dict[str, Sequence[int]], member: int, received: bool, samples: float) -> None:
        """`samples` rows of output, in which each table has one vector of each of its `widths`."""
        for table, vectors in widths.items():
            self.add(table, member, received, samples * sum(vectors), samples * len(vectors))

    def record(
        self,
        codec: Any,
        backward: bool,
        element_bytes: int,
        send_sizes: Optional[Sequence[int]],
        recv_sizes: Optional[Sequence[int]] = None,
    ) -> None:
        """Counts one direction of the exchange, checked against the payload handed to the
        all-to-all where the caller sees it: its elements per member sent and received, of
        `element_bytes` each on the wire."""
        world = self._stats.world_size
        per_table = []
        for table, b in self._blocks.items():
            sent, received = wire_bytes(codec, b[0], b[1]), wire_bytes(codec, b[2], b[3])
            per_table.append((table, *((received, sent) if backward else (sent, received))))
        for side, name, sizes in ((1, "sent", send_sizes), (2, "received", recv_sizes)):
            if sizes is None:
                continue
            measured = np.asarray(sizes, dtype=np.float64) * element_bytes
            tables = sum((entry[side] for entry in per_table), np.zeros(len(self._peers)))
            if not np.array_equal(tables, measured):
                raise RuntimeError(
                    f"{self._sharding_type}: the {'gradients' if backward else 'embeddings'} {name} per member, "
                    f"{measured.tolist()} bytes, are not the tables' {tables.tolist()}: byte counting is out of "
                    "step with what the all-to-all carries"
                )
        for table, sent, received in per_table:
            self._stats.record(
                self._sharding_type,
                table,
                "gradients" if backward else "embeddings",
                per_peer_bytes(world, self._peers, sent),
                per_peer_bytes(world, self._peers, received),
            )
