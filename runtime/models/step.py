"""The decode step the torch backend runs (and captures as a CUDA graph): one new token per row.

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

Shapes: B rows (the step's batch bucket), W the bound width (each row's new position, its length,
is < W), D hidden, nh query heads over nkv KV heads of hd, g = nh / nkv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kvcache import MASK_VALUE


@dataclass
class StepInputs:
    """What every layer of one decode step shares."""

    bias: torch.Tensor  # (B, 1, 1, W) fp32: 0 where a cache position is valid (the new one included)
    at: torch.Tensor  # (B,) int64: each row's own cache row
    positions: torch.Tensor  # (B,) int64: where each row's new K/V go (its length)
    cos: torch.Tensor | None = None  # (B, 1, hd) model dtype: RoPE (Llama family), as the graphs make it
    sin: torch.Tensor | None = None  # (B, 1, hd), its first half negated


def step_bias(mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``mask`` (B, W + 1): the rows' valid past left-aligned, then the new position (the graphs'
    input); the new position lives at column ``positions`` (B,) of the cache: -> bias (B, 1, 1, W)."""
    valid = mask[:, :-1].clone()  # (B, W)
    valid.scatter_(1, positions[:, None], mask[:, -1:])
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    masked = torch.full((), MASK_VALUE, dtype=torch.float32, device=mask.device)
    return torch.where(valid > 0, zero, masked)[:, None, None, :]  # (B, 1, 1, W)


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (sum of outs, in) weight (and bias) for ``linears`` applied to the same input; each
    module's own weight becomes a view of it, so the memory is not held twice."""
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
    """q (B, nkv, g, hd), already scaled; key_new / value_new (B, nkv, hd); key (B, nkv, hd, W) and
    value (B, nkv, W, hd), views of the cache rows, which get the new K/V of the rows that ``keep``
    (B, 1, 1) at their positions (the others keep what was there) -> attention (B, 1, nh * hd)."""
    at_k = (inputs.at, slice(None), slice(None), inputs.positions)  # (B, nkv, hd)
    at_v = (inputs.at, slice(None), inputs.positions)  # (B, nkv, hd)
    key[at_k] = torch.where(keep, key_new, key[at_k])
    value[at_v] = torch.where(keep, value_new, value[at_v])
    scores = torch.matmul(q, key).float()  # (B, nkv, g, W) fp32
    probs = torch.softmax(scores + inputs.bias, dim=-1).to(q.dtype)  # (B, nkv, g, W)
    out = torch.matmul(probs, value)  # (B, nkv, g, hd)
    return out.reshape(out.shape[0], 1, -1)  # (B, 1, nh * hd): head j*g + i, as the graphs order them


__all__ = ["StepInputs", "fuse_linears", "step_attention", "step_bias"]
