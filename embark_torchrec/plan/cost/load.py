"""RankLoad: what a plan costs each rank, summed over its tables, before the cost model turns it into time.

It is the one thing the cluster kinds (plan/layout/kinds.py) and the cost model both write, so it sits below both.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Iterable, Mapping

import numpy as np

# send_/recv_paired: the part of send_/recv_inter that goes to the ranks of the same local rank only (stage 2);
# send_/recv_inter_ids and _grads: the part of send_/recv_inter the input dists send (IDs, forward) and the part the
# backward sends (gradients back to the tables' holders); the rest is the forward's vectors and partial sums
_ROWS = (
    "lookup_bytes",
    "send_intra",
    "recv_intra",
    "send_inter",
    "recv_inter",
    "memory",
    "host_ms",
    "lookup_ids",
    "send_paired",
    "recv_paired",
    "send_inter_ids",
    "recv_inter_ids",
    "send_inter_grads",
    "recv_inter_grads",
)


def _row_accessors(i: int) -> tuple:
    """Getter and setter of row i, a view; `load.memory += x` writes through it."""

    def get(self: "RankLoad") -> np.ndarray:
        return self.rows[i]

    def set_(self: "RankLoad", value: np.ndarray) -> None:
        self.rows[i] = value

    return get, set_


class RankLoad:
    """Per-rank quantities, summed over tables, as the rows of one [14, W] array (so that adding a
    table is one array operation): lookup bytes, bytes sent / received intra and inter node,
    memory bytes, host work ms (UB's own per ID, DP tables' updates), IDs looked up, the inter-node
    bytes sent / received between ranks of the same local rank only, and the inter-node bytes of the input dists'
    IDs and of the backward's gradients (all three already in the inter rows: the step's phases, which the network
    cannot overlap, are priced apart, CostModel.rank_times); plus the DP
    all-reduce bytes per rank, intra and inter node, and the tables per sharding group (a group costs
    its collectives while it has any table), keyed by layout/groups.py's ShardingGroup, which this file, below the
    layouts, does not import."""

    def __init__(
        self,
        rows: np.ndarray,
        dp_intra: float = 0.0,
        dp_inter: float = 0.0,
        groups: Mapping[Hashable, int] | None = None,
    ) -> None:
        self.rows = rows
        self.dp_intra = dp_intra
        self.dp_inter = dp_inter
        self.groups: dict[Hashable, int] = dict(groups or {})

    @classmethod
    def zeros(cls, world_size: int) -> "RankLoad":
        return cls(np.zeros((len(_ROWS), world_size)))

    @classmethod
    def total(cls, loads: "Iterable[RankLoad]", world_size: int) -> "RankLoad":
        """The sum, added one load at a time in the given order (the order the search adds tables
        in, so that its running totals equal this to the last bit), without holding them all."""
        total = cls.zeros(world_size)
        for load in loads:
            total.add(load)
        return total

    lookup_bytes = property(*_row_accessors(0))
    send_intra = property(*_row_accessors(1))
    recv_intra = property(*_row_accessors(2))
    send_inter = property(*_row_accessors(3))
    recv_inter = property(*_row_accessors(4))
    memory = property(*_row_accessors(5))
    host_ms = property(*_row_accessors(6))
    lookup_ids = property(*_row_accessors(7))
    send_paired = property(*_row_accessors(8))
    recv_paired = property(*_row_accessors(9))
    send_inter_ids = property(*_row_accessors(10))
    recv_inter_ids = property(*_row_accessors(11))
    send_inter_grads = property(*_row_accessors(12))
    recv_inter_grads = property(*_row_accessors(13))

    def add(self, other: "RankLoad", sign: float = 1.0) -> None:
        self.rows += other.rows if sign == 1.0 else sign * other.rows
        self.dp_intra += sign * other.dp_intra
        self.dp_inter += sign * other.dp_inter
        for group, n in other.groups.items():
            self.groups[group] = self.groups.get(group, 0) + int(sign) * n

    def copy(self) -> "RankLoad":
        return RankLoad(self.rows.copy(), self.dp_intra, self.dp_inter, self.groups)
