"""The GPU kernel of runtime.models.quantized: y = x @ w.T with w in MatMulNBits' blocks, dequantized a
tile at a time in registers, never as a whole. Triton, imported when a quantized product first runs
on a GPU, or on the CPU in a process started with TRITON_INTERPRET=1 (Triton's interpreter, which
must be on before Triton is first imported: the tests run it in a process of its own).

Each program computes a (BM, BN) tile of y: it walks K in steps of BK, loading x's (BM, BK) tile
and the codes of its BN output columns, (BK, BN), whose scales and zero points it gathers by block
(k // block_size), and accumulates ``dot(x, (q - z) * s (+ m))`` in fp32. The codes of one output column
are contiguous in K, so a tile's loads are too. A decode step's M (its rows) is small: BM is the
smallest tile ``tl.dot`` takes (16), and the columns are spread over many programs.

That tile read int4 weights 2.85x *slower* than float16 ones on an H200 (docs/benchmarks-gpu.md, sixth
loan): a 16-row product for one row, and a scale and a zero point gathered for every code. A decode
step of a few rows (``GEMV_ROWS``) takes ``qmv`` instead: one row a program, no tensor cores. It reads
each column's codes as contiguous bytes, (BN, BK / 2) at 4 bits, multiplies the low nibbles by x's even
and the high by its odd features, sums them a block at a time and applies each block's scale and zero
point once, to the block's sums: sum_k (q_k - z) s x_k = s (sum_k q_k x_k - z sum_k x_k) (+ m sum_k x_k).
Its tile sizes are chosen on the GPU by Triton's autotuner (per N and K, at the first call: a warm-up
run before a CUDA graph's capture); the interpreter runs one fixed tile.
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


@triton.jit
def qmv(x_ptr, p_ptr, s_ptr, z_ptr, m_ptr, y_ptr, N, K, NB,
        BITS: tl.constexpr, QBLOCK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MINS: tl.constexpr):
    row = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)  # (BN,) output columns
    in_n = rn < N
    PER: tl.constexpr = 8 // BITS  # codes a byte
    HB: tl.constexpr = BK // PER  # bytes a column reads per step
    NBK: tl.constexpr = BK // QBLOCK  # blocks per step
    acc = tl.zeros((BN,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rb = k0 // PER + tl.arange(0, HB)  # (HB,) the bytes of codes k0 .. k0 + BK
        in_b = rb < K // PER
        byte = tl.load(p_ptr + rn[:, None] * (K // PER) + rb[None, :], mask=in_n[:, None] & in_b[None, :],
                       other=0).to(tl.int32)  # (BN, HB)
        if BITS == 4:  # the low nibble is code 2j, the high one 2j + 1
            xe = tl.load(x_ptr + row * K + 2 * rb, mask=in_b, other=0.0).to(tl.float32)  # (HB,)
            xo = tl.load(x_ptr + row * K + 2 * rb + 1, mask=in_b, other=0.0).to(tl.float32)
            qx = (byte & 0x0F).to(tl.float32) * xe[None, :] + (byte >> 4).to(tl.float32) * xo[None, :]  # (BN, HB)
            xsum = xe + xo  # (HB,)
        else:
            xv = tl.load(x_ptr + row * K + rb, mask=in_b, other=0.0).to(tl.float32)
            qx = byte.to(tl.float32) * xv[None, :]
            xsum = xv
        qx = tl.sum(tl.reshape(qx, (BN, NBK, QBLOCK // PER)), axis=2)  # (BN, NBK) each block's sum q x
        xs = tl.sum(tl.reshape(xsum, (NBK, QBLOCK // PER)), axis=1)  # (NBK,) each block's sum x
        rbk = k0 // QBLOCK + tl.arange(0, NBK)  # (NBK,) the step's blocks
        kb = in_n[:, None] & (rbk < NB)[None, :]  # (BN, NBK)
        s = tl.load(s_ptr + rn[:, None] * NB + rbk[None, :], mask=kb, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rn[:, None] * NB + rbk[None, :], mask=kb, other=0).to(tl.float32)
        part = s * (qx - z * xs[None, :])  # (BN, NBK)
        if MINS:  # a GGUF type's block minimums
            part += tl.load(m_ptr + rn[:, None] * NB + rbk[None, :], mask=kb, other=0.0).to(tl.float32) * xs[None, :]
        acc += tl.sum(part, axis=1)
    tl.store(y_ptr + row * N + rn, acc.to(y_ptr.dtype.element_ty), mask=in_n)


GEMV_ROWS = 4  # at most this many rows take qmv (untuned: beyond it the tensor cores' tile, above)
GEMV_TILE = dict(BN=16, BK=128)  # the interpreter's (and any run's where Triton's autotuner is off)
# The autotuner's candidates: columns a program x codes a step x warps (BK >= the block: see gemv_fits).
GEMV_CONFIGS = [triton.Config({"BN": bn, "BK": bk}, num_warps=w)
                for bn in (8, 16, 32, 64) for bk in (128, 256, 512) for w in (2, 4, 8) if bn * bk <= 16384]
# Short timings (Triton's default, 25 + 100 ms a candidate, would be ~20 s for a model's five shapes).
qmv_tuned = triton.autotune(configs=GEMV_CONFIGS, key=["N", "K"], do_bench=lambda call, quantiles: (
    triton.testing.do_bench(call, warmup=5, rep=15, quantiles=quantiles)))(qmv)


def gemv_fits(q) -> bool:
    """Whether ``qmv`` takes ``q``'s blocks: a power-of-two block no wider than the smallest BK."""
    b = q.block_size
    return b & (b - 1) == 0 and 8 // q.bits <= b <= 128


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
    mins = q.mins if q.mins is not None else q.scales  # (read only with MINS)
    NB = q.zeros.shape[1]
    if M <= GEMV_ROWS and gemv_fits(q):
        args = (x, q.packed, q.scales, q.zeros, mins, y, N, K, NB)
        flags = dict(BITS=q.bits, QBLOCK=q.block_size, MINS=q.mins is not None)
        if x.is_cuda:
            qmv_tuned[lambda meta: (M, triton.cdiv(N, meta["BN"]))](*args, **flags)
        else:  # Triton's interpreter (tests)
            qmv[(M, triton.cdiv(N, GEMV_TILE["BN"]))](*args, **flags, **GEMV_TILE)
        return y
    BM, BN, BK = tiles(M)
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    qmm[grid](
        x, q.packed, q.scales, q.zeros, mins, y, M, N, K, NB, BITS=q.bits, QBLOCK=q.block_size,
        BM=BM, BN=BN, BK=BK, IEEE=x.dtype == torch.float32, MINS=q.mins is not None)
    return y


__all__ = ["GEMV_ROWS", "gemv_fits", "matmul", "qmm", "qmv", "tiles"]
