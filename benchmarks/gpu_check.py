"""One-shot GPU check: every sharding type on CUDA, in one go (under 8 minutes on one H200).

    PYTHONPATH=. .venv/bin/python benchmarks/gpu_check.py            # on a machine with an NVIDIA GPU (make GPU=1)
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_check.py --dry-run-cpu   # the same logic on CPU / gloo (no GPU)

Checks (each in its own try/except and time budget, so one failure hides no other):

(a) exact  -- world size 1 on a real 1-rank NCCL process group on cuda:0: for TorchRec's table_wise, row_wise,
    column_wise (through our sharder), its table_wise and column_wise at fp8 from the plan (torchrec_at_fp8: our fp8
    codec told the row width; exact, as TorchRec's pooled all-to-all sends nothing in a group of one, so (b) is
    where their codec runs) and our embark_rb (flat grid), embark_rb_hier and embark_ub at fp32, fp16 and fp8 on
    the wire, DistributedModelParallel shards a 2-table model (one SUM table, one MEAN table with two
    features) onto cuda; 3 training steps (fused exact SGD) against the unsharded EmbeddingBagCollection on cuda
    (torch SGD): outputs at every step and weights after the last, max |error| against a per-precision tolerance.
    Also the sharder's codecs with the plan at fp32 (QCommsConfig's way): fbgemm's FP8 row-wise codec
    (fp8_quantize_dim = the width) on our embark_rb and embark_ub ("embark_rb:fbgemm-fp8"; CUDA only, fbgemm has
    no CPU kernel). Below fp32 an error of exactly zero fails too: the codec did not run.
(b) fake4  -- world size 4 (2 nodes x 2) seen as rank 0 of torch's "fake" process group, tensors on cuda: the
    multi-rank code paths (bucketizing, grid cells, hierarchical intra/cross stages, unique IDs) run their kernels on
    the device; 2 forward+backward steps per type (TorchRec's table_row_wise too). The fake collectives are wrapped so
    that every peer sends this rank what it sends itself (a consistent world: split sizes, batch sizes and counts
    agree with the tensors that follow, and nothing reads uninitialised memory). Passes when it runs without error
    and the outputs are on the device; the values are not checked (the peers are fake).
(d) lookups -- fbgemm's TBE forward+backward timed on the device at world size 1 (python -m embark_torchrec.calibrate's
    lookup measurement, quick: a table of 4M rows on cuda, widths 8 / 128, poolings 5 / 20, 32768 bags): the measured
    lookup figures (hbm_bw_gbps, lookup_ns_per_id, update_ns_per_row) and the widest step's time, set against what the
    dgx-h100 and h200 presets' figures predict for that step through the cost model (and what the measured figures
    predict). Passes when it measured; the figures are the result (docs/gpu-check.md).
(c) dlrm   -- examples/dlrm/train.py under torchrun (1 process; the example picks CUDA + NCCL when CUDA is
    available) for 200 steps; its RESULT line is parsed (device, steps, loss, AUC, samples/s).

(a), (b) and (d) run in worker subprocesses (a crash or hang ends only the type it was on; the worker is restarted
for the rest); one summary table is printed at the end; the exit status is 1 when any check did not pass, 2 when
the machine cannot run the checks at all (no CUDA, or a CPU-only fbgemm-gpu).

--dry-run-cpu runs (a) and (d) on a 1-rank gloo group, (b) on the fake group with CPU tensors, and (c) on CPU with
fewer steps (in (d) a host too busy for calibrate's lookup figures passes with the reason: the logic ran): it
validates the script's logic where there is no GPU (fp8 and everything else run on CPU too).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "dlrm" / "train.py"
MARK = "@@gpu_check "  # worker protocol: lines "@@gpu_check start <kind>" and "@@gpu_check result {json}"

BUILTIN = ("table_wise", "row_wise", "column_wise")
OURS = ("embark_rb", "embark_rb_hier", "embark_ub")
PRECISIONS = ("fp32", "fp16", "fp8")
# the sharder's codecs at fp8, the plan at fp32: fbgemm's on our dists (see the docstring)
SHARDER_CODECS = {"embark_rb": "fbgemm-fp8", "embark_ub": "fbgemm-fp8"}
CUDA_ONLY_CODECS = ("fbgemm-fp8",)
# TorchRec's types a plan may run at fp8 (torchrec_at_fp8: one group per row width, our fp8 codec told the width)
BUILTIN_AT_FP8 = ("table_wise:fp8", "column_wise:fp8")
KINDS_A = (
    list(BUILTIN)
    + list(BUILTIN_AT_FP8)
    + [f"{k}:{p}" for k in OURS for p in PRECISIONS]
    + [f"{k}:{c}" for k, c in SHARDER_CODECS.items()]
)
# (d): calibrate's lookup measurement with each optimizer, against these presets' lookup figures
KINDS_D = ["lookups:exact_sgd", "lookups:exact_rowwise_adagrad"]
LOOKUP_PRESETS = ("dgx-h100", "h200")
KINDS_B = list(BUILTIN) + list(BUILTIN_AT_FP8) + ["table_row_wise"] + [f"{k}:{p}" for k in OURS for p in PRECISIONS]
# max |sharded - unsharded| allowed, relative to the largest reference magnitude of the compared tensor
# (fp32: summation order only; fp16 / fp8: a few roundings of 2^-11 / 2^-4 relative, see sharding/codecs.py)
TOLERANCE = {"fp32": 1e-4, "fp16": 4e-3, "fp8": 0.25}
STEPS_A, STEPS_B, BATCH, LR = 3, 2, 16, 0.1
STARTUP_S = 90.0  # a worker's imports and process group, before its first check
WS_B, LWS_B = 4, 2


# ================================================================================ the model


def _tables() -> list[Any]:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    return [
        EmbeddingBagConfig(name="t0", num_embeddings=1000, embedding_dim=16, feature_names=["f0"]),
        EmbeddingBagConfig(
            name="t1", num_embeddings=500, embedding_dim=16, feature_names=["f1", "f2"], pooling=PoolingType.MEAN
        ),
    ]


def _arch(tables: list[Any], device: Any) -> Any:
    """The collection under an attribute, as in real models (plans address it as "ebc")."""
    import torch
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    class SparseArch(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=tables, device=device)

        def forward(self, features: Any) -> Any:
            return self.ebc(features)

    return SparseArch()


def _our_layouts(kind: str, precision: str, world_size: int) -> dict[str, Any]:
    """Two tables in one of our sharding types; at world size 1 every cell is on rank 0, at 4 they spread over
    both nodes (rank 0 always holds some)."""
    from embark_torchrec.plan.layout.tables import TableLayout, WirePrecision

    p = WirePrecision(precision, precision)
    one = world_size == 1
    if kind == "embark_ub":
        return {
            "t0": TableLayout("ub", (0, 1000), (0, 16), ((0,),), p),
            "t1": TableLayout("ub", (0, 300, 500), (0, 16), ((0,), (0,)) if one else ((1,), (3,)), p),
        }
    if kind in ("table_wise", "column_wise"):  # at fp8 on TorchRec's sharding, as the plan's torchrec_at_fp8 says
        cols, ranks = ((0, 16), ((0,),)) if kind == "table_wise" else ((0, 8, 16), ((0, world_size - 1),))
        return {
            "t0": TableLayout("rb", (0, 1000), cols, ranks, p, torchrec_at_fp8=True),
            "t1": TableLayout(
                "rb", (0, 500), cols, ((world_size - 1,),) if kind == "table_wise" else ranks, p, torchrec_at_fp8=True
            ),
        }
    hier = kind == "embark_rb_hier"
    grid = ((0, 0), (0, 0)) if one else ((0, 1), (2, 3)) if hier else ((0, 1), (3, 2))
    return {
        "t0": TableLayout("rb", (0, 375, 1000), (0, 8, 16), grid, p, hierarchical=hier),
        "t1": TableLayout("rb", (0, 200, 500), (0, 8, 16), grid, p, hierarchical=hier),
    }


def _module_plan(kind: str, module: Any, sharder: Any, world_size: int, local_world_size: int, device_type: str) -> Any:
    """The EBC's ParameterShardings for `kind` (TorchRec's types from torchrec's plan helpers, ours from a Plan),
    every shard placed on device index 0 (one GPU plays every rank)."""
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata

    from embark_torchrec.plan.layout.groups import sharding_group
    from embark_torchrec.plan.layout.tables import Plan
    from embark_torchrec.planner.parameter_sharding import module_sharding_plan
    from embark_torchrec.plan.model.spec import ModelSpec

    base, _, precision = kind.partition(":")
    precision = _plan_precision(precision)
    expected = base if precision in ("", "fp32") else f"{base}:{precision}-{precision}"
    if kind in BUILTIN_AT_FP8:
        expected += "@16" if base == "table_wise" else "@8"
    if base in OURS or kind in BUILTIN_AT_FP8:
        layouts = _our_layouts(base, precision, world_size)
        spec = ModelSpec.from_module(module, batch_size=world_size * BATCH)
        got = {sharding_group(layouts[t.name], t.rows, world_size, local_world_size).name for t in spec.tables}
        if got != {expected}:
            raise AssertionError(f"layouts run as {sorted(got)}, not {expected}")
        params = module_sharding_plan(Plan(world_size, local_world_size, layouts), spec, device_type)
    else:
        from torchrec.distributed import sharding_plan as sp

        generators = {
            "table_wise": lambda i: sp.table_wise(rank=[0, min(2, world_size - 1)][i], compute_kernel="fused"),
            "row_wise": lambda i: sp.row_wise(compute_kernel="fused"),
            "column_wise": lambda i: sp.column_wise(ranks=[0, world_size - 1], compute_kernel="fused"),
            "table_row_wise": lambda i: sp.table_row_wise(host_index=0),
        }
        params = sp.construct_module_sharding_plan(
            module,
            {f"t{i}": generators[base](i) for i in range(2)},
            sharder=sharder,
            local_size=local_world_size,
            world_size=world_size,
            device_type=device_type,
        )
    for ps in params.values():
        if ps.sharding_type != expected:
            raise AssertionError(f"table runs as {ps.sharding_type}, not {expected}")
        ps.compute_kernel = "fused"
        if ps.sharding_spec is not None:
            ps.sharding_spec = EnumerableShardingSpec(
                [
                    ShardMetadata(
                        s.shard_offsets,
                        s.shard_sizes,
                        f"rank:{s.placement.rank()}/{device_type}" + (":0" if device_type == "cuda" else ""),
                    )
                    for s in ps.sharding_spec.shards
                ]
            )
    return params


def _sharded(kind: str, tables: list[Any], world_size: int, local_world_size: int, device: Any) -> Any:
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from embark_torchrec.sharding.sharder import EmbarkEmbeddingBagCollectionSharder

    sharder = EmbarkEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR},
        qcomm_codecs_registry=_sharder_codecs(kind.partition(":")[2], tables),
    )
    meta = _arch(tables, torch.device("meta"))
    params = _module_plan(kind, meta.ebc, sharder, world_size, local_world_size, device.type)
    return DistributedModelParallel(
        meta,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=ShardingPlan({"ebc": params}),
        sharders=[sharder],
        device=device,
    )


def _plan_precision(suffix: str) -> str:
    """A kind's precision in the plan: fp32 where the sharder's codecs compress instead."""
    return "fp32" if suffix in SHARDER_CODECS.values() else suffix


def _sharder_codecs(suffix: str, tables: list[Any]) -> Any:
    """The sharder's qcomm_codecs_registry a kind names, None for the plan's own precision."""
    if suffix not in SHARDER_CODECS.values():
        return None
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    (width,) = {t.embedding_dim for t in tables}
    p = CommType.FP8
    return get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=p, backward_precision=p, fp8_quantize_dim=width, fp8_quantize_dim_bwd=width)
    )


def _outputs(out: Any) -> dict[str, Any]:
    out = out.wait() if hasattr(out, "wait") else out
    return out.to_dict()


def _off_device(values: dict[str, Any], device: Any) -> list[str]:
    return [f"{k} on {v.device}" for k, v in values.items() if v.device.type != device.type]


# ================================================================================ (a) exact at world size 1


def check_exact(kind: str, device: Any) -> dict[str, Any]:
    """Sharded vs unsharded training, 3 steps: outputs every step, weights after; max relative error."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from embark_torchrec.testing import copy_global_weights, global_kjt_batch

    suffix = kind.partition(":")[2]
    precision = "fp8" if suffix in SHARDER_CODECS.values() else suffix or "fp32"
    if kind in BUILTIN_AT_FP8:  # TorchRec's alltoall_pooled sends nothing in a group of one (no codec runs): exact;
        precision = "fp32"  # (b) runs the codec on the device
    tables = _tables()
    torch.manual_seed(0)
    reference = _arch(tables, device)
    model = _sharded(kind, tables, 1, 1, device)
    copy_global_weights(model, reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    dims = {f: t.embedding_dim for t in tables for f in t.feature_names}
    worst: dict[str, float] = {}

    def note(name: str, got: Any, want: Any) -> None:
        scale = max(float(want.abs().max()) if want.numel() else 0.0, 1e-6)
        err = float((got.detach().to(want.device) - want).abs().max()) / scale if want.numel() else 0.0
        worst[name] = max(worst.get(name, 0.0), err)

    for step in range(STEPS_A):
        kjt = global_kjt_batch(tables, 1, BATCH, seed=step)[0].to(device)
        gen = torch.Generator().manual_seed(100 + step)
        projection = {f: torch.randn(BATCH, d, generator=gen).to(device) for f, d in sorted(dims.items())}
        ref_opt.zero_grad()
        ref_out = _outputs(reference(kjt))
        sum((ref_out[f] * projection[f]).sum() for f in projection).backward()
        ref_opt.step()
        out = _outputs(model(kjt))
        off = _off_device(out, device)
        if off:
            raise AssertionError(f"outputs off {device}: {off}")
        sum((out[f] * projection[f]).sum() for f in projection).backward()
        for f in projection:
            note("outputs", out[f], ref_out[f].detach())
    state = reference.state_dict()
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                region = state[key]
                for dim, (off, size) in enumerate(zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)):
                    region = region.narrow(dim, off, size)
                note("weights", shard.tensor, region)
        elif key in state:
            note("weights", value, state[key])
    if device.type == "cuda":
        torch.cuda.synchronize()
    tolerance = TOLERANCE[precision]
    ok = all(math.isfinite(v) and v <= tolerance for v in worst.values()) and set(worst) == {"outputs", "weights"}
    ok = ok and (precision == "fp32" or worst["outputs"] > 0.0)  # a codec below fp32 must change something
    detail = (
        f"max rel err outputs {worst.get('outputs', float('nan')):.2e} "
        f"weights {worst.get('weights', float('nan')):.2e} (tol {tolerance:.0e})"
    )
    return {"status": "pass" if ok else "FAIL", "detail": detail, "errors": worst}


# ================================================================================ (b) 4 ranks as rank 0 of a fake world


@contextmanager
def _mirror_collectives() -> Iterator[None]:
    """Wraps torch.distributed's collectives for the fake process group (which leaves outputs uninitialised): every
    peer sends this rank exactly what it sends itself (a message of another size arrives as zeros). That is a
    consistent world for the dists' metadata: the split sizes, batch sizes and counts peers report agree with the
    tensors they then send."""
    import torch
    import torch.distributed as dist

    from embark_torchrec.testing.host_work import EXCHANGE_COLLECTIVES

    originals = {name: getattr(dist, name) for name in EXCHANGE_COLLECTIVES}

    def me_n(group: Any) -> tuple[int, int]:
        return dist.get_rank(group), dist.get_world_size(group)

    def all_to_all_single(
        output: Any,
        input: Any,
        output_split_sizes: Any = None,
        input_split_sizes: Any = None,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        work = originals["all_to_all_single"](
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )
        me, n = me_n(group)
        out_sizes = [int(x) for x in output_split_sizes] if output_split_sizes else [output.size(0) // n] * n
        in_sizes = [int(x) for x in input_split_sizes] if input_split_sizes else [input.size(0) // n] * n
        mine = input.narrow(0, sum(in_sizes[:me]), in_sizes[me])
        with torch.inference_mode():  # as a real collective writes: outside autograd, into any buffer
            for j, chunk in enumerate(torch.split(output, out_sizes)):
                chunk.copy_(mine) if chunk.shape == mine.shape else chunk.zero_()
        return work

    def all_to_all(output_list: Any, input_list: Any, group: Any = None, async_op: bool = False) -> Any:
        work = originals["all_to_all"](output_list, input_list, group=group, async_op=async_op)
        me, _ = me_n(group)
        with torch.inference_mode():
            for t in output_list:
                t.copy_(input_list[me]) if t.shape == input_list[me].shape else t.zero_()
        return work

    def all_gather(tensor_list: Any, tensor: Any, group: Any = None, async_op: bool = False) -> Any:
        work = originals["all_gather"](tensor_list, tensor, group=group, async_op=async_op)
        with torch.inference_mode():
            for t in tensor_list:
                t.copy_(tensor)
        return work

    def all_gather_into_tensor(output: Any, input: Any, group: Any = None, async_op: bool = False) -> Any:
        work = originals["all_gather_into_tensor"](output, input, group=group, async_op=async_op)
        _, n = me_n(group)
        with torch.inference_mode():
            output.view(n, -1).copy_(input.reshape(1, -1).expand(n, -1))
        return work

    def reduce_scatter_tensor(
        output: Any, input: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
    ) -> Any:
        work = originals["reduce_scatter_tensor"](output, input, op=op, group=group, async_op=async_op)
        me, n = me_n(group)
        with torch.inference_mode():
            output.copy_(input.reshape(n, -1)[me].view_as(output))
        return work

    def reduce_scatter(
        output: Any, input_list: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
    ) -> Any:
        work = originals["reduce_scatter"](output, input_list, op=op, group=group, async_op=async_op)
        me, _ = me_n(group)
        with torch.inference_mode():
            output.copy_(input_list[me])
        return work

    wrapped = {
        "all_to_all_single": all_to_all_single,
        "all_to_all": all_to_all,
        "all_gather": all_gather,
        "all_gather_into_tensor": all_gather_into_tensor,
        "reduce_scatter_tensor": reduce_scatter_tensor,
        "reduce_scatter": reduce_scatter,
    }
    for name, fn in wrapped.items():
        setattr(dist, name, fn)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def check_fake_world(kind: str, device: Any) -> dict[str, Any]:
    """Rank 0 of 4 (2 per node) on the fake group: 2 forward+backward steps; outputs must be on the device."""
    import torch
    import torchrec.distributed.comm as torchrec_comm

    from embark_torchrec.testing import fake_world, global_kjt_batch

    tables = _tables()
    saved = torchrec_comm._INTRA_PG, torchrec_comm._CROSS_PG
    torchrec_comm._INTRA_PG = torchrec_comm._CROSS_PG = None  # torchrec caches these; each world needs its own
    try:
        with fake_world(WS_B, rank=0, local_world_size=LWS_B), _mirror_collectives():
            torch.manual_seed(0)
            model = _sharded(kind, tables, WS_B, LWS_B, device)
            finite = True
            for step in range(STEPS_B):
                kjt = global_kjt_batch(tables, WS_B, BATCH, seed=step)[0].to(device)
                out = _outputs(model(kjt))
                off = _off_device(out, device)
                if off:
                    raise AssertionError(f"outputs off {device}: {off}")
                shapes = {k: tuple(v.shape) for k, v in out.items()}
                finite = finite and all(bool(torch.isfinite(v).all()) for v in out.values())
                sum(v.sum() for v in out.values()).backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
    finally:
        torchrec_comm._INTRA_PG, torchrec_comm._CROSS_PG = saved
    return {
        "status": "pass",
        "detail": f"{STEPS_B} fwd+bwd, outputs on {device} {sorted(shapes.items())}, finite={finite}",
    }


# ================================================================================ (d) lookups


def check_lookups(kind: str, device: Any) -> dict[str, Any]:
    """calibrate's TBE lookup measurement on `device` (this process's 1-rank group), its figures and the widest
    step's time against what each of LOOKUP_PRESETS predicts for that step through the cost model."""
    import socket

    from embark_torchrec.calibrate import (
        CPU_SETTINGS,
        GPU_SETTINGS,
        CalibrationError,
        Job,
        measure_lookups,
        quick,
        tbe_step_estimate_ms,
    )
    from embark_torchrec.plan.model.topology import PRESETS

    settings = quick(GPU_SETTINGS if device.type == "cuda" else CPU_SETTINGS)
    job = Job(0, 1, 1, device, (socket.gethostname(),))
    try:
        measured = {name: m["median"] for name, m in measure_lookups(job, settings, kind.partition(":")[2]).items()}
    except CalibrationError as e:
        if device.type == "cuda":
            raise
        return {"status": "pass", "detail": f"ran; the CPU host was too busy for a figure: {e}"}
    step = measured["tbe_step_ms"]
    lookup_figures = ("hbm_bw_gbps", "lookup_ns_per_id", "update_ns_per_row")
    own = PRESETS[LOOKUP_PRESETS[0]].with_overrides(**{f: max(0.0, measured[f]) for f in lookup_figures})
    predicted = {name: tbe_step_estimate_ms(PRESETS[name], settings) for name in LOOKUP_PRESETS}
    predicted["measured figures"] = tbe_step_estimate_ms(own, settings)
    presets = "/".join(f"{PRESETS[n].hbm_bw_gbps:.0f}" for n in LOOKUP_PRESETS)
    detail = (
        f"TBE step {step:.3f} ms measured; predicted "
        + ", ".join(f"{n} {ms:.3f} ms ({ms / step:.2f}x)" for n, ms in predicted.items())
        + f"; hbm_bw_gbps {measured['hbm_bw_gbps']:.0f} (presets {presets}), lookup_ns_per_id "
        f"{measured['lookup_ns_per_id']:.3f} (presets 0), update_ns_per_row {measured['update_ns_per_row']:.3f} "
        f"(presets 0)"
    )
    return {"status": "pass", "detail": detail}


# ================================================================================ worker processes


def _emit(what: str, **fields: Any) -> None:
    print(MARK + what + " " + json.dumps(fields), flush=True)


def worker(part: str, kinds: list[str], device_type: str) -> int:
    """Runs `kinds` of part a or b in this process, one result line each (the parent enforces the time)."""
    import traceback

    import torch
    import torch.distributed as dist

    from embark_torchrec.testing._env import rank_env

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device(device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if part in ("a", "d"):
        os.environ.update(rank_env(0, 1, 1))
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    for kind in kinds:
        _emit("start", kind=kind)
        start = time.perf_counter()
        selftest = os.environ.get(
            "GPU_CHECK_SELFTEST", ""
        )  # "hang:<kind>" / "crash:<kind>": tests the parent's handling
        if selftest == f"hang:{kind}":
            time.sleep(3600)
        if selftest == f"crash:{kind}":
            os.kill(os.getpid(), signal.SIGSEGV)
        try:
            result = {"a": check_exact, "b": check_fake_world, "d": check_lookups}[part](kind, device)
        except Exception as e:  # noqa: BLE001 - reported in the summary
            tb = traceback.format_exc().strip().splitlines()
            result = {
                "status": "FAIL",
                "detail": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                "traceback": tb[-12:],
            }
        result["seconds"] = round(time.perf_counter() - start, 2)
        _emit("result", kind=kind, **result)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


# ================================================================================ the parent


@dataclass
class Row:
    check: str
    status: str
    detail: str
    seconds: float


def _kill(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker and anything it started (its own process group)
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(text: str, lines: int = 3, chars: int = 400) -> str:
    """The last meaningful lines of a process's output (no caret markers, no "[rank0]:" prefixes)."""
    kept = [ln.replace("[rank0]:", "").strip() for ln in text.splitlines()]
    kept = [ln for ln in kept if ln and set(ln) - set("^~ ")]
    return " | ".join(kept[-lines:])[-chars:]


def _read_lines(stream: Any, lines: "queue.Queue[str | None]") -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


def run_part(
    part: str, kinds: list[str], device_type: str, per_check_s: float, part_budget_s: float, verbose: bool
) -> list[Row]:
    """Runs one part's kinds in worker subprocesses: a worker that crashes or overruns a check's budget is killed,
    that check is reported, and a new worker takes the rest (while the part's budget lasts)."""
    rows: list[Row] = []
    remaining = list(kinds)
    part_deadline = time.monotonic() + part_budget_s
    while remaining:
        if time.monotonic() >= part_deadline:
            rows += [Row(f"{part}/{k}", "SKIP", "the part's time budget ran out", 0.0) for k in remaining]
            break
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            part,
            "--device",
            device_type,
            "--kinds",
            ",".join(remaining),
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        with tempfile.TemporaryFile("w+") as stderr:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT, env=env, start_new_session=True
            )
            lines: "queue.Queue[str | None]" = queue.Queue()
            threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
            current: str | None = None
            started = time.monotonic()
            deadline = min(part_deadline, started + STARTUP_S)  # imports and the process group come first
            ended = "exited"
            while True:
                try:
                    line = lines.get(timeout=max(0.05, deadline - time.monotonic()))
                except queue.Empty:
                    ended = "timeout"
                    break
                if line is None:
                    break
                if verbose and not line.startswith(MARK):
                    print(f"  [{part}] {line.rstrip()}", flush=True)
                if not line.startswith(MARK):
                    continue
                what, _, payload = line[len(MARK) :].strip().partition(" ")
                fields = json.loads(payload)
                if what == "start":
                    current, started = fields["kind"], time.monotonic()
                    deadline = min(part_deadline, started + per_check_s)
                elif what == "result":
                    kind = fields["kind"]
                    rows.append(Row(f"{part}/{kind}", fields["status"], fields["detail"], fields["seconds"]))
                    print(f"  {part}/{kind}: {fields['status']} {fields['detail']} ({fields['seconds']} s)", flush=True)
                    if fields["status"] != "pass" and fields.get("traceback"):
                        print("    " + "\n    ".join(fields["traceback"]), flush=True)
                    remaining.remove(kind)
                    current = None
                    deadline = min(part_deadline, time.monotonic() + per_check_s)
            if ended == "timeout":
                _kill(proc)
            else:
                proc.wait()
            stderr.seek(0)
            tail = _tail(stderr.read())
        if not remaining:
            break
        victim = current or remaining[0]
        elapsed = round(time.monotonic() - started, 2)
        if ended == "timeout":
            limit = (
                "the part's budget"
                if time.monotonic() >= part_deadline
                else f"{per_check_s:.0f} s"
                if current
                else f"{STARTUP_S:.0f} s of start-up"
            )
            detail = f"no result within {limit} (worker killed)"
        else:
            detail = f"worker died (exit {proc.returncode}) {'during' if current else 'before'} this check: {tail}"
        rows.append(Row(f"{part}/{victim}", "FAIL", detail, elapsed))
        print(f"  {part}/{victim}: FAIL {detail}", flush=True)
        remaining.remove(victim)
        if current is None:  # it died before its first check: the others would die the same way
            rows += [
                Row(f"{part}/{k}", "FAIL", "not run: the worker died before its first check (see above)", 0.0)
                for k in remaining
            ]
            break
    return rows


def run_dlrm(steps: int, device_type: str, budget_s: float, extra: list[str], verbose: bool) -> Row:
    """(c): the DLRM example under torchrun, one process; its RESULT line parsed."""
    start = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        str(TRAIN),
        "--steps",
        str(steps),
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if device_type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the example picks CUDA whenever it sees one
    print(f"  c/dlrm: {' '.join(cmd[1:])}", flush=True)
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=budget_s, cwd=ROOT, env=env, start_new_session=True
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return Row(
            "c/dlrm",
            "FAIL",
            f"timed out after {budget_s:.0f} s; last output: {out.strip().splitlines()[-1:] if out else ''}",
            time.perf_counter() - start,
        )
    seconds = time.perf_counter() - start
    out = proc.stdout.replace("\r", "\n")
    if verbose:
        print("  [c] " + "\n  [c] ".join(out.strip().splitlines()[-30:]), flush=True)
    results = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(results) != 1:
        tail = _tail(proc.stderr or out, lines=6, chars=600)
        return Row("c/dlrm", "FAIL", f"exit {proc.returncode}, {len(results)} RESULT lines: {tail}", seconds)
    result = json.loads(results[0][len("RESULT ") :])
    problems = []
    if result.get("device") != device_type:
        problems.append(f"ran on {result.get('device')!r}, not {device_type}")
    if result.get("steps_run") != steps:
        problems.append(f"steps_run {result.get('steps_run')} != {steps}")
    for key in ("first_loss", "final_loss", "auc"):
        if not isinstance(result.get(key), (int, float)) or not math.isfinite(result[key]):
            problems.append(f"{key} = {result.get(key)!r}")
    detail = (
        f"device {result.get('device')}, {result.get('steps_run')} steps, "
        f"loss {result.get('first_loss'):.4f} -> {result.get('final_loss'):.4f}, "
        f"auc {result.get('auc')}, {result.get('samples_per_s')} samples/s"
        if not problems
        else "; ".join(problems) + f" (RESULT {json.dumps(result)[:300]})"
    )
    return Row("c/dlrm", "pass" if not problems else "FAIL", detail, seconds)


def environment_problem(dry_run: bool) -> str | None:
    """Why this machine cannot run the GPU checks (None: it can)."""
    if dry_run:
        return None
    import torch

    if not torch.cuda.is_available():
        return (
            f"CUDA is not available (torch {torch.__version__}, built with CUDA {torch.version.cuda}): "
            "run on a machine with an "
            "NVIDIA GPU and a CUDA build of torch, or validate the script logic with --dry-run-cpu"
        )
    import fbgemm_gpu

    variant = getattr(fbgemm_gpu, "__variant__", "unknown")
    if variant == "cpu":
        return f"fbgemm-gpu {fbgemm_gpu.__version__} is the CPU build: install the CUDA one (make GPU=1) and rerun"
    return None


def print_summary(rows: list[Row], header: str) -> None:
    widths = [
        max(len(r.check) for r in rows + [Row("check", "", "", 0)]),
        6,
        min(110, max(len(r.detail) for r in rows + [Row("", "", "detail", 0)])),
    ]
    line = f"{'check':<{widths[0]}}  {'status':<{widths[1]}}  {'detail':<{widths[2]}}  {'seconds':>8}"
    print("\n" + header)
    print(line)
    print("-" * len(line))
    for r in rows:
        detail = r.detail if len(r.detail) <= widths[2] else r.detail[: widths[2] - 3] + "..."
        print(f"{r.check:<{widths[0]}}  {r.status:<{widths[1]}}  {detail:<{widths[2]}}  {r.seconds:>8.1f}")
    passed = sum(r.status == "pass" for r in rows)
    print("-" * len(line))
    print(
        f"{passed}/{len(rows)} passed"
        + (
            ""
            if passed == len(rows)
            else f", {len(rows) - passed} did not: " + ", ".join(r.check for r in rows if r.status != "pass")
        )
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="run (a) on gloo and (b) with CPU tensors, (c) on CPU: checks the script's logic without a GPU",
    )
    p.add_argument(
        "--parts",
        default="a,b,c,d",
        help="which checks to run: a (exact, ws 1), b (fake ws 4), c (DLRM example), d (TBE lookups against presets)",
    )
    p.add_argument("--kinds", help="only these sharding types, comma separated (e.g. embark_rb:fp8,row_wise)")
    p.add_argument("--dlrm-steps", type=int, help="steps of the DLRM example (default 200; 20 with --dry-run-cpu)")
    p.add_argument("--per-check-s", type=float, default=60.0, help="time budget of one sharding type in (a) or (b)")
    p.add_argument("--budget-a-s", type=float, default=150.0, help="time budget of part (a), worker start-up included")
    p.add_argument("--budget-b-s", type=float, default=150.0, help="time budget of part (b), worker start-up included")
    p.add_argument("--budget-c-s", type=float, default=150.0, help="time budget of part (c)")
    p.add_argument("--budget-d-s", type=float, default=120.0, help="time budget of part (d), worker start-up included")
    p.add_argument("--json", type=Path, help="also write the summary rows here as JSON")
    p.add_argument("--verbose", action="store_true", help="echo the workers' and the example's output")
    p.add_argument("--worker", choices=("a", "b", "d"), help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker, args.kinds.split(","), args.device)
    problem = environment_problem(args.dry_run_cpu)
    if problem:
        print(f"gpu_check: cannot run: {problem}", file=sys.stderr)
        return 2
    device_type = "cpu" if args.dry_run_cpu else "cuda"
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    wanted = set(args.kinds.split(",")) if args.kinds else None
    rows: list[Row] = []
    started = time.perf_counter()
    for part, kinds, budget in (
        ("a", KINDS_A, args.budget_a_s),
        ("b", KINDS_B, args.budget_b_s),
        ("d", KINDS_D, args.budget_d_s),
    ):
        if part not in parts:
            continue
        kinds = [k for k in kinds if wanted is None or k in wanted or k.partition(":")[0] in wanted]
        if args.dry_run_cpu:  # fbgemm's FP8 row-wise kernel exists only on CUDA
            kinds = [k for k in kinds if k.partition(":")[2] not in CUDA_ONLY_CODECS]
        if not kinds:
            continue
        what = {
            "a": "exact at world size 1",
            "b": "world size 4 as rank 0 of a fake group",
            "d": "TBE lookups at world size 1 against the presets",
        }[part]
        print(f"({part}) {what} on {device_type}: {len(kinds)} checks", flush=True)
        try:
            rows += run_part(part, kinds, device_type, args.per_check_s, budget, args.verbose)
        except Exception as e:  # noqa: BLE001 - the other parts still run
            rows.append(Row(f"{part}/*", "FAIL", f"the checker itself failed: {type(e).__name__}: {e}", 0.0))
    if "c" in parts:
        steps = args.dlrm_steps or (20 if args.dry_run_cpu else 200)
        extra = ["--batch-size", "128", "--eval-batches", "2", "--log-every", "10"] if args.dry_run_cpu else []
        print(f"(c) the DLRM example, {steps} steps on {device_type}", flush=True)
        try:
            rows.append(run_dlrm(steps, device_type, args.budget_c_s, extra, args.verbose))
        except Exception as e:  # noqa: BLE001
            rows.append(Row("c/dlrm", "FAIL", f"the checker itself failed: {type(e).__name__}: {e}", 0.0))
    header = (
        f"gpu_check summary ({'CPU dry run' if args.dry_run_cpu else 'CUDA'}, {time.perf_counter() - started:.0f} s)"
    )
    print_summary(rows, header)
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1) + "\n")
    return 0 if rows and all(r.status == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
