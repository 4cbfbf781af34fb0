"""The GPU kernel of runtime.models.quantized: y = x @ w.T with w in MatMulNBits' blocks, dequantized a
tile at a time in registers, never as a whole. Triton, imported when a quantized product first runs
on a GPU, or on the CPU in a process started with TRITON_INTERPRET=1 (Triton's interpreter, which
must be on before Triton is first imported: the tests run it in a process of its own).

Each program computes a (BM, BN) tile of y: it walks K in steps of BK, loading x's (BM, BK) tile
and the codes of its BN output columns, (BK, BN), whose scales and zero points it gathers by block
(k // block_size), and accumulates ``dot(x, (q - z) * s (+ m))`` in fp32. The codes of one output column
are contiguous in K, so a tile's loads are too. A decode step's M (its rows) is small: BM is the
smallest tile ``tl.dot`` takes (16), and the columns are spread over many programs.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # this module is imported only when a quantized product runs on a GPU
    raise ImportError("int4/int8 weights on the torch backend's GPU path need Triton (pip install triton; "
                      "CUDA builds of torch ship it); or use the onnxruntime backend") from exc


@triton.jit
def qmm(x_ptr, p_ptr, s_ptr, z_ptr, m_ptr, y_ptr, M, N, K, NB,
        BITS: tl.constexpr, QBLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        IEEE: tl.constexpr, MINS: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)  # (BM,) rows of x and y
    rn = tl.program_id(1) * BN + tl.arange(0, BN)  # (BN,) output columns
    in_m, in_n = rm < M, rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)  # (BK,)
        in_k = rk < K
        kn = in_k[:, None] & in_n[None, :]  # (BK, BN)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)
        if BITS == 4:  # two codes a byte, the first in the low nibble
            byte = tl.load(p_ptr + rn[None, :] * (K // 2) + rk[:, None] // 2, mask=kn, other=0).to(tl.int32)
            q = (byte >> ((rk[:, None] % 2) * 4)) & 0x0F
        else:
            q = tl.load(p_ptr + rn[None, :] * K + rk[:, None], mask=kn, other=0).to(tl.int32)
        b = rk[:, None] // QBLOCK  # (BK, 1) each k's block
        s = tl.load(s_ptr + rn[None, :] * NB + b, mask=kn, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rn[None, :] * NB + b, mask=kn, other=0).to(tl.float32)
        w = (q.to(tl.float32) - z) * s  # (BK, BN) the weight's tile, as ONNX Runtime dequantizes it
        if MINS:  # a GGUF type's block minimums
            w += tl.load(m_ptr + rn[None, :] * NB + b, mask=kn, other=0.0).to(tl.float32)
        if IEEE:  # fp32 activations: no TF32 rounding of either operand
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:  # fp16 / bf16 activations: the tensor cores' product, fp32 sums
            acc += tl.dot(x, w.to(x.dtype))
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=in_m[:, None] & in_n[None, :])


def tiles(M: int) -> tuple[int, int, int]:
    """(BM, BN, BK) for M rows: the smallest row tile that holds them (at least 16, what tl.dot takes);
    a decode step's few rows read each weight once, so narrower column tiles there, for more programs
    than a GPU has SMs (Llama-3.2-3B's o_proj: 96 of 32 columns). Untuned: set from the first GPU figures."""
    if M <= 16:
        return 16, 32, 64
    return (32 if M <= 32 else 64), 64, 64


def matmul(x: torch.Tensor, q) -> torch.Tensor:
    """x (M, K) -> (M, N) = x @ w.T, w the blocks of ``q`` (a QuantLinear)."""
    x = x.contiguous()
    M, K = x.shape
    N = q.out_features
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    BM, BN, BK = tiles(M)
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    mins = q.mins if q.mins is not None else q.scales  # (read only with MINS)
    qmm[grid](
        x, q.packed, q.scales, q.zeros, mins, y, M, N, K, q.zeros.shape[1], BITS=q.bits, QBLOCK=q.block_size,
        BM=BM, BN=BN, BK=BK, IEEE=x.dtype == torch.float32, MINS=q.mins is not None)
    return y


__all__ = ["matmul", "qmm", "tiles"]
