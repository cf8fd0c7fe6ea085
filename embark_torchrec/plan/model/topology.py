"""Cluster topology and hardware presets: the figures the cost model turns bytes into time with.

Bandwidths are in GB/s (1e9 bytes/s) per GPU and per direction. Preset figures are public ones
(see docs/cost-model.md); every one can be overridden.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Per-GPU figures of one accelerator kind and its interconnect."""

    name: str
    hbm_gb: float  # memory per GPU
    hbm_reserve_gb: float  # kept free for activations, dense model and workspace
    hbm_bw_gbps: float  # achieved bandwidth of embedding lookups (gathers, not streaming)
    intra_node_bw_gbps: float  # NVLink per GPU per direction
    inter_node_bw_gbps: float  # network per GPU per direction
    # a rank's network rate when it exchanges with its local rank's peers on other nodes only (the hierarchical
    # stage 2, TorchRec's table-row-wise cross-node all-to-all), over inter_node_bw_gbps: on gloo one pair of
    # ranks per node pair carries it, half duplex (measured by calibrate; 1 in the presets)
    inter_node_paired_ratio: float = 1.0
    # where a node's ranks share one link (the emulated cluster; not GPU nodes with a NIC per GPU): the rate a rank
    # gets while its node-mates have nothing left to send, over inter_node_bw_gbps (at most the node's ranks: the
    # whole link). 1 (the presets): every rank has its own link, and a busier rank gains nothing from idle ones
    inter_node_solo_ratio: float = 1.0
    # how much faster a rank's inter-node bytes go one way than both ways at once, over inter_node_bw_gbps (measured
    # both ways): a rank that sends s and receives r < s takes r at that rate and the s - r left over at this ratio x
    # it. On gloo a pair of ranks is half duplex, so traffic one way runs faster (measured by calibrate, at most 2);
    # 1 (the presets): each direction has its own rate, and a rank's time is max(s, r) at it
    inter_node_one_way_ratio: float = 1.0
    # how much of a rank's inter-node traffic in one phase of the step overlaps its traffic in another (the phases:
    # the input dists' IDs, the forward's vectors and partial sums, the backward's gradients). 0: none, each phase in
    # turn (fitted on the emulated cluster, where a holder's forward sends and backward receives ran one after the
    # other: benchmarks/fit_link_ratios.py); 1 (the presets, not measured on GPUs, where the pipeline runs the next
    # batch's input dist during this one): the step's sends and receives priced at once, as max(sent, received)
    inter_node_phase_overlap: float = 1.0
    # an all-reduce's bus bandwidth as nccl-tests define it (2 (n-1)/n x bytes / time), measured by calibrate: what
    # DDP's all-reduces (the dense part's, the data-parallel tables') cost, whatever algorithm the backend runs
    # (gloo's is not NCCL's ring). 0 (the presets): priced as a ring over the two bandwidths above
    allreduce_bus_gbps: float = 0.0
    dense_ms_per_ksample: float  # dense forward+backward per 1000 samples on one GPU
    dense_params_mb: float = 0.0  # MB of dense gradients all-reduced every step (same for every plan)
    unique_ns_per_id: float = 0.0  # a UB table's own host work per ID (de-duplication, routing, expansion)
    collective_us: float = 0.0  # launching and synchronising one collective, whatever its size
    lookup_ns_per_id: float = 0.0  # per ID a cell looks up (forward + backward), whatever its width
    # per distinct row a cell's lookups touch in a step: the backward's per-row gradient and the fused optimizer's
    # row update, whatever its width (measured by calibrate; 0 in the presets, whose lookup_ns_per_id holds it)
    update_ns_per_row: float = 0.0
    dp_ns_per_element: float = 0.0  # per element of a data-parallel table per step: its dense gradient and update
    host_cores: int = 0  # > 0: every rank runs on one host with this many cores, so lookups share them
    # with host_cores: the ranks that shared the host when dense_ms_per_ksample and collective_us were measured (each
    # a rank's own host work); a plan for another number of ranks scales both by the cores a rank gets (Topology.
    # host_share); 0: not scaled
    shared_host_ranks: int = 0
    # with shared_host_ranks: what each rank beyond the host's cores adds to a collective (its peers wait for it to be
    # scheduled), a part of collective_us where the figures were measured with more ranks than cores
    oversubscribed_collective_us: float = 0.0
    # how far the cost model's predicted speedup of one plan over another has been measured to miss the measured one
    # on this hardware (the largest |predicted - measured| speedup, 0.05: 5 points), which benchmarks/sweep.py
    # measures end to end; the planner keeps TorchRec's plan unless ours is predicted faster by more (plan_model,
    # `incumbent`). 0: not measured, so every predicted gain counts
    plan_error: float = 0.0
    # the same error as fractions of the predicted speedup, each way (benchmarks/plan_band.py): the most a measured
    # speedup fell short of its prediction (0.09: 9% under) and the most it rose above it. The misses grow with the
    # predicted speedup (sweeps 4-11: ~4% of it under 1.45x, ~6% above), and only a shortfall can make a plan chosen
    # over TorchRec's slower than it: the planner keeps TorchRec's plan unless ours, less the shortfall, is faster.
    # Either set (> 0), they replace plan_error; 0: not measured
    plan_error_below: float = 0.0
    plan_error_above: float = 0.0

    def __post_init__(self) -> None:
        refusal = band_refusal(self.plan_error, self.plan_error_below, self.plan_error_above)
        if refusal is not None:
            raise ValueError(f"hardware {self.name!r}: {refusal}")

    @property
    def relative_band(self) -> bool:
        """Whether the error on plan differences is the relative pair (plan_error_below/above)."""
        return self.plan_error_below > 0 or self.plan_error_above > 0

    @property
    def plan_error_measured(self) -> bool:
        """Whether the cost model's error on plan differences has been measured here (either band)."""
        return self.plan_error > 0 or self.relative_band

    def speedup_band(self, speedup: float) -> tuple[float, float] | None:
        """The measured speedup to expect of a plan predicted `speedup` times another's, lowest and highest, by the
        cost model's measured error on plan differences here; None where that error has not been measured."""
        if self.relative_band:
            return speedup * (1 - self.plan_error_below), speedup * (1 + self.plan_error_above)
        if self.plan_error > 0:
            return speedup - self.plan_error, speedup + self.plan_error
        return None

    def with_overrides(self, **overrides: Any) -> "Hardware":
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown hardware figures {sorted(unknown)}; known: {sorted(known)}")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def band_refusal(plan_error: float, below: float, above: float) -> str | None:
    """Why these figures of the error on plan differences cannot be planned with (both forms given), or None."""
    if plan_error > 0 and (below > 0 or above > 0):
        return (
            f"two bands for one error: plan_error ({plan_error:g}, points of speedup) or plan_error_below/"
            "plan_error_above (fractions of it), not both"
        )
    return None


# Lookups are random row gathers: we take half of peak HBM bandwidth as achieved (NVIDIA's planners
# use a similar work ratio). Dense cost: DCNv2's dense part on H100 at ~2 ms per 8k samples.
# collective_us, per collective whatever its size, from nccl-tests' time at 8 bytes (its launch and
# synchronisation). Plans of these presets span nodes, so the figures are inter-node ones:
# - Hopper (dgx-h100, h200): 47.6 us, all_reduce_perf at 8 B over 2 nodes x 8 H20 (Hopper on the NVLink 4 /
#   NVSwitch and ConnectX-7 NDR InfiniBand fabric of DGX H100 and H200), NCCL 2.21.5 (NVIDIA/nccl issue #1244).
#   Inside one DGX H100 it is 13.67 us (all_reduce_perf, 8 B, 8 x H100, NVIDIA/dgxc-benchmarking nccl/README.md);
#   no H100 or H200 inter-node figure was found.
# - A100 (dgx-a100): 19.9 us, all_reduce_perf at 8 B between 2 nodes of A100 80GB over HDR InfiniBand, one GPU
#   per node (NVIDIA/nccl-tests issue #150): two ranks only, a lower bound for a full cluster.
# unique_ns_per_id: 0.23 ns on Hopper, fbgemm's jagged_unique_indices (de-duplication with the inverse index, what
# UB's de-duplication needs) of ~23M int64 IDs in 5.4 ms on H100 (pytorch/FBGEMM PR #5769, "on H100" in its stack's
# #5718; at::_unique took 5.87 ms, 0.26 ns); UB's routing and expansion passes are not in it. A100: 0.05 ns, CUB's
# radix sort of 32-bit keys (torch's), ~1.5x slower than Onesweep's 29.4 GKey/s on 256M keys on an A100 (Adinets and
# Merrill, arXiv 2206.01784): a sort alone, a floor (on H100 the de-duplication costs ~5x its sort passes, #5769).
# lookup_ns_per_id stays 0 in the GPU presets, checked against fbgemm's TBE (SplitTableBatchedEmbeddingBagsCodegen)
# training on an "NVIDIA H100 80GB HBM3" (NVIDIA/recsys-examples corelib/dynamicemb/benchmark/benchmark_results.json,
# commit ccbdb100, PR #396): 10 tables x 1.68M rows x dim 128, fp32, 1,048,570 IDs per step, forward + backward with
# SGD in 0.959 ms, 0.914 ns per ID, where the byte pricing alone (128 x 4 B x 3 per ID at hbm_bw_gbps) gives
# 0.917 ns: nothing is left for a per-ID term (with Adam, 1.29 ns: the optimizer state's bytes, not priced here).
# Calibrate a cluster (python -m embark_torchrec.calibrate) to measure all of them.
PRESETS: dict[str, Hardware] = {
    "dgx-h100": Hardware(
        name="dgx-h100",
        hbm_gb=80.0,
        hbm_reserve_gb=16.0,
        hbm_bw_gbps=3350.0 / 2,
        intra_node_bw_gbps=450.0,
        inter_node_bw_gbps=50.0,
        dense_ms_per_ksample=0.25,
        collective_us=47.6,
        unique_ns_per_id=0.23,
    ),
    "dgx-a100": Hardware(
        name="dgx-a100",
        hbm_gb=80.0,
        hbm_reserve_gb=16.0,
        hbm_bw_gbps=2039.0 / 2,
        intra_node_bw_gbps=300.0,
        inter_node_bw_gbps=25.0,
        dense_ms_per_ksample=0.5,
        collective_us=19.9,
        unique_ns_per_id=0.05,
    ),
    "h200": Hardware(
        name="h200",
        hbm_gb=141.0,
        hbm_reserve_gb=20.0,
        hbm_bw_gbps=4800.0 / 2,
        intra_node_bw_gbps=450.0,
        inter_node_bw_gbps=50.0,
        dense_ms_per_ksample=0.2,
        collective_us=47.6,
        unique_ns_per_id=0.23,
    ),
    # Gloo over loopback on a CPU box: what our CPU tests and the e2e benchmark run on. The medians of three runs
    # of python -m embark_torchrec.calibrate with 4 ranks as 2 nodes x 2 on this 2-core host on 2026-12-01, each
    # field's median over the runs (docs/cost-model.md): all-to-all at ~0.62 GB/s per rank inside a "node" and
    # ~0.71 GB/s across (both loopback), TBE lookups (forward + backward, fused row-wise Adagrad) at ~317 ns per ID
    # plus ~10.3 GB/s of lookup bytes on rank 0 alone (the ranks share the 2 cores: host_cores), unique-based
    # tables' own host work at ~292 ns per ID; a data-parallel table's step (dense gradient, Adagrad over every row)
    # at ~11.4 ns per element (one run, the fourth). At the DLRM demo's shape (2 ranks, one per core:
    # shared_host_ranks 2; issue 41): dense_ms_per_ksample and collective_us are the example's own --calibrate
    # (full, not quick) at 2 ranks on the idle box on 2026-12-06 (27.21 ms per 1000 samples of its dense part, every
    # rank at once; 2,125 us per collective of a table-wise DMP step, IQR 1,961-2,289); each rank beyond the cores
    # adds oversubscribed_collective_us to a collective, so that 4 ranks price the 7,126 us the 4-rank calibration of
    # 2026-12-01 measured there. docs/cost-model.md says how far off these figures have been measured to be.
    "cpu-gloo": Hardware(
        name="cpu-gloo",
        hbm_gb=16.0,
        hbm_reserve_gb=4.0,
        hbm_bw_gbps=10.3,
        intra_node_bw_gbps=0.62,
        inter_node_bw_gbps=0.71,
        dense_ms_per_ksample=27.21,
        unique_ns_per_id=292.0,
        collective_us=2125.0,
        lookup_ns_per_id=317.0,
        dp_ns_per_element=11.4,
        host_cores=2,
        shared_host_ranks=2,
        oversubscribed_collective_us=1438.0,
    ),
}
# What each preset's estimate has been measured against, for the plan report (report.hardware_line)
_PUBLIC = (
    "public figures (docs/cost-model.md), not yet checked against a measured step of this project's on such a "
    "GPU: measure your cluster (python -m embark_torchrec.calibrate) before trusting the estimate"
)
PRESET_CHECKS: dict[str, str] = {
    "dgx-h100": _PUBLIC,
    "dgx-a100": _PUBLIC,
    "h200": _PUBLIC,
    "cpu-gloo": (
        "calibrated at the DLRM demo's shape (2 ranks) on this project's idle 2-core box (issue 41): the demo's "
        "estimate was 0.95x its measured step at 2 ranks (35.8 against 37.5 ms) and 1.02x at 4 ranks as 2 nodes x 2 "
        "(85.4 against 83.5 ms), medians of 3 runs on 2026-12-06; a busy or other host differs "
        "(benchmarks/demo_estimate.py measures it): the example's --calibrate, or python -m embark_torchrec.calibrate, "
        "measures this one"
    ),
}
DEFAULT_HARDWARE = "dgx-h100"
CPU_HARDWARE = "cpu-gloo"
COMPUTE_DEVICES = ("cpu", "cuda")  # the devices our plans place shards on


def hardware_preset(name: str) -> Hardware:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown hardware preset {name!r}; known: {sorted(PRESETS)}") from None


@dataclass(frozen=True)
class Topology:
    """world_size GPUs in nodes of local_world_size; ranks are numbered node-major, as torchrun does."""

    world_size: int
    local_world_size: int
    hardware: Hardware = PRESETS[DEFAULT_HARDWARE]

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ValueError(f"local_world_size {self.local_world_size} must divide world_size {self.world_size}")

    @property
    def host_share(self) -> float:
        """On one host whose cores every rank shares: how much longer a rank's own host work (its dense step, its
        dists' work around each collective) takes at this world size than at the shared_host_ranks the figures were
        measured with, as each rank gets cores / ranks of a core once ranks outnumber cores. 1 elsewhere."""
        hw = self.hardware
        if not hw.host_cores or not hw.shared_host_ranks:
            return 1.0
        return max(self.world_size, hw.host_cores) / max(hw.shared_host_ranks, hw.host_cores)

    @property
    def collective_us(self) -> float:
        """One collective's cost at this world size: the hardware's collective_us, except on one shared host with
        the ranks it was measured at, where its own part scales with host_share and each rank beyond the cores adds
        oversubscribed_collective_us (both parts as measured at shared_host_ranks)."""
        hw = self.hardware
        if not hw.host_cores or not hw.shared_host_ranks:
            return hw.collective_us
        measured_over = max(0, hw.shared_host_ranks - hw.host_cores)
        own = max(0.0, hw.collective_us - hw.oversubscribed_collective_us * measured_over)
        return own * self.host_share + hw.oversubscribed_collective_us * max(0, self.world_size - hw.host_cores)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def aggregator(self, node: int, destination: int) -> int:
        """Hierarchical reduction's routing, the one definition (cost model, traffic model and the
        runtime's HierarchicalPooledEmbeddingDist follow it): partial sums for `destination` are
        summed inside `node` on its rank with the destination's local rank (stage 1, intra-node),
        which sends the node's sum to the destination (stage 2, across nodes unless it is home)."""
        return node * self.local_world_size + destination % self.local_world_size

    @property
    def hbm_cap_bytes(self) -> float:
        """Bytes of embedding weights and optimizer state one rank may hold."""
        return (self.hardware.hbm_gb - self.hardware.hbm_reserve_gb) * 1e9
