"""The step the torch backend runs (and captures as a CUDA graph): T new tokens per row, one for a
decode step, a lossless verify pass's first input and drafts for a pass.

A layer graph (runtime.models.opt.CachedOPTLayer) derives its attention bias and RoPE positions
from the call's mask in every layer, projects q, k and v by three products, and attends to the past
and the new position separately, because the graph contract hands the new K/V back to the runtime.
On a GPU a decode step is bound by the kernels it launches, not by bytes (docs/benchmarks-gpu.md:
~75 kernels per Llama-family layer, ~2 us each), so the torch backend's steps take a shorter road
to the same values: what every layer shares is made once per step (``StepInputs``), q/k/v and
gate/up are one product each over weights concatenated once (the modules' own weights become views
of them: no memory is added), and each layer writes its new K/V into the cache rows first and then
attends over them in one product. The tolerances of tests/runtime/test_torch_backend.py hold it
to the graphs' values: only the order of a few additions differs.

Shapes: B rows (the step's batch bucket), T new positions per row, W the bound width (the rows
that write have their new positions below it), D hidden, nh query heads over nkv KV heads of hd,
g = nh / nkv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kvcache import MASK_VALUE
from .quantized import QuantLinear


@dataclass
class StepInputs:
    """What every layer of one step shares."""

    bias: torch.Tensor  # (B, 1, T, 1, W) fp32: 0 where query t may read a cache position
    at: torch.Tensor  # (B, 1) int64: each row's own cache row
    cols: torch.Tensor  # (B, T) int64: the cache columns of the T new positions (from each row's length)
    cos: torch.Tensor | None = None  # (B, T, 1, hd) model dtype: RoPE (Llama family), as the graphs make it
    sin: torch.Tensor | None = None  # (B, T, 1, hd), its first half negated


def step_inputs(mask: torch.Tensor, at: torch.Tensor, positions: torch.Tensor, like: torch.Tensor,
                rope=None) -> StepInputs:
    """``mask`` (B, W + T): the rows' valid past left-aligned, then the T new positions (the graphs'
    input); ``at`` (B, 1): each row's cache row (a static tensor: made once, not in every step);
    ``positions`` (B,): each row's length, where its first new K/V go; ``like`` (B, T, D); ``rope``:
    a layer's ``_rope`` (Llama family).

    New position t of a row lives at column (length + t) mod W. A verify pass's rows that write
    nothing (riding along, or padding tokens) may wrap round to the start, since W bounds the
    longest row that writes: their columns keep what the past says, and a written position is
    seen by the queries at and after it (causal)."""
    B, T = like.shape[:2]
    W = mask.shape[1] - T
    device = mask.device
    past, new = mask[:, :W], mask[:, W:]  # (B, W), (B, T)
    if T == 1:  # a decode step (every one a step launches counts on a GPU): its position is below W
        cols = positions[:, None]  # (B, 1)
        valid = past.clone()  # (B, W)
        valid.scatter_(1, cols, new)
        valid = valid[:, None, :]  # (B, 1, W)
    else:
        cols = (positions[:, None] + torch.arange(T, device=device)) % W  # (B, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (t, t'): t' <= t
        written = causal & (new[:, None, :] > 0)  # (B, T, T)
        seen = torch.where(written, new[:, None, :], past.gather(1, cols)[:, None, :])  # (B, T, T)
        valid = past[:, None, :].expand(B, T, W).clone()  # (B, T, W)
        valid.scatter_(2, cols[:, None, :].expand(B, T, T), seen)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    masked = torch.full((), MASK_VALUE, dtype=torch.float32, device=device)
    bias = torch.where(valid > 0, zero, masked)[:, None, :, None, :]  # (B, 1, T, 1, W)
    if rope is None:
        return StepInputs(bias, at, cols)
    cos, sin = rope(mask, like)  # (B, 1, T, hd)
    return StepInputs(bias, at, cols, cos[:, 0, :, None], sin[:, 0, :, None])


def fuse_linears(*linears: nn.Linear):
    """One (sum of outs, in) weight (and bias) for ``linears`` applied to the same input; each
    module's own weight becomes a view of it, so the memory is not held twice. Quantized ones
    (QuantLinear, or tinygemm's Int4PackLinear) give one such product, its bias inside, and None (parts
    of both kinds: the parts one after the other, ``Stacked``). Either goes to ``linear``."""
    from .quantized_tinygemm import Int4PackLinear, Stacked

    if all(isinstance(m, QuantLinear) for m in linears):
        return QuantLinear.fused(list(linears)), None
    if all(isinstance(m, Int4PackLinear) for m in linears):
        return Int4PackLinear.fused(list(linears)), None
    if not all(isinstance(m, nn.Linear) for m in linears):
        return Stacked(list(linears)), None
    weight = torch.cat([m.weight for m in linears])  # (sum out, in)
    biases = [m.bias for m in linears]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else weight.new_zeros(m.out_features) for m, b in zip(linears, biases)])
    start = 0
    for m in linears:
        stop = start + m.out_features
        m.weight = nn.Parameter(weight[start:stop], requires_grad=False)
        if m.bias is not None:
            m.bias = nn.Parameter(bias[start:stop], requires_grad=False)
        start = stop
    return weight, bias


def step_attention(q: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, keep: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
    """q (B, nkv, T, g, hd), already scaled; key_new / value_new (B, T, nkv, hd); key (B, nkv, hd, W)
    and value (B, nkv, W, hd), views of the cache rows, which get the new K/V where ``keep`` (B, T |
    1, 1, 1) at ``inputs.cols`` (the others keep what was there) -> attention (B, T, nh * hd)."""
    B, nkv, T, g, hd = q.shape
    at_k = (inputs.at, slice(None), slice(None), inputs.cols)  # (B, T, nkv, hd)
    at_v = (inputs.at, slice(None), inputs.cols)  # (B, T, nkv, hd)
    key[at_k] = torch.where(keep, key_new, key[at_k])
    value[at_v] = torch.where(keep, value_new, value[at_v])
    scores = torch.matmul(q.reshape(B, nkv, T * g, hd), key).float()  # (B, nkv, T g, W) fp32
    probs = torch.softmax(scores.view(B, nkv, T, g, -1) + inputs.bias, dim=-1).to(q.dtype)  # (B, nkv, T, g, W)
    out = torch.matmul(probs.view(B, nkv, T * g, -1), value)  # (B, nkv, T g, hd)
    # (B, T, nh * hd): head j*g + i, as the graphs order them
    return out.view(B, nkv, T, g, hd).permute(0, 2, 1, 3, 4).reshape(B, T, nkv * g * hd)


__all__ = ["StepInputs", "fuse_linears", "step_attention", "step_inputs"]
