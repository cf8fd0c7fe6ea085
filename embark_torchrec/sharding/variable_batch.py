"""Variable batch per feature (TorchRec's VBE) on our sharding types.

A VBE KeyedJaggedTensor gives feature f of this rank B_f bags (its stride_per_key), and TorchRec's
sharded EBC expects each sharding's output as one flat tensor, feature-major: for each feature,
B_f rows of its width, which it then expands by the KJT's inverse indices. Our dists route IDs by
cells, not by features, so they take the batch as a uniform one: each feature's bags followed by
empty bags up to the rank's longest feature (`pad_to_uniform`; the IDs and weights are unchanged,
only lengths travel for the padding), and lay the pooled [longest, width] output out feature by
feature (`FeatureMajor`), reporting the longest count as every feature's.
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class RowGather(torch.autograd.Function):
    """Rows of `source` at `index` (distinct rows). Backward copies each gradient row back into
    place (a copy, not index_select's accumulating scatter, which is several times slower); given
    `inverse` (per source row, the output row whose gradient it takes), it gathers instead, which
    is faster than a zero-filled scatter: callers give it only where the gradient of a row not in
    `index` is never read (e.g. an empty bag's), so such rows may take any output row's."""

    @staticmethod
    def forward(
        ctx: Any, source: torch.Tensor, index: torch.Tensor, inverse: Optional[torch.Tensor] = None
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index if inverse is None else inverse)
        ctx.gather = inverse is not None
        ctx.rows = source.size(0)
        return source.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        if ctx.gather:
            return grad.index_select(0, index), None, None
        return grad.new_zeros(ctx.rows, grad.size(1)).index_copy_(0, index, grad), None, None


def pad_to_uniform(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """`kjt` with every feature's bags padded by empty ones to the longest feature's count (itself
    when its features already share one batch size)."""
    if not kjt.variable_stride_per_key():
        return kjt
    strides = np.asarray(kjt.stride_per_key(), dtype=np.int64)
    longest = int(strides.max(initial=0))
    lengths = kjt.lengths()
    # bag i of feature f goes to row f * longest + i of the padded lengths
    first = np.concatenate([[0], np.cumsum(strides)[:-1]])
    position = np.arange(int(strides.sum())) + np.repeat(np.arange(len(strides)) * longest - first, strides)
    padded = lengths.new_zeros(len(strides) * longest).index_copy(
        0, torch.from_numpy(position).to(lengths.device), lengths
    )
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values(),
        lengths=padded,
        weights=kjt.weights_or_none(),
        stride=longest,
        length_per_key=kjt.length_per_key(),  # unchanged by padding; known on the host already
    )


class FeatureMajor:
    """A uniform [batch, sum(dims)] output laid out as TorchRec's VBE path takes it: flat, feature
    by feature, `batch` rows of each feature's columns (the sharding context then reports `batch`
    bags for every feature, so the inverse indices read only a feature's real bags)."""

    def __init__(self, dims: List[int], device: torch.device) -> None:
        self._dims = dims
        self._same = len(set(dims)) <= 1
        self._width = sum(dims)
        self._dim_t = torch.tensor(dims, dtype=torch.int64, device=device)
        self._col_t = torch.cumsum(self._dim_t, 0) - self._dim_t

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        batch = pooled.size(0)
        if self._same:
            dim = self._dims[0] if self._dims else 0
            return pooled.view(batch, len(self._dims), dim).transpose(0, 1).reshape(-1)
        n = batch * self._width
        feature = torch.arange(len(self._dims), device=pooled.device).repeat_interleave(
            self._dim_t * batch, output_size=n
        )
        width = self._dim_t[feature]
        offset = torch.arange(n, device=pooled.device) - batch * self._col_t[feature]
        source = torch.div(offset, width, rounding_mode="floor") * self._width + self._col_t[feature]
        return RowGather.apply(pooled.reshape(-1, 1), source + torch.remainder(offset, width)).reshape(-1)
