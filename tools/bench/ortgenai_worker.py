"""ONNX Runtime GenAI as a benchmark peer, run with the python of a venv that has onnxruntime-genai.

    PYTHON tools/bench/ortgenai_worker.py build HF_DIR OUT_DIR --precision int4 [--threads 2]
    PYTHON tools/bench/ortgenai_worker.py measure OUT_DIR [--prompt 32] [--new 128] [--batch 1]  # one JSON line

``build`` runs GenAI's own model builder on the checkpoint (``-e cpu``: fused QKV,
GroupQueryAttention, SkipSimplifiedLayerNormalization, MatMulNBits at accuracy level 4 for int4)
and pins its session to ``--threads`` intra-op threads: left to itself on the 2-core build
machines it ran int4 decode at 29.5 ms/token against 16.5 with 2 threads (docs/benchmarks.md).
``measure`` decodes ``--new`` greedy tokens after a ``--prompt``-token prompt of fixed ids at
batch 1, EOS not stopping it (a random model's argmax can be EOS), and prints the mean ms of a
decode token (every token after the first), as ``python -m runtime --json`` reports its
``decode_seconds`` over its steps, and their median.

Standalone: it imports only the venv's packages, never this project. Set up the venv with
``python -m venv --system-site-packages VENV && VENV/bin/pip install onnxruntime-genai`` (the
builder reads the checkpoint with the torch and transformers already installed); a peer, never
a dependency of the project.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def build(hf_dir: str, out_dir: str, precision: str, threads: int) -> None:
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf_dir, "-o", out_dir,
                    "-p", precision, "-e", "cpu", "-c", str(Path(out_dir) / ".builder-cache")], check=True)
    config_path = Path(out_dir) / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    config_path.write_text(json.dumps(config, indent=4))


def measure(out_dir: str, prompt: int, new: int, batch: int = 1) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    began = time.perf_counter()
    model = og.Model(out_dir)
    loaded = time.perf_counter() - began
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt + new, min_length=prompt + new, do_sample=False, batch_size=batch)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(np.tile(np.arange(100, 100 + prompt, dtype=np.int32), (batch, 1)))  # (B, prompt)
    times = []
    for _ in range(new):
        t = time.perf_counter()
        generator.generate_next_token()
        times.append(time.perf_counter() - t)
    first = times[0] + (time.perf_counter() - start - sum(times))  # the prompt's token, prefill included
    return {"engine": f"onnxruntime-genai {og.__version__}", "batch": batch, "load_s": loaded,
            "first_token_ms": first * 1e3,
            "decode_ms_per_token": statistics.mean(times[1:]) * 1e3,
            "decode_ms_median": statistics.median(times[1:]) * 1e3, "new_tokens": len(times)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ortgenai_worker.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="run GenAI's model builder on a Hugging Face checkpoint")
    b.add_argument("hf_dir")
    b.add_argument("out_dir")
    b.add_argument("--precision", choices=["fp32", "int4"], default="int4")
    b.add_argument("--threads", type=int, default=2, help="intra-op threads of its session (default 2)")
    m = sub.add_parser("measure", help="decode ms/token at batch 1, one JSON line")
    m.add_argument("out_dir")
    m.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    m.add_argument("--new", type=int, default=128, help="tokens generated per row (default 128)")
    m.add_argument("--batch", type=int, default=1, help="rows, each the same prompt (default 1); a decode "
                                                         "token's ms is then a step's")
    args = p.parse_args(argv)
    if args.command == "build":
        build(args.hf_dir, args.out_dir, args.precision, args.threads)
    else:
        print(json.dumps(measure(args.out_dir, args.prompt, args.new, args.batch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
