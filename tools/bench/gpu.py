"""``python -m tools.bench.gpu``: the torch backend's decode step on a GPU, with and without CUDA graphs,
at full depth and under SkipDecode policies, against the device's measured memory-bandwidth floor.

Random weights at real shapes are built on the device (no download, no export): OPT's from
``OPTConfig``, the Llama family's (``smollm2-135m``, ``qwen3-0.6b``, ...) from the published shapes of
``runtime.models.published``; ``TorchBackend.from_model`` runs them. What is timed is the backend's whole decode step
(``Backend.decode``: embed, the policy's active layers, head, every row's greedy token back on the
host, picked on the device as the engine asks for greedy rows whose logits nothing reads, then fed
back), the step the engine calls; the engine's scheduling, sampling and detokenising are left out.
At full depth the graph steps are timed a second way in the same rounds, every row's logits brought
back (what a streamed, sampled or penalised row needs): the "logits to host" columns. Eager and
graph steps are timed in interleaved rounds on the same weights; the figure is the median over
rounds of the mean step time.

The floor of a step is the bytes it must read (the active layers' weights, the head, and every
row's K/V over its real past) divided by the best bandwidth the device showed: a device-to-device
copy of ``--bandwidth-mib`` (counted as read + write) or a sum over it (read only), best of 5.

``--weights int4`` (or ``int8``, or several: ``float int4``) multiplies by weight-only blocks instead, as an
``--weights int4`` export holds them (runtime.models.quantized.QuantLinear.quantize: ONNX Runtime's
quantizer's blocks of 32, made on the device; the Triton kernel on a GPU), the embedding float; such
a row's last column is its step against the float row of the same shapes, batch and policy.
``int4-tinygemm``: the same int4 blocks on PyTorch's own int4 product (runtime.models.quantized_tinygemm).

Beside them, on the same weights and prompt: transformers' own ``generate`` (eager, its dynamic
cache: what a PyTorch user runs first) per decoded token at full depth, with ``--peer compiled`` also
its static cache, which ``generate`` compiles itself on CUDA (torch.compile, CUDA graphs: what a
user picks for speed; eager on the CPU, where transformers does not compile); ``--compile-steps``
times the graph steps again with each layer compiled (inductor's fused kernels under the same CUDA
graphs); and, on CUDA, the kernels
the graph column's last timed step launched (the profiler's count; that step runs the policy's
fewest layers), which is what sets a step's time at these sizes, far more than the bytes, and their
device time summed ("device busy"): at full depth, the graph column's time beyond it is the host's work
(the step's inputs and its logits' copy waited for, the decode loop) and the device's idle gaps.

``--device cpu --arch tiny-random`` runs the same code on the CPU in seconds (its test); there
the graph column is the static step run eagerly (cuda_graphs.EagerCapture), not a CUDA graph.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from runtime.models.published import PUBLISHED
from runtime import cli
from runtime.errors import InvalidArgumentError

PAGE = 32  # the KV width's step, as export's default page_size

ARCHS = ("opt-125m", "opt-1.3b", *PUBLISHED, "tiny-random")
DTYPES = ("float16", "float32")
WEIGHTS = {"float": None, "int8": 8, "int4": 4, "int4-tinygemm": 4}  # --weights: bits of the layers' and head's
# products; int4-tinygemm: the same int4 blocks multiplied by PyTorch's own int4 product (the torch backend's
# int4_kernel="tinygemm") instead of the Triton kernel
GRAPH_NAMES = {"graph": "graph steps", "compiled": "compiled steps"}  # the timed backends, in the setup line
PEERS = ("eager", "compiled")  # transformers' generate: its dynamic cache, or its static cache compiled
BLOCK = 32  # the quantized products' block, export's default


@dataclass
class Options:
    device: str = "cuda"  # cuda (CUDA graphs) or cpu (the eager stand-in: the command's test)
    archs: list[str] = field(default_factory=lambda: ["opt-125m", "opt-1.3b"])  # random weights, real shapes
    batches: list[int] = field(default_factory=lambda: [1, 8])  # rows decoding together
    speedups: list[float] = field(default_factory=lambda: [1, 2, 3, 5])  # 1 = full depth
    dtype: str = "float16"  # the GPU deployments' precision
    prompt: int = 32  # prompt tokens per row (the prefill is not timed)
    new_tokens: int = 64  # decode steps timed per round; also the policies' horizon
    rounds: int = 3  # interleaved eager/graph rounds; the median is reported
    bandwidth_mib: int = 1024  # buffer of the bandwidth measurement: far beyond any cache
    seed: int = 0  # random weights and prompt ids
    transformers: bool = True  # time transformers' generate at full depth too (the usual PyTorch way)
    weights: list[str] = field(default_factory=lambda: ["float"])  # float, int8, int4 (WEIGHTS)
    peers: list[str] = field(default_factory=lambda: ["eager"])  # which transformers generate (PEERS)
    compile_steps: bool = False  # also time the graph steps with each layer compiled (TorchBackend's compile_steps)


@dataclass
class Row:
    arch: str
    batch: int
    speedup: float  # the policy asked for (1 = full depth)
    theoretical: float  # L / mean active layers over the timed steps
    layers: float  # mean active layers per step
    floor_ms: float  # bytes read per step / measured bandwidth
    eager_ms: float
    graph_ms: float
    kernels: int | None = None  # kernels one graph step launches (CUDA only: the profiler's count)
    busy_ms: float | None = None  # the device time of those kernels and copies (CUDA only)
    transformers_ms: float | None = None  # transformers' generate per token, full-depth rows only
    compiled_ms: float | None = None  # the same with its static cache, compiled (--peer compiled)
    compiled_steps_ms: float | None = None  # the graph steps, each layer compiled (--compile-steps)
    logits_ms: float | None = None  # the graph steps with every row's logits to the host (full depth)
    weights: str = "float"

    @property
    def shapes(self) -> str:
        return self.arch if self.weights == "float" else f"{self.arch} {self.weights}"


# -- measurements ------------------------------------------------------------------------------


def device_bandwidth(device, mib: int, repeats: int = 5) -> tuple[float, str]:
    """(bytes/s, how): the best of a device copy (read + write bytes) and a sum (read bytes)."""
    import torch

    if device.type == "cpu":
        from . import bandwidth

        found = bandwidth.measure(threads=torch.get_num_threads(), array_bytes=mib << 20, repeats=repeats)
        return found.best, f"numpy sum over {mib} MiB, {found.threads} threads"
    src = torch.ones(mib << 18, dtype=torch.float32, device=device)  # mib MiB
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4

    def best(fn, moved: int) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return moved / min(times)

    copy = best(lambda: dst.copy_(src), 2 * nbytes)
    read = best(lambda: src.sum(), nbytes)
    return max(copy, read), f"best of device copy {copy / 1e9:.0f} GB/s (read+write) and sum {read / 1e9:.0f} GB/s"


def step_bytes(model, layers, batch: int, past: int) -> int:
    """Bytes a decode step must read: active layers' weights, the head, the rows' K/V over ``past``."""
    from runtime.models import head_dim, kv_heads

    body = getattr(model.model, "decoder", model.model)  # OPT nests its layers one level deeper
    # (a quantized product's codes, scales and zero points are buffers)
    size = lambda module: sum(t.numel() * t.element_size()  # noqa: E731
                              for t in (*module.parameters(), *module.buffers()))
    weights = sum(size(body.layers[i]) for i in layers)
    head = size(model.lm_head)  # tied or not, it is read
    norm = getattr(body, "final_layer_norm", None) if hasattr(model.model, "decoder") else body.norm
    if norm is not None:  # OPT-350m style checkpoints have none
        head += size(norm)
    config = model.config
    element = model.get_input_embeddings().weight.element_size()  # the cache's dtype: the model's (a float table)
    kv = 2 * batch * len(layers) * kv_heads(config) * head_dim(config) * past * element  # K and V
    return weights + head + kv


def build_model(arch: str, device, dtype, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, OPTForCausalLM

    from export.checkpoint import random_config

    torch.manual_seed(seed)
    if arch in PUBLISHED:  # a Llama-family shape at its real vocabulary (token ids are not decoded)
        config, build = PUBLISHED[arch].config(bos=1, eos=2, pad=0), AutoModelForCausalLM.from_config
    else:  # the real OPT vocabulary at real shapes, 512 for tiny-random
        config, build = random_config(arch, 512), OPTForCausalLM
    with torch.device(device):  # initialised where it runs: OPT-1.3B in seconds on a GPU
        model = build(config)
    return model.to(dtype).eval()


def quantize_model(model, bits: int) -> None:
    """Every product of the layers and the head made weight-only blocks of ``bits`` (QuantLinear), in
    place: what an export with --weights int4 / int8 holds; the embedding stays float, as there."""
    import torch

    from runtime.models.quantized import QuantLinear

    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for name, linear in targets:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, QuantLinear.quantize(linear, bits, BLOCK))


def run_steps(backend, cache, ids: np.ndarray, policy, new_tokens: int, probe=None,
              argmax: bool = True) -> tuple[float, list[int]]:
    """Prefill ``ids`` (untimed) into ``cache``'s rows, then ``new_tokens`` decode steps: (seconds
    per step, layers per step). The rows are released at the end, so the cache (and the CUDA graphs
    captured over its buffers) serves the next run. ``probe``, a context manager, wraps the last step.
    ``argmax``: the steps ask for the rows' token ids (DecodeStep.argmax), else their logits."""
    from types import SimpleNamespace

    from runtime.backends.base import DecodeStep, run_layers, tokens as tokens_of

    B, P = ids.shape
    prompt = np.ones((B, P), np.int64)
    cache.seat([SimpleNamespace(row=-1) for _ in range(B)])
    cache.reserve(0, B, P)
    mask = cache.mask(0, B, prompt)
    hidden = run_layers(backend, cache, 0, B, backend.embed(ids, mask), mask, range(len(backend.layers)))
    cache.advance(0, B, prompt)
    cache.promote()
    tokens = backend.head(hidden).argmax(-1)  # (B,)
    counts, new, start = [], np.ones((B, 1), np.int64), time.perf_counter()
    for g in range(new_tokens):
        layers = list(policy.active_layers(g))
        cache.reserve(0, B, 1)
        step = DecodeStep(tokens[:, None].astype(np.int64), cache.mask(0, B, new), layers,
                          np.ones((len(layers), B), bool), argmax=argmax)
        with probe if probe is not None and g == new_tokens - 1 else contextlib.nullcontext():
            tokens = tokens_of(backend.decode(step, cache))  # waits for the device
        cache.advance(0, B, new)
        counts.append(len(layers))
    seconds = (time.perf_counter() - start) / new_tokens
    for row in reversed(range(B)):
        cache.release(row)
    return seconds, counts


def profile_last_step(backend, cache, ids, policy, new_tokens: int) -> tuple[int, float]:
    """(kernels, device busy ms) of the last decode step of a run (a replayed graph's, once captured): the
    CUDA kernels and copies the profiler saw, and the sum of their device times. A step's wall time
    beyond its busy time is the host's (the step's inputs, the decode loop) and the device's idle gaps."""
    import torch

    probe = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    run_steps(backend, cache, ids, policy, new_tokens, probe=probe)
    device = [e for e in probe.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(device), sum(e.device_time_total for e in device) / 1e3


def transformers_step(model, ids: np.ndarray, new_tokens: int, rounds: int, peer: str = "eager") -> float:
    """Seconds per decoded token of transformers' own ``generate`` on the same weights and prompt:
    ``peer`` "eager" (its dynamic cache) or "compiled" (its static cache, which generate compiles
    itself on CUDA; on the CPU it runs eagerly); the time of ``new_tokens`` + 1 tokens less that of 1
    (the prefill and the first token), over ``new_tokens``; the median of ``rounds``."""
    import torch

    input_ids = torch.from_numpy(ids).to(model.device)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    static = dict(cache_implementation="static", disable_compile=model.device.type != "cuda") if peer == "compiled" else {}

    def run(n: int) -> float:
        sync()
        start = time.perf_counter()
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=model.config.pad_token_id, **static)
        sync()
        return time.perf_counter() - start

    for n in (new_tokens + 1, 1, new_tokens + 1):  # warm-up: a static cache compiles for each length it sees
        run(n)
    return statistics.median((run(new_tokens + 1) - run(1)) / new_tokens for _ in range(rounds))


def measure(options: Options, log=print) -> tuple[list[Row], dict]:
    import torch

    from runtime.backends.cuda_graphs import EagerCapture
    from runtime.backends.torch import TorchBackend
    from runtime.kvcache import KVCache
    from runtime.policy import SkipPolicy

    device = torch.device(options.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(f"--device {options.device}: no CUDA device is visible to PyTorch "
                         f"{torch.__version__}; run on a GPU, or --device cpu --arch tiny-random for the dry run")
    dtype = getattr(torch, options.dtype)
    bandwidth, how = device_bandwidth(device, options.bandwidth_mib)
    log(f"bandwidth: {bandwidth / 1e9:.1f} GB/s ({how})")
    rows: list[Row] = []
    setups: list[str] = []
    rng = np.random.default_rng(options.seed)
    for arch, weights in [(a, w) for a in options.archs for w in options.weights]:
        model = build_model(arch, device, dtype, options.seed)  # the same random weights for each --weights
        if WEIGHTS[weights] is not None:
            quantize_model(model, WEIGHTS[weights])
        L = model.config.num_hidden_layers
        kernel = "tinygemm" if weights == "int4-tinygemm" else "auto"  # (the first backend repacks the blocks)
        backends = {"eager": TorchBackend.from_model(model, cuda_graphs=False, int4_kernel=kernel)}
        for name in ("graph", "compiled") if options.compile_steps else ("graph",):
            backends[name] = TorchBackend.from_model(model, cuda_graphs=None if device.type == "cuda" else False,
                                                     compile_steps=name == "compiled", int4_kernel=kernel)
            if device.type != "cuda":
                backends[name].use_graphs(EagerCapture())  # the same static step, run eagerly
        graphs = backends["graph"]
        # what a user pays before the fast steps (captures, warm-up runs, compiles): the warm-up round's
        # time beyond a timed round's, over all batches and policies
        first = {name: 0.0 for name in backends}
        for batch in options.batches:
            capacity = options.prompt + options.new_tokens + 1
            caches = {name: KVCache(backend.kv_storage(), batch, capacity, PAGE) for name, backend in backends.items()}
            ids = rng.integers(4, model.config.vocab_size, (batch, options.prompt)).astype(np.int64)
            for speedup in options.speedups:
                policy = (SkipPolicy.full_depth(L, options.new_tokens) if speedup == 1 else
                          SkipPolicy.for_speedup(L, speedup, horizon=options.new_tokens))
                times = {name: [] for name in backends}
                logits = []  # the graph steps again, logits to the host (full depth only: its time)
                for r in range(options.rounds + 1):  # round 0 warms up (and captures the graphs)
                    order = list(backends.items())[:: 1 if r % 2 else -1]
                    for name, backend in order:
                        seconds, counts = run_steps(backend, caches[name], ids, policy, options.new_tokens)
                        if r:
                            times[name].append(seconds)
                        else:
                            first[name] += seconds * options.new_tokens
                        if name == "graph" and speedup == 1 and r:
                            logits.append(run_steps(graphs, caches[name], ids, policy, options.new_tokens,
                                                    argmax=False)[0])
                for name in backends:  # (never below 0: a timed round may be the slower one)
                    first[name] = max(0.0, first[name] - statistics.median(times[name]) * options.new_tokens)
                kernels, busy = (profile_last_step(graphs, caches["graph"], ids, policy, options.new_tokens)
                                 if device.type == "cuda" else (None, None))
                layers = statistics.fmean(counts)
                floor = statistics.fmean(
                    step_bytes(model, policy.active_layers(g), batch, options.prompt + g)
                    for g in range(options.new_tokens)) / bandwidth
                row = Row(arch, batch, speedup, L / layers, layers, floor * 1e3,
                          statistics.median(times["eager"]) * 1e3, statistics.median(times["graph"]) * 1e3, kernels,
                          weights=weights, busy_ms=busy)
                if options.compile_steps:
                    row.compiled_steps_ms = statistics.median(times["compiled"]) * 1e3
                if logits:
                    row.logits_ms = statistics.median(logits) * 1e3
                if speedup == 1 and options.transformers and weights == "float":
                    for peer in options.peers:
                        ms = transformers_step(model, ids, options.new_tokens, options.rounds, peer) * 1e3
                        setattr(row, "transformers_ms" if peer == "eager" else "compiled_ms", ms)
                peers = "".join(f", transformers {name} {ms:.2f} ms" for name, ms in
                                (("eager", row.transformers_ms), ("compiled", row.compiled_ms)) if ms is not None)
                log(f"{row.shapes} batch {batch} {speedup:g}x: eager {row.eager_ms:.2f} ms, graphs "
                    f"{row.graph_ms:.2f} ms, floor {row.floor_ms:.2f} ms{peers}")
                rows.append(row)
        setups.append(f"{rows[-1].shapes}: " + ", ".join(f"{GRAPH_NAMES[name]} {first[name]:.1f} s"
                                                     for name in backends if name != "eager"))
        for backend in backends.values():
            backend.close()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, {"device": describe_device(device), "bandwidth": bandwidth, "bandwidth_how": how, "setups": setups}


def describe_device(device) -> str:
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}")
    from .machine import cpu_model

    return f"{cpu_model()} (CPU, {torch.get_num_threads()} threads), torch {torch.__version__}"


# -- the table ---------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _times(num: float | None, den: float | None) -> str:
    """num / den as "1.23x", "-" where either is missing."""
    return "-" if num is None or den is None else f"{num / den:.2f}x"


def table(rows: list[Row], info: dict, options: Options, command: str) -> str:
    graph_name = "CUDA graphs" if options.device.startswith("cuda") else "static step (eager stand-in)"
    lines = [f"Hardware: {info['device']}; bandwidth floor from {info['bandwidth'] / 1e9:.1f} GB/s "
             f"({info['bandwidth_how']}).",
             f"Command: `{command}`", "",
             f"{options.dtype}, prompt {options.prompt}, {options.new_tokens} decode steps, median of "
             f"{options.rounds} interleaved rounds. Speedups are against the same column's full depth.", "",
             f"| shapes | batch | policy | layers/step | floor ms | eager ms | {graph_name} ms | "
             f"graphs / floor | graphs vs eager | realised (graphs) | theoretical | realised / theoretical | "
             f"kernels, last step | device busy, last step ms | transformers ms | graphs vs transformers | "
             f"transformers compiled ms | "
             f"graphs vs compiled | graphs / float graphs | compiled steps ms | compiled steps vs graphs | "
             f"graphs, logits to host ms | ids vs logits to host |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    full = {(r.arch, r.batch, r.weights): r for r in rows if r.speedup == 1}
    floats = {(r.arch, r.batch, r.speedup): r for r in rows if r.weights == "float"}
    for r in rows:
        base = full.get((r.arch, r.batch, r.weights))
        peer = floats.get((r.arch, r.batch, 1))  # transformers runs the float weights, at full depth
        same = floats.get((r.arch, r.batch, r.speedup))
        share = f"{base.graph_ms / r.graph_ms / r.theoretical:.0%}" if base else "-"
        policy = "full" if r.speedup == 1 else f"{r.speedup:g}x"
        # a policy row (and a quantized one) against transformers' full depth on the float weights
        lines.append(f"| {r.shapes} | {r.batch} | {policy} | {r.layers:.1f} | {r.floor_ms:.3f} | "
                     f"{r.eager_ms:.3f} | {r.graph_ms:.3f} | {r.graph_ms / r.floor_ms:.2f}x | "
                     f"{r.eager_ms / r.graph_ms:.2f}x | {_times(base and base.graph_ms, r.graph_ms)} | "
                     f"{r.theoretical:.2f}x | {share} | {'-' if r.kernels is None else r.kernels} | "
                     f"{_ms(r.busy_ms)} | "
                     f"{_ms(r.transformers_ms)} | {_times(peer and peer.transformers_ms, r.graph_ms)} | "
                     f"{_ms(r.compiled_ms)} | {_times(peer and peer.compiled_ms, r.graph_ms)} | "
                     f"{'-' if r.weights == 'float' else _times(r.graph_ms, same and same.graph_ms)} | "
                     f"{_ms(r.compiled_steps_ms)} | {_times(r.graph_ms, r.compiled_steps_ms)} | "
                     f"{_ms(r.logits_ms)} | {_times(r.logits_ms, r.graph_ms)} |")
    if info.get("setups"):
        lines += ["", "Setup (captures, warm-up runs, compiles: the warm-up round's time beyond a timed "
                  "round's, over all the batches and policies above): "
                  + "; ".join(info["setups"]) + "."]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    d = Options()
    p = argparse.ArgumentParser(prog="python -m tools.bench.gpu", description=__doc__.split("\n\n")[0])
    cli.add_version(p)
    p.add_argument("--device", default=d.device, help=f"cuda or cpu (default {d.device})")
    p.add_argument("--arch", nargs="+", default=d.archs, choices=ARCHS, metavar="ARCH",
                   help=f"shapes, of {', '.join(ARCHS)} (default opt-125m opt-1.3b)")
    p.add_argument("--batch", type=int, nargs="+", default=d.batches, help="batch sizes (default 1 8)")
    p.add_argument("--speedups", type=float, nargs="+", default=d.speedups,
                   help="policies by theoretical speedup, 1 = full depth (default 1 2 3 5)")
    p.add_argument("--dtype", choices=DTYPES, default=d.dtype, help=f"default {d.dtype}")
    p.add_argument("--prompt", type=int, default=d.prompt, help=f"prompt tokens (default {d.prompt})")
    cli.add_max_new_tokens(p, d.new_tokens, f"decode steps (default {d.new_tokens})")
    p.add_argument("--rounds", type=int, default=d.rounds, help=f"timed rounds (default {d.rounds})")
    p.add_argument("--bandwidth-mib", type=int, default=d.bandwidth_mib,
                   help=f"bandwidth buffer in MiB (default {d.bandwidth_mib})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"default {d.seed}")
    p.add_argument("--weights", nargs="+", choices=list(WEIGHTS), default=d.weights,
                   help="the products' weights, each its rows: float, int8, int4 (weight-only blocks of "
                        f"{BLOCK}, as an export's; default float)")
    p.add_argument("--peer", nargs="+", choices=PEERS, default=d.peers,
                   help="transformers' generate at full depth: eager (its dynamic cache) and/or compiled "
                        "(its static cache, compiled on CUDA) (default eager)")
    p.add_argument("--compile-steps", action="store_true",
                   help="also time the graph steps with each layer compiled by torch.compile (the torch "
                        "backend's compile_steps; the table's last columns)")
    p.add_argument("--no-transformers", action="store_true",
                   help="skip timing transformers' generate at full depth (the table's last columns)")
    p.add_argument("--out", help="also write the table to this Markdown file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if 1 not in args.speedups:
        args.speedups = [1.0, *args.speedups]  # the realised speedups need full depth beside them
    options = Options(args.device, args.arch, args.batch, args.speedups, args.dtype, args.prompt,
                      args.max_new_tokens, args.rounds, args.bandwidth_mib, args.seed, not args.no_transformers,
                      args.weights, args.peer, args.compile_steps)
    return cli.run(lambda: _measure_and_print(args, argv, options))


def _measure_and_print(args, argv, options: Options) -> int:
    rows, info = measure(options, log=lambda line: print(line, file=sys.stderr, flush=True))
    command = "python -m tools.bench.gpu " + " ".join(sys.argv[1:] if argv is None else argv)
    text = table(rows, info, options, command.strip())
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
