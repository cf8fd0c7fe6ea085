"""Any of TorchRec's QuantizedCommCodec runs on our dists: a sharder's QCommsConfig registry reaches our grid
and unique-based clusters as given, as it reaches TorchRec's own shardings. fbgemm's row-wise codecs (INT8,
and FP8 with QCommsConfig's fp8_quantize_dim where its kernel runs: not on CPU) get each run of rows of one
width with their row dim set to that width, so that they scale each embedding row; a user's element-wise
codec gets the whole message. Where the plan sets a cluster's precision, our codecs carry it instead
(test_qcomms.py)."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.fbgemm_qcomm_codec import CommOp, CommType, QCommsConfig, get_qcomm_codecs_registry
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import QuantizedCommCodec, QuantizedCommCodecs, ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from embark_torchrec.plan.layout.tables import Plan, TableLayout
from embark_torchrec.plan.model.spec import ModelSpec
from embark_torchrec.sharding.codecs import decode, encode, encoded_size
from embark_torchrec.sharding.comm_stats import enable_comm_stats
from embark_torchrec.planner.parameter_sharding import module_sharding_plan
from embark_torchrec.sharding.sharder import EmbarkEmbeddingBagCollectionSharder
from embark_torchrec.testing import global_kjt_batch, run_ranks
from embark_torchrec.testing.host_work import HostWorkCounter
from embark_torchrec.testing.training import SparseArch

DIM = 8
TABLES = [
    EmbeddingBagConfig(name="g", num_embeddings=40, embedding_dim=DIM, feature_names=["g0"]),
    EmbeddingBagConfig(name="h", num_embeddings=36, embedding_dim=DIM, feature_names=["h0"]),
    EmbeddingBagConfig(name="u", num_embeddings=30, embedding_dim=DIM, feature_names=["u0"]),
]
# a row-wise codec's largest error on one value, over its row's largest magnitude: e4m3 rounds to 3 mantissa
# bits; int8 rounds to 1/255 of the row's range (at most twice its largest magnitude), half a step
ROW_UNIT = {"fbgemm_fp8": 2.0**-4, "fbgemm_int8": 1.0 / 255}
FP16_UNIT = 2.0**-11


def fp8_rowwise_runs_here() -> bool:
    """Whether fbgemm's FP8 row-wise kernel runs on this build (fbgemm-gpu-cpu has none)."""
    try:
        torch.ops.fbgemm.FloatToFP8RowwiseQuantized(torch.ones(1, 4), True)
    except (RuntimeError, NotImplementedError):
        return False
    return True


ROW_WISE = [
    "fbgemm_int8",
    pytest.param(
        "fbgemm_fp8",
        marks=pytest.mark.skipif(
            not fp8_rowwise_runs_here(),
            reason="fbgemm's FloatToFP8RowwiseQuantized has no CPU kernel in this build "
            "(INT8 takes the same row-wise path)",
        ),
    ),
]


class HalfCodec(QuantizedCommCodec[None]):
    """A user's element-wise codec: fp16 values on the wire; counts the values it encodes."""

    def __init__(self) -> None:
        self.encoded = 0

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.float16

    def encode(self, input_tensor: torch.Tensor, ctx: Optional[None] = None) -> torch.Tensor:
        self.encoded += input_tensor.numel()
        return input_tensor.to(torch.float16)

    def decode(self, input_grad: torch.Tensor, ctx: Optional[None] = None) -> torch.Tensor:
        return input_grad.to(torch.float32)

    def calc_quantized_size(self, input_len: int, ctx: Optional[None] = None) -> int:
        return input_len

    def create_context(self) -> None:
        return None

    def padded_size(
        self, input_tensor: torch.Tensor, dim_per_rank: List[int], my_rank: int, qcomm_ctx: None
    ) -> Tuple[int, int]:
        return dim_per_rank[my_rank], 0


def _fbgemm(kind: str) -> Any:
    if kind == "fbgemm_fp8":
        config = QCommsConfig(
            forward_precision=CommType.FP8,
            backward_precision=CommType.FP8,
            fp8_quantize_dim=DIM,
            fp8_quantize_dim_bwd=DIM,
        )
    else:
        config = QCommsConfig(forward_precision=CommType.INT8, backward_precision=CommType.INT8)
    return get_qcomm_codecs_registry(config, device=torch.device("cpu"))


def _registry(kind: str) -> Any:
    if kind == "fp32":
        return None
    if kind.startswith("fbgemm_"):
        return _fbgemm(kind)
    return {CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name: QuantizedCommCodecs(forward=HalfCodec(), backward=HalfCodec())}


def _step(kind: str) -> dict[str, Any]:
    ws = dist.get_world_size()
    layouts = {  # no precision in the plan: the sharder's codecs apply
        "g": TableLayout("rb", (0, 15, 40), (0, DIM), ((0,), (1,))),  # flat grid
        "h": TableLayout("rb", (0, 20, 36), (0, 4, DIM), ((0, 1), (1, 0))),  # 2 x 2: rows of 4 and 8 in one message
        "u": TableLayout("ub", (0, 12, 30), (0, DIM), ((1,), (0,))),  # unique-based
    }
    torch.manual_seed(0)
    meta = SparseArch(TABLES, False, torch.device("meta"))
    spec = ModelSpec.from_module(meta.ebc, batch_size=2)
    registry = _registry(kind)
    sharder = EmbarkEmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1}, qcomm_codecs_registry=registry)
    model = DistributedModelParallel(
        meta,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=ShardingPlan({"ebc": module_sharding_plan(Plan(ws, ws, layouts), spec, "cpu")}),
        sharders=[sharder],
        device=torch.device("cpu"),
    )
    stats = enable_comm_stats(model)
    out = model(global_kjt_batch(TABLES, 2, 8, seed=1)[dist.get_rank()])
    out = (out.wait() if hasattr(out, "wait") else out).to_dict()
    sum((v * (1 + torch.arange(v.numel()).view_as(v) % 3)).sum() for v in out.values()).backward()
    by_table = {
        t: {
            kind: sum(stats.totals(k for k in stats.keys() if k.table == t and k.kind == kind).values())
            for kind in ("embeddings", "gradients")
        }
        for t in ("g", "h", "u")
    }
    codecs = (registry or {}).get(CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name)
    encoded = [getattr(c, "encoded", 0) for c in (codecs.forward, codecs.backward)] if codecs else [0, 0]
    return {"bytes": by_table, "out": {k: v.detach() for k, v in out.items()}, "encoded": encoded}


def _run() -> dict[str, Any]:
    kinds = ["fp32", "fbgemm_int8", "user"] + (["fbgemm_fp8"] if fp8_rowwise_runs_here() else [])
    return {kind: _step(kind) for kind in kinds}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_run, 2, timeout_s=240)


@pytest.mark.parametrize("kind", ROW_WISE)
def test_fbgemm_rowwise_codecs_run_on_grid_and_unique_dists_within_their_bound(
    results: list[dict[str, Any]], kind: str
) -> None:
    """Outputs within the codec's rounding of the partial sums (one scale per row: a partial sum's error is at
    most ROW_UNIT of its row's largest value; a column adds two cells' sums here, none larger than the output's
    largest value by more than a few times), and the codec really applied on every cluster kind."""
    for r in results:
        for feature in ("g0", "h0", "u0"):
            ref, got = r["fp32"]["out"][feature], r[kind]["out"][feature]
            assert not torch.equal(ref, got), feature
            bound = 4 * ROW_UNIT[kind] * float(ref.abs().max())
            assert float((got - ref).abs().max()) <= bound, feature


@pytest.mark.parametrize("kind", ROW_WISE)
def test_bytes_counted_are_what_fbgemm_rowwise_codecs_send(results: list[dict[str, Any]], kind: str) -> None:
    """fbgemm's row-wise row of 8 values is 8 value bytes + 8 bytes of scale and bias: half the fp32 row's 32,
    both ways; the 2 x 2 grid's rows of 4 columns take 4 + 8 = 12 bytes against 16 (and "h" sends rows of both
    widths in one message: each run went through the codec at its own width)."""
    for r in results:
        for t, ratio in (("g", 2.0), ("u", 2.0), ("h", 16 / 12)):
            for direction in ("embeddings", "gradients"):
                fp32, coded = r["fp32"]["bytes"][t][direction], r[kind]["bytes"][t][direction]
                assert coded > 0 and coded * ratio == pytest.approx(fp32), (t, direction, coded, fp32)


def test_a_users_codec_runs_on_every_cluster_both_ways(results: list[dict[str, Any]]) -> None:
    """A user's element-wise codec carries the embeddings (its forward instance) and the gradients (its
    backward one): both encoded values, the outputs are within fp16 rounding of a few partial sums, and the
    counted bytes are its 2 bytes per value."""
    for r in results:
        assert min(r["user"]["encoded"]) > 0
        for feature in ("g0", "h0", "u0"):
            ref, got = r["fp32"]["out"][feature], r["user"]["out"][feature]
            assert not torch.equal(ref, got), feature
            torch.testing.assert_close(got, ref, rtol=4 * FP16_UNIT, atol=4 * FP16_UNIT * float(ref.abs().max()))
        for t in ("g", "h", "u"):
            for kind in ("embeddings", "gradients"):
                assert r["user"]["bytes"][t][kind] * 2 == r["fp32"]["bytes"][t][kind] > 0


@pytest.mark.parametrize("kind", ROW_WISE)
def test_a_row_dim_codec_gets_each_width_of_a_message_as_rows_of_it(kind: str) -> None:
    """A message of rows of widths 4 and 8 (two cells) goes through fbgemm's row-wise codec as two runs, each
    scaled per row of its own width: its size is the codec's for each run, and it decodes within the row-wise
    bound (rows of small values next to rows of large ones keep their precision)."""
    codec = _fbgemm(kind)[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name].forward
    gen = torch.Generator().manual_seed(0)
    small, large = torch.randn(6, 4, generator=gen) * 1e-3, torch.randn(5, 8, generator=gen) * 1e3
    x = torch.cat([small.reshape(-1), large.reshape(-1)])
    peers = [[(small.numel(), 4)], [(large.numel(), 8)]]
    with torch.inference_mode():
        wire = encode(codec, x, peers)
    assert wire.numel() == encoded_size(codec, peers[0]) + encoded_size(codec, peers[1]) == 6 * (4 + 8) + 5 * (8 + 8)
    y = decode(codec, wire, peers)
    for got, ref in ((y[: small.numel()].view(6, 4), small), (y[small.numel() :].view(5, 8), large)):
        assert bool(((got - ref).abs() <= ROW_UNIT[kind] * ref.abs().amax(dim=1, keepdim=True)).all())


def _mixed_message(cells: int) -> tuple[torch.Tensor, list[list[tuple[int, Any]]]]:
    """Two peers' messages of `cells` cells each, alternately rows of width 4 and 8, one cell a block pair."""
    gen = torch.Generator().manual_seed(cells)
    peers: list[list[tuple[int, Any]]] = [[], []]
    for peer in peers:
        for c in range(cells):
            peer.append((3 * 4, 4) if c % 2 else (2 * 8, 8))
        peer.append((2 * 12, (4, 8)))  # two cells side by side: rows of blocks 4 and 8
    x = torch.randn(sum(e for peer in peers for e, _ in peer), generator=gen)
    return x, peers


@pytest.mark.parametrize("kind", ROW_WISE)
def test_a_row_wise_codec_takes_the_same_ops_for_3_cells_or_30(kind: str) -> None:
    """A row-wise codec of TorchRec's protocol encodes and decodes the vectors of each width at once: the same aten
    ops for a message of 3 cells as for one of 30 (host work per width, not per cell), its size the sum of its
    vectors' rows, and every vector within the row-wise bound."""
    codec = _fbgemm(kind)[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name].forward
    ops = []
    for cells in (3, 30):
        x, peers = _mixed_message(cells)
        with torch.inference_mode():
            encode(codec, x, peers)  # the first step of a layout builds its indices
            with HostWorkCounter() as counter:
                wire = encode(codec, x, peers)
                y = decode(codec, wire, peers)
        ops.append(counter.summary()["aten_ops"])
        rows = {4: 0, 8: 0}
        for peer in peers:
            for e, w in peer:
                for b in w if isinstance(w, tuple) else (w,):
                    rows[b] += e // (sum(w) if isinstance(w, tuple) else w)
        assert wire.numel() == sum(encoded_size(codec, p) for p in peers) == rows[4] * (4 + 8) + rows[8] * (8 + 8)
        start = 0
        for peer in peers:
            for e, w in peer:
                widths = w if isinstance(w, tuple) else (w,)
                got, ref = y[start : start + e].view(-1, sum(widths)), x[start : start + e].view(-1, sum(widths))
                col = 0
                for b in widths:
                    g, r = got[:, col : col + b], ref[:, col : col + b]
                    assert bool(((g - r).abs() <= ROW_UNIT[kind] * r.abs().amax(dim=1, keepdim=True)).all())
                    col += b
                start += e
    assert ops[0] == ops[1], ops
