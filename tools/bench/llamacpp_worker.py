"""llama.cpp as a benchmark peer (llama-cpp-python), run with the python of a venv that has it.

    PYTHON tools/bench/llamacpp_worker.py build HF_DIR OUT_DIR --type q4_0 [--threads 2]
    PYTHON tools/bench/llamacpp_worker.py bench SPEC_JSON     # a tools.bench row's record, one JSON line
    PYTHON tools/bench/llamacpp_worker.py quantize SRC.gguf DST.gguf --type q4_k_m   # requantizing too
    PYTHON tools/bench/llamacpp_worker.py logits MODEL.gguf IDS.json OUT.npy  # tools.evaluate.agreement's

``build`` writes the checkpoint as an F32 GGUF (gguf_file.py beside this file: llama.cpp's own
converter refuses the random checkpoints' tokenizer) and, for ``q8_0`` / ``q4_0``, quantizes it
with llama.cpp's own quantizer (``llama_model_quantize``, as its ``llama-quantize`` tool does),
into OUT_DIR/model.gguf. ``bench`` is ``python -m tools.bench``'s ``llamacpp`` /
``llamacpp-q8_0`` / ``llamacpp-q4_0`` rows: the prompt through llama.cpp's own tokenizer,
``warmup_tokens`` untimed, then ``new_tokens`` greedy (top-k 1), EOS not stopping it, the record
hf_generate.timing_record makes for the other rows, and the file's own weight bytes for the
row's bandwidth floor. llama-cpp-python's ``Llama`` decodes one sequence: batch 1 rows only.

Standalone: it imports the venv's packages and the files beside it, never this project. The venv
is made with ``--system-site-packages`` (``build`` reads the checkpoint with the transformers
already installed): ``python -m venv --system-site-packages VENV && VENV/bin/pip install
llama-cpp-python`` (it compiles llama.cpp: ~25 minutes on 2 cores); a peer, never a dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_generate import peak_rss_bytes, timing_record  # noqa: E402  (standard library only)

TYPES = ("f32", "q8_0", "q4_0")  # llama.cpp's names; f32 is the file as written
QUANTIZE = ("q8_0", "q4_0", "q4_1", "q4_k_m")  # what ``quantize`` makes of a GGUF (its LLAMA_FTYPE_MOSTLY_*)


def build(hf_dir: str, out_dir: str, kind: str, threads: int) -> Path:
    """OUT_DIR/model.gguf of ``kind``, written to a temporary name first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gguf_file import write_checkpoint_gguf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    f32, final = out / "model-f32.gguf.partial", out / "model.gguf"
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    write_checkpoint_gguf(model, AutoTokenizer.from_pretrained(hf_dir), f32)
    del model
    if kind == "f32":
        os.replace(f32, final)
        return final
    quantize(f32, final, kind, threads)
    f32.unlink()
    return final


def quantize(src, dst, kind: str, threads: int = 2, requantize: bool = False) -> Path:
    """``src`` quantized to ``kind`` by llama.cpp's own quantizer (as its ``llama-quantize`` tool
    does; ``requantize``: from a file already quantized, as its --allow-requantize), into ``dst``
    through a temporary name."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}")
    params.nthread = threads
    params.allow_requantize = requantize
    partial = Path(f"{dst}.partial")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize {src} to {kind}")
    os.replace(partial, dst)
    return Path(dst)


def logits(model: str, ids: list[list[int]], threads: int = 2):
    """(P, V) float32: llama.cpp's logits after each prompt's last token, the prompts given as token
    ids (the compared artifacts' own), each from an empty cache."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=model, n_ctx=max(map(len, ids)) + 1, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    rows = []
    for prompt in ids:
        llm.reset()
        llm.eval(prompt)
        rows.append(np.array(llm.scores[len(prompt) - 1], np.float32))
    return np.stack(rows)


def bench(spec: dict) -> dict:
    """tools.bench's row: ``spec["prompts"]`` (one: batch 1) through llama.cpp's tokenizer, a
    warm-up generation, then ``new_tokens`` timed greedy tokens."""
    from importlib.metadata import version

    import llama_cpp

    if len(spec["prompts"]) != 1:
        raise SystemExit(f"llama-cpp-python's Llama decodes one sequence; this row has {len(spec['prompts'])}")
    threads = spec["threads"]
    began = time.perf_counter()
    llm = llama_cpp.Llama(model_path=spec["llamacpp_gguf"], n_threads=threads, n_threads_batch=threads,
                          n_ctx=spec.get("context", 2048), n_batch=512, verbose=False)
    load_s = time.perf_counter() - began
    arch = llm.metadata["general.architecture"]
    layers = int(llm.metadata[f"{arch}.block_count"])

    def generate(new: int) -> dict:
        start = time.perf_counter()  # from the prompt string in hand, as for the other rows
        ids = llm.tokenize(spec["prompts"][0].encode("utf-8"))
        # an empty cache: Llama.generate otherwise keeps the warm-up's prefix that matches the
        # prompt (its "prefix-match hit"), and the timed prompt would not run
        llm.reset()
        stamps = []
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):  # never stops by itself
            stamps.append(time.perf_counter())
            if len(stamps) == new:
                break
        return timing_record(start, stamps, new, len(ids))

    generate(spec["warmup_tokens"])
    record = generate(spec["new_tokens"])
    record.update(load_s=load_s, peak_rss_bytes=peak_rss_bytes(), layers_per_step=[layers] * len(record["step_s"]),
                  versions={"llama-cpp-python": version("llama-cpp-python")})
    try:
        from gguf_file import weight_bytes

        record["weight_bytes"] = list(weight_bytes(spec["llamacpp_gguf"]))  # the floor's, as stored
    except ImportError:  # a venv without the gguf package: the floor falls back to the float bytes
        pass
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="llamacpp_worker.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="the checkpoint as a GGUF of --type, into OUT_DIR/model.gguf")
    b.add_argument("hf_dir")
    b.add_argument("out_dir")
    b.add_argument("--type", choices=TYPES, default="q4_0", help="default q4_0")
    b.add_argument("--threads", type=int, default=2, help="the quantizer's threads (default 2)")
    r = sub.add_parser("bench", help="a tools.bench row's record, one JSON line")
    r.add_argument("spec", help="the row's spec as JSON")
    q = sub.add_parser("quantize", help="a GGUF quantized to --type by llama.cpp, already quantized ones too")
    q.add_argument("src")
    q.add_argument("dst")
    q.add_argument("--type", choices=QUANTIZE, required=True)
    q.add_argument("--threads", type=int, default=2)
    lg = sub.add_parser("logits", help="each prompt's next-token logits (token ids as JSON lists) into an .npy")
    lg.add_argument("model")
    lg.add_argument("ids", help="a JSON file: a list of lists of token ids")
    lg.add_argument("out", help="the .npy to write, (prompts, vocabulary) float32")
    lg.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.command == "build":
        print(build(args.hf_dir, args.out_dir, args.type, args.threads))
    elif args.command == "quantize":
        print(quantize(args.src, args.dst, args.type, args.threads, requantize=True))
    elif args.command == "logits":
        import numpy as np

        np.save(args.out, logits(args.model, json.loads(Path(args.ids).read_text()), args.threads))
    else:
        print(json.dumps(bench(json.loads(args.spec))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
