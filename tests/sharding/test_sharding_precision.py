"""Wire precision per cluster: fp16 / bf16 (torchrec's codecs) and fp8 (ours) on the all-to-alls of flat and
hierarchical grids and of unique-based tables.

- codecs: every element of N(0,1) rows decodes within the documented bound (codecs.py), and the wire size is what
  the cost model charges (fp16/bf16 half of fp32; fp8 one byte per value plus a 4-byte scale per row);
- first-step outputs and weights after two steps stay within a few roundings of the unsharded fp32 model, and the
  precision is really applied on every feature;
- a short training run's loss stays within 1% of the same run at fp32.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from embark_torchrec.plan.layout.wire import vector_bytes
from embark_torchrec.plan.layout.tables import TableLayout, WirePrecision
from embark_torchrec.sharding.codecs import _codec, encode, encoded_size, decode
from embark_torchrec.testing import global_kjt_batch, run_ranks
from embark_torchrec.testing.training import compare_sharded_training, sharded_model

pytestmark = pytest.mark.torchrec_version

TABLES = [
    EmbeddingBagConfig(name="g", embedding_dim=16, num_embeddings=60, feature_names=["g0", "g1"]),
    EmbeddingBagConfig(name="h", embedding_dim=8, num_embeddings=40, feature_names=["h0"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="u", embedding_dim=12, num_embeddings=50, feature_names=["u0"]),
]
FEATURES = ["g0", "g1", "h0", "u0"]
# Relative rounding of one value on the wire (fp8 also has an absolute floor, see codecs.py).
UNIT = {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8, "fp8": 2.0**-4}
PRECISIONS = ["fp32/fp32", "fp16/fp16", "bf16/bf16", "fp16/bf16", "fp8/fp8", "fp8/fp16"]
TRAIN_STEPS = 30


def _layouts(forward: str, backward: str) -> dict[str, TableLayout]:
    p = WirePrecision(forward, backward)
    return {
        "g": TableLayout("rb", (0, 25, 60), (0, 8, 16), ((0, 3), (2, 1)), p),
        "h": TableLayout("rb", (0, 10, 40), (0, 8), ((1,), (2,)), p, hierarchical=True),
        "u": TableLayout("ub", (0, 20, 50), (0, 4, 12), ((3, 1), (0, 3)), p),
    }


def _train_losses(precision: str) -> list[float]:
    """Mean loss over all ranks at each step of a short fused-Adagrad run: pooled embeddings projected onto a
    fixed direction are the logit of a click label that depends on the IDs."""
    forward, backward = precision.split("/")
    torch.manual_seed(0)
    model = sharded_model(TABLES, _layouts(forward, backward), 2, optimizer="adagrad", lr=0.05)
    gen = torch.Generator().manual_seed(1)
    direction = {f: torch.randn(t.embedding_dim, generator=gen) for t in TABLES for f in t.feature_names}
    losses = []
    for step in range(TRAIN_STEPS):
        batch = global_kjt_batch(TABLES, dist.get_world_size(), 32, seed=step, ids="zipf")[dist.get_rank()]
        # per sample, a click label that depends on its IDs, as in a DLRM (learnable up to collisions)
        score = sum(
            torch.segment_reduce((kjt.values() % 3).float() - 1.0, "sum", lengths=kjt.lengths())
            for kjt in batch.to_dict().values()
        )
        label = (score > 0).float()
        out = model(batch)
        out = (out.wait() if hasattr(out, "wait") else out).to_dict()
        logit = sum(out[f] @ direction[f] for f in FEATURES)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, label)
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return losses


def _run() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for precision in PRECISIONS:
        forward, backward = precision.split("/")
        out[precision] = compare_sharded_training(TABLES, _layouts(forward, backward), 2, steps=2, ids="zipf")
        out[f"train/{precision}"] = _train_losses(precision)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_run, 4, local_world_size=2, timeout_s=600)


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp8"])
def test_codec_error_and_size_on_normal_rows(precision: str) -> None:
    """N(0,1) rows of several widths in messages to two peers: every element decodes within the documented bound,
    and the wire size is the cost model's vector_bytes per row."""
    codec = _codec(precision)
    gen = torch.Generator().manual_seed(0)
    segments = [(37 * w, w) for w in (4, 12, 64, 128)]
    peers = [segments[:1], segments[1:]]
    x = torch.randn(sum(e for e, _ in segments), generator=gen)
    y = decode(codec, encode(codec, x, peers), peers)
    err = (y - x).abs()
    if precision == "fp8":
        row_max = torch.cat(
            [
                p.view(-1, w).abs().amax(dim=1, keepdim=True).expand(-1, w).reshape(-1)
                for p, (_, w) in zip(torch.split(x, [e for e, _ in segments]), segments)
            ]
        )
        bound = UNIT["fp8"] * x.abs() + 2.0**-10 * row_max / 448.0
    else:
        bound = UNIT[precision] * x.abs() + 2.0**-24
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err.max()) > 0.0
    element = torch.empty(0, dtype=codec.quantized_dtype).element_size()
    assert encoded_size(codec, segments) * element == sum(e // w * vector_bytes(w, precision) for e, w in segments)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_forward_error_within_the_wire_rounding(results: Any, precision: str) -> None:
    """First-step outputs differ from the unsharded model by at most two roundings of the wire precision per
    value (a partial sum crosses at most two hops), and reduced precision really changes them (it is applied)."""
    forward = precision.split("/")[0]
    step0 = {k: v for r in results for k, v in r[precision].items() if k.startswith("step0/")}
    assert sorted({k.split("/")[1] for k in step0}) == FEATURES
    bound = 4 * UNIT[forward] * 2.0 + 1e-6  # outputs here stay below 2 in magnitude
    assert max(step0.values()) <= bound, step0
    if forward != "fp32":  # applied on the flat (g), hierarchical (h) and unique-based (u) tables alike
        for feature in FEATURES:
            assert max(v for k, v in step0.items() if k.endswith(feature)) > 0.0, f"{feature}: precision not applied"


@pytest.mark.parametrize("precision", PRECISIONS[1:])
def test_training_stays_close_to_fp32(results: Any, precision: str) -> None:
    """After two fused SGD steps, weights trained with reduced precision on the wire differ from the unsharded
    fp32 model (the gradients did travel reduced) by no more than a couple of roundings."""
    forward, backward = precision.split("/")
    weights = {k: v for r in results for k, v in r[precision].items() if k.startswith("weight/")}
    assert len(weights) == 3
    assert 0.0 < max(weights.values()) <= 2 * (UNIT[forward] + UNIT[backward]), weights


@pytest.mark.parametrize("precision", PRECISIONS[1:])
def test_short_training_loss_within_one_percent_of_fp32(results: Any, precision: str) -> None:
    """30 steps of fused Adagrad on a click label: the mean loss of the last 10 steps is within 1% of the fp32
    run's, and training did learn (the loss fell by a quarter)."""
    reference, losses = results[0]["train/fp32/fp32"], results[0][f"train/{precision}"]
    tail = lambda xs: sum(xs[-10:]) / 10  # noqa: E731
    assert tail(reference) < 0.75 * sum(reference[:5]) / 5, reference
    assert abs(tail(losses) - tail(reference)) <= 0.01 * tail(reference), (tail(losses), tail(reference))


def test_fp8_scales_each_block_of_a_row() -> None:
    """A row of several cells' partial sums side by side (width given as a tuple of block widths) gets one fp8
    scale per block, as the cost model prices one vector per cell: wire size = values + 4 bytes per block, and a
    block of small values keeps its own precision next to a block of large ones."""
    codec = _codec("fp8")
    rows, blocks = 5, (4, 8)
    gen = torch.Generator().manual_seed(1)
    x = torch.cat(
        [torch.randn(rows, 4, generator=gen) * 1e-3, torch.randn(rows, 8, generator=gen) * 1e3], dim=1
    ).reshape(-1)
    peers = [[(x.numel(), blocks)]]
    assert encoded_size(codec, peers[0]) == rows * (4 + 8) + rows * 2 * 4
    assert encoded_size(codec, peers[0]) * 1 == rows * (vector_bytes(4, "fp8") + vector_bytes(8, "fp8"))
    y = decode(codec, encode(codec, x, peers), peers).view(rows, 12)
    small, large = x.view(rows, 12)[:, :4], x.view(rows, 12)[:, 4:]
    assert bool(
        (
            (y[:, :4] - small).abs()
            <= UNIT["fp8"] * small.abs() + 2.0**-10 * small.abs().amax(dim=1, keepdim=True) / 448
        ).all()
    )
    assert bool(
        (
            (y[:, 4:] - large).abs()
            <= UNIT["fp8"] * large.abs() + 2.0**-10 * large.abs().amax(dim=1, keepdim=True) / 448
        ).all()
    )
