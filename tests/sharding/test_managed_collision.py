"""ManagedCollisionEmbeddingBagCollection and ManagedCollisionEmbeddingCollection: EmbarkPlanner plans their inner
collections row-wise (the only layout TorchRec's managed-collision sharding runs), DistributedModelParallel runs them
with our managed-collision sharders (TorchRec's, around our EBC and EC sharders, checking every batch), and they
train exactly like the same modules and plan run by TorchRec's own sharders (losses over two fused SGD steps and the
weights after them), at 2 ranks; a plain EBC next to them is planned on its own, and an MC module's inner collection
is not planned twice. A bad batch on one rank is every rank's named error within seconds, and the next good batch
runs on every rank (the modules run on a process group with a short timeout, so a rank left waiting in the managed
collisions' all-to-all fails the test instead of hanging it)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec import EmbarkEmbeddingBagCollectionSharder, EmbarkPlanner
from embark_torchrec.sharding.managed_collision import (
    EmbarkManagedCollisionEmbeddingBagCollectionSharder,
    EmbarkManagedCollisionEmbeddingCollectionSharder,
)
from embark_torchrec.sharding.sharded_ec import EmbarkEmbeddingCollectionSharder
from embark_torchrec.sharding.validation import InvalidInputError
from embark_torchrec.testing import run_ranks

pytestmark = pytest.mark.torchrec_version

FUSED = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
PG_TIMEOUT_S = 20.0  # a rank left waiting in a collective fails after this
WITHIN_S = 5.0  # every rank must have its error this soon


def _with(kjt: KeyedJaggedTensor, **change: Any) -> KeyedJaggedTensor:
    parts = {"values": kjt.values(), "lengths": kjt.lengths(), "weights": kjt.weights_or_none(), **change}
    return KeyedJaggedTensor(keys=kjt.keys(), stride=kjt.stride(), **parts)


# what one rank's bad batch is (from a good one), and words every rank's error has; raw IDs may be any int64 >= 0
# (the managed collisions remap them), so an ID is bad only when negative
BAD: dict[str, tuple[Callable[[KeyedJaggedTensor], KeyedJaggedTensor], list[str]]] = {
    "ids_uint8": (lambda k: _with(k, values=k.values().to(torch.uint8)), ["IDs are torch.uint8"]),
    "id_negative": (lambda k: _with(k, values=-k.values() - 1), ["outside [0, 9223372036854775807)"]),
    "negative_length": (lambda k: _with(k, lengths=torch.tensor([-1, 4, 2, 1])), ["1 negative bag lengths"]),
    "lengths_exceed_values": (lambda k: _with(k, values=k.values()[:-1]), ["add up to 6 IDs", "holds 5 values"]),
    "weights": (lambda k: _with(k, weights=torch.ones(6)), ["got per-sample weights", "TorchRec's would drop them"]),
}


def _collisions(tables: list[BaseEmbeddingConfig], device: torch.device) -> ManagedCollisionCollection:
    """Managed collisions hashing each table's IDs into its 40 rows."""
    modules = {
        t.name: MCHManagedCollisionModule(
            zch_size=40, device=device, eviction_interval=2, eviction_policy=DistanceLFU_EvictionPolicy()
        )
        for t in tables
    }
    return ManagedCollisionCollection(managed_collision_modules=modules, embedding_configs=tables)


class Model(torch.nn.Module):
    """A managed-collision EBC and a managed-collision EC (IDs hashed into 40 rows each) and a plain EBC."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        tables = [EmbeddingBagConfig(name="mc", num_embeddings=40, embedding_dim=8, feature_names=["user"])]
        self.mc = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=tables, device=device), _collisions(tables, device)
        )
        sequence = [EmbeddingConfig(name="mc_seq", num_embeddings=40, embedding_dim=8, feature_names=["history"])]
        self.mc_seq = ManagedCollisionEmbeddingCollection(
            EmbeddingCollection(tables=sequence, device=device), _collisions(sequence, device)
        )
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="plain", num_embeddings=30, embedding_dim=8, feature_names=["item"])],
            device=device,
        )

    def forward(self, user: KeyedJaggedTensor, item: KeyedJaggedTensor) -> torch.Tensor:
        mc = self.mc(user)
        mc = mc[0] if isinstance(mc, tuple) else mc
        history = KeyedJaggedTensor.from_lengths_sync(keys=["history"], values=user.values(), lengths=user.lengths())
        seq = self.mc_seq(history)
        seq = seq[0] if isinstance(seq, tuple) else seq
        return mc.values().sum() + (seq["history"].values() ** 2).sum() + self.ebc(item).values().sum()


def _batch(step: int, rank: int) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    user = KeyedJaggedTensor.from_lengths_sync(
        keys=["user"], values=torch.randint(0, 10**6, (6,), generator=g), lengths=torch.tensor([2, 0, 3, 1])
    )
    item = KeyedJaggedTensor.from_lengths_sync(
        keys=["item"], values=torch.randint(0, 30, (5,), generator=g), lengths=torch.tensor([1, 1, 2, 1])
    )
    return user, item


def _train(model: DistributedModelParallel) -> list[float]:
    losses = []
    for step in range(2):
        torch.manual_seed(step)  # the same random draws for both models (managed collisions draw some)
        loss = model(*_batch(step, dist.get_rank()))
        loss.backward()
        losses.append(float(loss))
    return losses


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                out[f"{key}@{shard.metadata.shard_offsets}"] = shard.tensor.clone()
        elif key.endswith("weight"):
            out[key] = value.clone()
    return out


def _one_bad_rank(model: DistributedModelParallel) -> dict[str, Any]:
    """Rank 1 feeds each bad batch to each managed-collision module, rank 0 a good one; both catch the error, then
    feed a good batch. Per case and module: each rank's error and how long it took, and whether the next batch ran."""
    out: dict[str, Any] = {}
    for name, feature in (("mc", "user"), ("mc_seq", "history")):
        module = getattr(model.module, name)
        good = KeyedJaggedTensor(
            keys=[feature], values=torch.arange(6) * 7919, lengths=torch.tensor([2, 0, 3, 1]), stride=4
        )
        for case, (corrupt, _) in BAD.items():
            start = time.monotonic()
            try:
                module(corrupt(good) if dist.get_rank() == 1 else good)
                error = "no error"
            except InvalidInputError as exc:
                error = f"{type(exc).__name__}: {exc}"
            seconds = time.monotonic() - start
            result = module(good)
            result = result[0] if isinstance(result, tuple) else result
            ran = bool(torch.isfinite(result.values() if name == "mc" else result[feature].values()).all())
            out[f"{name}/{case}"] = {"error": error, "seconds": seconds, "next_ran": ran}
    return out


def _run() -> dict[str, Any]:
    env = ShardingEnv.from_process_group(dist.new_group(backend="gloo", timeout=timedelta(seconds=PG_TIMEOUT_S)))
    ours = [
        EmbarkManagedCollisionEmbeddingBagCollectionSharder(
            ebc_sharder=EmbarkEmbeddingBagCollectionSharder(fused_params=FUSED)
        ),
        EmbarkManagedCollisionEmbeddingCollectionSharder(
            ec_sharder=EmbarkEmbeddingCollectionSharder(fused_params=FUSED)
        ),
        EmbarkEmbeddingBagCollectionSharder(fused_params=FUSED),
    ]
    theirs = [
        ManagedCollisionEmbeddingBagCollectionSharder(ebc_sharder=EmbeddingBagCollectionSharder(fused_params=FUSED)),
        ManagedCollisionEmbeddingCollectionSharder(ec_sharder=EmbeddingCollectionSharder(fused_params=FUSED)),
        EmbeddingBagCollectionSharder(fused_params=FUSED),
    ]
    planner = EmbarkPlanner(batch_size=4)
    plan = planner.collective_plan(Model(torch.device("meta")), ours)
    torch.manual_seed(0)
    model = DistributedModelParallel(
        Model(torch.device("meta")), env=env, plan=plan, sharders=ours, device=torch.device("cpu")
    )
    stock = DistributedModelParallel(
        Model(torch.device("meta")), env=env, plan=plan, sharders=theirs, device=torch.device("cpu")
    )
    stock.load_state_dict(model.state_dict())
    return {
        "plan": {path: {t: ps.sharding_type for t, ps in p.items()} for path, p in plan.plan.items()},
        "stock": (_train(stock), _weights(stock)),
        "ours": (_train(model), _weights(model)),
        "one_bad_rank": _one_bad_rank(model),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_run, 2, timeout_s=300)


def test_managed_collision_modules_run_row_wise_like_torchrec(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert result["plan"]["mc"] == {"mc": "row_wise"}, result["plan"]
        assert result["plan"]["mc_seq"] == {"mc_seq": "row_wise"}, result["plan"]
        assert set(result["plan"]) == {"mc", "mc_seq", "ebc"}, result["plan"]  # inner collections not planned again
        (losses, weights), (stock_losses, stock_weights) = result["ours"], result["stock"]
        assert losses == stock_losses
        assert weights.keys() == stock_weights.keys() and any("mc_seq" in k for k in weights)
        for key, value in weights.items():
            assert torch.equal(value, stock_weights[key]), key


def test_one_bad_rank_in_a_managed_collision_module_is_every_ranks_named_error(
    results: list[dict[str, Any]],
) -> None:
    """A bad batch on rank 1 only (bad ID or length dtype, a negative raw ID, lengths that disagree with the values,
    per-sample weights, which managed collisions drop), fed to a managed-collision EBC and EC: every rank raises the
    same InvalidInputError naming rank 1, its feature where there is one, and what is wrong, within seconds (no rank
    waits in the managed collisions' all-to-all its bad peer never joins), and the next good batch runs on both."""
    for key in results[0]["one_bad_rank"]:
        name, case = key.split("/")
        got = [r["one_bad_rank"][key] for r in results]
        texts = {g["error"] for g in got}
        assert len(texts) == 1, (key, texts)
        (text,) = texts
        assert text.startswith("InvalidInputError: rank 1: ") or text.startswith("InvalidIdError: rank 1: "), text
        for word in BAD[case][1]:
            assert word in text, (key, word, text)
        assert all(g["seconds"] < WITHIN_S for g in got), (key, [g["seconds"] for g in got])
        assert all(g["next_ran"] for g in got), key
