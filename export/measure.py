"""Peak RSS of a load + generate on ONNX Runtime's CPU backend, in a fresh process.

``python -m export.measure ARTIFACT_DIR --batch B --tokens N --prompt P`` prints one JSON object.
``python -m export plan DIR --measure`` runs it and compares with the plan. Its own process, so the
peak (VmHWM) holds only the runtime: not the exporter, torch from a build, nor an earlier model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from runtime.errors import SkipDecodeError


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise OSError(f"/proc/self/status has no {field}")


def resident_by_mapping(weights_file: str = "weights.bin") -> dict:
    """Resident bytes now, split by what backs them (/proc/self/smaps): anonymous memory (heap,
    packed weights, the KV cache), pages of the artifact's ``weights_file`` that are mapped (the
    embedding rows read), and every other file (the libraries' code and data)."""
    out = {"anonymous": 0, "weights_file": 0, "other_files": 0}
    kind = "anonymous"
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=6)
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
                path = head[5].strip() if len(head) > 5 else ""
                kind = ("weights_file" if path.endswith(weights_file)
                        else "other_files" if path.startswith("/") else "anonymous")
            elif head[0] == "Rss:":
                out[kind] += int(head[1]) * 1024  # kB
    return out


def _prompt(tokenizer, length: int) -> str:
    """A text that tokenizes to ``length`` ids (BOS included) with this tokenizer, as near as a
    round trip through decode allows."""
    ids = tokenizer(" hello" * (2 * length))["input_ids"]
    return tokenizer.decode(ids[1:length], skip_special_tokens=True)


def probe(directory, batch: int, tokens: int, prompt: int) -> dict:
    import runtime

    baseline = status_bytes("VmRSS")
    gen = runtime.load(directory, backend="onnxruntime", max_batch=batch, max_length=tokens)
    loaded = status_bytes("VmRSS")
    text = _prompt(gen.tokenizer, prompt)
    prompt_len = len(gen.tokenizer(text)["input_ids"])
    new = tokens - prompt_len
    if new < 1:
        raise SkipDecodeError(f"--prompt {prompt} leaves no room for new tokens in --tokens {tokens}")
    gen.generate([text] * batch, max_new_tokens=new, ignore_eos=True)
    resident = resident_by_mapping()
    gen.close()
    return {"baseline_rss_bytes": baseline, "loaded_rss_bytes": loaded, "peak_rss_bytes": status_bytes("VmHWM"),
            "resident_after_generate_bytes": resident,
            "rows": batch, "positions": prompt_len + new, "prompt_tokens": prompt_len}


def run_probe(directory, batch: int, tokens: int, prompt: int) -> dict:
    """``probe`` in a child Python (this file as a module), from the repository root."""
    cmd = [sys.executable, "-m", "export.measure", str(directory), "--batch", str(batch),
           "--tokens", str(tokens), "--prompt", str(prompt)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if done.returncode != 0:
        raise SkipDecodeError(f"measuring {directory} failed (exit {done.returncode}): "
                              f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'no output'}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m export.measure", description=__doc__.splitlines()[0])
    p.add_argument("directory")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompt", type=int, default=64)
    args = p.parse_args(argv)
    print(json.dumps(probe(args.directory, args.batch, args.tokens, args.prompt)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
