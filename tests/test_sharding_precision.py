"""Wire precision per cluster: fp16 / bf16 on the all-to-alls of flat and hierarchical grid shardings."""

from __future__ import annotations

from typing import Any

import pytest
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from embark_torchrec.plan.layout import TableLayout, WirePrecision
from embark_torchrec.testing import run_ranks
from embark_torchrec.testing.training import compare_sharded_training

TABLES = [
    EmbeddingBagConfig(name="g", embedding_dim=16, num_embeddings=60, feature_names=["g0", "g1"]),
    EmbeddingBagConfig(name="h", embedding_dim=8, num_embeddings=40, feature_names=["h0"], pooling=PoolingType.MEAN),
]
# Relative rounding of one value on the wire, and the hops a partial sum takes (hierarchical: two).
UNIT = {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8}


def _layouts(forward: str, backward: str) -> dict[str, TableLayout]:
    p = WirePrecision(forward, backward)
    return {
        "g": TableLayout("rb", (0, 25, 60), (0, 8, 16), ((0, 3), (2, 1)), p),
        "h": TableLayout("rb", (0, 10, 40), (0, 8), ((1,), (2,)), p, hierarchical=True),
    }


def _run() -> dict[str, dict[str, float]]:
    out = {}
    for forward, backward in (("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "bf16"), ("fp16", "bf16")):
        out[f"{forward}/{backward}"] = compare_sharded_training(TABLES, _layouts(forward, backward), 2, steps=2)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, float]]]:
    return run_ranks(_run, 4, local_world_size=2, timeout_s=300)


@pytest.mark.parametrize("precision", ["fp32/fp32", "fp16/fp16", "bf16/bf16", "fp16/bf16"])
def test_forward_error_within_the_wire_rounding(results: Any, precision: str) -> None:
    """First-step outputs differ from the unsharded model by at most two roundings of the wire precision per
    value (a partial sum crosses at most two hops), and reduced precision really changes them (it is applied)."""
    forward = precision.split("/")[0]
    step0 = {k: v for r in results for k, v in r[precision].items() if k.startswith("step0/")}
    assert sorted({k.split("/")[1] for k in step0}) == ["g0", "g1", "h0"]
    bound = 4 * UNIT[forward] * 2.0 + 1e-6  # outputs here stay below 2 in magnitude
    assert max(step0.values()) <= bound, step0
    if forward != "fp32":  # applied on the flat (g) and the hierarchical (h) grid alike
        for feature in ("g0", "g1", "h0"):
            assert max(v for k, v in step0.items() if k.endswith(feature)) > 0.0, f"{feature}: precision not applied"


@pytest.mark.parametrize("precision", ["fp16/fp16", "bf16/bf16", "fp16/bf16"])
def test_training_stays_close_to_fp32(results: Any, precision: str) -> None:
    """After two fused SGD steps, weights trained with reduced precision on the wire differ from the unsharded
    fp32 model (the gradients did travel reduced) by no more than a couple of roundings."""
    forward, backward = precision.split("/")
    weights = {k: v for r in results for k, v in r[precision].items() if k.startswith("weight/")}
    assert len(weights) == 2
    assert 0.0 < max(weights.values()) <= 2 * (UNIT[forward] + UNIT[backward]), weights
