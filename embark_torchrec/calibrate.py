"""python -m embark_torchrec.calibrate: measure the cost model's figures on your own cluster, write a hardware file.

    torchrun --nnodes N --nproc_per_node L ... -m embark_torchrec.calibrate [--out hardware.json] [--quick]
    torchrun --standalone --nproc_per_node 4 -m embark_torchrec.calibrate --local-world-size 2   # 2 simulated nodes

Every rank joins (NCCL on GPUs, gloo on CPUs); rank 0 writes the file, which plans wherever a preset name is
accepted (EmbarkPlanner(hardware="hardware.json"), python -m embark_torchrec.plan --hardware hardware.json,
examples/dlrm/train.py --hardware hardware.json). What it measures, each `repeats` times (median, quartiles,
min and max go into the file):

- alltoall_latency_us (not a field): a tiny all_to_all_single (16 floats per peer) over every rank, a few back to
  back per sample, slowest rank;
- intra/inter_node_bw_gbps: all-to-all inside each node (every node at once), and over all ranks with messages
  to the ranks of other nodes only (a node's ranks share its links, as in training's all-to-alls): bytes each
  rank sends to its peers / (time of a large all-to-all - time of a tiny one to the same peers);
- inter_node_paired_ratio: the same over each cross-node group (the ranks of one local rank, every group at once:
  how the hierarchical stage 2 and TorchRec's table-row-wise cross nodes, each rank paired with one rank per other
  node; measurement inter_node_paired_bw_gbps), over inter_node_bw_gbps: the two take turns sample by sample, and
  the figure is the median of each paired sample over the all-ranks sample just before it (so that both see the
  same minutes of the links: measured one after the other, a link's slow minutes could fall on one pattern only);
- inter_node_solo_ratio: where a node has several ranks, rank 0 alone exchanging with every rank of the other
  nodes (its node-mates idle), over inter_node_bw_gbps, sample by sample as the paired ratio: how much of its node's
  link a rank gets once its node-mates are done (1 where every rank has its own NIC; up to the node's ranks);
- inter_node_one_way_ratio: the first node's ranks sending to every rank of the other nodes, nothing coming back,
  over inter_node_bw_gbps (measured both ways), sample by sample as the paired ratio: how much faster a rank's bytes
  go where its traffic runs one way (gloo's pairs are half duplex; 1 to 2);
- allreduce_bus_gbps: nccl-tests' bus bandwidth of an all_reduce over every rank, at which the cost model prices
  DDP's all-reduces (the ring's 2 (n-1)/n bytes per rank over it, whatever algorithm the backend runs);
- lookup_ns_per_id, update_ns_per_row and hbm_bw_gbps (and tbe_step_ms, not a field: the widest step's time, which
  benchmarks/gpu_check.py sets against what the presets predict): fbgemm's SplitTableBatchedEmbeddingBagsCodegen forward
  + backward with the fused optimizer, at two poolings and two widths, and at the larger pooling over a table of
  REPEAT_ROWS rows: time = fixed + IDs x (per ID + width x per element) + distinct rows x per row (the backward
  and the optimizer work per distinct row), so the few-row table gives a distinct row's cost, two poolings one
  more ID's, two widths one more element's; hbm_bw_gbps prices an element as
  the cost model does (4 bytes x (1 + backward multiplier));
- dp_ns_per_element: a data-parallel table's step, TorchRec's dense TBE (DenseTableBatchedEmbeddingBagsCodegen)
  forward + backward, which makes a gradient of every row, and the dense optimizer (Adagrad; SGD for exact_sgd)
  over the whole table, at two table sizes: the time's difference per element;
- dedup_ns_per_id (not a field): torch.unique over the IDs of many features, as the unique-based input dist
  runs it;
- unique_ns_per_id: a unique-based table's own host work per ID (de-duplication, routing, expansion), as the
  cost model prices it: one-hot tables trained table-wise and unique-based in interleaved rounds on IDs that
  never repeat (so UB saves no bytes), the step time's difference per ID; at least the de-duplication alone;
- collective_us: what a sharding group costs a real training step per collective it issues: the table-wise step
  of those rounds less the cost model's lookups and bytes for it (priced with the figures above), divided by the
  group's collectives; at least alltoall_latency_us. It holds the host work TorchRec's dists do around each
  collective (KJT splits and permutes, output copies, autograd), which a bare all-to-all does not;
- dense_ms_per_ksample and dense_params_mb, only when the caller hands calibrate() its model's dense part
  (a DenseStep; the DLRM example's --calibrate does): forward, backward and optimizer step of the dense
  modules on one rank's batch, every rank at once as in training (on one CPU host they share its cores as
  they will then), the slowest rank; the dense parameters' bytes, which the step all-reduces.

On one CPU host (the ranks share its cores: host_cores) lookups and de-duplication are measured on rank 0
alone, since the cost model shares the cores among ranks itself; elsewhere every rank measures at once.
Figures that cannot be measured (memory reserve, the dense model when no DenseStep is given, a bandwidth when
there is one node or one rank per node, GPU memory on CPUs) come from the base preset and are marked "preset" in
the file's "sources".
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .plan.layout.kinds import REDUCTION_KIND, UNIQUE_KIND
from .plan.model.constants import BACKWARD_COMPUTE_MULTIPLIER, WEIGHT_BYTES
from .plan.model.hardware_file import FORMAT, VERSION, HardwareError, hardware_to_dict, resolve_hardware, save_hardware
from .plan.model.topology import Hardware
from .plan.model.ranges import MAX_ONE_WAY_RATIO

OPTIMIZERS = ("exact_rowwise_adagrad", "exact_adagrad", "exact_sgd")  # fbgemm's EmbOptimType values by name
NARROW, WIDE, FEW, MANY = 8, 128, 5, 20  # TBE widths and poolings
REPEAT_ROWS = 64  # a table whose rows a batch's IDs all repeat: its backward and optimizer touch few rows
TINY_CALLS = 5  # tiny collectives per latency sample


@dataclass(frozen=True)
class Settings:
    """Sizes and repeats of the measurements; CPU and GPU defaults below, --quick repeats less."""

    repeats: int = 40
    tiny_floats: int = 16  # per peer: a message whose time is launch and synchronisation
    large_floats: int = 1 << 20  # per peer (4 MiB): a message whose time is its bytes
    allreduce_floats: int = 1 << 20
    lookup_rows: int = 100_000
    lookup_batch: int = 2048
    dp_rows: tuple[int, int] = (50_000, 400_000)
    dp_dim: int = 16
    dedup_features: int = 26
    dedup_batch: int = 2048
    ub_tables: int = 26
    ub_rows: int = 100_000
    ub_dim: int = 16
    ub_batch: int = 512
    ub_steps: int = 10
    ub_rounds: int = 9
    quick: bool = False


CPU_SETTINGS = Settings()
GPU_SETTINGS = Settings(
    repeats=50,
    large_floats=1 << 22,
    allreduce_floats=1 << 26,
    lookup_rows=4_000_000,
    lookup_batch=32768,
    dp_rows=(1_000_000, 8_000_000),
    dp_dim=128,
    dedup_batch=65536,
    ub_rows=1_000_000,
    ub_batch=8192,
)


def quick(settings: Settings) -> Settings:
    """The same sizes with few repeats and steps: seconds, for tests and a first look (wider spreads)."""
    return replace(settings, quick=True, repeats=8, ub_steps=3, ub_rounds=3)


@dataclass(frozen=True)
class DenseStep:
    """A model's dense part, which every plan runs alike: `step()` trains it (forward, backward, optimizer) on
    `samples` samples, as one rank does per training step; `params` dense parameters are all-reduced per step."""

    step: Callable[[], object]
    samples: int
    params: int

    @property
    def params_mb(self) -> float:
        """Hardware.dense_params_mb: the MB of fp32 gradients the step all-reduces."""
        return self.params * 4 / 1e6


class CalibrationError(RuntimeError):
    """A measurement that gives no usable figure (e.g. a large message no slower than a tiny one)."""


# ---------------------------------------------------------------- the job


@dataclass(frozen=True)
class Job:
    rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    hosts: tuple[str, ...]

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def shared_host_cores(self) -> int:
        """Cores every rank shares (the cost model's host_cores): a CPU job on one host; else 0."""
        if self.device.type != "cpu" or len(set(self.hosts)) > 1:
            return 0
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _job() -> Job:
    """This process's place in the (initialised) default group; LOCAL_WORLD_SIZE as torchrun or
    simulate_nodes set it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lws = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if lws < 1 or world % lws:
        raise CalibrationError(f"LOCAL_WORLD_SIZE {lws} does not divide the world size {world}")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    return Job(rank, world, lws, device, tuple(hosts))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gather(values: list[float]) -> list[list[float]]:
    """Every rank's list, on every rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    return out


def _slowest(values: list[float]) -> list[float]:
    """Per sample, the slowest rank's time (a collective ends when its last rank does)."""
    return [max(column) for column in zip(*_gather(values))]


def stats(samples: Sequence[float], unit: str, what: str) -> dict[str, Any]:
    """Median, quartiles, min and max of samples, in the hardware file's form."""
    a = np.asarray(samples, dtype=np.float64)
    p25, median, p75 = np.percentile(a, [25, 50, 75])
    return {
        "median": float(median),
        "p25": float(p25),
        "p75": float(p75),
        "min": float(a.min()),
        "max": float(a.max()),
        "samples": int(a.size),
        "unit": unit,
        "what": what,
    }


# ---------------------------------------------------------------- collectives


def _local_rounds(steps: Sequence[Callable[[], object]], repeats: int, device: torch.device) -> list[list[float]]:
    """Per round, seconds of each of `steps` on this rank alone (no barrier: rank 0 may measure while the others
    wait), after three warm-up calls of each; the steps take turns, so that each round sees the same load."""
    for step in steps:
        for _ in range(3):
            step()
    rounds = []
    for _ in range(repeats):
        seconds = []
        for step in steps:
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            seconds.append(time.perf_counter() - start)
        rounds.append(seconds)
    return rounds


def _times(
    fns: Sequence[Callable[[], object]], repeats: int, device: torch.device, group: Any = None, calls: int = 1
) -> list[list[float]]:
    """Seconds per call of each collective in `fns`, the slowest rank's: each sample of each is `calls` calls
    back to back after a barrier of its group, divided by `calls` (several calls share out the ranks' skew
    leaving the barrier); the collectives take turns, so that each sample of each sees the same load."""
    for fn in fns:
        for _ in range(max(2, repeats // 10)):
            fn()
    _sync(device)
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, out):
            dist.barrier(group=group)
            _sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            samples.append((time.perf_counter() - start) / calls)
    return [_slowest(samples) for samples in out]


def _all_to_all(
    per_peer: int,
    device: torch.device,
    group: Any = None,
    peers: Sequence[bool] | None = None,
    senders: Sequence[bool] | None = None,
) -> Callable[[], object]:
    """An all_to_all_single of `group` sending `per_peer` floats to each rank, or, with `peers` (one flag per
    rank of the group), to the flagged ranks only (nothing to the others), receiving as much back; with `senders`
    (one flag per rank) receiving from the flagged ranks instead (one way: a rank that sends receives nothing)."""
    n = dist.get_world_size(group)
    sizes = [per_peer if peers is None or peers[k] else 0 for k in range(n)]
    received = sizes if senders is None else [per_peer if senders[k] else 0 for k in range(n)]
    send = torch.randn(sum(sizes), device=device)
    recv = torch.empty(sum(received), device=device)
    return lambda: dist.all_to_all_single(recv, send, received, sizes, group=group)


@dataclass(frozen=True)
class _Pattern:
    """A large all-to-all's traffic: over `group` (None: every rank), to every other rank of it or, with `peers`
    (one flag per rank of the group), to the flagged ones only."""

    group: Any
    peers: Sequence[bool] | None
    what: str
    senders: Sequence[bool] | None = None  # one way: the ranks this rank receives from (_all_to_all)


def _bandwidths(job: Job, s: Settings, patterns: Sequence[_Pattern]) -> list[tuple[dict[str, Any], list[float]]]:
    """Per pattern, GB/s each rank sends to its peers, every rank at once: per sample, its bytes / (the large
    all-to-all's time - the tiny one's just before it), as stats and as the samples (nan where the large one
    was no slower). The patterns take turns sample by sample after a barrier of every rank (every group runs at
    once), so that the i-th samples of two patterns see the same state of the links."""
    fns = []
    for p in patterns:
        fns += [_all_to_all(s.tiny_floats, job.device, p.group, p.peers, p.senders)]
        fns += [_all_to_all(s.large_floats, job.device, p.group, p.peers, p.senders)]
    times = _times(fns, s.repeats, job.device)
    out = []
    for p, tiny, large in zip(patterns, times[0::2], times[1::2]):
        count = dist.get_world_size(p.group) - 1 if p.peers is None else sum(p.peers)
        peer_bytes = count * s.large_floats * 4
        gbps = [peer_bytes / (y - x) / 1e9 if y > x else float("nan") for x, y in zip(tiny, large)]
        usable = [g for g in gbps if np.isfinite(g)]
        if len(usable) * 2 < len(large):
            raise CalibrationError(
                f"{p.what}: an all-to-all of {s.large_floats * 4} bytes per peer was mostly no slower than one of "
                f"{s.tiny_floats * 4}: the machine is too noisy for these sizes"
            )
        what = f"{p.what}: {peer_bytes} bytes sent per rank, less a tiny all-to-all's time"
        out.append((stats(usable, "GB/s", what), gbps))
    return out


def _intra_node_group(job: Job) -> Any:
    """This rank's intra-node group (its node's ranks); None where it would have one rank. Every rank creates
    every node's group."""
    lws = job.local_world_size
    if lws == 1:
        return None
    group, _ = dist.new_subgroups_by_enumeration([list(range(n * lws, (n + 1) * lws)) for n in range(job.num_nodes)])
    return group


def _cross_node_group(job: Job) -> Any:
    """This rank's cross-node group (the ranks of its local rank on every node, as torchrec's
    intra_and_cross_node_pg makes them); None (every rank) with one rank per node. Every rank creates every
    local rank's group."""
    lws = job.local_world_size
    if lws == 1:
        return None
    group, _ = dist.new_subgroups_by_enumeration([list(range(j, job.world_size, lws)) for j in range(lws)])
    return group


def measure_collectives(job: Job, s: Settings) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    (tiny,) = _times([_all_to_all(s.tiny_floats, job.device)], s.repeats, job.device, calls=TINY_CALLS)
    out["alltoall_latency_us"] = stats(
        [t * 1e6 for t in tiny],
        "us",
        f"all_to_all_single of {s.tiny_floats} floats per peer over all {job.world_size} ranks, {TINY_CALLS} calls "
        "back to back per sample, slowest rank (not a Hardware field: collective_us is at least this)",
    )
    intra = _intra_node_group(job)
    if intra is not None:
        ((out["intra_node_bw_gbps"], _),) = _bandwidths(
            job, s, [_Pattern(intra, None, f"all-to-all inside each node of {job.local_world_size} ranks")]
        )
    if job.num_nodes > 1:
        node = job.rank // job.local_world_size
        remote = [k // job.local_world_size != node for k in range(job.world_size)]
        everyone = _Pattern(
            None,
            remote,
            f"all-to-all of all {job.world_size} ranks, each sending to every rank of the other nodes only "
            f"(as training's all-to-alls cross nodes: a node's {job.local_world_size} ranks share its links)",
        )
        paired = _Pattern(
            _cross_node_group(job),
            None,
            f"all-to-all inside each cross-node group of {job.num_nodes} ranks (one local rank's), every group at "
            "once (as the hierarchical stage 2 and TorchRec's table-row-wise cross nodes), its samples taking "
            "turns with inter_node_bw_gbps's",
        )
        patterns = [everyone, paired]
        if job.local_world_size > 1:  # does a rank alone on its node's link(s) get more than its share?
            alone = node == 0 and job.rank % job.local_world_size == 0
            patterns.append(
                _Pattern(
                    None,
                    [remote[k] if alone else k == 0 and node != 0 for k in range(job.world_size)],
                    "all-to-all of rank 0 alone with every rank of the other nodes (its node-mates idle), its samples "
                    "taking turns with inter_node_bw_gbps's",
                )
            )
        on_first = [k // job.local_world_size == 0 for k in range(job.world_size)]
        patterns.append(  # one way: the first node's ranks send to every rank of the other nodes, which send nothing
            _Pattern(
                None,
                [remote[k] and node == 0 for k in range(job.world_size)],
                "all-to-all of the first node's ranks sending to every rank of the other nodes, nothing sent back, "
                "its samples taking turns with inter_node_bw_gbps's",
                senders=[on_first[k] and node != 0 for k in range(job.world_size)],
            )
        )
        measured = _bandwidths(job, s, patterns)
        (out["inter_node_bw_gbps"], all_gbps), (out["inter_node_paired_bw_gbps"], paired_gbps) = measured[:2]
        ratios = [("inter_node_paired_ratio", paired_gbps, "inter_node_paired_bw_gbps")]
        if job.local_world_size > 1:
            ratios.append(("inter_node_solo_ratio", measured[2][1], "rank 0's alone"))
        ratios.append(("inter_node_one_way_ratio", measured[-1][1], "rank 0's one way"))
        for name, gbps, what in ratios:
            out[name] = stats(
                [y / x for x, y in zip(all_gbps, gbps) if np.isfinite(x) and np.isfinite(y)],
                "ratio",
                f"{what} sample / inter_node_bw_gbps's taken just before it (the patterns see the same minutes of "
                "the links)",
            )
    if job.world_size > 1:
        grad = torch.randn(s.allreduce_floats, device=job.device)
        (times,) = _times([lambda: dist.all_reduce(grad)], s.repeats, job.device)
        ring = 2.0 * (job.world_size - 1) / job.world_size * s.allreduce_floats * 4
        out["allreduce_bus_gbps"] = stats(
            [ring / t / 1e9 for t in times],
            "GB/s",
            f"all_reduce of {s.allreduce_floats * 4} bytes over all ranks, nccl-tests' bus bandwidth",
        )
    return out


# ---------------------------------------------------------------- lookups and de-duplication


def _alone_or_all(job: Job, measure: Callable[[], list[float]]) -> list[float]:
    """On one shared CPU host rank 0 measures alone while the others wait (the cost model shares the
    host's cores among ranks itself); elsewhere every rank measures and the samples are pooled."""
    if job.shared_host_cores:
        samples = measure() if job.rank == 0 else []
        dist.barrier()
        shared: list[Any] = [samples]
        dist.broadcast_object_list(shared, src=0)
        return shared[0]
    return [x for rank_samples in _gather(measure()) for x in rank_samples]


def _optimizer(name: str) -> Any:
    """fbgemm's EmbOptimType member of one of OPTIMIZERS."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return getattr(EmbOptimType, name.upper())


def _lookup_rounds(
    s: Settings, device: torch.device, optimizer: str
) -> tuple[list[tuple[float, float, float, float]], tuple[int, int, int]]:
    """Per round, seconds of TBE forward+backward at (NARROW, FEW), (NARROW, MANY), (WIDE, MANY) on lookup_rows
    rows, and at (NARROW, MANY) on REPEAT_ROWS rows (the same IDs' count over few distinct rows); and the
    distinct IDs of the (NARROW, FEW), (NARROW, MANY) and repeating batches."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    on_gpu = device.type == "cuda"
    location = EmbeddingLocation.DEVICE if on_gpu else EmbeddingLocation.HOST
    compute = ComputeDevice.CUDA if on_gpu else ComputeDevice.CPU
    generator = torch.Generator().manual_seed(dist.get_rank())
    steps, distinct = [], []
    for dim, pooling, rows in (
        (NARROW, FEW, s.lookup_rows),
        (NARROW, MANY, s.lookup_rows),
        (WIDE, MANY, s.lookup_rows),
        (NARROW, MANY, REPEAT_ROWS),
    ):
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(rows, dim, location, compute)],
            optimizer=_optimizer(optimizer),
            learning_rate=0.01,
            device=device,
        )
        n = s.lookup_batch * pooling
        ids = torch.randint(0, rows, (n,), generator=generator)
        distinct.append(len(torch.unique(ids)))
        ids, offsets = ids.to(device), torch.arange(0, n + 1, pooling).to(device)
        steps.append(lambda tbe=tbe, ids=ids, offsets=offsets: tbe(ids, offsets).sum().backward())
    rounds = [(few, narrow, wide, repeat) for few, narrow, wide, repeat in _local_rounds(steps, s.repeats, device)]
    return rounds, (distinct[0], distinct[1], distinct[3])


def measure_lookups(job: Job, s: Settings, optimizer: str) -> dict[str, dict[str, Any]]:
    """lookup_ns_per_id, update_ns_per_row and hbm_bw_gbps, from each round's four TBE timings."""

    def measure() -> list[float]:
        flat = []
        rounds, (d_few, d_many, d_repeating) = _lookup_rounds(s, job.device, optimizer)
        for few, narrow, wide, repeating in rounds:
            # time = fixed + IDs x (per ID + width x per element) + distinct rows x per row
            per_element = (wide - narrow) / (s.lookup_batch * MANY * (WIDE - NARROW))
            per_row = (narrow - repeating) / (d_many - d_repeating)
            per_more = (narrow - few) / (s.lookup_batch * (MANY - FEW))  # one more (mostly distinct) ID's cost
            per_id = per_more - (d_many - d_few) * per_row / (s.lookup_batch * (MANY - FEW))
            flat += [per_id - NARROW * per_element, per_element, per_row, per_more, wide]
        return flat

    flat = _alone_or_all(job, measure)
    per_id, per_element, per_row, per_more, wide_step = flat[0::5], flat[1::5], flat[2::5], flat[3::5], flat[4::5]
    if sum(x > 0 for x in per_element) * 2 < len(per_element):
        raise CalibrationError(
            f"TBE lookups of width {WIDE} were mostly no slower than of width {NARROW}: the machine is too noisy"
        )
    stalled = sum(x <= 0 for x in per_more)
    if job.device.type == "cpu" and stalled * 4 > len(per_more):
        # a CPU lookup of a new row costs hundreds of ns: a quarter of the rounds at or below zero means other work
        # on the host drowned the difference between the poolings (on GPUs a cost near zero is real)
        raise CalibrationError(
            f"TBE lookups at pooling {MANY} were in {stalled} of {len(per_more)} rounds no slower "
            f"per ID than at pooling {FEW}: the host is too busy to measure lookup_ns_per_id; rerun when it is idle"
        )
    element_bytes = WEIGHT_BYTES * (1.0 + BACKWARD_COMPUTE_MULTIPLIER)
    where = "rank 0 alone" if job.shared_host_cores else "every rank at once"
    what = (
        f"fbgemm TBE forward+backward, {optimizer}, {s.lookup_rows} rows, {s.lookup_batch} bags at poolings "
        f"{FEW}/{MANY} and widths {NARROW}/{WIDE}, {where}"
    )
    return {
        "lookup_ns_per_id": stats([x * 1e9 for x in per_id], "ns", what),
        "update_ns_per_row": stats(
            [x * 1e9 for x in per_row], "ns", f"{what}; less the same IDs' count over {REPEAT_ROWS} rows, per row"
        ),
        "hbm_bw_gbps": stats([element_bytes / x / 1e9 for x in per_element if x > 0], "GB/s", what),
        "tbe_step_ms": stats(
            [x * 1e3 for x in wide_step],
            "ms",
            f"{what}; the step at width {WIDE}, pooling {MANY} (tbe_step_estimate_ms)",
        ),
    }


def tbe_step_estimate_ms(hardware: Hardware, s: Settings) -> float:
    """The cost model's lookups of the TBE step tbe_step_ms times (a table of lookup_rows rows of width WIDE, whole
    on the one rank of world size 1, lookup_batch bags of MANY IDs), on `hardware`: what a preset's lookup figures
    predict for a step that was measured."""
    from .plan.cost.model import CostModel
    from .plan.layout.tables import Plan, TableLayout
    from .plan.model.spec import ModelSpec, TableSpec
    from .plan.model.topology import Topology

    table = TableSpec("tbe", rows=s.lookup_rows, dim=WIDE, pooling=float(MANY))
    model = CostModel(ModelSpec("tbe-step", s.lookup_batch, (table,)), Topology(1, 1, hardware))
    plan = Plan(1, 1, {"tbe": TableLayout(REDUCTION_KIND.name, (0, s.lookup_rows), (0, WIDE), ((0,),))})
    return model.step_cost(model.rank_load(plan)).lookup_ms


def _dp_step_times(s: Settings, device: torch.device, optimizer: str) -> list[float]:
    """Per round, seconds per element of a data-parallel table's step beyond the same step of a smaller table:
    dense TBE forward + backward (a gradient of every row) and the dense optimizer over the whole table."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen

    generator = torch.Generator().manual_seed(dist.get_rank())
    steps = []
    for rows in s.dp_rows:
        tbe = DenseTableBatchedEmbeddingBagsCodegen([(rows, s.dp_dim)], use_cpu=device.type == "cpu").to(device)
        params = list(tbe.parameters())
        dense = torch.optim.SGD(params, lr=0.01) if optimizer == "exact_sgd" else torch.optim.Adagrad(params, lr=0.01)
        n = s.lookup_batch * FEW
        ids = torch.randint(0, rows, (n,), generator=generator).to(device)
        offsets = torch.arange(0, n + 1, FEW).to(device)

        def step(tbe: Any = tbe, dense: Any = dense, ids: torch.Tensor = ids, offsets: torch.Tensor = offsets) -> None:
            tbe(ids, offsets).sum().backward()
            dense.step()
            dense.zero_grad()

        steps.append(step)
    elements = (s.dp_rows[1] - s.dp_rows[0]) * s.dp_dim
    return [(large - small) / elements for small, large in _local_rounds(steps, s.repeats, device)]


def measure_dp_steps(job: Job, s: Settings, optimizer: str) -> dict[str, dict[str, Any]]:
    """dp_ns_per_element, on rank 0 alone on one shared host (as lookups), else on every rank at once."""
    where = "rank 0 alone" if job.shared_host_cores else "every rank at once"
    dense = "SGD" if optimizer == "exact_sgd" else "Adagrad"
    return {
        "dp_ns_per_element": stats(
            [x * 1e9 for x in _alone_or_all(job, lambda: _dp_step_times(s, job.device, optimizer))],
            "ns",
            f"dense TBE forward + backward and torch.optim.{dense} of {s.dp_rows[1]} rows x {s.dp_dim} less the "
            f"same of {s.dp_rows[0]} rows, per element, {where}",
        )
    }


def _dedup_times(s: Settings, device: torch.device) -> list[float]:
    """Seconds per ID of the unique-based input dist's de-duplication: one sorted torch.unique (with the
    inverse) over every feature's IDs offset per feature, and each feature's first key found by searchsorted."""
    from .sharding.unique import key_dtype

    generator = torch.Generator().manual_seed(dist.get_rank())
    rows = s.ub_rows
    n = s.dedup_features * s.dedup_batch
    keys_dtype = key_dtype(s.dedup_features * rows)  # as the input dist sorts them
    ids = torch.randint(0, rows, (n,), generator=generator).to(device, keys_dtype)
    key_start = torch.arange(s.dedup_features + 1, device=device, dtype=keys_dtype) * rows
    offset = key_start[:-1].repeat_interleave(s.dedup_batch)

    def dedup() -> None:
        keys, _ = torch.unique(ids + offset, sorted=True, return_inverse=True)
        torch.searchsorted(keys, key_start, out_int32=True)

    for _ in range(3):
        dedup()
    out = []
    for _ in range(s.repeats):
        _sync(device)
        start = time.perf_counter()
        dedup()
        _sync(device)
        out.append((time.perf_counter() - start) / n)
    return out


def _reference_plan(job: Job, s: Settings, cluster: str) -> Any:
    """The reference step's plan: ub_tables one-hot tables, each whole on rank i % world size."""
    from .plan.layout.tables import Plan, TableLayout

    world, rows, dim = job.world_size, s.ub_rows, s.ub_dim
    layouts = {f"t{i}": TableLayout(cluster, (0, rows), (0, dim), ((i % world,),)) for i in range(s.ub_tables)}
    return Plan(world, job.local_world_size, layouts)


def _reference_spec(job: Job, s: Settings) -> Any:
    """The reference step's tables: ub_tables one-hot tables (table t<i> read by feature f<i>) whose IDs never
    repeat within a rank's batch, at the job's global batch."""
    from .plan.model.spec import ModelSpec, TableSpec

    tables = tuple(
        TableSpec(f"t{i}", rows=s.ub_rows, dim=s.ub_dim, pooling=1.0, feature_names=(f"f{i}",), unique_ratio=1.0)
        for i in range(s.ub_tables)
    )
    return ModelSpec("calibration-reference", job.world_size * s.ub_batch, tables)


def _reference_estimate_ms(job: Job, s: Settings, hardware: Hardware) -> tuple[float, int]:
    """The cost model's lookups + communication of the table-wise reference step on `hardware`, and the
    collectives it issues per step (its one sharding group's and its module's split exchange)."""
    from .plan.cost.model import CostModel
    from .plan.layout.groups import module_collectives_per_step
    from .plan.model.topology import Topology

    model = CostModel(_reference_spec(job, s), Topology(job.world_size, job.local_world_size, hardware))
    load = model.rank_load(_reference_plan(job, s, REDUCTION_KIND.name))
    cost = model.step_cost(load)
    return cost.lookup_ms + cost.comm_ms, module_collectives_per_step(load.groups)


def _ub_round_times(job: Job, s: Settings, optimizer: str) -> tuple[list[float], list[float]]:
    """Per round, seconds per step (slowest rank) of ub_tables one-hot tables trained table-wise, then
    unique-based, on IDs that never repeat within a rank's batch; the first round is a warm-up."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from .planner.parameter_sharding import module_sharding_plan
    from .sharding.sharder import EmbarkEmbeddingBagCollectionSharder
    from .testing.training import SparseArch

    spec = _reference_spec(job, s)
    t, rows = s.ub_tables, s.ub_rows
    tables = [
        EmbeddingBagConfig(name=c.name, num_embeddings=c.rows, embedding_dim=c.dim, feature_names=list(c.feature_names))
        for c in spec.tables
    ]
    sharder = EmbarkEmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": _optimizer(optimizer),
            "learning_rate": 0.01,
        }
    )

    def build(cluster: str) -> torch.nn.Module:
        meta = SparseArch(tables, False, torch.device("meta"))
        plan = ShardingPlan({"ebc": module_sharding_plan(_reference_plan(job, s, cluster), spec, job.device.type)})
        env = ShardingEnv.from_process_group(dist.group.WORLD)
        return DistributedModelParallel(meta, env=env, plan=plan, sharders=[sharder], device=job.device)

    rb, ub = REDUCTION_KIND.name, UNIQUE_KIND.name
    models = {cluster: build(cluster) for cluster in (rb, ub)}
    generator = torch.Generator().manual_seed(job.rank)
    batches = [
        KeyedJaggedTensor(
            keys=[c.feature_names[0] for c in spec.tables],
            values=torch.cat([torch.randperm(rows, generator=generator)[: s.ub_batch] for _ in range(t)]),
            lengths=torch.ones(t * s.ub_batch, dtype=torch.int32),
        ).to(job.device)
        for _ in range(s.ub_steps)
    ]

    def run(model: torch.nn.Module) -> None:
        for b in batches:
            out = model(b)
            out = (out.wait() if hasattr(out, "wait") else out).to_dict()
            torch.cat(list(out.values()), dim=1).sum().backward()

    times: dict[str, list[float]] = {rb: [], ub: []}
    for _ in range(s.ub_rounds + 1):
        for cluster, model in models.items():
            dist.barrier()
            _sync(job.device)
            start = time.perf_counter()
            run(model)
            _sync(job.device)
            elapsed = torch.tensor([time.perf_counter() - start], device=job.device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[cluster].append(float(elapsed) / s.ub_steps)
    return times[rb][1:], times[ub][1:]


def measure_sharded_steps(job: Job, s: Settings, optimizer: str, hardware: Hardware) -> dict[str, dict[str, Any]]:
    """From real DMP training steps of the reference tables: collective_us as a sharding group costs in a
    step (table-wise step - the cost model's lookups and bytes on `hardware`, the figures measured so far,
    per collective of the group: TorchRec's dists' host work around each collective included), and
    dedup_ns_per_id (torch.unique alone) and unique_ns_per_id (UB against table-wise, per ID, at least the
    de-duplication alone)."""
    dedup = [x * 1e9 for x in _alone_or_all(job, lambda: _dedup_times(s, job.device))]
    where = "rank 0 alone" if job.shared_host_cores else "every rank at once"
    out = {
        "dedup_ns_per_id": stats(
            dedup,
            "ns",
            f"sorted torch.unique with inverse + searchsorted over {s.dedup_features} features x "
            f"{s.dedup_batch} IDs, {where} (not a Hardware field: part of unique_ns_per_id)",
        )
    }
    table_wise, unique = _ub_round_times(job, s, optimizer)
    estimate_ms, collectives = _reference_estimate_ms(job, s, hardware)
    out["collective_us"] = stats(
        [(t * 1e3 - estimate_ms) * 1e3 / collectives for t in table_wise],
        "us",
        f"{s.ub_tables} one-hot tables x {s.ub_batch} samples per rank trained table-wise in DMP: step - the cost "
        f"model's lookups and bytes ({estimate_ms:.3g} ms), per collective it issues ({collectives}); "
        "at least alltoall_latency_us",
    )
    ids = s.ub_tables * s.ub_batch  # per rank and step
    cores = job.shared_host_cores
    # on one shared host the extra work of every rank shares its cores, as the cost model prices it
    scale = cores / (job.world_size * ids) if cores else 1.0 / ids
    extra = [(u - t) * scale * 1e9 for t, u in zip(table_wise, unique)]
    out["unique_ns_per_id"] = stats(
        extra,
        "ns",
        f"{s.ub_tables} one-hot tables x {s.ub_batch} samples per rank, IDs never repeating: unique-based step "
        f"- table-wise step, per ID{f' x {cores} cores / {job.world_size} ranks' if cores else ''}; "
        "the figure is at least dedup_ns_per_id",
    )
    return out


def measure_dense(job: Job, s: Settings, dense: DenseStep) -> dict[str, dict[str, Any]]:
    """dense_ms_per_ksample: every rank steps its dense part at once, as in training, the slowest rank."""
    (seconds,) = _times([dense.step], s.repeats, job.device)
    return {
        "dense_ms_per_ksample": stats(
            [x * 1e3 * 1000 / dense.samples for x in seconds],
            "ms",
            f"the model's dense forward + backward + optimizer on {dense.samples} samples per rank, every rank at "
            "once, slowest rank, per 1000 samples",
        )
    }


# ---------------------------------------------------------------- the hardware document


def _device_memory_gb(job: Job) -> float | None:
    """The smallest GPU memory of any rank (GB), or None on CPUs."""
    if job.device.type != "cuda":
        return None
    return min(_gather([torch.cuda.get_device_properties(job.device).total_memory / 1e9]))[0]


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__}
    for package, key in (("fbgemm-gpu", "fbgemm_gpu"), ("fbgemm-gpu-cpu", "fbgemm_gpu"), ("torchrec", "torchrec")):
        try:
            out.setdefault(key, version(package))
        except PackageNotFoundError:
            continue
    return out


def calibrate(
    settings: Settings,
    base: str | Hardware,
    optimizer: str = OPTIMIZERS[0],
    name: str | None = None,
    dense: DenseStep | None = None,
) -> dict[str, Any]:
    """Runs every measurement on the job's ranks (the default process group must be initialised;
    every rank calls this) and returns the hardware document on every rank; with `dense`, the model's
    dense figures too."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    base_hw = resolve_hardware(base)
    job = _job()
    measured = measure_collectives(job, settings)
    measured |= measure_lookups(job, settings, optimizer)
    measured |= measure_dp_steps(job, settings, optimizer)
    so_far = _hardware(base_hw, measured, job)
    measured |= measure_sharded_steps(
        job, settings, optimizer, replace(so_far, collective_us=0.0, oversubscribed_collective_us=0.0)
    )
    if dense is not None:
        measured |= measure_dense(job, settings, dense)
    memory = _device_memory_gb(job)
    document: list[Any] = [None]
    if job.rank == 0:
        document[0] = _document(job, settings, base, base_hw, measured, memory, optimizer, name, dense)
    dist.broadcast_object_list(document, src=0)
    return document[0]


def recalibrate_dense(document: dict[str, Any], settings: Settings, dense: DenseStep, file: str = "") -> dict[str, Any]:
    """A calibrated cluster's hardware document (`file`'s) for another model on the same ranks: the cluster's figures
    do not depend on the model, its dense part's do, so only those are measured again (seconds, where a calibration
    takes minutes on a slow link). Every rank calls this; the job must have the document's ranks per node and world
    size, since the dense part is timed with every rank of the job stepping at once."""
    job = _job()
    run = document.get("run", {})
    shape = (run.get("world_size"), run.get("local_world_size"))
    if shape != (job.world_size, job.local_world_size):
        raise HardwareError(
            f"{file or 'the hardware document'}: calibrated on {shape[0]} ranks, {shape[1]} per node; this job has "
            f"{job.world_size}, {job.local_world_size} per node: calibrate this cluster in full"
        )
    measured = measure_dense(job, settings, dense)
    out = {**document, "hardware": dict(document["hardware"]), "sources": dict(document.get("sources", {}))}
    out["measurements"] = {**document.get("measurements", {}), **measured}
    out["hardware"]["dense_ms_per_ksample"] = measured["dense_ms_per_ksample"]["median"]
    out["hardware"]["dense_params_mb"] = dense.params_mb
    out["sources"] |= {"dense_ms_per_ksample": "measured", "dense_params_mb": "model"}
    out["run"] = {**run, "dense_date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return out


def _hardware(
    base: Hardware,
    measured: dict[str, dict[str, Any]],
    job: Job,
    dense: DenseStep | None = None,
    memory_gb: float | None = None,
) -> Hardware:
    """`base` with every figure measured so far (medians), the machine's and the model's."""
    figures: dict[str, Any] = {f: measured[f]["median"] for f in _MEASURED_FIELDS if f in measured}
    for figure in ("lookup_ns_per_id", "update_ns_per_row", "dp_ns_per_element"):
        if figure in figures:
            figures[figure] = max(0.0, figures[figure])  # noise around a zero cost
    if "inter_node_solo_ratio" in figures:  # a rank alone gets at least its share and at most its node's link
        figures["inter_node_solo_ratio"] = min(max(figures["inter_node_solo_ratio"], 1.0), job.local_world_size)
    if "inter_node_one_way_ratio" in figures:  # one way is no slower than both ways, and a half-duplex pair doubles
        figures["inter_node_one_way_ratio"] = min(max(figures["inter_node_one_way_ratio"], 1.0), MAX_ONE_WAY_RATIO)
    if "collective_us" in figures:
        figures["collective_us"] = max(figures["collective_us"], measured["alltoall_latency_us"]["median"])
    if "unique_ns_per_id" in measured:
        figures["unique_ns_per_id"] = max(measured["unique_ns_per_id"]["median"], measured["dedup_ns_per_id"]["median"])
    figures["host_cores"] = job.shared_host_cores
    figures["shared_host_ranks"] = job.world_size if job.shared_host_cores else 0
    if dense is not None:
        figures["dense_params_mb"] = dense.params_mb
    if memory_gb is not None:
        figures["hbm_gb"] = memory_gb
        figures["hbm_reserve_gb"] = min(base.hbm_reserve_gb, memory_gb / 2)
    return replace(base, **figures)


# Hardware fields set to their measurement's median when it was taken
_MEASURED_FIELDS = (
    "collective_us",
    "intra_node_bw_gbps",
    "inter_node_bw_gbps",
    "inter_node_paired_ratio",
    "inter_node_solo_ratio",
    "inter_node_one_way_ratio",
    "allreduce_bus_gbps",
    "hbm_bw_gbps",
    "lookup_ns_per_id",
    "update_ns_per_row",
    "dp_ns_per_element",
    "dense_ms_per_ksample",
)


def _document(
    job: Job,
    settings: Settings,
    base: str | Hardware,
    base_hw: Hardware,
    measured: dict[str, dict[str, Any]],
    memory_gb: float | None,
    optimizer: str,
    name: str | None,
    dense: DenseStep | None = None,
) -> dict[str, Any]:
    sources = {field.name: "preset" for field in fields(Hardware)}
    sources |= {field: "measured" for field in (*_MEASURED_FIELDS, "unique_ns_per_id") if field in measured}
    sources["host_cores"] = sources["shared_host_ranks"] = "machine"
    if dense is not None:
        sources["dense_params_mb"] = "model"
    if memory_gb is not None:
        sources["hbm_gb"] = "machine"
    host = job.hosts[0]
    hw = _hardware(base_hw, measured, job, dense, memory_gb)
    hardware = hardware_to_dict(replace(hw, name=name or f"calibrated-{host}"))
    return {
        "format": FORMAT,
        "version": VERSION,
        "hardware": hardware,
        "base": base if isinstance(base, str) else base.name,
        "sources": sources,
        "measurements": measured,
        "run": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": host,
            "hosts": sorted(set(job.hosts)),
            "backend": dist.get_backend(),
            "device": torch.cuda.get_device_name(job.device) if job.device.type == "cuda" else "cpu",
            "world_size": job.world_size,
            "local_world_size": job.local_world_size,
            "optimizer": optimizer,
            "quick": settings.quick,
            **_versions(),
        },
    }


def summary(document: dict[str, Any]) -> str:
    """The figures, where they came from and their spread, one line each, for people."""
    run, hw, sources, measured = document["run"], document["hardware"], document["sources"], document["measurements"]
    lines = [
        f"{run['world_size']} ranks ({run['world_size'] // run['local_world_size']} nodes x "
        f"{run['local_world_size']}), {run['backend']} on {run['device']}, base preset {document['base']}:"
    ]
    for field, value in hw.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        line = f"  {field:22} {shown:>14}  {sources.get(field, '')}"
        if field in measured:
            m = measured[field]
            line += f", {m['unit']}: IQR {m['p25']:.4g}-{m['p75']:.4g}, range {m['min']:.4g}-{m['max']:.4g}"
            line += f", {m['samples']} samples"
        lines.append(line)
    for key in sorted(set(measured) - set(hw)):
        m = measured[key]
        lines.append(
            f"  {key:22} {m['median']:>14.4g}  (not a field) {m['unit']}: IQR {m['p25']:.4g}-{m['p75']:.4g}, "
            f"range {m['min']:.4g}-{m['max']:.4g}, {m['samples']} samples"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m embark_torchrec.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("hardware.json"), help="the hardware file rank 0 writes")
    p.add_argument(
        "--base",
        help="preset (or hardware file) the figures not measured come from "
        "(default: cpu-gloo on CPUs, the preset matching the GPU on CUDA)",
    )
    p.add_argument(
        "--local-world-size", type=int, help="ranks per simulated node (default: torchrun's LOCAL_WORLD_SIZE)"
    )
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=OPTIMIZERS[0], help="the TBE's fused optimizer")
    p.add_argument("--quick", action="store_true", help="few repeats and steps (seconds; wider spreads)")
    p.add_argument("--repeats", type=int, help="samples per measurement (default: 40 on CPU, 50 on GPU; 8 quick)")
    p.add_argument("--name", help="the Hardware's name (default: calibrated-<host of rank 0>)")
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 2:
        p.error("--repeats must be at least 2")
    return args


def _check_output(path: Path) -> None:
    if path.is_dir() or not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise SystemExit(f"error: --out {path}: not a writable file path")


def main(argv: Sequence[str] | None = None) -> None:
    from .planner.planner import default_hardware
    from .nodes import simulate_nodes

    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit(
            "start me with torchrun, e.g. torchrun --standalone --nproc_per_node 4 -m embark_torchrec.calibrate"
        )
    if int(os.environ["RANK"]) == 0:
        _check_output(args.out)
    on_gpu = torch.cuda.is_available()
    if on_gpu:  # the real local rank's GPU, before simulated nodes renumber the local ranks
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if args.local_world_size is not None:
        try:
            simulate_nodes(args.local_world_size)
        except ValueError as e:
            raise SystemExit(f"error: --local-world-size: {e}") from None
    base = args.base or default_hardware("cuda" if on_gpu else "cpu")
    try:
        resolve_hardware(base)
    except (HardwareError, ValueError) as e:
        raise SystemExit(f"error: --base: {e}") from None
    settings = GPU_SETTINGS if on_gpu else CPU_SETTINGS
    settings = quick(settings) if args.quick else settings
    if args.repeats is not None:
        settings = replace(settings, repeats=args.repeats)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    try:
        document = calibrate(settings, base, args.optimizer, args.name)
        if dist.get_rank() == 0:
            save_hardware(args.out, document)
            print(summary(document), flush=True)
            print(f"hardware file written to {args.out}", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch 2.13's gloo threads can abort interpreter teardown after a clean run (see the DLRM example)
