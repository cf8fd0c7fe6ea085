"""Per-cluster wire precision: what the plan's "precision" field turns into on the all-to-alls.

Every codec here is one of TorchRec's QuantizedCommCodec (torchrec/distributed/types.py), registered per
cluster as QCommsConfig's codecs are (a QuantizedCommCodecs under CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL), and
our dists (collectives.all_to_all) take any such codec: fbgemm's, TorchRec's or a user's.

fp16 and bf16 are TorchRec's fbgemm codecs (TorchRecCodec), built here directly so that torchrec's CPU
fallback from bf16 to fp16 does not apply. fp8 is our own codec (Fp8RowwiseCodec): float8 e4m3 with one fp32
scale per row vector, the bits carried as uint8 because gloo rejects float8 tensors; our messages hold rows of
several widths, so its QuantizationContext (SegmentContext) carries the message's layout as segments. Given a row
width (Fp8RowwiseCodec(row_width), wire_codecs(precision, row_width)), it also serves TorchRec's own dists, from
the sharder's registry as QCommsConfig's codecs do, or from the plan (a group "table_wise:fp8-fp8@64", its tables'
torchrec_at_fp8): their messages are whole rows of that width (table-wise and column-wise tables of one width),
and TorchRec's own FP8 codec has no CPU kernel.

A codec of TorchRec's protocol that scales rows of its context's row dim (fbgemm's INT8 row-wise, and its FP8
row-wise, QCommsConfig's fp8_quantize_dim, on GPUs) gets the message's vectors of each width at once, gathered,
the context's row dim set to that width, so that each cell's vector has its own scale (as plan/layout/wire.py prices our
fp8): a fixed number of ops per distinct width, whatever the number of cells (the gather and scatter indices are
built once per message layout). Any other codec (fp16, bf16, a user's element-wise one) takes the whole message
at once.

Per-element error bounds (round to nearest; |x| the element, a its row's largest magnitude):
fp16 |e| <= 2^-11 |x| (|x| >= 2^-14), bf16 |e| <= 2^-8 |x|, fp8 |e| <= 2^-4 |x| + 2^-10 a / 448.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torchrec.distributed.fbgemm_qcomm_codec import CommOp, CommType, QCommsConfig, get_qcomm_codecs
from torchrec.distributed.types import (
    NoOpQuantizedCommCodec,
    QuantizedCommCodec,
    QuantizedCommCodecs,
)

from ..plan.layout.groups import ShardingGroup
from ..plan.layout.tables import WirePrecision
from ..plan.layout.wire import FP8_SCALE_BYTES, intra_node_reduction_precision, rows_bytes

# A message part: `elems` values laid out as rows of `width`; a width given as a tuple is a row of
# blocks of those widths (several cells' partial sums side by side), each its own row for row-wise
# codecs, which scale each row.
Segment = Tuple[int, Union[int, Tuple[int, ...]]]


def _blocks(width: Union[int, Tuple[int, ...]]) -> Tuple[int, ...]:
    return width if isinstance(width, tuple) else (width,)


def scaled_rows(segment: Segment) -> int:
    """How many rows (blocks of rows) a row-wise codec scales in a segment."""
    elems, width = segment
    blocks = _blocks(width)
    return elems // sum(blocks) * len(blocks) if elems else 0


_TORCHREC_TYPES = {"fp32": CommType.FP32, "fp16": CommType.FP16, "bf16": CommType.BF16}
FP8_MAX = 448.0  # largest finite float8 e4m3fn


@dataclass
class SegmentContext:
    """What Fp8RowwiseCodec needs of one message, besides its values: its parts as (elements, row width)
    segments, the messages to (or from) each peer in order; or, where TorchRec's dists send (and set no
    segments), the one width of every row. `padded_dim_sum_per_rank` and `row_dim`: TorchRec's dists read them
    (padding for fbgemm's row-wise codecs, whose groups need not divide a rank's columns); ours scales whole
    rows and pads none."""

    segments: Sequence[Segment] = ()
    row_width: int = 0
    padded_dim_sum_per_rank: Optional[List[int]] = None
    row_dim: int = -1


class Fp8RowwiseCodec(QuantizedCommCodec[SegmentContext]):
    """float8 e4m3fn values with one fp32 scale per row (row max / 448), as uint8 bytes on the wire.

    A row of w values travels as its w value bytes followed by its scale's 4 bytes, so each peer's
    message is simply its rows in order and needs no per-peer handling. Messages are described per
    peer as segments (elements, row width), since our dists send blocks of different widths in one
    all-to-all; rows of one width take a fixed handful of ops (views), mixed widths a fixed number
    of gathers and scatters, whatever the number of segments."""

    wire_precision = "fp8"

    def __init__(self, row_width: int = 0) -> None:
        """`row_width`: the width of every row of the messages of a TorchRec dist this codec serves (0 for ours,
        which describe each message in its context)."""
        self.row_width = row_width

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.uint8

    def create_context(self) -> SegmentContext:
        return SegmentContext(row_width=self.row_width)

    def calc_quantized_size(self, input_len: int, ctx: Optional[SegmentContext] = None) -> int:
        segments = _segments_of(ctx, input_len)
        if sum(e for e, _ in segments) != input_len:
            raise ValueError(
                f"fp8 codec: the context's segments hold {sum(e for e, _ in segments)} values, not {input_len}"
            )
        return sum(int(rows_bytes(s[0], scaled_rows(s), "fp8")) for s in segments)

    def padded_size(
        self, input_tensor: torch.Tensor, dim_per_rank: List[int], my_rank: int, qcomm_ctx: SegmentContext
    ) -> Tuple[int, int]:
        return dim_per_rank[my_rank], 0  # each row carries its own scale: no padding

    @staticmethod
    def _one_width(segments: Sequence[Segment]) -> int:
        """The row width common to every block of every non-empty segment, or 0."""
        widths = {b for e, w in segments if e for b in _blocks(w)}
        return widths.pop() if len(widths) == 1 else 0

    @staticmethod
    def _row_widths(segments: Sequence[Segment]) -> np.ndarray:
        """Each row's width, in order."""
        parts = [np.tile(_blocks(w), e // sum(_blocks(w))) for e, w in segments if e]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    @staticmethod
    def _positions(widths: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each value and each scale byte of rows of `widths` sit in the wire layout."""
        n = int(widths.sum())
        out_start = np.cumsum(widths + FP8_SCALE_BYTES) - (widths + FP8_SCALE_BYTES)
        shift = torch.as_tensor(out_start - (np.cumsum(widths) - widths), device=device)
        values = torch.arange(n, device=device) + shift.repeat_interleave(
            torch.as_tensor(widths, device=device), output_size=n
        )
        scale_start = torch.as_tensor(out_start + widths, device=device)
        scales = (scale_start.unsqueeze(1) + torch.arange(FP8_SCALE_BYTES, device=device)).reshape(-1)
        return values, scales

    def encode(self, input_tensor: torch.Tensor, ctx: Optional[SegmentContext] = None) -> torch.Tensor:
        """The wire bytes of the message (best called in inference mode, as our all-to-all does: the payload
        only travels, so its dtype views need no autograd bookkeeping)."""
        x, segments = input_tensor, _segments_of(ctx, input_tensor.numel())
        if x.numel() == 0:
            return x.new_empty(0, dtype=torch.uint8)
        if x.dtype != torch.float32:  # (in inference mode even a no-op conversion is an op)
            x = x.float()
        tiny = torch.finfo(torch.float32).tiny
        width = self._one_width(segments)
        if width:  # rows of one width: values and scale side by side, by views
            rows = x.view(-1, width)
            scale = rows.abs().amax(dim=1, keepdim=True).clamp_(min=tiny).div_(FP8_MAX)
            q = (rows / scale).to(torch.float8_e4m3fn).view(torch.uint8)
            return torch.cat([q, scale.view(torch.uint8)], dim=1).view(-1)
        widths = self._row_widths(segments)
        lengths = torch.as_tensor(widths, device=x.device)
        scale = torch.segment_reduce(x.abs(), "max", lengths=lengths).clamp(min=tiny) / FP8_MAX
        q = (x / scale.repeat_interleave(lengths, output_size=x.numel())).to(torch.float8_e4m3fn).view(torch.uint8)
        values, scales = self._positions(widths, x.device)
        out = q.new_empty(x.numel() + len(widths) * FP8_SCALE_BYTES)
        out[values] = q
        out[scales] = scale.view(torch.uint8)
        return out

    def decode(self, input_grad: torch.Tensor, ctx: Optional[SegmentContext] = None) -> torch.Tensor:
        """The values of wire bytes (best an inference tensor, as the exchange allocates it: its dtype views
        then need no autograd bookkeeping); the result is a normal tensor."""
        y, values_len = input_grad, None
        if isinstance(ctx, SegmentContext) and ctx.row_width:  # a TorchRec dist's message: whole rows of one width
            values_len = y.numel() // (ctx.row_width + FP8_SCALE_BYTES) * ctx.row_width
        segments = _segments_of(ctx, values_len)
        if sum(e for e, _ in segments) == 0:
            return y.new_empty(0, dtype=torch.float32)
        width = self._one_width(segments)
        if width:
            with torch.inference_mode():
                values, scale_bytes = y.view(-1, width + FP8_SCALE_BYTES).split([width, FP8_SCALE_BYTES], dim=1)
                # the scale bytes are 4-byte aligned when the width is (TBE widths are multiples of 4)
                scale = (scale_bytes if width % 4 == 0 else scale_bytes.contiguous()).view(torch.float32)
                q = values.view(torch.float8_e4m3fn)
        else:
            widths = self._row_widths(segments)
            values, scales = self._positions(widths, y.device)
            lengths = torch.as_tensor(widths, device=y.device)
            with torch.inference_mode():
                scale = y[scales].view(torch.float32).repeat_interleave(lengths, output_size=values.numel())
                q = y[values].view(torch.float8_e4m3fn)
        # outside inference mode, so that the result may join autograd (e.g. be saved for backward)
        out = q.float() * scale
        return out.view(-1) if width else out


def _segments_of(ctx: Optional[SegmentContext], input_len: Optional[int] = None) -> Sequence[Segment]:
    """The context's segments; a context of one row width (a TorchRec dist's) describes a message of `input_len`
    values (a whole number of rows) as one segment."""
    if not isinstance(ctx, SegmentContext):
        raise ValueError("Fp8RowwiseCodec needs the message's SegmentContext (from create_context)")
    if ctx.segments or not ctx.row_width:
        return ctx.segments
    if input_len is None or input_len % ctx.row_width:
        raise ValueError(f"fp8 codec: a message of {input_len} values is not rows of {ctx.row_width}")
    return ((input_len, ctx.row_width),)


class TorchRecCodec(QuantizedCommCodec[Any]):
    """One of TorchRec's fbgemm codecs (fp16 / bf16), labelled with its wire precision for the byte
    counters (plan/layout/wire.py prices it)."""

    def __init__(self, precision: str) -> None:
        config = QCommsConfig(
            forward_precision=_TORCHREC_TYPES[precision], backward_precision=_TORCHREC_TYPES[precision]
        )
        self._codec = get_qcomm_codecs(config).forward
        self.wire_precision = precision

    @property
    def quantized_dtype(self) -> torch.dtype:
        return self._codec.quantized_dtype

    def encode(self, input_tensor: torch.Tensor, ctx: Optional[Any] = None) -> torch.Tensor:
        return self._codec.encode(input_tensor, ctx)

    def decode(self, input_grad: torch.Tensor, ctx: Optional[Any] = None) -> torch.Tensor:
        return self._codec.decode(input_grad, ctx)

    def calc_quantized_size(self, input_len: int, ctx: Optional[Any] = None) -> int:
        return self._codec.calc_quantized_size(input_len, ctx)

    def create_context(self) -> Optional[Any]:
        return self._codec.create_context()

    def padded_size(
        self, input_tensor: torch.Tensor, dim_per_rank: List[int], my_rank: int, qcomm_ctx: Any
    ) -> Tuple[int, int]:
        return self._codec.padded_size(input_tensor, dim_per_rank, my_rank, qcomm_ctx)


def _codec(precision: str, row_width: int = 0) -> Optional[QuantizedCommCodec]:
    if precision == "fp8":
        return Fp8RowwiseCodec(row_width)
    if precision == "fp32":
        return None
    return TorchRecCodec(precision)


# the collectives of an embedding group that carry embeddings forward and their gradients backward, by
# TorchRec's registry keys: our dists read the first; TorchRec's row-wise and table-row-wise reduce-scatter,
# and its sequence shardings send through the last
_EMBEDDING_COMM_OPS = (
    CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
    CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
    CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL,
)


def wire_codecs(precision: WirePrecision, row_width: int = 0) -> Optional[Dict[str, QuantizedCommCodecs]]:
    """One group's codec registry, from the plan's precision (the plan decides a cluster's precision, not
    module-wide qcomms), under every key an embedding group's collectives read, as QCommsConfig's registry
    is; our dists and TorchRec's take it alike (`row_width`: of every row a TorchRec dist of the group sends,
    for a row-scaled codec). None: fp32 both ways."""
    if (precision.forward, precision.backward) == ("fp32", "fp32"):
        return None
    return {
        op.name: QuantizedCommCodecs(
            forward=_codec(precision.forward, row_width) or NoOpQuantizedCommCodec(),
            backward=_codec(precision.backward, row_width) or NoOpQuantizedCommCodec(),
        )
        for op in _EMBEDDING_COMM_OPS
    }


def cluster_codecs(
    precision: WirePrecision, registry: Optional[Dict[str, QuantizedCommCodecs]], op: CommOp
) -> Optional[Dict[str, QuantizedCommCodecs]]:
    """The codec registry one of our clusters' dists take (under the pooled all-to-all's key, which they read):
    the plan's precision, where it sets one, in our codecs; else the sharder's QCommsConfig codecs of `op` as
    given (TorchRec's, fbgemm's or a user's QuantizedCommCodec), as TorchRec's own shardings take them."""
    if precision != WirePrecision():
        return wire_codecs(precision)
    codecs = (registry or {}).get(op.name)
    return None if codecs is None else {CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name: codecs}


def intra_node_codecs(codecs: Optional[QuantizedCommCodecs]) -> Optional[QuantizedCommCodecs]:
    """The codecs of a hierarchical reduction's intra-node hop (its stage 1), given the layout's: each of ours
    at wire.intra_node_reduction_precision of its precision (fp8's partial sums travel at fp32), so that the
    cost model, the traffic model and the byte counters price the hop alike; a codec that names no precision
    (a user's) as given."""
    if codecs is None:
        return None
    return QuantizedCommCodecs(forward=_intra_node_codec(codecs.forward), backward=_intra_node_codec(codecs.backward))


def _intra_node_codec(codec: QuantizedCommCodec) -> QuantizedCommCodec:
    precision = getattr(codec, "wire_precision", None)
    if precision is None or intra_node_reduction_precision(precision) == precision:
        return codec
    return _codec(intra_node_reduction_precision(precision)) or NoOpQuantizedCommCodec()


def builtin_codecs(
    group: ShardingGroup, registry: Optional[Dict[str, QuantizedCommCodecs]]
) -> Optional[Dict[str, QuantizedCommCodecs]]:
    """The codec registry a group of TorchRec's type takes: below fp32 (its string names the precision,
    "table_wise:fp16-fp16"; at fp8 also the row width its row-scaled codec is told, "table_wise:fp8-fp8@64") its
    precision's codecs, which replace the sharder's (the plan's precision wins, as on our types); else the
    sharder's registry as given."""
    if group.precision == WirePrecision():
        return registry
    return wire_codecs(group.precision, group.row_width)


def active_codec(codec: Optional[QuantizedCommCodec]) -> Optional[QuantizedCommCodec]:
    """The codec a message goes through; None for fp32 (no codec, or TorchRec's no-op one: the message
    travels as it is)."""
    return None if codec is None or isinstance(codec, NoOpQuantizedCommCodec) else codec


def _row_context(codec: QuantizedCommCodec, width: int) -> Optional[Any]:
    """A context that makes `codec` scale rows of `width`, where it scales rows of its context's row dim and its
    size for one such row depends on it (fbgemm's INT8 and FP8 row-wise: values + scale per row); else None
    (an element-wise codec: fp16, bf16, a user's)."""
    ctx = codec.create_context()
    if getattr(ctx, "row_dim", -1) <= 0:
        return None
    ctx.row_dim = width
    row = codec.calc_quantized_size(width, ctx)
    if row == width:
        return None
    ctx.row_dim_quant = row  # what decode views a row as
    return ctx


@dataclass(frozen=True)
class _RowWidth:
    """The vectors of one width in a message, for a row-wise codec of TorchRec's protocol: how many, the
    context that makes the codec scale rows of that width, and the bytes (codec elements) one row takes."""

    width: int
    rows: int
    ctx: Any
    row_size: int


def _row_widths(codec: QuantizedCommCodec, segments: Sequence[Segment]) -> Optional[List[_RowWidth]]:
    """For a row-wise codec of TorchRec's protocol, the message's vectors (each cell's row of one width) grouped by
    width, so that each vector gets its own scale as the cost model prices it, in one encode per width; None for
    our fp8 codec and element-wise codecs, which take the whole message."""
    if isinstance(codec, Fp8RowwiseCodec):
        return None
    rows: Dict[int, int] = {}
    for elems, width in segments:
        if elems:
            blocks = _blocks(width)
            for w in blocks:
                rows[w] = rows.get(w, 0) + elems // sum(blocks)
    out = []
    for w, n in rows.items():
        ctx = _row_context(codec, w)
        if ctx is None:
            return None
        out.append(_RowWidth(w, n, ctx, codec.calc_quantized_size(w, ctx)))
    return out


def _vector_widths(segments: Sequence[Segment]) -> np.ndarray:
    """Each vector's width, in message order (a segment's rows one after another, each row its blocks)."""
    parts = [np.tile(_blocks(w), e // sum(_blocks(w))) for e, w in segments if e]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


_ROW_INDEX_CACHE: Dict[Any, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
_ROW_INDEX_CACHE_SIZE = 64


def _row_indices(
    segments: Sequence[Segment], widths: Sequence[_RowWidth], device: torch.device
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per width (as `widths`): where its vectors' values sit in the message, and where their codes go on the
    wire (the vectors' codes in message order). Built once per message layout and device (a training step
    repeats its layouts), so that a step takes a fixed number of ops per width."""
    key = (tuple(segments), tuple((w.width, w.row_size) for w in widths), device)
    cached = _ROW_INDEX_CACHE.get(key)
    if cached is not None:
        return cached
    vector = _vector_widths(segments)
    row_size = np.zeros(max(w.width for w in widths) + 1, dtype=np.int64)
    for w in widths:
        row_size[w.width] = w.row_size
    codes = row_size[vector]
    value_start = np.cumsum(vector) - vector
    code_start = np.cumsum(codes) - codes
    out = []
    for w in widths:
        mine = np.flatnonzero(vector == w.width)
        values = (value_start[mine][:, None] + np.arange(w.width)).reshape(-1)
        wire = (code_start[mine][:, None] + np.arange(w.row_size)).reshape(-1)
        out.append((torch.as_tensor(values, device=device), torch.as_tensor(wire, device=device)))
    if len(_ROW_INDEX_CACHE) >= _ROW_INDEX_CACHE_SIZE:
        _ROW_INDEX_CACHE.pop(next(iter(_ROW_INDEX_CACHE)))
    _ROW_INDEX_CACHE[key] = out
    return out


def _message_context(codec: QuantizedCommCodec, segments: Sequence[Segment]) -> Optional[Any]:
    ctx = codec.create_context()
    if isinstance(ctx, SegmentContext):
        ctx.segments = segments
    return ctx


def _flat_tensor(t: torch.Tensor) -> torch.Tensor:
    """A codec's result as one dimension (a codec may keep its input's shape); no op when it is already."""
    return t if t.dim() == 1 else t.reshape(-1)


def _flat(peers: Sequence[Sequence[Segment]]) -> List[Segment]:
    return [s for segs in peers for s in segs]


def encoded_size(codec: Optional[QuantizedCommCodec], segments: Sequence[Segment]) -> int:
    """Wire elements (of codec.quantized_dtype, or fp32 without a codec) of one peer's message."""
    codec = active_codec(codec)
    elems = sum(e for e, _ in segments)
    if codec is None:
        return elems
    widths = _row_widths(codec, segments)
    if widths is None:
        return codec.calc_quantized_size(elems, _message_context(codec, segments))
    return sum(w.rows * w.row_size for w in widths)


def encode(codec: Optional[QuantizedCommCodec], x: torch.Tensor, peers: Sequence[Sequence[Segment]]) -> torch.Tensor:
    """x (1-D, the messages to each peer in order, described by `peers`) in the codec's wire format;
    call it in inference mode where a codec is given (see all_to_all). A row-wise codec of TorchRec's
    protocol encodes the vectors of each width at once (a fixed number of ops per distinct width)."""
    codec = active_codec(codec)
    if codec is None:
        return x
    segments = _flat(peers)
    widths = _row_widths(codec, segments)
    if widths is None:
        return _flat_tensor(codec.encode(x, _message_context(codec, segments)))
    if not widths:  # an empty message
        return x.new_empty(0, dtype=codec.quantized_dtype)
    if len(widths) == 1:  # every vector of one width: the message is its rows, in order
        return _flat_tensor(codec.encode(x, widths[0].ctx))
    out = x.new_empty(sum(w.rows * w.row_size for w in widths), dtype=codec.quantized_dtype)
    for w, (values, wire) in zip(widths, _row_indices(segments, widths, x.device)):
        out[wire] = _flat_tensor(codec.encode(x[values], w.ctx))
    return out


def decode(codec: Optional[QuantizedCommCodec], y: torch.Tensor, peers: Sequence[Sequence[Segment]]) -> torch.Tensor:
    """The inverse of encode, for the messages received from each peer."""
    codec = active_codec(codec)
    if codec is None:
        return y
    segments = _flat(peers)
    widths = _row_widths(codec, segments)
    if widths is None:
        return _flat_tensor(codec.decode(y, _message_context(codec, segments)))
    if not widths:
        return y.new_empty(0, dtype=torch.float32)
    if len(widths) == 1:
        return _flat_tensor(codec.decode(y, widths[0].ctx)).float()
    out = y.new_empty(sum(w.rows * w.width for w in widths), dtype=torch.float32)
    for w, (values, wire) in zip(widths, _row_indices(segments, widths, y.device)):
        out[values] = _flat_tensor(codec.decode(y[wire], w.ctx)).float()
    return out
