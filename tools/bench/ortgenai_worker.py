"""ONNX Runtime GenAI as a benchmark peer, run with the python of a venv that has onnxruntime-genai.

    PYTHON tools/bench/ortgenai_worker.py build HF_DIR OUT_DIR --precision int4 [--threads 2] [--block-size 32]
    PYTHON tools/bench/ortgenai_worker.py measure OUT_DIR [--prompt 32] [--new 128] [--batch 1]  # one JSON line
    PYTHON tools/bench/ortgenai_worker.py bench SPEC_JSON     # a tools.bench row's record, one JSON line

``build`` runs GenAI's own model builder on the checkpoint (``-e cpu``: fused QKV,
GroupQueryAttention, SkipSimplifiedLayerNormalization, MatMulNBits at accuracy level 4 for int4)
and pins its session to ``--threads`` intra-op threads: left to itself on the 2-core build
machines it ran int4 decode at 29.5 ms/token against 16.5 with 2 threads (docs/benchmarks.md).
``measure`` decodes ``--new`` greedy tokens after a ``--prompt``-token prompt of fixed ids in
each of ``--batch`` rows, EOS not stopping it (a random model's argmax can be EOS), and prints the mean ms of a
decode token (every token after the first), as ``python -m runtime --json`` reports its
``decode_seconds`` over its steps, and their median. ``bench`` is ``python -m tools.bench``'s
``ortgenai`` / ``ortgenai-int4`` rows.

Standalone: it imports only the venv's packages and ``hf_generate.py`` beside it, never this project. Set up the venv with
``python -m venv --system-site-packages VENV && VENV/bin/pip install onnxruntime-genai`` (the
builder reads the checkpoint with the torch and transformers already installed); a peer, never
a dependency of the project.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_generate import peak_rss_bytes, timing_record  # noqa: E402  (standard library only)


def build(hf_dir: str, out_dir: str, precision: str, threads: int, block_size: int = 32) -> None:
    # block_size: weights per int4 scale along K (the builder's own default is 32)
    extra = ["--extra_options", f"block_size={block_size}"] if precision == "int4" else []
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf_dir, "-o", out_dir,
                    "-p", precision, "-e", "cpu", "-c", str(Path(out_dir) / ".builder-cache"), *extra], check=True)
    config_path = Path(out_dir) / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    config_path.write_text(json.dumps(config, indent=4))


def _token_stamps(og, model, ids, new: int) -> list[float]:
    """Greedy ``new`` tokens after the prompts ``ids`` (B, prompt) int32, EOS ignored: the time each
    token was ready (the first's includes the prefill)."""
    total = ids.shape[1] + new
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=ids.shape[0])
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    stamps = []
    for _ in range(new):
        generator.generate_next_token()
        stamps.append(time.perf_counter())
    return stamps


def measure(out_dir: str, prompt: int, new: int, batch: int = 1) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    began = time.perf_counter()
    model = og.Model(out_dir)
    loaded = time.perf_counter() - began
    start = time.perf_counter()
    ids = np.tile(np.arange(100, 100 + prompt, dtype=np.int32), (batch, 1))  # (B, prompt)
    stamps = _token_stamps(og, model, ids, new)
    times = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"engine": f"onnxruntime-genai {og.__version__}", "batch": batch, "load_s": loaded,
            "first_token_ms": (stamps[0] - start) * 1e3,  # the prompt's token, prefill included
            "decode_ms_per_token": statistics.mean(times) * 1e3,
            "decode_ms_median": statistics.median(times) * 1e3, "new_tokens": len(stamps)}


SLACK = 2  # prompt tokens by which GenAI's tokenizer may split the rows' prompts apart (it merges a
# few pieces otherwise than transformers' does on Qwen3's vocabulary: 30 and 31 for 32): the rows are
# then cut to the shortest, which the record's prompt_tokens says


def bench(spec: dict) -> dict:
    """tools.bench's row: ``spec["prompts"]`` (text, one per row, the same token count each) through
    GenAI's own tokenizer (rows up to SLACK tokens apart cut to the shortest), ``warmup_tokens`` untimed, then ``new_tokens`` timed, greedy, EOS ignored;
    the record hf_generate.timing_record makes for the other rows."""
    from importlib.metadata import version

    import numpy as np
    import onnxruntime_genai as og

    began = time.perf_counter()
    model = og.Model(spec["ortgenai_dir"])
    tokenizer = og.Tokenizer(model)
    load_s = time.perf_counter() - began
    config = json.loads((Path(spec["ortgenai_dir"]) / "genai_config.json").read_text())
    layers = config["model"]["decoder"]["num_hidden_layers"]

    def generate(new: int) -> dict:
        start = time.perf_counter()  # from prompt strings in hand, as for the other rows
        rows = [tokenizer.encode(p) for p in spec["prompts"]]
        lengths = sorted({len(r) for r in rows})
        if lengths[-1] - lengths[0] > SLACK:
            raise SystemExit(f"GenAI's tokenizer gives the prompts {lengths} tokens; the rows need one length")
        rows = [r[len(r) - lengths[0]:] for r in rows]  # one length: each prompt's last tokens
        ids = np.array(rows, dtype=np.int32)  # (B, prompt)
        return timing_record(start, _token_stamps(og, model, ids, new), new, ids.shape[1])

    generate(spec["warmup_tokens"])
    record = generate(spec["new_tokens"])
    record.update(load_s=load_s, peak_rss_bytes=peak_rss_bytes(), layers_per_step=[layers] * len(record["step_s"]),
                  versions={k: version(k) for k in ("onnxruntime-genai", "onnxruntime")})
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ortgenai_worker.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="run GenAI's model builder on a Hugging Face checkpoint")
    b.add_argument("hf_dir")
    b.add_argument("out_dir")
    b.add_argument("--precision", choices=["fp32", "int4"], default="int4")
    b.add_argument("--threads", type=int, default=2, help="intra-op threads of its session (default 2)")
    b.add_argument("--block-size", type=int, default=32, help="int4: weights per scale along K (default 32, "
                                                             "the builder's)")
    m = sub.add_parser("measure", help="decode ms/token (a step's at --batch rows), one JSON line")
    m.add_argument("out_dir")
    m.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    m.add_argument("--new", type=int, default=128, help="tokens generated per row (default 128)")
    m.add_argument("--batch", type=int, default=1, help="rows, each the same prompt (default 1); a decode "
                                                         "token's ms is then a step's")
    r = sub.add_parser("bench", help="one tools.bench row from its JSON spec")
    r.add_argument("spec", help="the row's spec as JSON (tools.bench.cli)")
    args = p.parse_args(argv)
    if args.command == "build":
        build(args.hf_dir, args.out_dir, args.precision, args.threads, args.block_size)
    elif args.command == "bench":
        print(json.dumps(bench(json.loads(args.spec))))
    else:
        print(json.dumps(measure(args.out_dir, args.prompt, args.new, args.batch)))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
