"""Weight-only int4 / int8 products for the torch backend, from the artifact's own blocks.

An artifact exported with ``--weights int4`` or ``int8`` holds each product as ONNX Runtime's
``MatMulNBits`` reads it: per output column n, its K weights in blocks of ``block_size``, each
weight a code q of ``bits`` bits (two 4-bit codes a byte, the first in the low nibble), each block a
scale s and a zero point z (default 2^(bits - 1)): w = (q - z) * s. ``Blocks`` is that, read from a
graph (``read_products``); ``QuantLinear`` multiplies by it where ``nn.Linear`` multiplied by a
float weight. These are the very blocks the CPU runs, so the torch backend computes what the ONNX
Runtime backend computes (the same dequantized values; only the order of the additions differs).

The product is never dequantized into a float copy of the weight (that would cost the memory and
the bandwidth the blocks save): on a GPU a Triton kernel (runtime.models.quantized_triton) reads the
codes and dequantizes a tile at a time in registers; on the CPU, where the torch backend is the
tests' reference rather than a fast path, the weight is dequantized a slice of columns at a time
(at most ``CPU_SLICE`` floats). The same kernel runs on the CPU under Triton's interpreter in the
tests (a process started with TRITON_INTERPRET=1), so CI checks the code a GPU runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..artifact.manifest import FUSED, LEVELS, MINIMUMS, MINS, PART, REBUILD_HINT, SCALES, TRANSPOSED, WIDTHS
from ..errors import ArtifactError

CPU_SLICE = 1 << 20  # floats of weight the CPU path dequantizes at once (4 MB in fp32)
# Triton's interpreter runs the GPU kernel on the CPU (tests): on only in a process started with it
TRITON_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class Blocks:
    """One product's weight in MatMulNBits' blocks: w[n, k] = (q[n, k] - zeros[n, b]) * scales[n, b]
    (+ mins[n, b]), b = k // block_size. An embedding table's too (n a token, k a feature)."""

    packed: np.ndarray  # (N, K * bits / 8) uint8: each output's codes in K order, two a byte at 4 bits
    scales: np.ndarray  # (N, nb) float32 or float16 (the activations' type)
    zeros: np.ndarray  # (N, nb) uint8
    bits: int  # 4 or 8
    block_size: int
    mins: np.ndarray | None = None  # (N, nb) float32: a GGUF type's block minimums, added (w = (q - z) * s + m)

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 8 // self.bits

    def codes(self) -> np.ndarray:
        """(N, K) uint8: the codes unpacked."""
        if self.bits == 8:
            return self.packed
        low, high = self.packed & 0x0F, self.packed >> 4  # (N, K / 2) each
        return np.stack([low, high], axis=-1).reshape(self.out_features, self.in_features)

    def dequantize(self) -> np.ndarray:
        """(N, K) float32: the weight these blocks stand for (tests; never the runtime's path)."""
        per = np.repeat(np.arange(self.scales.shape[1]), self.block_size)[: self.in_features]  # (K,) block of k
        w = (self.codes().astype(np.float32) - self.zeros[:, per]) * self.scales[:, per].astype(np.float32)
        return w if self.mins is None else w + self.mins[:, per]

    def split(self, widths) -> list["Blocks"]:
        """The blocks of consecutive runs of ``widths`` output columns (a fused product's parts)."""
        cuts = np.cumsum(widths)[:-1]
        mins = [None] * len(widths) if self.mins is None else np.split(self.mins, cuts)
        return [Blocks(p, s, z, self.bits, self.block_size, m) for p, s, z, m in
                zip(np.split(self.packed, cuts), np.split(self.scales, cuts), np.split(self.zeros, cuts), mins)]


def _attrs(node) -> dict:
    return {a.name: a.i for a in node.attribute if a.type == a.INT}


def read_products(proto) -> dict[str, Blocks]:
    """Every ``MatMulNBits`` product of the graph ``proto`` (weights inside), keyed by the float
    weight it replaced, a fused product's parts apart: ``self_attn.q_proj.weight`` (the module's
    (out, in) weight, not the ``.T`` the graph multiplied by). Raises ArtifactError on a form the
    torch backend does not read (the QDQ form, a GGUF product carried as runs of several types)."""
    from onnx import numpy_helper

    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    out: dict[str, Blocks] = {}
    for node in graph.node:
        if node.op_type == "Gather" and node.input[0].endswith(LEVELS) and node.input[0] in inits:
            table = node.input[0][: -len(LEVELS)]
            out[table.removesuffix(TRANSPOSED)] = _table(inits, table)
            continue
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            raise ArtifactError(
                f"{node.name or node.output[0]!r} is a blocked DequantizeLinear (the qdq format, for "
                f"TensorRT); the torch backend reads MatMulNBits products: re-export with "
                f"--quant-format matmulnbits, or use the onnxruntime backend")
        if node.op_type != "MatMulNBits":
            continue
        a = _attrs(node)
        K, N, bits, block = a["K"], a["N"], a["bits"], a["block_size"]
        name = node.input[1]
        if not name.endswith(f"_Q{bits}") or bits not in (4, 8) or K % block or PART in node.name \
                or any(node.input[4:]) or name not in inits:
            raise ArtifactError(
                f"product {node.name or name!r} ({bits} bits, K {K}, block {block}, inputs "
                f"{list(node.input)}) is no form the torch backend reads: whole blocks of 4- or 8-bit "
                f"codes with scales and zero points (a GGUF's products of several types are not); "
                f"use the onnxruntime backend, or re-export with --weights int4 from a float model")
        nb = K // block
        packed = numpy_helper.to_array(inits[name]).reshape(N, K * bits // 8)
        scales = numpy_helper.to_array(inits[node.input[2]]).reshape(N, nb)
        if len(node.input) > 3 and node.input[3]:
            z = numpy_helper.to_array(inits[node.input[3]])
            if z.dtype != np.uint8:
                raise ArtifactError(f"product {name!r} has {z.dtype} zero points; the torch backend reads "
                                    f"packed uint8 ones (ONNX Runtime's quantizer's); {REBUILD_HINT}")
            z = z.reshape(N, -1)
            zeros = np.stack([z & 0x0F, z >> 4], -1).reshape(N, -1)[:, :nb] if bits == 4 else z[:, :nb]
        else:
            zeros = np.full((N, nb), 1 << (bits - 1), np.uint8)
        mins = inits.get(f"{node.name}{MINS}/m")  # (nb, N): a carried GGUF type's minimums' term
        blocks = Blocks(np.ascontiguousarray(packed), np.ascontiguousarray(scales), np.ascontiguousarray(zeros),
                        bits, block, None if mins is None else np.ascontiguousarray(numpy_helper.to_array(mins).T))
        weight = name[: -len(f"_Q{bits}")]
        parts = weight.split(FUSED)
        if len(parts) > 1:
            widths = inits.get(weight + WIDTHS)
            if widths is None:
                raise ArtifactError(f"fused product {weight!r} has no {weight + WIDTHS!r} beside it; {REBUILD_HINT}")
            pieces = blocks.split(numpy_helper.to_array(widths))
        else:
            pieces = [blocks]
        for part, piece in zip(parts, pieces):
            out[part.removesuffix(TRANSPOSED)] = piece
    return out


def _table(inits: dict, name: str) -> Blocks:
    """A GGUF's 8-bit embedding table as export.gguf_blocks.carry_embedding writes it: levels (V, nb,
    block) uint8 and scales (V * nb,), w = d * (q - 128), or d * q + m with minimums (V * nb,)."""
    from onnx import numpy_helper

    levels = numpy_helper.to_array(inits[name + LEVELS])  # (V, nb, block)
    V, nb, block = levels.shape
    scales = numpy_helper.to_array(inits[name + SCALES]).reshape(V, nb)
    mins = inits.get(name + MINIMUMS)
    zeros = np.full((V, nb), 0 if mins is not None else 128, np.uint8)
    return Blocks(np.ascontiguousarray(levels.reshape(V, nb * block)), np.ascontiguousarray(scales), zeros, 8, block,
                  None if mins is None else numpy_helper.to_array(mins).reshape(V, nb).astype(np.float32))


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, mins: torch.Tensor | None,
               block_size: int) -> torch.Tensor:
    """(..., K) float32 weights from (..., K) codes and their blocks' (..., nb) scales, zero points
    and minimums (or None): (q - z) * s (+ m), as ONNX Runtime dequantizes them."""
    per = lambda t: t.float().repeat_interleave(block_size, dim=-1)  # noqa: E731  (..., K) each code's block's
    w = (codes.float() - per(zeros)) * per(scales)
    return w if mins is None else w + per(mins)


class QuantEmbedding(nn.Module):
    """``nn.Embedding`` over an 8-bit table's ``Blocks``: the rows looked up are dequantized, no others."""

    def __init__(self, blocks: Blocks, device, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = blocks.out_features, blocks.in_features
        self.block_size = blocks.block_size
        self.register_buffer("levels", torch.from_numpy(np.array(blocks.packed)).to(device))  # (V, D) uint8
        self.register_buffer("scales", torch.from_numpy(np.array(blocks.scales)).to(device=device, dtype=torch.float32))
        self.register_buffer("zeros", torch.from_numpy(np.array(blocks.zeros)).to(device))  # (V, nb) uint8
        mins = None if blocks.mins is None else torch.from_numpy(np.array(blocks.mins)).to(device)
        self.register_buffer("mins", mins)  # (V, nb) float32, or None
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mins = None if self.mins is None else self.mins[ids]
        return dequantize(self.levels[ids], self.scales[ids], self.zeros[ids], mins, self.block_size).to(self.dtype)


class QuantLinear(nn.Module):
    """``nn.Linear`` over blocks: x (..., K) -> (..., N), the codes, scales and zero points held on
    the device as they are in the artifact (4 bits a weight, plus a scale and a zero point a block).
    ``from_blocks``: an artifact's; ``quantize``: a float linear's, on its device (benchmarks of
    random weights at real shapes)."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, mins: torch.Tensor | None,
                 bits: int, block_size: int, bias: torch.Tensor | None):
        super().__init__()
        self.bits, self.block_size = bits, block_size
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 8 // bits
        self.register_buffer("packed", packed)  # (N, K * bits / 8) uint8
        self.register_buffer("scales", scales)  # (N, nb) the activations' type
        self.register_buffer("zeros", zeros)  # (N, nb) uint8
        self.register_buffer("mins", mins)  # (N, nb) the activations' type, or None
        self.bias = None if bias is None else nn.Parameter(bias.to(scales.dtype), requires_grad=False)

    @classmethod
    def from_blocks(cls, blocks: Blocks, bias: torch.Tensor | None, device, dtype: torch.dtype) -> "QuantLinear":
        tensor = lambda a, dt=None: torch.from_numpy(np.array(a)).to(device=device, dtype=dt)  # noqa: E731
        return cls(tensor(blocks.packed), tensor(blocks.scales, dtype), tensor(blocks.zeros),
                   None if blocks.mins is None else tensor(blocks.mins, dtype), blocks.bits, blocks.block_size,
                   None if bias is None else bias.to(device))

    @classmethod
    @torch.no_grad()
    def quantize(cls, linear: nn.Linear, bits: int, block_size: int) -> "QuantLinear":
        """``linear``'s weight in asymmetric blocks as ONNX Runtime's quantizer makes them (each block's
        range, 0 included, in 2^bits levels; its zero point rounded), on the weight's device."""
        w = linear.weight.float()  # (N, K)
        N, K = w.shape
        if K % block_size:
            raise ValueError(f"K {K} is no whole number of blocks of {block_size}")
        blocks = w.reshape(N, K // block_size, block_size)
        lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)  # (N, nb)
        top = (1 << bits) - 1
        scales = torch.where(hi > lo, (hi - lo) / top, torch.ones_like(lo))
        zeros = (-lo / scales).round().clamp(0, top)
        q = (blocks / scales[..., None] + zeros[..., None]).round().clamp(0, top).to(torch.uint8).reshape(N, K)
        packed = q if bits == 8 else q[:, 0::2] | (q[:, 1::2] << 4)  # two codes a byte, the first low
        return cls(packed.contiguous(), scales.to(linear.weight.dtype), zeros.to(torch.uint8), None, bits, block_size,
                   linear.bias)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @classmethod
    def fused(cls, parts: list["QuantLinear"]) -> "QuantLinear":
        """One product for ``parts`` applied to the same input (q/k/v, gate/up), their outputs
        concatenated; each part's buffers become views of the fused ones, so nothing is held twice."""
        first = parts[0]
        if any((p.bits, p.block_size, p.in_features, p.mins is None) !=
               (first.bits, first.block_size, first.in_features, first.mins is None) for p in parts):
            raise ValueError("fused products need one bit width, block size and input width (and minimums or none)")
        names = ("packed", "scales", "zeros") + (() if first.mins is None else ("mins",))
        wholes = {name: torch.cat([getattr(p, name) for p in parts]) for name in names}  # (sum N, ...)
        for name, whole in wholes.items():
            start = 0
            for p in parts:
                setattr(p, name, whole[start:start + p.out_features])
                start += p.out_features
        biases = [p.bias for p in parts]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else first.scales.new_zeros(p.out_features) for p, b in zip(parts, biases)])
        return cls(wholes["packed"], wholes["scales"], wholes["zeros"], wholes.get("mins"), first.bits,
                   first.block_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (M, K)
        if x.is_cuda or TRITON_INTERPRETER:
            from .quantized_triton import matmul

            out = matmul(flat, self)  # (M, N)
        else:
            out = self._cpu(flat)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _cpu(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) -> (M, N): the weight dequantized ``CPU_SLICE`` floats at a time."""
        N, K = self.out_features, self.in_features
        step = max(1, CPU_SLICE // K)
        out = x.new_empty(x.shape[0], N)
        for start in range(0, N, step):
            stop = min(start + step, N)
            out[:, start:stop] = x @ self.weight_rows(start, stop).to(x.dtype).T
        return out

    def weight_rows(self, start: int, stop: int) -> torch.Tensor:
        """(stop - start, K) float32: output columns [start, stop) of the weight, dequantized."""
        packed = self.packed[start:stop]
        if self.bits == 4:
            codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(stop - start, -1)
        else:
            codes = packed
        mins = None if self.mins is None else self.mins[start:stop]
        return dequantize(codes, self.scales[start:stop], self.zeros[start:stop], mins, self.block_size)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"block_size={self.block_size}")


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over a float weight (out, in) or a product module (QuantLinear, tinygemm's
    Int4PackLinear; its own bias aside)."""
    if isinstance(weight, nn.Module):
        out = weight(x)
        return out if bias is None else out + bias
    return torch.nn.functional.linear(x, weight, bias)


__all__ = ["Blocks", "CPU_SLICE", "QuantEmbedding", "QuantLinear", "linear", "read_products"]
