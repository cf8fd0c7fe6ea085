"""The table-row-wise (TWRW) baseline, the EMBark paper's, as a Plan so that one cost model scores
it with ours: table i on node i mod N, its rows split over that node's GPUs in torchrec's ceil blocks,
partial sums reduced inside the node first. (TorchRec's default plan needs torchrec to run its
planner: planner/torchrec_plans.py.)
"""

from __future__ import annotations

from ..layout.tables import Plan, TableLayout
from ..layout.torchrec_types import ceil_row_bounds
from ..model.spec import ModelSpec
from ..model.topology import Topology


def table_row_wise_plan(spec: ModelSpec, topology: Topology) -> Plan:
    lws = topology.local_world_size
    tables = {}
    for i, t in enumerate(spec.tables):
        node = i % topology.num_nodes
        bounds = ceil_row_bounds(t.rows, lws)
        ranks = tuple((node * lws + r,) for r in range(len(bounds) - 1))
        tables[t.name] = TableLayout("rb", bounds, (0, t.dim), ranks, hierarchical=len(ranks) > 1)
    return Plan(topology.world_size, lws, tables)
