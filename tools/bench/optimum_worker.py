"""Optimum's ORTModelForCausalLM as a benchmark peer, run with the Optimum venv's python.

    PYTHON optimum_worker.py export HF_DIR OUT_DIR
    PYTHON optimum_worker.py measure SPEC_JSON      # prints one JSON line

Standalone: it imports only the venv's packages and ``hf_generate.py`` beside it, never this
project (whose transformers is newer than Optimum accepts).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_generate import peak_rss_bytes, timed_generate  # noqa: E402


def export(hf_dir: str, out_dir: str) -> None:
    """Export the saved checkpoint with Optimum's own exporter (decoder with past)."""
    from optimum.onnxruntime import ORTModelForCausalLM

    model = ORTModelForCausalLM.from_pretrained(hf_dir, export=True, use_cache=True)
    model.save_pretrained(out_dir)
    load_tokenizer(hf_dir).save_pretrained(out_dir)


def load_tokenizer(directory: str):
    """The checkpoint's tokenizer. One saved by transformers 5 names the class TokenizersBackend,
    which transformers 4.x lacks: rebuild it from tokenizer.json and the special tokens."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(directory)
    except ValueError:
        config = json.loads((Path(directory) / "tokenizer_config.json").read_text())
        special = {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if k in config}
        return PreTrainedTokenizerFast(tokenizer_file=str(Path(directory) / "tokenizer.json"), **special)


def measure(spec: dict) -> dict:
    import onnxruntime
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    threads = spec["threads"]
    torch.set_num_threads(threads)  # Optimum's inputs and outputs are torch tensors
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    loaded = time.perf_counter()
    model = ORTModelForCausalLM.from_pretrained(spec["optimum_dir"], session_options=options,
                                                provider="CPUExecutionProvider", use_cache=True)
    tokenizer = load_tokenizer(spec["optimum_dir"])
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = spec["pad_token_id"]
    load_s = time.perf_counter() - loaded
    timed_generate(model, tokenizer, spec["prompts"], spec["warmup_tokens"], torch)
    record = timed_generate(model, tokenizer, spec["prompts"], spec["new_tokens"], torch)
    layers = model.config.num_hidden_layers
    from importlib.metadata import version

    record.update(load_s=load_s, peak_rss_bytes=peak_rss_bytes(),
                  layers_per_step=[layers] * len(record["step_s"]),
                  versions={k: version(k) for k in ("optimum-onnx", "onnxruntime", "transformers", "torch")})
    return record


def main(argv: list[str]) -> int:
    if argv[:1] == ["export"] and len(argv) == 3:
        export(argv[1], argv[2])
        return 0
    if argv[:1] == ["measure"] and len(argv) == 2:
        print(json.dumps(measure(json.loads(argv[1]))))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
