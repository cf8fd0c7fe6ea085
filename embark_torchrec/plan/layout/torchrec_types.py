"""TorchRec's built-in sharding types as the planner sees them: their names, the collectives one group of each
issues per training step, and the row split its row-wise types run. Pure constants and one pure function, so that
the cluster kinds (kinds.py), the layouts and the sharding groups all read them from here.

Collectives per training step of one group, forward and backward: the KJT input dist's tensors (lengths, values:
their split sizes travel in the module's split exchange), then the pooled output and its gradient; hierarchical
reductions (TorchRec's table-row-wise, and ours) add an intra-node stage each way. A data-parallel group has no
dists, but TorchRec wraps its lookups in a DistributedDataParallel of their own, whose reducer all-reduces their
gradients in the backward (one all-reduce per DDP bucket of 25 MB; priced as one). Counted by wrapping
torch.distributed's collectives around a training step (tests/test_plan_groups.py).
"""

from __future__ import annotations

DATA_PARALLEL = "data_parallel"
TABLE_WISE = "table_wise"
COLUMN_WISE = "column_wise"
ROW_WISE = "row_wise"
TABLE_ROW_WISE = "table_row_wise"

DATA_PARALLEL_COLLECTIVES = 1
FLAT_COLLECTIVES = 4
HIERARCHICAL_COLLECTIVES = 6
BUILTIN_COLLECTIVES = {
    DATA_PARALLEL: DATA_PARALLEL_COLLECTIVES,
    TABLE_WISE: FLAT_COLLECTIVES,
    COLUMN_WISE: FLAT_COLLECTIVES,
    ROW_WISE: FLAT_COLLECTIVES,
    TABLE_ROW_WISE: HIERARCHICAL_COLLECTIVES,
}
# TorchRec's EmbeddingCollection runs these exactly; every other layout of a sequence table runs as ours
# (TorchRec's sequence column-wise needs one width for all its tables)
SEQUENCE_BUILTIN_TYPES = (DATA_PARALLEL, TABLE_WISE, ROW_WISE)


def ceil_row_bounds(rows: int, parts: int) -> tuple[int, ...]:
    """TorchRec's row-wise blocks: `parts` blocks of ceil(rows / parts) rows, the last ones shorter or
    empty; empty blocks are left out (a plan never holds an empty slice). The one definition of the
    row split TorchRec's row-wise and table-row-wise run, and of the TWRW baseline."""
    block = -(-rows // parts)
    return tuple(range(0, rows, block)) + (rows,)
