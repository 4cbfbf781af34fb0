"""Tensor operations that trace into the fewest ONNX nodes, with the same values in PyTorch.

Why: a decode step at batch 1 is memory-bound, and every small node of a layer graph costs ONNX
Runtime a few microseconds. Written as plain torch, the TorchScript exporter derives every shape
from ``Shape -> Gather -> Unsqueeze -> Concat`` chains and every index range from ``Range`` (see
docs/benchmarks.md, "Decode at the memory floor"). Each function here runs plain torch eagerly (so
the torch backend, autograd and fine-tuning are untouched) and, only while ``torch.onnx.export``
traces it, an ``autograd.Function`` whose ``symbolic`` writes the ONNX it means directly:

* ``reshape``: one Reshape with a constant shape, using ONNX's 0 (copy this dim) and -1 (infer);
* ``split_past``: the past and new columns of attention probabilities, two Slices with constant
  axes (TensorRT 8.x parses a Slice only when its axes are an initializer or a Constant);
* ``last_columns``: the last T columns of a (B, S) tensor, one Slice of a negated length;
* ``unflatten_rows``: (B*T, V) back to (B, T, V), one Reshape of a shape taken once;
* ``attention_bias``: the causal, padding-aware additive bias from a Trilu of a constant-filled
  (T, S) block instead of two Ranges compared;
* ``mask_positions``: the positions of the new tokens from the attention mask (plain torch over
  ``last_columns``), the one rule OPT's learned embedding and Llama's RoPE share.

Every op is in the export's opsets 14 to 17 (Shape's start/end attributes only from 15) and
within TensorRT 8.6's parser (export.trt_compat checks the graphs).
"""

from __future__ import annotations

import torch

from .kvcache import MASK_VALUE  # noqa: F401  (the graphs' API too)
_INT64_MAX = 2**63 - 1  # a Slice end meaning "to the end" (ONNX clamps it)


def _exporting() -> bool:
    return torch.onnx.is_in_onnx_export()


def _const(g, values, dtype=torch.int64):
    return g.op("Constant", value_t=torch.tensor(values, dtype=dtype))


def _shape(g, x, start: int = 0, end: int | None = None):
    """Dims [start, end) of x's shape as a 1-D tensor: Shape's start/end attributes from opset 15,
    a Shape then a Slice of constant starts, ends and axes before it (export opsets 14..17)."""
    if g.opset >= 15:
        attrs = {"start_i": start} | ({"end_i": end} if end is not None else {})
        return g.op("Shape", x, **attrs)
    return g.op("Slice", g.op("Shape", x), _const(g, [start]), _const(g, [_INT64_MAX if end is None else end]),
                _const(g, [0]))


def _onnx_shape(x: torch.Tensor, shape: tuple[int, ...]) -> list[int]:
    """ONNX Reshape's reading of ``shape`` (allowzero=0): 0 copies the input's dim at that index."""
    return [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]


class _Reshape(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shape):
        return x.reshape(_onnx_shape(x, shape))

    @staticmethod
    def symbolic(g, x, shape):
        return g.op("Reshape", x, _const(g, list(shape)))


def reshape(x: torch.Tensor, *shape: int) -> torch.Tensor:
    """``x`` reshaped as ONNX Reshape reads ``shape``: 0 keeps the dim of ``x`` at that index, one
    -1 is inferred, other values are taken as they are. Exported as one Reshape of a constant.

    A shape with a 0 needs a -1 too: the TorchScript exporter's shape inference asserts otherwise."""
    if _exporting():
        return _Reshape.apply(x, tuple(shape))
    return x.reshape(_onnx_shape(x, shape))


class _SplitPast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs, past_key):
        W = past_key.shape[-1]
        return probs[..., :W], probs[..., W:]

    @staticmethod
    def symbolic(g, probs, past_key):
        width = _shape(g, past_key, 3, 4)  # (1,) W
        axes = _const(g, [3])  # probs (B, h, R, W + T): a constant axis, as TensorRT 8.x wants it
        past = g.op("Slice", probs, _const(g, [0]), width, axes)
        new = g.op("Slice", probs, width, _const(g, [_INT64_MAX]), axes)
        return past, new


def split_past(probs: torch.Tensor, past_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """probs (B, h, R, W + T) -> its first W columns (the past) and its last T (the new positions),
    W = past_key.shape[3] (the past's width, K stored (B, h, hd, W)). Two Slices once exported."""
    if _exporting():
        return _SplitPast.apply(probs, past_key)
    W = past_key.shape[3]
    return probs[..., :W], probs[..., W:]


class _LastColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, like):
        return x[:, x.shape[1] - like.shape[1]:]

    @staticmethod
    def symbolic(g, x, like):
        count = g.op("Neg", _shape(g, like, 1, 2))  # (1,) -T
        return g.op("Slice", x, count, _const(g, [_INT64_MAX]), _const(g, [1]))


def last_columns(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """x (B, S, ...) -> x[:, S - T:] (B, T, ...), T = like.shape[1]. One Slice (and a Shape, a Neg)
    once exported, its axes constant for TensorRT 8.x."""
    if _exporting():
        return _LastColumns.apply(x, like)
    return x[:, x.shape[1] - like.shape[1]:]


def mask_positions(attention_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B, S) mask -> (B, T) fp32 positions of its last T columns (T = like.shape[1], the new
    positions): real tokens before them, counted; padding -1, masked anyway.

    CumSum in fp32 (exact below 2**24 positions): TensorRT's parser documents CumSum for float
    types only. The last T columns are one Slice with constant axes (``last_columns``): TensorRT
    8.x cannot parse the Slice with computed axes that the TorchScript export of [:, S - T:] makes."""
    mask = attention_mask.float()
    positions = torch.cumsum(mask, dim=1) * mask - 1  # (B, S)
    return last_columns(positions, like)  # (B, T)


class _UnflattenRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, like):
        return x.reshape(like.shape[0], like.shape[1], -1)

    @staticmethod
    def symbolic(g, x, like):
        rows = _shape(g, like, 0, 2)  # (2,) [B, T]
        return g.op("Reshape", x, g.op("Concat", rows, _const(g, [-1]), axis_i=0))


def unflatten_rows(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """x (B*T, V) -> (B, T, V), B and T those of ``like`` (B, T, ...): one Reshape once exported."""
    if _exporting():
        return _UnflattenRows.apply(x, like)
    return x.reshape(like.shape[0], like.shape[1], -1)


def _attention_bias(attention_mask: torch.Tensor, query_len: int) -> torch.Tensor:
    total = attention_mask.shape[1]
    key_pos = torch.arange(total, device=attention_mask.device)  # (S,)
    query_pos = torch.arange(query_len, device=attention_mask.device) + (total - query_len)  # (T,)
    causal = key_pos[None, :] <= query_pos[:, None]  # (T, S)
    allowed = causal[None, :, :] & (attention_mask[:, None, :] > 0)  # (B, T, S)
    zero = torch.zeros((), dtype=torch.float32, device=attention_mask.device)
    masked = torch.full((), MASK_VALUE, dtype=torch.float32, device=attention_mask.device)
    return torch.where(allowed, zero, masked)[:, None, :, :]  # (B, 1, T, S)


class _AttentionBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, attention_mask, scores):
        return _attention_bias(attention_mask, scores.shape[2])

    @staticmethod
    def symbolic(g, attention_mask, scores):
        # Causal: query t (at position S - T + t) sees key s iff s - t <= S - T. Trilu(upper) keeps
        # s - t >= k of a (T, S) block of MASK_VALUE, so k = S - T + 1 leaves MASK_VALUE exactly
        # on the future keys and 0 elsewhere. ConstantOfShape in fp32: TensorRT 8.x's only type.
        block = _shape(g, scores, 2)  # (2,) [T, S]
        past = g.op("Sub", g.op("Gather", block, _const(g, 1), axis_i=0),
                    g.op("Gather", block, _const(g, 0), axis_i=0))  # () S - T
        filled = g.op("ConstantOfShape", block, value_t=torch.tensor([MASK_VALUE], dtype=torch.float32))
        causal = g.op("Trilu", filled, g.op("Add", past, _const(g, 1)), upper_i=1)  # (T, S)
        real = g.op("Greater", g.op("Reshape", attention_mask, _const(g, [0, 1, 1, -1])),
                    _const(g, 0))  # (B, 1, 1, S)
        return g.op("Where", real, causal, _const(g, MASK_VALUE, torch.float32))  # (B, 1, T, S)


def attention_bias(attention_mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Additive fp32 attention bias, causal and padding-aware.

    attention_mask: (B, S) with 1 for real tokens; scores: (B, h, T, S), whose last T columns are
    the query positions (S = past + T). Returns (B, 1, T, S): 0 where query t may attend key s,
    MASK_VALUE elsewhere."""
    if _exporting():
        return _AttentionBias.apply(attention_mask, scores)
    return _attention_bias(attention_mask, scores.shape[2])
