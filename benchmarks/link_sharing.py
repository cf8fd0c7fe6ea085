"""How the emulated cluster's shaped link is shared: raw TCP flows against gloo's pairs, one way and both ways.

    sudo PYTHONPATH=. .venv/bin/python benchmarks/link_sharing.py [--link-mbit 50] [--repeats 5] [--out FILE]

The cost model prices a rank's inter-node bytes at its share of the link (inter_node_bw_gbps, which calibrate
measures with every rank sending to every rank of the other nodes). Where a plan's traffic does not look like that
(one rank of a node carrying most of it; TWRW's cross-node stage, whose all-to-all pairs each rank with one rank of
the other node), what a rank gets depends on how TCP and gloo share the link. This measures it on 2 emulated nodes x
2 ranks (embark_torchrec.cluster): raw TCP flows between the nodes (one way, both ways on separate connections),
then gloo all-to-alls of `--mbytes` per peer in the patterns training makes, each `--repeats` times: Mbit/s per
direction of the busiest rank (its bytes one way / the all-to-all's time, the slowest rank's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from embark_torchrec import cluster  # noqa: E402

SECONDS_PER_FLOW = 5.0
PORT = 29650
RESULT = "LINK "

SINK = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(1)
c, _ = s.accept()
while c.recv(1 << 20): pass
"""
SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf, sent, start = b"x" * (1 << 20), 0, time.time()
while time.time() - start < float(sys.argv[3]): sent += c.send(buf)
print(sent * 8 / (time.time() - start) / 1e6)
"""


def tcp_flows(c: cluster.EmulatedCluster, flows: list[tuple[int, int]]) -> list[float]:
    """Mbit/s of raw TCP flows (source node, destination node) running at once, one connection each."""
    sinks = [
        subprocess.Popen(["ip", "netns", "exec", c.namespace(dst), sys.executable, "-c", SINK, str(PORT + i)])
        for i, (_, dst) in enumerate(flows)
    ]
    time.sleep(0.5)
    sources = [
        subprocess.Popen(
            ["ip", "netns", "exec", c.namespace(src), sys.executable, "-c", SOURCE]
            + [c.address(dst), str(PORT + i), str(SECONDS_PER_FLOW)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i, (src, dst) in enumerate(flows)
    ]
    rates = [float(p.communicate()[0]) for p in sources]
    for p in sinks:
        p.wait()
    return rates


def worker(mbytes: float, repeats: int) -> None:
    """One rank of the gloo patterns; rank 0 prints `LINK {json}`: per pattern, the Mbit/s of each repeat."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world, local = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    floats = int(mbytes * 1e6 / 4)
    node = [k // local for k in range(world)]
    remote = [[node[j] != node[k] for k in range(world)] for j in range(world)]
    first_remote = local  # the next node's first rank
    patterns: dict[str, list[list[bool]]] = {  # per pattern, who sends to whom: [sender][receiver]
        "one gloo pair, one way (rank 0 to the next node's first rank)": [
            [j == 0 and k == first_remote for k in range(world)] for j in range(world)
        ],
        "one gloo pair, both ways": [[{j, k} == {0, first_remote} for k in range(world)] for j in range(world)],
        "rank 0 with every rank of the other node, both ways (its node's other ranks idle)": [
            [remote[j][k] and 0 in (j, k) for k in range(world)] for j in range(world)
        ],
        "every rank with the other node's rank of its local rank, both ways (TWRW's cross-node stage)": [
            [remote[j][k] and j % local == k % local for k in range(world)] for j in range(world)
        ],
        "every rank with every rank of the other node, both ways (calibrate's inter_node_bw_gbps)": remote,
    }
    out: dict[str, list[float]] = {}
    for name, sends in patterns.items():
        to = [floats if sends[rank][k] else 0 for k in range(world)]
        back = [floats if sends[k][rank] else 0 for k in range(world)]
        send, receive = torch.randn(sum(to)), torch.empty(sum(back))
        busiest = max(sum(row) for row in sends) * floats * 4
        rates = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_to_all_single(receive, send, back, to)
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            rates.append(busiest * 8 / float(took) / 1e6)
        out[name] = rates
    if rank == 0:
        print(RESULT + json.dumps(out), flush=True)
    dist.destroy_process_group()


def table(link_mbit: float, tcp: dict[str, list[float]], gloo: dict[str, list[float]], repeats: int) -> str:
    lines = [
        f"# Sharing a {link_mbit:g} Mbit/s emulated link: raw TCP against gloo's pairs",
        "",
        f"2 nodes x 2 ranks (`embark_torchrec.cluster`), each node's link shaped to {link_mbit:g} Mbit/s per "
        f"direction. Raw TCP: {SECONDS_PER_FLOW:g} s per flow; gloo: {repeats} all-to-alls per pattern, the busiest "
        "rank's bytes one way / the slowest rank's time (median, and every repeat). `benchmarks/link_sharing.py`.",
        "",
        "| traffic | Mbit/s per direction (median) | each |",
        "|---|---:|---|",
    ]
    for name, rates in [*tcp.items(), *gloo.items()]:
        each = ", ".join(f"{r:.1f}" for r in rates)
        lines.append(f"| {name} | {statistics.median(rates):.1f} | {each} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link-mbit", type=float, default=50.0)
    p.add_argument("--mbytes", type=float, default=4.0, help="per peer and all-to-all")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, help="also write the markdown table here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.mbytes, args.repeats)
        return 0
    spec = cluster.ClusterSpec(nodes=2, gpus_per_node=2, link_mbit=args.link_mbit)
    with cluster.EmulatedCluster(spec) as c, tempfile.TemporaryDirectory() as tmp:
        tcp = {
            "raw TCP, one flow one way": tcp_flows(c, [(0, 1)]),
            "raw TCP, one flow each way at once (two connections)": tcp_flows(c, [(0, 1), (1, 0)]),
        }
        log = Path(tmp) / "node0.out"
        with open(log, "wb") as out:
            script = [__file__, "--worker", "--mbytes", str(args.mbytes), "--repeats", str(args.repeats)]
            code = c.run(script, timeout_s=600, log_dir=Path(tmp), stdout=out.fileno())
        lines = [line for line in log.read_text().splitlines() if line.startswith(RESULT)]
        if code != 0 or len(lines) != 1:
            print(log.read_text()[-3000:], file=sys.stderr)
            return code or 1
        gloo = json.loads(lines[0][len(RESULT) :])
    text = table(args.link_mbit, tcp, gloo, args.repeats)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
