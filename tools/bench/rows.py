"""What one run measures: shapes, rows (backend x policy), and the SkipDecode policies.

Policies: ``SkipPolicy.for_speedup(L, s, horizon=new_tokens - 1)``, the max/min budgets whose
theoretical speedup ``L / mean(budget)`` over the decode steps is closest to ``s``, preferring a
max:min ratio near 2:1 as in the paper's Table 2 (OPT-1.3B, 24 layers: 16/8 for 2x); 1 warm-up
layer. The decay spans the whole generation, as the runtime's default horizon does.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.policy import SkipPolicy

# Backends a row can run on ({block}: tools.bench --block-size, the quantized rows' weights per
# scale). ort-spin: the ONNX Runtime backend with spin=True (--spin); ort-nospin measured it with
# spinning off before that was the backend's default, and now runs exactly ort.
BACKENDS = {
    "hf": "transformers generate (PyTorch eager)",
    "torch": "this project, torch backend",
    "ort": "this project, ONNX Runtime backend",
    "ort-spin": "this project, ONNX Runtime backend, --spin (worker threads busy-wait briefly)",
    "ort-nospin": "this project, ONNX Runtime backend, allow_spinning=0 (now the default: as ort)",
    "optimum": "Optimum ORTModelForCausalLM",
    "ort-int4": "this project, ONNX Runtime backend, int4 weights (layers and head; MatMulNBits, block {block}), "
                "the products on runtime/platform/kernels' VNNI kernel where it runs (int4_kernel='auto')",
    "ort-int4-mlas": "this project, ONNX Runtime backend, the ort-int4 export on ONNX Runtime's own MatMulNBits kernel "
                     "(int4_kernel='onnxruntime')",
    "ort-int4head": "this project, ONNX Runtime backend, int4 head, float layers",
    "ort-int8head": "this project, ONNX Runtime backend, int8 head, float layers",
    "ort-int8": "this project, ONNX Runtime backend, int8 weights (layers and head; MatMulNBits, block {block})",
    "ortgenai": "ONNX Runtime GenAI, fp32 (its model builder, `-e cpu`: fused QKV, GroupQueryAttention)",
    "ortgenai-int4": "ONNX Runtime GenAI, int4 (its builder: MatMulNBits, block {block}, symmetric, accuracy level 4)",
    "llamacpp": "llama.cpp (llama-cpp-python), F32 GGUF of the checkpoint",
    "llamacpp-q8_0": "llama.cpp, Q8_0 (its quantizer, from the F32 GGUF)",
    "llamacpp-q4_0": "llama.cpp, Q4_0 (its quantizer, from the F32 GGUF)",
}
# The quantized rows run their own export of the same checkpoint: backend -> (layers, head) weights
# (export.build.BuildOptions.weights / head_weights).
QUANTIZED = {"ort-int4": ("int4", "int4"), "ort-int4-mlas": ("int4", "int4"), "ort-int4head": ("float", "int4"),
             "ort-int8": ("int8", "int8"), "ort-int8head": ("float", "int8")}
SAME_EXPORT = {"ort-int4-mlas": "ort-int4"}  # rows that run another row's export, another way
INT4_KERNEL = {"ort-int4-mlas": "onnxruntime"}  # the backend's int4_kernel per row (others: "auto")
# ONNX Runtime GenAI's rows: backend -> its builder's precision (tools/bench/ortgenai_worker.py)
ORTGENAI = {"ortgenai": "fp32", "ortgenai-int4": "int4"}
# llama.cpp's rows: backend -> the GGUF's type (tools/bench/llamacpp_worker.py)
LLAMACPP = {"llamacpp": "f32", "llamacpp-q8_0": "q8_0", "llamacpp-q4_0": "q4_0"}
FULL_ONLY = ("hf", "optimum", *ORTGENAI, *LLAMACPP)  # peers: the plain model only
VENV_PEERS = {"optimum": "optimum", **{b: "ortgenai" for b in ORTGENAI},
              **{b: "llamacpp" for b in LLAMACPP}}  # backend -> the venv its worker runs in
RUNTIME = ("torch", "ort", "ort-spin", "ort-nospin", *QUANTIZED)  # this project's runtime: SkipDecode policies apply
ORT = ("ort", "ort-spin", "ort-nospin", *QUANTIZED)


@dataclass(frozen=True)
class Shape:
    batch: int
    prompt: int  # prompt tokens per row (every row of the batch has exactly this many)

    def __str__(self) -> str:
        return f"b{self.batch} p{self.prompt}"


@dataclass(frozen=True)
class Row:
    backend: str
    speedup: float | None  # requested theoretical speedup; None = full depth

    @property
    def name(self) -> str:
        return f"{self.backend} {'full' if self.speedup is None else f'{self.speedup:g}x'}"

    @property
    def is_full(self) -> bool:
        return self.speedup is None


def parse_backend(token: str, default_speedups: dict[str, list[float]]) -> list[Row]:
    """``NAME`` (full depth + the backend's default speedups) or ``NAME@full+2+5``."""
    name, _, which = token.partition("@")
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    if which:
        levels = [None if w == "full" else float(w) for w in which.split("+") if w]
    else:
        levels = [None, *default_speedups.get(name, [])]
    if name in FULL_ONLY and any(s is not None for s in levels):
        raise ValueError(f"{name} runs the plain model only: use {name} or {name}@full")
    for s in levels:
        if s is not None and s < 1:
            raise ValueError(f"{token}: a speedup must be >= 1, got {s:g}")
    return [Row(name, None if s is None or s == 1 else s) for s in levels]


def rows_for(backends: list[str], speedups: list[float], torch_speedups: list[float]) -> list[Row]:
    defaults = {"torch": torch_speedups, **{b: speedups for b in ORT}}
    rows: list[Row] = []
    for token in backends:
        for row in parse_backend(token, defaults):
            if row not in rows:
                rows.append(row)
    return rows


def policy_for(row: Row, num_layers: int, new_tokens: int) -> SkipPolicy:
    horizon = max(new_tokens - 1, 1)  # decode steps: the first token comes from the prompt pass
    if row.is_full:
        return SkipPolicy.full_depth(num_layers, horizon=horizon)
    return SkipPolicy.for_speedup(num_layers, row.speedup, horizon=horizon, warmup_layers=1)


def theoretical_speedup(policy: SkipPolicy, new_tokens: int) -> float:
    return policy.theoretical_speedup(max(new_tokens - 1, 1))
