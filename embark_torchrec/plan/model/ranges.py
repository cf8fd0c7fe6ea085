"""Plannable ranges: the one place that bounds every size and rate a model spec, a hardware file or a CLI flag
gives the planner.

Each bound is far beyond any real model or cluster; it is there so that the cost model's products (samples x IDs
per sample x width x bytes, divided by a bandwidth) stay finite floats. Without them `pooling: 1e308` made every
cost NaN (a batch of it is inf, and inf x 0 is NaN) and a bandwidth of 1e-320 GB/s made one infinite. Values
outside are refused, naming the file and the field, before any planning. Pure Python: plan/ imports it.
"""

from __future__ import annotations

# ---- model specs (spec.py), per table and per model ----
MAX_ROWS = 2**40  # rows of one table: ~1.1e12 (the largest tables in production hold ~1e10)
MAX_DIM = 2**16  # embedding width: 65,536 (fbgemm's kernels stop at a few thousand)
MAX_POOLING = 1e6  # IDs per sample of one table (a sequence table's mean length)
MAX_BATCH_SIZE = 2**31 - 1  # global samples per step
MAX_WORLD_SIZE = 2**20  # ranks of one job, and of one node: a million (the largest jobs run ~1e5 GPUs)
# ranks the planner plans for (EmbarkPlanner, the plan CLI); plan files and load_plan take up to MAX_WORLD_SIZE.
# Planning prices every candidate layout over every rank, so its time grows with the ranks (and the tables): 8
# tables (EmbarkPlanner.plan, 10k-80k rows x 64) on the shared 2-core box (load 7-9) planned in 37 s at 512 ranks,
# 54 s at 1,024, 66 s at 2,048, 241 s at 4,096 and 434 s at 8,192; at 10**6 ranks it had not returned after 120 s.
MAX_PLANNED_WORLD_SIZE = 8192
MIN_UNIQUE_RATIO = 1e-9  # distinct / total IDs in one rank's batch: at least 1 in 1e9 (and at most 1)
MAX_ZIPF_ALPHA = 10.0  # Zipf's exponent (real ID streams: ~0.5..2; at 10, 99.9% of the draws are the hottest ID)

# ---- hardware (hardware_file.py and --hbm-gb), per GPU ----
MAX_HBM_GB = 1e6  # memory per GPU, and the reserve below it: a petabyte
MIN_BANDWIDTH_GBPS, MAX_BANDWIDTH_GBPS = 1e-3, 1e6  # HBM, NVLink, network: 1 MB/s .. 1 PB/s
MAX_NS_PER_ID = 1e9  # per-ID, per-row and per-element host work: up to a second each
MAX_MS_PER_KSAMPLE = 1e9  # the dense part's forward + backward per 1000 samples
MAX_COLLECTIVE_US = 1e9  # one collective's launch and synchronisation
MAX_DENSE_PARAMS_MB = 1e9  # dense gradients all-reduced each step: a petabyte
MIN_PAIRED_RATIO, MAX_PAIRED_RATIO = 1e-3, 1e3  # paired inter-node rate over the all-ranks one
MAX_SOLO_RATIO = 1024.0  # a lone rank's inter-node rate over the all-ranks one: at most a node's ranks
MAX_ONE_WAY_RATIO = 2.0  # one way over both ways: a half-duplex pair at most doubles (and the lower bound holds)
MAX_HOST_CORES = 2**20  # cores of the one host every rank shares (0: ranks have their own GPUs)

# every Hardware figure a hardware file holds (hardware_file.py): (lowest, highest, whether the lowest is allowed);
# figures the cost model divides by (memory, bandwidths) may not be zero, nor so small that a cost is infinite
MAX_PLAN_ERROR = 10.0  # a predicted speedup off by 1000 points: a model that predicts nothing
MAX_PLAN_SHORTFALL = 0.9  # a measured speedup a tenth of the predicted one: beyond, no gain could ever be claimed
HARDWARE_RANGES: dict[str, tuple[float, float, bool]] = {
    "hbm_gb": (0.0, MAX_HBM_GB, False),
    "hbm_reserve_gb": (0.0, MAX_HBM_GB, True),
    **{
        bw: (MIN_BANDWIDTH_GBPS, MAX_BANDWIDTH_GBPS, True)
        for bw in ("hbm_bw_gbps", "intra_node_bw_gbps", "inter_node_bw_gbps")
    },
    "inter_node_paired_ratio": (MIN_PAIRED_RATIO, MAX_PAIRED_RATIO, True),
    "inter_node_solo_ratio": (1.0, MAX_SOLO_RATIO, True),
    "inter_node_one_way_ratio": (1.0, MAX_ONE_WAY_RATIO, True),
    "inter_node_phase_overlap": (0.0, 1.0, True),
    "allreduce_bus_gbps": (0.0, MAX_BANDWIDTH_GBPS, True),
    "dense_ms_per_ksample": (0.0, MAX_MS_PER_KSAMPLE, True),
    "dense_params_mb": (0.0, MAX_DENSE_PARAMS_MB, True),
    **{
        ns: (0.0, MAX_NS_PER_ID, True)
        for ns in ("unique_ns_per_id", "lookup_ns_per_id", "update_ns_per_row", "dp_ns_per_element")
    },
    "collective_us": (0.0, MAX_COLLECTIVE_US, True),
    "host_cores": (0, MAX_HOST_CORES, True),
    "shared_host_ranks": (0, MAX_WORLD_SIZE, True),
    "oversubscribed_collective_us": (0.0, MAX_COLLECTIVE_US, True),
    "plan_error": (0.0, MAX_PLAN_ERROR, True),
    "plan_error_below": (0.0, MAX_PLAN_SHORTFALL, True),
    "plan_error_above": (0.0, MAX_PLAN_ERROR, True),
}


def planned_world_size_refusal(world_size: int) -> str | None:
    """Why the planner will not plan for `world_size` ranks, or None: above MAX_PLANNED_WORLD_SIZE its time (which
    grows with the ranks) is no longer minutes, and a planner that does not return is worse than a refusal."""
    if world_size <= MAX_PLANNED_WORLD_SIZE:
        return None
    return (
        f"the planner plans for at most {MAX_PLANNED_WORLD_SIZE} ranks, got {world_size}: its time grows with the "
        f"ranks (minutes at {MAX_PLANNED_WORLD_SIZE}: ~7 for 8 tables on 2 cores), so beyond that it would not "
        f"return in useful time; plan files and load_plan take up to {MAX_WORLD_SIZE} ranks"
    )
