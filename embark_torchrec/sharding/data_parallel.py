"""DDP's gradient all-reduce at a plan's precision.

DistributedModelParallel wraps the dense part and the data-parallel tables in one DDP, so their gradients travel
together at one precision: Plan.allreduce_precision, which the cost model prices and TorchRec's
DefaultDataParallelWrapper(allreduce_comm_precision=) runs (DDP's fp16/bf16 compress hooks). Pass it to DMP:

    model = DistributedModelParallel(model, plan=..., sharders=..., data_parallel_wrapper=data_parallel_wrapper(plan))
"""

from __future__ import annotations

from torchrec.distributed.model_parallel import DefaultDataParallelWrapper

from ..plan.layout import ALLREDUCE_PRECISIONS, Plan, PlanError


def data_parallel_wrapper(plan: Plan | str) -> DefaultDataParallelWrapper:
    """DMP's DDP wrapper all-reducing at `plan`'s allreduce_precision (or the precision given by name). A plan
    whose data-parallel tables' gradients are at another precision is refused by table: DDP runs one for all."""
    if isinstance(plan, Plan):
        precision = plan.allreduce_precision
        for name, layout in plan.tables.items():
            if layout.cluster == "dp" and layout.precision.backward != precision:
                raise PlanError(
                    f"table {name!r}: data-parallel gradients at {layout.precision.backward}, but DDP all-reduces "
                    f"every data-parallel table and the dense part at the plan's allreduce_precision {precision}"
                )
    else:
        precision = plan
    if precision not in ALLREDUCE_PRECISIONS:
        raise ValueError(f"allreduce precision: expected one of {list(ALLREDUCE_PRECISIONS)}, got {precision!r}")
    return DefaultDataParallelWrapper(allreduce_comm_precision=None if precision == "fp32" else precision)
