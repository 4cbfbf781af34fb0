"""One measurement, in a fresh process so that its peak RSS belongs to one row alone.

    python -m tools.bench.worker SPEC_JSON        # prints one JSON line

SPEC kinds: ``hf`` (transformers ``generate``, PyTorch eager, on the saved checkpoint), ``torch``,
``ort``, ``ort-spin`` and ``ort-nospin`` (this project's runtime on the exported artifact, with
``policy``). ``ort-spin`` runs the ONNX Runtime backend with ``spin=True`` (``--spin``), the other ONNX
Runtime kinds with ``spin="auto"`` where the spec's ``spin`` says ``auto`` (tools.bench ``--spin``),
and every ONNX Runtime kind with ``huge_pages=True`` where the spec's ``huge_pages`` is true
(tools.bench ``--huge-pages``);
``ort-nospin``, from before the backend's threads slept by default, now runs exactly ``ort`` and is
kept so that the commands in docs/benchmarks.md still run. Every kind runs a
short warm-up generation first, then the timed one, and reports the same fields (see
``hf_generate.timing_record``) plus layers per step, load time and peak RSS.
"""

from __future__ import annotations

import json
import os
import sys
import time

from .hf_generate import peak_rss_bytes, timed_generate, timing_record
from .rows import INT4_KERNEL, QUANTIZED

KINDS = ("hf", "torch", "ort", "ort-spin", "ort-nospin", *QUANTIZED)


def measure_hf(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(spec["threads"])
    loaded = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32).eval()  # OPT, Llama, Qwen
    tokenizer = AutoTokenizer.from_pretrained(spec["hf_dir"])
    tokenizer.padding_side = "left"
    load_s = time.perf_counter() - loaded
    timed_generate(model, tokenizer, spec["prompts"], spec["warmup_tokens"], torch)
    record = timed_generate(model, tokenizer, spec["prompts"], spec["new_tokens"], torch)
    record.update(load_s=load_s, layers_per_step=[model.config.num_hidden_layers] * len(record["step_s"]))
    return record


def measure_runtime(spec: dict) -> dict:
    import runtime

    backend = "torch" if spec["kind"] == "torch" else "onnxruntime"
    loaded = time.perf_counter()
    # Hashes were checked when the artifact was prepared; hashing GBs per process is not the subject.
    # ort-spin: spinning whatever else runs; the other ONNX Runtime rows as --spin says (off: sleeping)
    options = {}
    if backend == "onnxruntime":
        options["spin"] = True if spec["kind"] == "ort-spin" else ("auto" if spec.get("spin") == "auto" else False)
        if spec.get("huge_pages"):
            options["huge_pages"] = True  # tools.bench --huge-pages
        if spec["kind"] in QUANTIZED:
            options["int4_kernel"] = INT4_KERNEL.get(spec["kind"], "auto")
    gen = runtime.load(spec["artifact_dir"], backend=backend, threads=spec["threads"], check_hashes=False,
                       max_batch=len(spec["prompts"]), **options)  # KV slots for exactly this batch
    load_s = time.perf_counter() - loaded
    policy = spec["policy"]
    gen.generate(spec["prompts"], spec["warmup_tokens"], policy=dict(policy), ignore_eos=True)
    stamps = []
    start = time.perf_counter()
    stream = gen.stream(spec["prompts"], spec["new_tokens"], policy=dict(policy), ignore_eos=True)
    for _ in stream:
        stamps.append(time.perf_counter())
    stats = stream.result.stats
    record = timing_record(start, stamps, stats.new_tokens, stats.prompt_tokens)
    record.update(load_s=load_s, layers_per_step=stats.layers_per_step,
                  compute_prefill_s=stats.prefill_seconds,  # embed + layers + head only
                  compute_step_s=[s.seconds for s in stats.steps],
                  theoretical_speedup=stats.theoretical_speedup,
                  int4_kernel=getattr(gen.backend, "int4_kernel", None))  # which kernel ran the int4 products
    gen.close()
    return record


def measure(spec: dict) -> dict:
    if spec["kind"] not in KINDS:
        raise ValueError(f"unknown kind {spec['kind']!r}; this worker runs {', '.join(KINDS)}")
    record = measure_hf(spec) if spec["kind"] == "hf" else measure_runtime(spec)
    record["peak_rss_bytes"] = peak_rss_bytes()
    return record


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(measure(json.loads(argv[0]))))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
