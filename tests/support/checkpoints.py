"""Train, checkpoint and inspect sharded models: the pieces of the checkpoint and determinism tests.

Run inside every rank (e.g. with run_ranks). A model is a SparseArch sharded by DistributedModelParallel with
EmbarkEmbeddingBagCollectionSharder, by any ShardingPlan: an EMBark plan from layouts (`embark_sharding_plan`) or
TorchRec's own planner (`torchrec_sharding_plan`). Model-parallel tables train with the sharder's fused optimizer;
data-parallel tables are dense parameters of the model, trained by a dense optimizer (`dense_optimizer`, a
KeyedOptimizer, so its state is keyed by parameter name as the fused one is).

`training_state` is what a trainer checkpoints: the model's state_dict, the fused optimizer's state and the dense
optimizer's state (the "state" parts only: their param_groups hold per-rank key lists, which DCP would keep from one
rank only). `flatten_state` names every tensor of it by a path (e.g. "fused/ebc.embedding_bags.t.weight/t.momentum1"),
`gather_full` assembles each one's global tensor on every rank, and `compare_with_full` checks this rank's pieces
against global tensors bit for bit; `unsharded_steps` is what training from a gathered state should give.

Hostile checkpoint folders, which resume must skip by name: `HOSTILE_MANIFESTS` damages a saved step's manifest (or
what it names) in each way a sloppy or hostile user might, with the words the reason must contain;
`stopped_between_renames` makes a re-save of a step stop where a crash between its two renames would, and
`leave_rename_window` leaves a directory as that crash does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim.keyed import KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from embark_torchrec import checkpoint
from embark_torchrec.plan.layout.tables import Plan, TableLayout
from embark_torchrec.planner.parameter_sharding import module_sharding_plan
from embark_torchrec.plan.model.spec import ModelSpec
from embark_torchrec.sharding.sharder import EmbarkEmbeddingBagCollectionSharder
from embark_torchrec.testing.batches import global_kjt_batch
from embark_torchrec.testing.training import ADAGRAD_EPS, OPTIMIZERS, SparseArch

__all__ = [
    "HOSTILE_MANIFESTS",
    "compare_with_full",
    "dense_optimizer",
    "embark_sharding_plan",
    "flatten_state",
    "gather_full",
    "leave_rename_window",
    "load_training_state",
    "make_sharder",
    "shard",
    "stopped_between_renames",
    "torchrec_sharding_plan",
    "train_steps",
    "training_state",
    "unsharded_steps",
]

_MODULE = "ebc"  # SparseArch keeps its collection here


def make_sharder(optimizer: str = "adagrad", lr: float = 0.1) -> EmbarkEmbeddingBagCollectionSharder:
    """Our sharder with a fused optimizer ("sgd": EXACT_SGD, "adagrad": EXACT_ADAGRAD, per-element state)."""
    return EmbarkEmbeddingBagCollectionSharder(
        fused_params={"optimizer": OPTIMIZERS[optimizer], "learning_rate": lr, "eps": ADAGRAD_EPS}
    )


def embark_sharding_plan(
    tables: Sequence[EmbeddingBagConfig], layouts: Mapping[str, TableLayout], local_world_size: int
) -> ShardingPlan:
    """The ShardingPlan of an EMBark Plan made of `layouts` (CPU placements), for a SparseArch of `tables`."""
    ws = dist.get_world_size()
    meta = SparseArch(list(tables), False, torch.device("meta"))
    plan = Plan(ws, local_world_size, dict(layouts))
    spec = ModelSpec.from_module(meta.ebc, batch_size=ws)
    plan.validate(spec)
    return ShardingPlan({_MODULE: module_sharding_plan(plan, spec, "cpu")})


def torchrec_sharding_plan(
    tables: Sequence[EmbeddingBagConfig],
    local_world_size: int,
    constraints: Mapping[str, Any] | None = None,
    optimizer: str = "adagrad",
    batch_size: int = 4,
) -> ShardingPlan:
    """TorchRec's default planner (EmbeddingShardingPlanner on a CPU topology) with our sharder, planned on rank 0
    and broadcast (collective_plan)."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import Topology as TorchrecTopology

    ws = dist.get_world_size()
    planner = EmbeddingShardingPlanner(
        topology=TorchrecTopology(world_size=ws, local_world_size=local_world_size, compute_device="cpu"),
        batch_size=batch_size,
        constraints=dict(constraints or {}),
    )
    meta = SparseArch(list(tables), False, torch.device("meta"))
    return planner.collective_plan(meta, [make_sharder(optimizer)], dist.group.WORLD)


def shard(
    tables: Sequence[EmbeddingBagConfig], sharding_plan: ShardingPlan, optimizer: str = "adagrad", lr: float = 0.1
) -> DistributedModelParallel:
    """A SparseArch of `tables` (initialised from the current torch seed) sharded by `sharding_plan` on CPU."""
    return DistributedModelParallel(
        SparseArch(list(tables), False, torch.device("meta")),
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=sharding_plan,
        sharders=[make_sharder(optimizer, lr)],
        device=torch.device("cpu"),
    )


def dense_optimizer(model: torch.nn.Module, lr: float = 0.1) -> KeyedOptimizer:
    """torch Adagrad (state "sum" and "step") over the parameters the fused optimizer does not train: here the
    data-parallel tables (whose gradients DDP averages over ranks)."""
    params = {k: p for k, p in in_backward_optimizer_filter(model.named_parameters()) if p.numel() > 0}
    return KeyedOptimizerWrapper(params, lambda ps: torch.optim.Adagrad(ps, lr=lr, eps=ADAGRAD_EPS))


def train_steps(
    model: torch.nn.Module,
    dense: KeyedOptimizer,
    tables: Sequence[EmbeddingBagConfig],
    steps: int,
    seed: int,
    batch_per_rank: int = 4,
    ids: str = "uniform",
) -> list[float]:
    """`steps` training steps on deterministic global batches (rank r trains on slice r); returns this rank's
    losses. The loss is a fixed random projection of every pooled output."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        batch = global_kjt_batch(list(tables), ws, batch_per_rank, seed=seed + 100 * step, ids=ids)[rank]
        gen = torch.Generator().manual_seed(seed + step)
        projection = {
            f: torch.randn(ws, batch_per_rank, t.embedding_dim, generator=gen)[rank]
            for t in tables
            for f in t.feature_names
        }
        dense.zero_grad()
        out = model(batch)
        out = (out.wait() if hasattr(out, "wait") else out).to_dict()
        loss = sum((out[k] * projection[k]).sum() for k in sorted(projection))
        loss.backward()  # type: ignore[union-attr]
        dense.step()
        losses.append(float(loss))
    return losses


def training_state(model: DistributedModelParallel, dense: KeyedOptimizer) -> dict[str, Any]:
    """What to checkpoint: {"model": state_dict, "fused": fused optimizer state, "dense": dense optimizer state}.

    The tensors are the live ones (views of the weights and of the optimizer states), so torch.distributed.checkpoint
    loads into them in place; a rank's "fused" part only names the tables it holds a cell of.
    """
    return {
        "model": model.state_dict(),
        "fused": model.fused_optimizer.state_dict()["state"],
        "dense": dense.state_dict()["state"],
    }


def load_training_state(model: DistributedModelParallel, dense: KeyedOptimizer, state: Mapping[str, Any]) -> None:
    """The documented second half of loading (after dcp.load filled `state` = training_state(...) in place): hand
    the loaded dicts to the model and both optimizers."""
    model.load_state_dict(state["model"])
    model.fused_optimizer.load_state_dict({"state": state["fused"]})
    dense.load_state_dict({"state": state["dense"]})


def flatten_state(state: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every tensor (ShardedTensor or plain) of a nested dict, by "/"-joined path."""
    flat: dict[str, Any] = {}
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_state(value, path + "/"))
        elif isinstance(value, (ShardedTensor, torch.Tensor)):
            flat[path] = value
        else:
            raise TypeError(f"{path}: unexpected {type(value).__name__} in a training state")
    return flat


def _pieces(value: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(offsets, tensor) of this rank's part of a tensor: the local shards of a ShardedTensor, else the whole."""
    if isinstance(value, ShardedTensor):
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    return [((0,) * value.dim(), value)]


def _region(full: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    for dim, (off, size) in enumerate(zip(offsets, sizes, strict=True)):
        full = full.narrow(dim, off, size)
    return full


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern, so that comparisons are bitwise (-0.0 != 0.0, NaN == the same NaN)."""
    t = t.detach().contiguous()
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype == torch.float64:
        return t.view(torch.int64)
    return t


def gather_full(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Each tensor of flatten_state(state) as a global tensor, on every rank (collective: every rank calls it).

    Pieces are all-gathered from every rank; a ShardedTensor must be covered exactly once by its shards, and the
    copies of a plain (replicated) tensor must be bitwise identical on every rank that has it; either failure raises.
    """
    flat = flatten_state(state)
    mine = {}
    for path, value in flat.items():
        sharded = isinstance(value, ShardedTensor)
        dtype = value.metadata().tensor_properties.dtype if sharded else value.dtype
        mine[path] = (tuple(value.size()), dtype, sharded, [(o, t.detach().clone()) for o, t in _pieces(value)])
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    paths = sorted({p for per_rank in everyone for p in per_rank})
    full: dict[str, torch.Tensor] = {}
    for path in paths:
        entries = [(r, per_rank[path]) for r, per_rank in enumerate(everyone) if path in per_rank]
        size, dtype, sharded, _ = entries[0][1]
        if any(e[:3] != (size, dtype, sharded) for _, e in entries):
            raise AssertionError(
                f"{path}: ranks disagree on its global size, dtype or kind: {[e[:3] for _, e in entries]}"
            )
        if not sharded:
            first = entries[0][1][3][0][1]
            for r, (_, _, _, pieces) in entries:
                if not torch.equal(_bits(pieces[0][1]), _bits(first)):
                    raise AssertionError(f"{path}: replicated copies differ between rank {entries[0][0]} and rank {r}")
            full[path] = first
            continue
        out = torch.zeros(size, dtype=dtype)
        count = torch.zeros(size, dtype=torch.int32)
        for _, (_, _, _, pieces) in entries:
            for offsets, tensor in pieces:
                _region(out, offsets, tensor.shape).copy_(tensor)
                _region(count, offsets, tensor.shape).add_(1)
        if not bool((count == 1).all()):
            raise AssertionError(
                f"{path}: shards cover {int((count == 0).sum())} elements never "
                f"and {int((count > 1).sum())} more than once"
            )
        full[path] = out
    return full


def compare_with_full(state: Mapping[str, Any], full: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Per path of flatten_state(state): this rank's pieces against the same regions of `full`, bitwise.

    Returns {path: {"differing": elements whose bits differ, "elements": elements compared, "cells": [(offsets,
    sizes)] compared, "sharded": bool}}; a path missing from `full` or of another global shape raises.
    """
    result: dict[str, dict[str, Any]] = {}
    for path, value in flatten_state(state).items():
        if path not in full:
            raise KeyError(f"{path}: not in the saved tensors ({sorted(full)})")
        if tuple(value.size()) != tuple(full[path].shape):
            raise ValueError(f"{path}: global shape {tuple(value.size())} != saved {tuple(full[path].shape)}")
        differing = elements = 0
        cells = []
        for offsets, tensor in _pieces(value):
            saved = _region(full[path], offsets, tensor.shape)
            if tensor.dtype != saved.dtype:
                raise TypeError(f"{path}: dtype {tensor.dtype} != saved {saved.dtype}")
            differing += int((_bits(tensor) != _bits(saved)).sum())
            elements += tensor.numel()
            cells.append((list(offsets), list(tensor.shape)))
        result[path] = {
            "differing": differing,
            "elements": elements,
            "cells": cells,
            "sharded": isinstance(value, ShardedTensor),
        }
    return result


def _table_of(path: str) -> str:
    """ "model/ebc.embedding_bags.t.weight" (or "fused/.../t.momentum1", "dense/.../sum") -> "t"."""
    return path.split("/")[1].split(".")[2]


def unsharded_steps(
    tables: Sequence[EmbeddingBagConfig],
    full: Mapping[str, torch.Tensor],
    steps: int,
    seed: int,
    world_size: int,
    batch_per_rank: int = 4,
    ids: str = "uniform",
    lr: float = 0.1,
) -> dict[str, torch.Tensor]:
    """What `train_steps` on `world_size` ranks should do to a model whose state is `full` (as gather_full gives,
    Adagrad throughout): an unsharded SparseArch with those weights and torch Adagrad with those sums (the fused
    tables' momentum1, the dense tables' sum and step) trains on the mean of the per-rank losses (TorchRec and DDP
    average gradients over ranks). Returns the state after `steps`, under the same paths as `full`."""
    reference = SparseArch(list(tables), False, torch.device("cpu"))
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for path, value in full.items():
            if path.startswith("model/"):
                params[path[len("model/") :]].copy_(value)
    opt = torch.optim.Adagrad(list(params.values()), lr=lr, eps=ADAGRAD_EPS)
    sums = {
        _table_of(p): v
        for p, v in full.items()
        if p.startswith("fused/") or (p.startswith("dense/") and p.endswith("/sum"))
    }
    step_of = {_table_of(p): v for p, v in full.items() if p.startswith("dense/") and p.endswith("/step")}
    for name, param in params.items():
        table = name.split(".")[2]
        opt.state[param]["sum"].copy_(sums[table])
        if table in step_of:
            opt.state[param]["step"].copy_(step_of[table])
    for step in range(steps):
        batch = global_kjt_batch(list(tables), world_size, batch_per_rank, seed=seed + 100 * step, ids=ids)
        gen = torch.Generator().manual_seed(seed + step)
        projection = {
            f: torch.randn(world_size, batch_per_rank, t.embedding_dim, generator=gen)
            for t in tables
            for f in t.feature_names
        }
        opt.zero_grad()
        loss = torch.zeros(())
        for r in range(world_size):
            out = reference(batch[r]).to_dict()
            loss = loss + sum((out[k] * projection[k][r]).sum() for k in sorted(projection))
        (loss / world_size).backward()
        opt.step()
    after: dict[str, torch.Tensor] = {}
    for path in full:
        table = _table_of(path)
        param = params[f"{_MODULE}.embedding_bags.{table}.weight"]
        if path.startswith("model/"):
            after[path] = param.detach().clone()
        elif path.endswith("/step"):
            after[path] = opt.state[param]["step"].clone()
        else:
            after[path] = opt.state[param]["sum"].clone()
    return after


# ---------------------------------------------------------------- hostile checkpoint folders


def _manifest(folder: Path) -> Path:
    return folder / checkpoint.MANIFEST_NAME


def _edit(folder: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Rewrite folder's manifest as JSON of edit(its data)."""
    data = json.loads(_manifest(folder).read_text())
    _manifest(folder).write_text(json.dumps(edit(data)))


def _set(key: str, value: Any) -> Callable[[Path], None]:
    return lambda folder: _edit(folder, lambda d: {**d, key: value})


def _set_entry(field: str, value: Any) -> Callable[[Path], None]:
    """Set `field` of the manifest's entry of .metadata."""

    def edit(d: dict[str, Any]) -> dict[str, Any]:
        d["files"][".metadata"][field] = value
        return d

    return lambda folder: _edit(folder, edit)


def _add_entry(name: str, file: Callable[[Path], Path]) -> Callable[[Path], None]:
    """List one more file under `name`, with the true size and SHA-256 of file(folder): only the name is wrong."""

    def damage(folder: Path) -> None:
        real = file(folder)
        size, sha = os.path.getsize(real), checkpoint._file_digest(real)[1]
        _edit(folder, lambda d: {**d, "files": {**d["files"], name: {"size": size, "sha256": sha}}})

    return damage


def _digits(field: str) -> Callable[[Path], None]:
    """A 5,000-digit integer (past Python's 4,300-digit str-to-int limit) as the manifest's first `field`."""

    def damage(folder: Path) -> None:
        text = _manifest(folder).read_text()
        _manifest(folder).write_text(re.sub(rf'"{field}": [0-9]+', f'"{field}": {"9" * 5000}', text, count=1))

    return damage


def _raw(content: bytes) -> Callable[[Path], None]:
    return lambda folder: _manifest(folder).write_bytes(content)


def _utf16(folder: Path) -> None:
    _manifest(folder).write_bytes(_manifest(folder).read_text().encode("utf-16"))


def _too_large(folder: Path) -> None:
    """The valid manifest, then zeros (a sparse file) past the size any save writes."""
    os.truncate(_manifest(folder), checkpoint.MANIFEST_MAX_BYTES + 1)


def _replace_by_link(path: Path) -> None:
    """path moved beside its folder and a symbolic link to it put in its place: the same bytes, reached by a link."""
    target = path.parent.parent / f"outside-{path.parent.name}-{path.name}"
    path.rename(target)
    path.symlink_to(target)


def _fifo(folder: Path) -> None:
    _manifest(folder).unlink()
    os.mkfifo(_manifest(folder))


def _folder(folder: Path) -> None:
    _manifest(folder).unlink()
    _manifest(folder).mkdir()


def _linked_folder(folder: Path) -> None:
    """A file reached through a link from the step folder to a folder outside it, listed with its true hash."""
    outside = folder.parent / f"outside-{folder.name}"
    outside.mkdir()
    (outside / "x").write_bytes(b"outside")
    (folder / "sub").symlink_to(outside)
    _add_entry("sub/x", lambda f: outside / "x")(folder)


def _data_file(folder: Path) -> Path:
    return sorted(folder.glob("*.distcp"))[0]


HOSTILE_MANIFESTS: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "deeply_nested_json": (_raw(b"[" * 200_000 + b"]" * 200_000), ("unreadable", "RecursionError")),
    "5000_digit_step": (_digits("step"), ("unreadable", "ValueError", "digits")),
    "5000_digit_size": (_digits("size"), ("unreadable", "ValueError", "digits")),
    "json_list": (_raw(b"[]"), ("not in format",)),
    "json_null": (_raw(b"null"), ("not in format",)),
    "json_string": (_raw(b'"embark-torchrec-checkpoint/1"'), ("not in format",)),
    "format_is_a_dict": (_set("format", {}), ("not in format",)),
    "step_is_a_string": (_set("step", "12"), ("lacks an integer 'step'",)),
    "step_is_true": (_set("step", True), ("lacks an integer 'step'",)),
    "step_is_a_float": (_set("step", 12.0), ("lacks an integer 'step'",)),
    "step_is_negative": (_set("step", -1), ("lacks an integer 'step'",)),
    "files_is_a_list": (_set("files", [".metadata"]), ("'files' table",)),
    "entry_is_a_string": (_set("files", {".metadata": "0"}), ("lacks an integer 'size'",)),
    "size_is_true": (_set_entry("size", True), ("lacks an integer 'size'",)),
    "size_is_negative": (_set_entry("size", -1), ("lacks an integer 'size'",)),
    "size_is_nan": (_set_entry("size", float("nan")), ("lacks an integer 'size'",)),
    "sha256_not_hex": (_set_entry("sha256", "z" * 64), ("64 lowercase hex",)),
    "binary_junk": (_raw(bytes(range(256)) * 64), ("unreadable", "UnicodeDecodeError")),
    "utf16": (_utf16, ("unreadable", "UnicodeDecodeError")),
    "larger_than_any_save": (_too_large, ("larger than",)),
    "symbolic_link": (lambda f: _replace_by_link(_manifest(f)), ("symbolic link",)),
    "fifo": (_fifo, ("not a regular file",)),
    "a_folder": (_folder, ("not a regular file",)),
    "name_outside": (_add_entry("../x", lambda f: f / ".metadata"), ("outside",)),
    "absolute_name": (_add_entry("/etc/hostname", lambda f: f / ".metadata"), ("outside",)),
    "unnormalised_name": (_add_entry("./.metadata", lambda f: f / ".metadata"), ("plain relative POSIX path",)),
    "nul_in_a_name": (_add_entry("x\0y", lambda f: f / ".metadata"), ("plain relative POSIX path",)),
    "100k_character_name": (_add_entry("../" + "x" * 100_000, lambda f: f / ".metadata"), ("outside", "characters")),
    "through_a_linked_folder": (_linked_folder, ("symbolic link out of",)),
    "data_file_is_a_link": (lambda f: _replace_by_link(_data_file(f)), ("symbolic link", ".distcp")),
}


@contextmanager
def stopped_between_renames() -> Iterator[None]:
    """Inside, a save of a step that exists stops (OSError) between its two renames, as a crash there would: the old
    step already moved aside as step_<n>.replaced, the new one, whole with its manifest, still step_<n>.partial."""
    real = os.replace

    def replace(src: Any, dst: Any) -> None:
        if str(src).endswith(".partial"):
            raise OSError(f"stopped before renaming {src} to {dst}")
        real(src, dst)

    os.replace = replace  # the function checkpoint.py renames with (for the whole process, while inside)
    try:
        yield
    finally:
        os.replace = real


def leave_rename_window(directory: str | os.PathLike[str], step: int) -> Path:
    """Leave `directory` as stopped_between_renames leaves a re-save of `step` (with the same state): step_<n> moved
    to step_<n>.replaced and a finished copy in step_<n>.partial. Returns the .replaced folder."""
    final = checkpoint.checkpoint_path(directory, step)
    replaced = final.with_name(final.name + ".replaced")
    final.rename(replaced)
    shutil.copytree(replaced, final.with_name(final.name + ".partial"))
    return replaced
