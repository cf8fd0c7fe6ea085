"""python -m embark_torchrec.testing.link_probe, run on an emulated cluster (embark_torchrec.cluster): what the
kernel counts on each node's link for collectives of known size, so that the counters can be checked against it.

Every rank runs `repeats` all-to-alls of `--alltoall-bytes` per peer, then `repeats` all-reduces of
`--allreduce-bytes`; around each phase every node's local rank 0 reads its link's kernel counters
(/sys/class/net/$EMBARK_CLUSTER_IFNAME/statistics, the node's own namespace). Rank 0 prints one line,
`PROBE {json}`: per node, the payload bytes that crossed nodes in the all-to-alls (sent + received) and the
counters' growth (sent + received) in each phase. Their ratio is TCP/IP's overhead on the wire (headers,
acknowledgements); the all-reduce's growth over it is what gloo's all-reduce really sends across nodes.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from ..cluster import IFNAME_ENV

FLOAT_BYTES = 4


def link_bytes() -> int:
    """Bytes sent + received so far on this node's link, as the kernel counts them (0 off the node's rank 0)."""
    if int(os.environ["LOCAL_RANK"]) != 0:
        return 0
    stats = Path("/sys/class/net") / os.environ[IFNAME_ENV] / "statistics"
    return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())


def counted_growth(phase: Callable[[], None]) -> int:
    """The link counters' growth over `phase`, bracketed by barriers so that no other traffic falls inside (the
    second one: no node starts sending before every node has read its counters)."""
    dist.barrier()
    before = link_bytes()
    dist.barrier()
    phase()
    dist.barrier()
    return link_bytes() - before


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alltoall-bytes", type=int, default=1 << 20, help="per peer")
    p.add_argument("--allreduce-bytes", type=int, default=1 << 22)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    send = torch.ones(world * args.alltoall_bytes // FLOAT_BYTES)
    receive = torch.empty_like(send)
    reduce = torch.ones(args.allreduce_bytes // FLOAT_BYTES)

    def alltoalls() -> None:
        for _ in range(args.repeats):
            dist.all_to_all_single(receive, send)

    def allreduces() -> None:
        for _ in range(args.repeats):
            dist.all_reduce(reduce)

    alltoalls()  # connections made before anything is counted
    allreduces()
    growth = torch.tensor([counted_growth(alltoalls), counted_growth(allreduces)], dtype=torch.int64)
    every = [torch.zeros_like(growth) for _ in range(world)]
    dist.all_gather(every, growth)
    if rank == 0:
        nodes = range(world // local)
        # each of a node's ranks sends and receives one message per rank of every other node
        payload = 2 * local * (world - local) * args.alltoall_bytes * args.repeats
        result = {
            "world_size": world,
            "local_world_size": local,
            "repeats": args.repeats,
            "allreduce_bytes": args.allreduce_bytes,
            "alltoall_payload_per_node": payload,
            "alltoall_link_bytes": [int(every[n * local][0]) for n in nodes],
            "allreduce_link_bytes": [int(every[n * local][1]) for n in nodes],
        }
        print("PROBE " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
