"""Asynchronous, differentiable all-to-all for our output dists, with per-cluster wire codecs.

TorchRec's pooled all-to-alls take one row width per rank, and its codec interface one row width
per message; our messages are blocks of cells of different widths (fp8 scales each row), so our
dists use this all-to-all, built as TorchRec's comm_ops are: a Req/Wait pair of autograd functions
joined by a dummy tensor.

- forward: Req encodes and starts the exchange (async_op=True) and returns at once; the caller
  waits when it needs the result (AllToAllAwaitable.wait, where TorchRec waits its own awaitables);
- backward: Wait's backward starts the gradients' exchange and returns; Req's backward waits for
  it, so autograd runs other work (other groups' backward, the dense part) in between.

Every member of the group must join both exchanges, also one whose input needs no gradient: such an
input becomes a leaf that requires one.

Profiler labels follow TorchRec's comm_ops ("## all2all_pooled ##", "## All2All_Pooled_fwd ##", ...), so that a
trace reads alike: ALL_TO_ALL_LABEL around the call, the exchange's start forward and backward, and its wait.
observing_waits times each wait for the stage timer (stage_times.py); unobserved, a wait pays one list check.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.types import Awaitable

from .codecs import Segment, active_codec, decode, encode, encoded_size

ALL_TO_ALL_LABEL = "## embark_all2all ##"
FORWARD_LABEL = "## Embark_All2All_fwd ##"
BACKWARD_LABEL = "## Embark_All2All_bwd ##"
WAIT_LABEL = "## Embark_All2All_wait ##"

WaitObserver = Callable[[bool, float], None]  # (whether the backward's, seconds waited)
_wait_observers: List[WaitObserver] = []


@contextmanager
def observing_waits(observer: WaitObserver) -> Iterator[None]:
    """While open, `observer` hears how long each of our exchanges kept its caller waiting, forward or backward."""
    _wait_observers.append(observer)
    try:
        yield
    finally:
        _wait_observers.remove(observer)


class _Exchange:
    """One all-to-all and the reverse exchange of its gradients: what the autograd pair shares."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        send: Sequence[Sequence[Segment]],
        recv: Sequence[Sequence[Segment]],
        codecs: Any,
        gradient_divisor: int,
        on_send: Optional[Any],
    ) -> None:
        self.group, self.send, self.recv, self.codecs = group, send, recv, codecs
        self.gradient_divisor, self.on_send = gradient_divisor, on_send
        self.work: Optional[dist.Work] = None
        self.buffer: Optional[torch.Tensor] = None

    def codec(self, backward: bool) -> Any:
        """The codec of one direction (any of TorchRec's QuantizedCommCodec), None for fp32."""
        if self.codecs is None:
            return None
        return active_codec(self.codecs.backward if backward else self.codecs.forward)

    def start(
        self,
        x: torch.Tensor,
        send: Sequence[Sequence[Segment]],
        recv: Sequence[Sequence[Segment]],
        codec: Any,
        backward: bool,
    ) -> None:
        with record_function(BACKWARD_LABEL if backward else FORWARD_LABEL):
            send_sizes = [encoded_size(codec, segs) for segs in send]
            recv_sizes = [encoded_size(codec, segs) for segs in recv]
            # a codec's payload and receive buffer only travel and are decoded: as inference tensors,
            # their views need no autograd bookkeeping (without a codec the buffer is the result)
            with torch.inference_mode(codec is not None):
                payload = encode(codec, x.contiguous(), send)
                self.buffer = payload.new_empty(sum(recv_sizes))
            if self.on_send is not None:
                self.on_send(payload, send_sizes, recv_sizes, backward)
            # the collective writes into the inference buffer: backends that dispatch it as an in-place op (torch's
            # fake process group) allow that only in inference mode
            with torch.inference_mode(codec is not None):
                self.work = dist.all_to_all_single(
                    self.buffer, payload, recv_sizes, send_sizes, group=self.group, async_op=True
                )

    def finish(self, recv: Sequence[Sequence[Segment]], codec: Any, backward: bool) -> torch.Tensor:
        assert self.work is not None and self.buffer is not None
        with record_function(WAIT_LABEL):
            start = time.perf_counter() if _wait_observers else 0.0
            self.work.wait()
            if _wait_observers:
                waited = time.perf_counter() - start
                for observer in _wait_observers:
                    observer(backward, waited)
            out, self.work, self.buffer = decode(codec, self.buffer, recv), None, None
        return out


class _Req(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, exchange: _Exchange) -> torch.Tensor:  # type: ignore[override]
        ctx.exchange = exchange
        exchange.start(x, exchange.send, exchange.recv, exchange.codec(backward=False), False)
        return x.new_empty(1)  # a token that ties _Wait to this exchange in the autograd graph

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        exchange: _Exchange = ctx.exchange
        grad = exchange.finish(exchange.send, exchange.codec(backward=True), True)
        if exchange.gradient_divisor > 1 and get_gradient_division():
            grad = grad.div_(exchange.gradient_divisor)  # a fresh buffer: in place, as TorchRec does
        return grad, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, exchange: _Exchange) -> torch.Tensor:  # type: ignore[override]
        ctx.exchange = exchange
        return exchange.finish(exchange.recv, exchange.codec(backward=False), False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        exchange: _Exchange = ctx.exchange
        exchange.start(grad, exchange.recv, exchange.send, exchange.codec(backward=True), True)
        return grad.new_zeros(1), None


class AllToAllAwaitable(Awaitable[torch.Tensor]):
    """The received 1-D tensor, once the exchange has arrived (differentiable)."""

    def __init__(self, dummy: torch.Tensor, exchange: _Exchange) -> None:
        super().__init__()
        self._dummy, self._exchange = dummy, exchange

    def _wait_impl(self) -> torch.Tensor:
        return _Wait.apply(self._dummy, self._exchange)


def all_to_all(
    x: torch.Tensor,
    send: Sequence[Sequence[Segment]],
    recv: Sequence[Sequence[Segment]],
    group: dist.ProcessGroup,
    codecs: Any = None,
    gradient_divisor: int = 1,
    on_send: Optional[Any] = None,
) -> AllToAllAwaitable:
    """Starts sending member i of `group` the next message of the 1-D tensor x, described by
    send[i] (segments of (elements, row width)); the awaitable gives what the members send, as
    described by recv. Gradients travel back in the backward codec and are divided by
    `gradient_divisor` (TorchRec divides embedding gradients by the world size). `on_send(payload,
    send_sizes, recv_sizes, backward)` sees every payload handed to the collective (byte counting)."""
    with record_function(ALL_TO_ALL_LABEL):
        if torch.is_grad_enabled() and not x.requires_grad:
            x = x.detach().requires_grad_()
        exchange = _Exchange(group, send, recv, codecs, gradient_divisor, on_send)
        dummy = _Req.apply(x, exchange)
        return AllToAllAwaitable(dummy, exchange)
