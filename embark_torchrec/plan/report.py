"""Plan reports in the spirit of torchrec's EmbeddingStats: per-rank load, imbalance, clusters,
shard kinds, and a side-by-side comparison of plans scored by the same cost model."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .cost.model import StepCost
from .model.fields import SEQUENCE
from .layout.tables import Plan, TableLayout
from .model.topology import PRESET_CHECKS, PRESETS, Hardware, Topology

_ALL_RANKS_UP_TO = 16
_COSTLIEST_SHOWN = 8


@dataclass(frozen=True)
class ScoredPlan:
    """One plan under comparison: its name (embark, trw, torchrec), cost and planning seconds."""

    name: str
    plan: Plan
    cost: StepCost
    seconds: float | None
    bound_ms: float | None = None  # a step no plan of the model beats (bound.step_lower_bound), if known


def layout_kind(layout: TableLayout) -> str:
    """dp, tw, cw, rw (row slices only) or grid, as the layout's cluster kind names them (UB: ub-tw, ...)."""
    n_r, n_c = layout.num_row_slices, layout.num_col_slices
    shape = "tw" if n_r == n_c == 1 else "cw" if n_r == 1 else "rw" if n_c == 1 else "grid"
    return layout.kind.shape_name(shape)


def summary(scored: ScoredPlan) -> dict[str, Any]:
    """A JSON-ready summary: step and its parts, planning time, imbalance, clusters, shard kinds, and how many
    tables reduce inside nodes first, are sequence tables, or run at fp8 on TorchRec's own sharding."""
    loads = scored.cost.rank_load_ms
    tables = scored.plan.tables.values()
    return {
        **{k: round(v, 6) for k, v in scored.cost.parts().items()},
        "planning_s": None if scored.seconds is None else round(scored.seconds, 3),
        "imbalance": round(float(loads.max() / loads.mean()), 4) if loads.mean() > 0 else 1.0,
        "max_memory_gb": round(float(scored.cost.rank_memory.max()) / 1e9, 3),
        "clusters": dict(sorted(Counter(t.cluster for t in tables).items())),
        "kinds": dict(sorted(Counter(layout_kind(t) for t in tables).items())),
        "shards": sum(t.num_row_slices * t.num_col_slices for t in tables if not t.kind.replicated),
        "hierarchical_tables": sum(t.hierarchical for t in tables),
        "torchrec_at_fp8_tables": sum(t.torchrec_at_fp8 for t in tables),
        "sequence_tables": sum(kind == SEQUENCE for kind in scored.plan.kinds.values()),
    }


def _rank_rows(cost: StepCost, topology: Topology) -> list[int]:
    w = topology.world_size
    if w <= _ALL_RANKS_UP_TO:
        return list(range(w))
    return sorted(np.argsort(-cost.rank_load_ms, kind="stable")[:_COSTLIEST_SHOWN].tolist())


def rank_table(scored: ScoredPlan, topology: Topology) -> str:
    """Per rank: memory, lookup ms, communication ms (intra / inter node), shards held."""
    cost, plan = scored.cost, scored.plan
    held = Counter(s.rank for t in plan.tables.values() for s in t.shards())
    lines = [
        "| rank | node | memory GB | lookup ms | intra ms | inter ms | load ms | shards |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k in _rank_rows(cost, topology):
        lines.append(
            f"| {k} | {topology.node_of(k)} | {cost.rank_memory[k] / 1e9:.2f} | {cost.rank_lookup_ms[k]:.3f} | "
            f"{cost.rank_intra_ms[k]:.3f} | {cost.rank_inter_ms[k]:.3f} | {cost.rank_load_ms[k]:.3f} | {held[k]} |"
        )
    if topology.world_size > _ALL_RANKS_UP_TO:
        lines.append(f"(the {_COSTLIEST_SHOWN} costliest of {topology.world_size} ranks)")
    return "\n".join(lines)


def comparison_table(plans: Sequence[ScoredPlan]) -> str:
    """Every plan's estimate side by side; speedup = other plan's step / embark's step."""
    base = plans[0]
    lines = [
        "| plan | step ms | lookup ms | comm ms | collective ms | dp ms | dense ms | imbalance | planning s "
        "| speedup of " + base.name + " |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in plans:
        s = summary(p)
        seconds = "-" if p.seconds is None else f"{p.seconds:.1f}"
        lines.append(
            f"| {p.name} | {s['step_ms']:.3f} | {s['lookup_ms']:.3f} | {s['comm_ms']:.3f} | {s['collective_ms']:.3f} | "
            f"{s['dp_allreduce_ms']:.3f} | "
            f"{s['dense_ms']:.3f} | {s['imbalance']:.2f} | {seconds} | {p.cost.step_ms / base.cost.step_ms:.2f}x |"
        )
    return "\n".join(lines)


def hardware_line(hardware: Hardware, sources: Mapping[str, str] | None = None) -> str:
    """Where the figures under the estimate come from, so a reader knows how far to trust it: a hardware file's
    measured and preset figures (its "sources"), or a preset's, with how far off it has been measured to be."""
    if sources:
        measured = [f for f, s in sources.items() if s != "preset" and f != "name"]
        preset = [f for f, s in sources.items() if s == "preset" and f != "name"]
        return (
            f"hardware figures measured (calibrate, on this machine or model): {', '.join(measured) or 'none'}; "
            f"from the base preset: {', '.join(preset) or 'none'}"
        )
    if PRESETS.get(hardware.name) == hardware:
        return (
            f"hardware figures: all the {hardware.name} preset's, none measured on this machine; "
            f"{PRESET_CHECKS[hardware.name]}"
        )
    return (
        f"hardware figures: {hardware.name!r}, a preset with figures overridden or a hardware file given without its "
        "sources: which were measured is not known here"
    )


def render(
    plans: Sequence[ScoredPlan], topology: Topology, model_name: str, sources: Mapping[str, str] | None = None
) -> str:
    """The full text report: the first plan's ranks and clusters, then the comparison; `sources`: a hardware file's
    (which figures were measured), for the hardware line."""
    main = plans[0]
    s = summary(main)
    hw = topology.hardware
    out = [
        f"# {main.name} plan for {model_name}: {topology.world_size} ranks ({topology.num_nodes} "
        f"{'node' if topology.num_nodes == 1 else 'nodes'} x {topology.local_world_size}), hardware {hw.name}, "
        f"cap {topology.hbm_cap_bytes / 1e9:.0f} GB per rank",
        "",
        f"estimated step {s['step_ms']:.3f} ms = lookups {s['lookup_ms']:.3f} + embedding comm {s['comm_ms']:.3f} "
        f"+ collectives {s['collective_ms']:.3f} + DP all-reduce {s['dp_allreduce_ms']:.3f} "
        f"+ dense {s['dense_ms']:.3f}",
        hardware_line(hw, sources),
        f"imbalance (max/mean load) {s['imbalance']:.2f}; clusters {s['clusters']}; tables by layout {s['kinds']}; "
        f"{s['shards']} shards; {s['hierarchical_tables']} tables reduce inside nodes first"
        + (f"; {s['sequence_tables']} sequence tables (one vector per ID)" if s["sequence_tables"] else "")
        + (
            f"; {s['torchrec_at_fp8_tables']} fp8 tables on TorchRec's own sharding"
            if s["torchrec_at_fp8_tables"]
            else ""
        ),
        "",
        rank_table(main, topology),
    ]
    if main.bound_ms:
        out[-2:-2] = [f"lower bound {main.bound_ms:.3f} ms; this plan {main.cost.step_ms / main.bound_ms:.2f}x it"]
    if len(plans) > 1:
        out += ["", comparison_table(plans)]
    return "\n".join(out)


def plot_rank_loads(plans: Sequence[ScoredPlan], path: str | Path) -> None:
    """A PNG with one panel per plan: per-rank lookup, intra- and inter-node communication ms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(plans), 1, figsize=(10, 2.6 * len(plans)), sharex=True, squeeze=False)
    top = max(float(p.cost.rank_load_ms.max()) for p in plans) * 1.05
    for ax, p in zip(axes[:, 0], plans):
        ranks = np.arange(len(p.cost.rank_load_ms))
        ax.bar(ranks, p.cost.rank_lookup_ms, label="lookup", color="#4c72b0")
        ax.bar(ranks, p.cost.rank_intra_ms, bottom=p.cost.rank_lookup_ms, label="intra-node comm", color="#55a868")
        ax.bar(
            ranks,
            p.cost.rank_inter_ms,
            bottom=p.cost.rank_lookup_ms + p.cost.rank_intra_ms,
            label="inter-node comm",
            color="#c44e52",
        )
        ax.set_ylim(0, top)
        ax.set_ylabel("ms")
        ax.set_title(f"{p.name}: estimated step {p.cost.step_ms:.2f} ms")
    axes[0, 0].legend(loc="upper right", fontsize="small")
    axes[-1, 0].set_xlabel("rank")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
