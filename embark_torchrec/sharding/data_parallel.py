"""DDP's gradient all-reduce at a plan's precision.

DistributedModelParallel all-reduces replicated gradients in two kinds of DDP: its own, over the dense part, and
one per data-parallel sharding inside each sharded module (TorchRec wraps a data-parallel sharding's lookups in a
DDP of their own, and DMP's DDP leaves every sharded module's parameters out). A plan's allreduce_precision, which
the cost model prices for the dense part and the data-parallel tables alike, must reach both:
TorchRec's DefaultDataParallelWrapper(allreduce_comm_precision=) sets DDP's fp16/bf16 compress hook on DMP's DDP
only, so the wrapper here sets the same hook on the sharded modules' DDPs too. Pass it to DMP:

    model = DistributedModelParallel(model, plan=..., sharders=..., data_parallel_wrapper=data_parallel_wrapper(plan))
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardedModule, ShardingEnv

from ..plan.layout.tables import ALLREDUCE_PRECISIONS, Plan
from .torchrec_compat import data_parallel_lookup_ddps

COMPRESS_HOOKS: dict[str, Callable[..., Any]] = {
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}  # DDP's hooks for the precisions below fp32 in ALLREDUCE_PRECISIONS (the ones TorchRec's wrapper sets)


def sharded_module_ddps(module: torch.nn.Module) -> list[DistributedDataParallel]:
    """The DDPs inside sharded modules: TorchRec's, one per data-parallel sharding of an embedding collection."""
    return [
        ddp
        for sharded in module.modules()
        if isinstance(sharded, ShardedModule)
        for ddp in data_parallel_lookup_ddps(sharded)
    ]


class PlanPrecisionDataParallelWrapper(DefaultDataParallelWrapper):
    """TorchRec's wrapper (DMP's DDP over the dense part, at `precision`) that also gives the data-parallel
    tables' DDPs the same compress hook, so every replicated gradient travels at the plan's precision."""

    def __init__(self, precision: str) -> None:
        if precision not in ALLREDUCE_PRECISIONS:
            raise ValueError(f"allreduce precision: expected one of {list(ALLREDUCE_PRECISIONS)}, got {precision!r}")
        super().__init__(allreduce_comm_precision=None if precision == "fp32" else precision)
        self.precision = precision

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        super().wrap(dmp, env, device)
        hook = COMPRESS_HOOKS.get(self.precision)
        if hook is not None:
            for ddp in sharded_module_ddps(dmp):
                ddp.register_comm_hook(None, hook)


def data_parallel_wrapper(plan: Plan | str) -> PlanPrecisionDataParallelWrapper:
    """DMP's DDP wrapper all-reducing at `plan`'s allreduce_precision (or the precision given by name). A plan
    whose data-parallel tables are at another precision is refused by table and field (Plan.check_replicated_precision,
    which load_plan runs too): one precision runs for all."""
    if isinstance(plan, Plan):
        plan.check_replicated_precision()
        precision = plan.allreduce_precision
    else:
        precision = plan
    return PlanPrecisionDataParallelWrapper(precision)
