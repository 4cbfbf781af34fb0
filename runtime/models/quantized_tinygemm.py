"""PyTorch's own int4 weight-only product over an artifact's 4-bit blocks: ``torch.ops.aten.
_weight_int4pack_mm`` ("tinygemm", the kernel gpt-fast and torchao's int4 weight-only quantization run
on a GPU), the other GPU kernel beside runtime.models.quantized_triton's
(``TorchBackend(int4_kernel="tinygemm")``).

tinygemm dequantizes w = (q - 8) * s + z a group of K at a time, in registers, on tensor cores; on
CUDA its activations, scales and zero terms are bfloat16 (its CPU twin, ``_weight_int4pack_mm_for_cpu``,
takes float32 too: the tests' path). MatMulNBits' blocks are w = (q - zp) * s (+ m): the same with
z = (8 - zp) * s (+ m), so one product reads what the blocks stand for, with s and z rounded to
bfloat16 on CUDA (8 bits of mantissa against float16's 11: what the GPU's top-1 agreement with the
CPU measures). The codes are repacked once, at load, into tinygemm's layout (CUDA: tiles of 8 output
columns; CPU: blocks of 64), the blocks' own bytes dropped: the weight is held once. A fused product
(q/k/v, gate/up) is its parts' packs laid end to end, the parts' packs views of it where the layout
allows (every part a whole number of tiles: on CUDA a real model's widths always are), else
``Stacked``: its parts one after the other. Its scales and zero terms are a copy (at blocks of 32,
a quarter of the codes' bytes).

Products it cannot take stay on the blocks (``fits`` says why): 8 bits, blocks other than 32-256,
K not a multiple of 32, N not of 8 (CUDA) or 16 (CPU).
"""

from __future__ import annotations

import torch
from torch import nn

from .quantized import QuantLinear

GROUPS = (32, 64, 128, 256)  # the block sizes tinygemm takes


def rows_block(device: torch.device) -> int:
    """Output columns of one block of the packed layout: a fused pack's parts are views of it
    where each is a whole number of them."""
    return 8 if device.type == "cuda" else 64


def fits(q: QuantLinear) -> str | None:
    """Why ``q`` cannot be multiplied by tinygemm, or None."""
    N, K = q.out_features, q.in_features
    columns = 8 if q.packed.is_cuda else 16
    if q.bits != 4:
        return f"{q.bits}-bit codes (tinygemm takes 4)"
    if q.block_size not in GROUPS:
        return f"blocks of {q.block_size} (tinygemm takes {', '.join(map(str, GROUPS))})"
    if K % 32:
        return f"K {K} is not a multiple of 32"
    if N % columns:
        return f"N {N} is not a multiple of {columns}"
    return None


def _inner_k_tiles(K: int) -> int:
    """k-tiles of 16 a load: the most of 8, 4, 2 that divide K's tiles (K % 32 == 0 gives 2)."""
    return next(t for t in (8, 4, 2) if (K // 16) % t == 0)


class Int4PackLinear(nn.Module):
    """``nn.Linear`` over tinygemm's pack: x (..., K) -> (..., N) in the activations' dtype."""

    def __init__(self, pack: torch.Tensor, scale_zeros: torch.Tensor, in_features: int, out_features: int,
                 group: int, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.register_buffer("pack", pack)  # CUDA (N / 8, K / (t 16), 32, t / 2) int32; CPU (N, K / 2) uint8
        self.register_buffer("scale_zeros", scale_zeros)  # (K / group, N, 2): s, z
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._dtype = dtype

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the artifact's), which the product takes and gives."""
        return self._dtype

    @classmethod
    @torch.no_grad()
    def from_quant(cls, q: QuantLinear) -> "Int4PackLinear":
        """``q``'s blocks repacked (``fits(q)`` must be None); ``q``'s buffers are not kept."""
        N, K, device = q.out_features, q.in_features, q.packed.device
        cuda = device.type == "cuda"
        if cuda:  # tinygemm's CUDA packer reads the even k in the high nibble, the blocks have it low
            pack = torch.ops.aten._convert_weight_to_int4pack(((q.packed & 0x0F) << 4) | (q.packed >> 4),
                                                               _inner_k_tiles(K))
        else:  # its CPU packer reads one code an int32
            codes = torch.stack([q.packed & 0x0F, q.packed >> 4], dim=-1).reshape(N, K).to(torch.int32)
            pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _inner_k_tiles(K))
        scales = q.scales.float()  # (N, nb)
        zeros = (8 - q.zeros.float()) * scales + (0 if q.mins is None else q.mins.float())  # (N, nb)
        kind = torch.bfloat16 if cuda else q.dtype
        scale_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(kind)  # (nb, N, 2)
        return cls(pack, scale_zeros, K, N, q.block_size, q.bias, q.dtype)

    @classmethod
    def fused(cls, parts: list["Int4PackLinear"]):
        """One product for ``parts`` applied to the same input, their outputs concatenated: one pack,
        the parts' packs its views, where each part is a whole number of the layout's blocks; else
        the parts one after the other (``Stacked``)."""
        first = parts[0]
        block = rows_block(first.pack.device)
        if any((p.in_features, p.group) != (first.in_features, first.group) for p in parts) or any(
                p.out_features % block for p in parts):
            return Stacked(parts)
        cuda = first.pack.is_cuda
        pack = torch.cat([p.pack for p in parts])  # dim 0: tiles of 8 columns (CUDA), columns (CPU)
        start = 0
        for p in parts:
            size = p.out_features // 8 if cuda else p.out_features
            p.pack = pack[start:start + size]
            start += size
        biases = [p.bias for p in parts]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(p.out_features, dtype=first.dtype, device=pack.device)
             for p, b in zip(parts, biases)])
        return cls(pack, torch.cat([p.scale_zeros for p in parts], dim=1), first.in_features,
                   sum(p.out_features for p in parts), first.group, bias, first.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (M, K)
        if flat.is_cuda:
            out = torch.ops.aten._weight_int4pack_mm(flat.to(torch.bfloat16).contiguous(), self.pack, self.group,
                                                     self.scale_zeros).to(x.dtype)  # (M, N)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), self.pack, self.group,
                                                             self.scale_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, tinygemm"


class Stacked(nn.Module):
    """Products applied to the same input, their outputs concatenated, one after the other: a fused
    product whose parts cannot share one (each holds its own bias)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def use_tinygemm(model: nn.Module) -> tuple[int, list[str]]:
    """Every QuantLinear of ``model`` that tinygemm can take replaced by an Int4PackLinear over its
    blocks, in place: (how many products it runs, those of an earlier call included; why the others
    do not, one reason each kind)."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, QuantLinear)]
    done = sum(isinstance(m, Int4PackLinear) for m in model.modules())  # (a model two backends share)
    why = []
    for name, q in found:
        reason = fits(q)
        if reason is not None:
            why.append(reason)
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, Int4PackLinear.from_quant(q))
        done += 1
    return done, list(dict.fromkeys(why))


__all__ = ["GROUPS", "Int4PackLinear", "Stacked", "fits", "rows_block", "use_tinygemm"]
