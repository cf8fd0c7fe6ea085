"""Per-cluster wire precision: what the plan's "precision" field turns into on the all-to-alls.

fp16 and bf16 use torchrec's fbgemm codecs, built here directly so that torchrec's CPU fallback from
bf16 to fp16 does not apply. fp8 is our own codec (Fp8RowwiseCodec): float8 e4m3 with one fp32
scale per row vector, the bits carried as uint8 because gloo rejects float8 tensors.

Per-element error bounds (round to nearest; |x| the element, a its row's largest magnitude):
fp16 |e| <= 2^-11 |x| (|x| >= 2^-14), bf16 |e| <= 2^-8 |x|, fp8 |e| <= 2^-4 |x| + 2^-10 a / 448.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torchrec.distributed.fbgemm_qcomm_codec import CommOp, CommType, QCommsConfig, get_qcomm_codecs
from torchrec.distributed.types import QuantizedCommCodecs

from ..plan.layout import WirePrecision
from ..plan.wire import FP8_SCALE_BYTES, rows_bytes

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


class Fp8RowwiseCodec:
    """float8 e4m3fn values with one fp32 scale per row (row max / 448), as uint8 bytes on the wire.

    A row of w values travels as its w value bytes followed by its scale's 4 bytes, so each peer's
    message is simply its rows in order and needs no per-peer handling. Messages are described per
    peer as segments (elements, row width), since our dists send blocks of different widths in one
    all-to-all; rows of one width take a fixed handful of ops (views), mixed widths a fixed number
    of gathers and scatters, whatever the number of segments."""

    quantized_dtype = torch.uint8
    row_wise = True
    wire_precision = "fp8"

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

    def encode(self, x: torch.Tensor, peers: Sequence[Sequence[Segment]]) -> torch.Tensor:
        """The wire bytes of x; an inference tensor (called in inference mode: the payload only
        travels, so its dtype views need no autograd bookkeeping)."""
        segments = [s for segs in peers for s in segs]
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

    def decode(self, y: torch.Tensor, peers: Sequence[Sequence[Segment]]) -> torch.Tensor:
        """The values of wire bytes y (best an inference tensor, as the exchange allocates it: its
        dtype views then need no autograd bookkeeping); the result is a normal tensor."""
        segments = [s for segs in peers for s in segs]
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

    @staticmethod
    def size(segment: Segment) -> int:
        return int(rows_bytes(segment[0], scaled_rows(segment), "fp8"))


class TorchRecCodec:
    """One of TorchRec's fbgemm codecs (fp16 / bf16), labelled with its wire precision for the byte
    counters."""

    row_wise = False

    def __init__(self, precision: str) -> None:
        config = QCommsConfig(
            forward_precision=_TORCHREC_TYPES[precision], backward_precision=_TORCHREC_TYPES[precision]
        )
        self._codec = get_qcomm_codecs(config).forward
        self.wire_precision = precision
        self.quantized_dtype = self._codec.quantized_dtype

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self._codec.encode(x)

    def decode(self, y: torch.Tensor) -> torch.Tensor:
        return self._codec.decode(y)


class WireCodecs:
    """A cluster's forward (embeddings) and backward (gradients) codecs, shaped like torchrec's
    QuantizedCommCodecs; None: fp32."""

    def __init__(self, forward: Any, backward: Any) -> None:
        self.forward, self.backward = forward, backward


def _codec(precision: str) -> Any:
    if precision == "fp8":
        return Fp8RowwiseCodec()
    if precision == "fp32":
        return None
    return TorchRecCodec(precision)


def wire_codecs(precision: WirePrecision) -> Optional[Dict[str, QuantizedCommCodecs]]:
    """The codecs of one cluster's embedding all-to-alls, from the plan's precision (the plan decides
    an embark cluster's precision, not module-wide qcomms)."""
    if (precision.forward, precision.backward) == ("fp32", "fp32"):
        return None
    return {CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name: WireCodecs(_codec(precision.forward), _codec(precision.backward))}  # type: ignore[dict-item]


def encoded_size(codec: Any, segments: Sequence[Segment]) -> int:
    """Wire elements (of codec.quantized_dtype, or fp32 without a codec) of one peer's message."""
    if codec is not None and getattr(codec, "row_wise", False):
        return sum(codec.size(s) for s in segments)
    return sum(e for e, _ in segments)


def encode(codec: Any, x: torch.Tensor, peers: Sequence[Sequence[Segment]]) -> torch.Tensor:
    """x (1-D, the messages to each peer in order, described by `peers`) in the codec's wire format;
    call it in inference mode where a codec is given (see all_to_all)."""
    if codec is None:
        return x
    return codec.encode(x, peers) if getattr(codec, "row_wise", False) else codec.encode(x)


def decode(codec: Any, y: torch.Tensor, peers: Sequence[Sequence[Segment]]) -> torch.Tensor:
    """The inverse of encode, for the messages received from each peer."""
    if codec is None:
        return y
    return codec.decode(y, peers) if getattr(codec, "row_wise", False) else codec.decode(y)
