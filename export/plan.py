"""Memory plan of an OPT model on a device: weights at fp32/fp16/int8/int4, the KV cache,
activations and the runtime's own overhead; which fit each Jetson module (DEVICES: Orin Nano 4GB to
AGX Thor), as the memory Linux sees less an OS reserve that scales with it and the TensorRT path's own
overhead (a CUDA context, torch, TensorRT), each figure with its source.

``python -m export plan [opt-1.3b | ARTIFACT_DIR ...] [--tokens 1024 --batch 8 --prompt 1024]``

Every figure is arithmetic on the architecture (an alias's known shape, or an artifact's manifest
and hf_config), so it runs anywhere without weights. ``--measure`` checks it against the peak RSS
of a real load + generate on ONNX Runtime's CPU backend (export/measure.py).

The shape planned is, unless given, what ``python -m engines build`` builds by default
(``engines.config.EngineBuildConfig``: --max-batch 8, --max-seq 1024, --max-prompt = --max-seq), the
sequence capped at the model's max_position_embeddings (engines build refuses more): the KV buffers
the TensorRT backend preallocates and the activation scratch of the engines' largest profile shape.

Weights, per tensor, in the format of the artifact planned (its manifest's ``weights``: the layers'
and the head's, block size, zero points or not, its dtype) or of each ``--weights`` format for an
alias. In float the head reads the tied embedding itself (export.weights stores it once in
weights.bin); quantized, the head holds its own quantized copy, because the embedding is gathered
in float while the head is a quantized MatMul:

* stay in float (the artifact's dtype; fp16 for an alias's int8/int4): token and position
  embeddings, layer norms, biases, the embedding graph's project_in (OPT-350m);
* quantized for int8/int4, as ONNX Runtime's MatMulNBits (or the qdq form's DequantizeLinear, the
  same bytes without zero points) stores a K x N weight: ceil(K / block) blocks per output column,
  each of ``block * bits / 8`` bytes, one float scale per block, and for asymmetric quantization
  (the matmulnbits format) one zero point per block packed at ``bits`` bits: the q/k/v/out
  projections, fc1 and fc2 of every layer, and the head's project_out (OPT-350m) and lm_head.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from engines.config import EngineBuildConfig
from runtime.errors import ModelNotFoundError, SkipDecodeError
from runtime.kvcache import pages_width
from runtime.models import family_named, published
from runtime.models.published import OPT_ARCHS, OPT_VOCAB_SIZE

from .quantize import BLOCK_SIZE, QUANT_BITS  # noqa: F401 - the planner's, and its callers' from here

GiB = 1024**3
WEIGHT_FORMATS = ("fp32", "fp16", "int8", "int4")
FLOAT_BYTES = {"fp32": 4, "fp16": 2, "float32": 4, "float16": 2}
# Runtime overhead of one process on the ONNX Runtime CPU backend: Python, numpy, onnxruntime,
# tokenizers, one session per graph and the tokenizer. Measured here (x86, 2026-11-23, after the
# runtime stopped importing torch and transformers): `python -m export plan DIR --measure --tokens
# 256 --prompt 64` on a `python -m export build --model tiny-random` artifact peaks at 88.2-88.6 MB
# RSS (three runs), of which its weights, KV cache and activations are 3.4 MB: 81 MiB remain.
# A floor, not a per-byte factor; rerun the command when the runtime's imports change.
RUNTIME_OVERHEAD_BYTES = 81 * 1024**2
MiB = 1024**2


# -- the devices ----------------------------------------------------------------------------------
# A Jetson's CPU and GPU share one memory. What a model may use is what Linux sees (MemTotal: the
# module's DRAM less the carveouts taken before the kernel boots), less what the OS keeps, less what
# the TensorRT path itself costs before any weight loads. Nothing here was measured on a Jetson (none
# is available to this project); each figure names where it comes from.


@dataclass(frozen=True)
class Device:
    name: str
    visible_mib: int  # MemTotal in MiB, as tegrastats prints it ("RAM used/totalMB")
    source: str  # where visible_mib comes from

    @property
    def visible_bytes(self) -> int:
        return self.visible_mib * MiB

    def reserve_bytes(self, reserve: int | None = None) -> int:
        """What the OS keeps: ``reserve`` (--reserve) if given, else os_reserve_bytes' rule."""
        return os_reserve_bytes(self.visible_bytes) if reserve is None else reserve

    def usable_bytes(self, reserve: int | None = None) -> int:
        return self.visible_bytes - self.reserve_bytes(reserve)


_TEGRASTATS = "tegrastats' RAM total in public captures (exact-string search for 'RAM n/{}MB' in GitHub code)"
# The totals tegrastats prints: 62841 MB is the 61.4 GiB issue 60 quotes for the AGX Orin 64GB, 7620 MB
# the Orin Nano 8GB's 7,620 MB. Two modules have no capture found: their figure is an estimate, marked so.
DEVICES = (
    Device("Orin Nano 4GB", 3524, "unverified: estimated as 4096 MiB less the 572 MiB the Orin Nano 8GB "
                                  "loses to carveouts (8192 - 7620); no capture found"),
    Device("Orin Nano 8GB", 7620, _TEGRASTATS.format(7620)),
    Device("Orin NX 8GB", 7620, "unverified: taken as the Orin Nano 8GB's (same 8 GB LPDDR5); no capture found"),
    Device("Orin NX 16GB", 15656, _TEGRASTATS.format(15656)),
    Device("AGX Orin 32GB", 30536, _TEGRASTATS.format(30536)),
    Device("AGX Orin 64GB", 62841, _TEGRASTATS.format(62841)),
    Device("AGX Thor", 125772, _TEGRASTATS.format(125772) + "; 128 GB LPDDR5X module"),
)

# The OS reserve scales with the module: a fixed part for the OS itself (Ubuntu's services and, on a
# developer kit, the desktop; a public report puts a Jetson Nano's OS with its desktop at ~1.5 GB and at
# ~0.3-0.5 GB over ssh alone: microsoft/onnxruntime#4259) plus 5% of what Linux sees, for what grows
# with the memory: the kernel's free-page watermarks, page cache and slab, and headroom before the OOM
# killer (CUDA allocations on a Jetson are not swapped). The 1 GiB and the 5% are this project's choice,
# not a measurement: on a headless board pass a smaller --reserve, which replaces the rule for every device.
OS_RESERVE_FIXED_BYTES = GiB
OS_RESERVE_FRACTION = 20  # 1/20 = 5% of MemTotal


def os_reserve_bytes(visible_bytes: int) -> int:
    """The OS reserve of a module whose Linux sees ``visible_bytes``: 1 GiB + 5% of it."""
    return OS_RESERVE_FIXED_BYTES + visible_bytes // OS_RESERVE_FRACTION


# The TensorRT path's own overhead, on top of RUNTIME_OVERHEAD_BYTES (that process's Python, numpy and
# tokenizer): cited, not measured here (no Jetson). A CUDA context: 300-400 MB (issue 60; ~300 MB with
# CUDA's lazy module loading, pytorch/pytorch#107667); we take 384 MiB. `import torch` (the backend uses
# PyTorch's CUDA allocator): 502 MB resident for a CUDA build on x86 (stefan-jansen/machine-learning-for-
# trading#1029; NVIDIA's Jetson wheel unverified). TensorRT: 341 MiB, what trtexec logged on a Jetson for
# cuBLAS/cuBLASLt's initialization (CPU +159 MiB, GPU +182 MiB: NVIDIA/TensorRT#2217, TensorRT 8.x);
# libnvinfer's own footprint on JetPack 6/7 is unverified. Rerun the plan with a measured figure when a
# board is at hand (docs/jetson.md, "Measure on your board").
CUDA_CONTEXT_BYTES = 384 * MiB
TORCH_IMPORT_BYTES = 502 * MiB
TENSORRT_INIT_BYTES = (159 + 182) * MiB
TENSORRT_PATH_BYTES = CUDA_CONTEXT_BYTES + TORCH_IMPORT_BYTES + TENSORRT_INIT_BYTES


class PlanError(SkipDecodeError, ValueError):
    """A plan's inputs are inconsistent (tokens, batch, prompt, block size)."""


@dataclass(frozen=True)
class Arch:
    name: str  # alias or artifact directory
    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_dim: int
    word_embed_proj_dim: int  # != hidden_size only for OPT-350m (project_in / project_out)
    vocab_size: int
    max_positions: int  # max_position_embeddings; the position table has 2 more rows (OPT's offset)
    pre_layer_norm: bool  # False for OPT-350m: post-LayerNorm, no final layer norm
    kv_width: int | None = None  # K/V values per position and layer: KV heads x head_dim, smaller than
    # hidden_size under grouped-query attention (Llama family); None: hidden_size (OPT)
    weights: tuple | None = None  # (name, (K, N), quantizable) of a non-OPT family (runtime.models.published); None: OPT's


ENGINE_DEFAULTS = EngineBuildConfig()  # what `python -m engines build` builds when given no limits


@dataclass(frozen=True)
class Workload:
    tokens: int = ENGINE_DEFAULTS.max_seq  # positions per row the KV cache holds (prompt + new tokens): engines build's --max-seq
    batch: int = ENGINE_DEFAULTS.max_batch  # rows decoded together: engines build's --max-batch
    prompt: int = ENGINE_DEFAULTS.prompt_limit  # longest prompt prefilled at once (--max-prompt, default --max-seq): the prefill's attention scores grow with its square
    page_size: int = 32  # KV positions per page (the export's default): the width grows in whole pages
    block_size: int = BLOCK_SIZE  # quantization block along K
    symmetric: bool = False  # True: no zero points (the qdq format; matmulnbits, ONNX Runtime's default, has them)

    def check(self, arch: Arch) -> None:
        for name in ("tokens", "batch", "prompt", "page_size", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name} must be a positive int, got {value!r}; pass --{name.replace('_', '-')} N")
        if self.tokens > arch.max_positions:
            raise PlanError(f"--tokens {self.tokens} exceeds max_position_embeddings {arch.max_positions} of "
                            f"{arch.name}: positions past it have no embedding; pass --tokens {arch.max_positions} "
                            f"or less")
        if self.prompt > self.tokens:
            raise PlanError(f"--prompt {self.prompt} exceeds --tokens {self.tokens}: a prompt must fit in the "
                            f"KV cache; pass --prompt {self.tokens} or less")


def engine_workload(arch: Arch, tokens: int | None = None, batch: int | None = None, prompt: int | None = None,
                    **fields) -> Workload:
    """The shape to plan: each limit not given is what `python -m engines build` builds by default,
    its --max-seq capped at the model's max_position_embeddings (which engines build refuses to pass),
    its --max-prompt the sequence."""
    tokens = tokens if tokens is not None else EngineBuildConfig.default_max_seq(arch.max_positions)
    return Workload(tokens=tokens, batch=batch if batch is not None else ENGINE_DEFAULTS.max_batch,
                    prompt=prompt if prompt is not None else tokens, **fields)


@dataclass(frozen=True)
class WeightFormat:
    """What a model's graphs hold: the layers' and the head's MatMul weights and the float parts."""

    layers: str  # "float", "int8" or "int4" (export.quantize.QuantConfig.weights)
    head: str  # the head's (QuantConfig.head_weights); the embedding graph is always float
    float_bytes: int  # 4 or 2: embeddings, norms, biases and scales; the KV cache and activations too

    @property
    def label(self) -> str:
        """fp32 / fp16 / int8 / int4 as ``--weights`` names them; the rest spelled out."""
        dtype = "fp32" if self.float_bytes == 4 else "fp16"
        if self.layers == self.head == "float":
            return dtype
        if self.layers == self.head and dtype == "fp16":
            return self.layers
        name = self.layers if self.layers == self.head else f"{self.layers} layers, {self.head} head"
        return f"{name} ({dtype})"


def parse_format(name: str) -> WeightFormat:
    """A ``--weights`` format: fp32, fp16, or int8/int4 with fp16 float parts."""
    if name not in WEIGHT_FORMATS:
        raise PlanError(f"weights {name!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    if name in QUANT_BITS:
        return WeightFormat(name, name, 2)
    return WeightFormat("float", "float", FLOAT_BYTES[name])


def artifact_format(manifest) -> tuple[WeightFormat, dict]:
    """An artifact's weights as its manifest records them, and the Workload fields they fix
    (block_size, symmetric: the qdq format writes no zero points)."""
    w = manifest.weights or {}
    fmt = WeightFormat(w.get("layers", "float"), w.get("head", "float"), FLOAT_BYTES[manifest.dtype])
    fields = {"block_size": w["block_size"], "symmetric": w.get("format") == "qdq"} if w else {}
    return fmt, fields


@dataclass(frozen=True)
class Plan:
    arch: Arch
    weights: str  # WeightFormat.label: "fp32", "fp16", "int8", "int4", or an artifact's own, "int4 (fp32)"
    workload: Workload
    weight_bytes: int
    float_weight_bytes: int  # of weight_bytes, the tensors kept in float
    kv_bytes: int
    activation_bytes: int
    overhead_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes + self.overhead_bytes

    @property
    def device_bytes(self) -> int:
        """On a Jetson: the total plus the TensorRT path's own overhead (CUDA context, torch, TensorRT)."""
        return self.total_bytes + TENSORRT_PATH_BYTES

    def fits(self, device: Device, reserve: int | None = None) -> bool:
        """Whether it fits what ``device``'s Linux sees less its OS reserve (``reserve``: --reserve)."""
        return self.device_bytes <= device.usable_bytes(reserve)


# -- architectures --------------------------------------------------------------------------------


def arch_from_alias(name: str) -> Arch:
    if (alias := published.alias_of(name)) is not None:  # a Llama-family alias
        return plan_arch(alias, published.PUBLISHED[alias].fields())
    key = name.lower().split("/")[-1]
    if key not in OPT_ARCHS:
        raise ModelNotFoundError(f"unknown model {name!r}: pass an artifact directory or one of "
                                 f"{', '.join([*OPT_ARCHS, *published.PUBLISHED])}")
    layers, hidden, heads, ffn, proj, pre_ln = OPT_ARCHS[key]
    return Arch(key, layers, hidden, heads, ffn, proj, OPT_VOCAB_SIZE, 2048, pre_ln)


def arch_from_artifact(directory) -> Arch:
    """The manifest's model fields plus ffn_dim and word_embed_proj_dim from the hf_config/ the
    export writes beside it (the manifest has no FFN width)."""
    from runtime.artifact.manifest import load_manifest

    directory = Path(directory)
    m = load_manifest(directory, check_hashes=False).model
    config_path = directory / "hf_config" / "config.json"
    if m.architecture != "opt":  # the Llama family's shapes, from its config.json
        try:
            return plan_arch(str(directory), json.loads(config_path.read_text()))
        except (OSError, ValueError, KeyError) as exc:
            raise PlanError(f"cannot read the model's shape from {config_path} ({exc}); re-export with "
                            f"`python -m export build`") from exc
    try:
        config = json.loads(config_path.read_text())
        ffn, proj = int(config["ffn_dim"]), int(config["word_embed_proj_dim"])
    except (OSError, ValueError, KeyError) as exc:
        raise PlanError(f"cannot read ffn_dim and word_embed_proj_dim from {config_path} ({exc}); re-export "
                        f"with `python -m export build`, or plan by alias (e.g. opt-1.3b)") from exc
    return Arch(str(directory), m.num_layers, m.hidden_size, m.num_heads, ffn, proj, m.vocab_size,
                m.max_position_embeddings, m.pre_layer_norm)


def resolve_arch(spec: str) -> Arch:
    return arch_from_artifact(spec) if Path(spec).is_dir() else arch_from_alias(spec)


# -- arithmetic -----------------------------------------------------------------------------------


def tensors(arch: Arch) -> list[tuple[str, tuple[int, int], bool]]:
    """(name, shape, quantizable) of every weight the graphs hold; a matmul's shape is (K, N).
    project_in is in the embedding graph, which stays float (export.quantize)."""
    if arch.weights is not None:
        return list(arch.weights)
    D, P, F, V = arch.hidden_size, arch.word_embed_proj_dim, arch.ffn_dim, arch.vocab_size
    out = [("embed_tokens", (V, P), False), ("embed_positions", (arch.max_positions + 2, D), False)]
    if P != D:
        out.append(("project_in", (P, D), False))
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out += [(p + name, (D, D), True), (p + name + ".bias", (1, D), False)]
        out += [(p + "fc1", (D, F), True), (p + "fc1.bias", (1, F), False),
                (p + "fc2", (F, D), True), (p + "fc2.bias", (1, D), False),
                (p + "self_attn_layer_norm", (2, D), False), (p + "final_layer_norm", (2, D), False)]
    if arch.pre_layer_norm:
        out.append(("final_layer_norm", (2, D), False))
    if P != D:
        out.append(("project_out", (D, P), True))
    out.append(("lm_head", (P, V), True))  # counted only when quantized (see weight_bytes)
    return out


def quantized_bytes(k: int, n: int, bits: int, block: int, scale_bytes: int, symmetric: bool) -> int:
    """Bytes of a K x N weight as MatMulNBits stores it: packed blocks, scales, zero points."""
    blocks = -(-k // block)  # K is padded up to whole blocks
    data = n * blocks * (block * bits // 8)
    scales = n * blocks * scale_bytes
    zero_points = 0 if symmetric else n * -(-blocks * bits // 8)
    return data + scales + zero_points


HEAD_TENSORS = ("lm_head", "project_out")  # in the head graph: the head's weight format


def weight_bytes(arch: Arch, weights: str | WeightFormat, workload: Workload = Workload()) -> tuple[int, int]:
    """(all weight bytes, of which float) for a ``--weights`` name or a WeightFormat."""
    fmt = weights if isinstance(weights, WeightFormat) else parse_format(weights)
    float_bytes = fmt.float_bytes
    total = floats = 0
    for name, (k, n), quantizable in tensors(arch):
        bits = fmt.head if name in HEAD_TENSORS else fmt.layers
        if name == "lm_head" and bits not in QUANT_BITS:
            continue  # the float head is the tied embedding, stored once
        if quantizable and bits in QUANT_BITS:
            total += quantized_bytes(k, n, QUANT_BITS[bits], workload.block_size, float_bytes,
                                     workload.symmetric)
        else:
            total += k * n * float_bytes
            floats += k * n * float_bytes
    return total, floats


def kv_cache_bytes(arch: Arch, workload: Workload, dtype_bytes: int) -> int:
    """The runtime's K and V buffers: per layer a K of (batch, kv_heads, head_dim, capacity) and a V of
    (batch, kv_heads, capacity, head_dim), the capacity (tokens) rounded up to whole pages."""
    width = pages_width(workload.tokens, workload.page_size)
    return arch.num_layers * 2 * workload.batch * (arch.kv_width or arch.hidden_size) * width * dtype_bytes


def activation_bytes(arch: Arch, workload: Workload, dtype_bytes: int) -> int:
    """The largest single graph run's intermediates: a layer's prefill of the longest prompt over
    the widest past the engines' prefill profile admits, or the head's logits. TensorRT sizes each
    engine's activation scratch for its profiles' largest shapes, whatever runs; on ONNX Runtime
    (--measure) this is the largest a run can reach, a prompt's later chunk over a full cache.

    Layer prefill: attention scores and probabilities in fp32 (softmax is fp32 in every export) over
    the bound past and the prompt, (B, heads, T, W + T) each, W the cache's width in whole pages
    (runtime.kvcache.pages_width of the sequence, the prefill profile's past_sequence max);
    fc1's output (B, T, ffn); and q, k, v, the attention output and the residuals, (B, T, D) each,
    six of them. Head: the last position's logits (B, V) in the artifact's dtype plus the float32
    copy the engine keeps.
    """
    B, T, D = workload.batch, workload.prompt, arch.hidden_size
    W = pages_width(workload.tokens, workload.page_size)
    scores = 2 * B * arch.num_heads * T * (W + T) * 4
    layer = scores + B * T * (arch.ffn_dim + 6 * D) * dtype_bytes
    head = B * arch.vocab_size * (dtype_bytes + 4)
    return max(layer, head)


def plan(arch: Arch, weights: str | WeightFormat, workload: Workload = Workload(),
         overhead: int = RUNTIME_OVERHEAD_BYTES) -> Plan:
    workload.check(arch)
    fmt = weights if isinstance(weights, WeightFormat) else parse_format(weights)
    total, floats = weight_bytes(arch, fmt, workload)
    act = fmt.float_bytes  # the KV cache and activations are in the float parts' dtype
    return Plan(arch, fmt.label, workload, total, floats, kv_cache_bytes(arch, workload, act),
                activation_bytes(arch, workload, act), overhead)


# -- output ---------------------------------------------------------------------------------------


def gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def fit_table(plans: list[Plan], reserve: int | None = None) -> str:
    """Markdown: one row per model and weight format, GiB per term, and whether it fits each device
    (its MemTotal less the OS reserve: os_reserve_bytes, or ``reserve`` for every device)."""
    head = ["model", "weights", "weights GiB", "KV GiB", "activations GiB", "overhead GiB", "total GiB",
            "with TensorRT path GiB",
            *(f"{d.name} ({d.usable_bytes(reserve) / GiB:.1f} GiB usable)" for d in DEVICES)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in plans:
        cells = [Path(p.arch.name).name, p.weights, gib(p.weight_bytes), gib(p.kv_bytes),
                 gib(p.activation_bytes), gib(p.overhead_bytes), gib(p.total_bytes), gib(p.device_bytes),
                 *("yes" if p.fits(d, reserve) else "no" for d in DEVICES)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def describe(workload: Workload, reserve: int | None, engine_defaults: bool = False) -> str:
    quant = ("symmetric" if workload.symmetric else "asymmetric, with zero points")
    shape = (f"KV cache for {workload.tokens} tokens x batch {workload.batch} (rounded up to pages of "
             f"{workload.page_size}), prefill of a {workload.prompt}-token prompt over that cache")
    if engine_defaults:
        shape += (f": what `python -m engines build` builds by default (--max-batch {ENGINE_DEFAULTS.max_batch} "
                  f"--max-seq {ENGINE_DEFAULTS.max_seq}, --max-prompt = --max-seq; pass --batch/--tokens/--prompt "
                  f"to plan another)")
    kept = ("1 GiB + 5% of the memory Linux sees (--reserve to set one size)" if reserve is None
            else f"{reserve / GiB:g} GiB (--reserve)")
    return (f"{shape}; int8/int4: blocks of {workload.block_size}, {quant}, scales and "
            f"embeddings/layer norms/biases in the float dtype (fp16 for an alias); "
            f"devices: the memory Linux sees, less {kept} for the OS; "
            f"the TensorRT path adds {TENSORRT_PATH_BYTES / GiB:.2f} GiB (CUDA context, torch, TensorRT: "
            f"cited, not measured; see export/plan.py)")


def ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def measured_line(p: Plan, measured: dict) -> str:
    peak = measured["peak_rss_bytes"]
    return (f"{Path(p.arch.name).name} {p.weights}: predicted {gib(p.total_bytes)} GiB, measured peak RSS "
            f"{gib(peak)} GiB ({ratio(peak, p.total_bytes)} of the prediction; {ratio(peak, p.weight_bytes)} "
            f"the weights); after imports {gib(measured['baseline_rss_bytes'])} GiB, after load "
            f"{gib(measured['loaded_rss_bytes'])} GiB; generated {measured['rows']} x "
            f"{measured['positions']} positions")


def all_aliases() -> list[str]:
    return list(OPT_ARCHS)


def check_formats(text: str) -> list[str]:
    formats = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in formats if f not in WEIGHT_FORMATS]
    if bad or not formats:
        raise PlanError(f"--weights {text!r}: each must be one of {', '.join(WEIGHT_FORMATS)} "
                        f"(comma-separated, e.g. fp16,int8,int4)")
    return formats


def parse_gib(text: str) -> int | None:
    """--reserve: a size in GiB, or "auto" (None: each device's own reserve, os_reserve_bytes)."""
    if str(text).strip().lower() == "auto":
        return None
    try:
        value = float(str(text).lower().removesuffix("gib").removesuffix("gb"))
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise PlanError(f"--reserve {text!r} is not a size in GiB; pass e.g. --reserve 2 or 1.5GiB (default: auto, "
                        f"1 GiB + 5% of each device's memory)")
    return int(value * GiB)


# -- the Llama family's shapes (runtime.models.published) ------------------------------------------------


def weight_tensors(config: dict) -> tuple[tuple[str, tuple[int, int], bool], ...]:
    """(name, shape, quantizable) of every weight a Llama-family artifact's graphs hold, as
    export.plan counts them (a matmul's shape is (K, N)), from config.json fields. The head is
    "lm_head" when tied (plan counts it only when quantized: in float it is the embedding) and
    "lm_head.untied" otherwise (always counted)."""
    D, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nh = config["num_attention_heads"]
    nkv = config.get("num_key_value_heads") or nh
    hd = config.get("head_dim") or D // nh
    family = family_named(config.get("model_type"))  # what differs between families: runtime.models
    bias = family.qkv_bias or bool(config.get("attention_bias"))
    out = [("embed_tokens", (V, D), False)]
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        for name, n in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            out.append((p + name, (D, n), True))
            if bias:
                out.append((p + name + ".bias", (1, n), False))
        out.append((p + "o_proj", (nh * hd, D), True))
        if family.qk_norm:
            out += [(p + "q_norm", (1, hd), False), (p + "k_norm", (1, hd), False)]
        out += [(p + "gate_proj", (D, F), True), (p + "up_proj", (D, F), True), (p + "down_proj", (F, D), True),
                (p + "input_layernorm", (1, D), False), (p + "post_attention_layernorm", (1, D), False)]
    out.append(("norm", (1, D), False))
    tied = config.get("tie_word_embeddings", family.tied_by_default)
    out.append(("lm_head" if tied else "lm_head.untied", (D, V), True))
    return tuple(out)


def plan_arch(name: str, config: dict):
    """export.plan's Arch of a Llama-family shape: its K/V width (KV heads x head_dim), its weights, and
    the MLP's activation width (gate and up outputs side by side)."""

    nh = config["num_attention_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // nh
    kv_width = (config.get("num_key_value_heads") or nh) * hd
    return Arch(name, config["num_hidden_layers"], config["hidden_size"], nh, 2 * config["intermediate_size"],
                config["hidden_size"], config["vocab_size"], config["max_position_embeddings"], True,
                kv_width=kv_width, weights=weight_tensors(config))
