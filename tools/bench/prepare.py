"""The weights every row runs: one random OPT of the requested architecture, saved three ways.

    ROOT/ARCH/hf/        save_pretrained checkpoint + tokenizer  (transformers and Optimum rows)
    ROOT/ARCH/artifact/  `python -m export build` of that checkpoint (this project's rows)
    ROOT/ARCH/optimum/   Optimum's own export of that checkpoint (the Optimum row)
    ROOT/ARCH/artifact-ort-int4/ ...  quantized exports of that checkpoint, one per quantized row
                                      (rows.QUANTIZED), built only when such a row is asked for;
                                      artifact-ort-int4-b64/ ... at --block-size 64 (likewise GenAI's
                                      ortgenai-int4-b64/)

Each is built once and reused while its stamp (architecture, seed) matches. The artifact is
exported from the saved checkpoint directory, so all rows share bit-identical weights.
"""

from __future__ import annotations

import gc
import os
import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from export.quantize import BLOCK_SIZE
from runtime import cli

from .gguf_file import ARCHITECTURES

STAMP = "bench-stamp.json"
EXPORT_GENERATION = 2  # 2: the layers' fused graphs for ONNX Runtime (export.fused) beside the plain ones


@dataclass
class Prepared:
    arch: str
    hf_dir: Path
    artifact_dir: Path
    config: dict  # the model's dimensions, from the manifest
    variants: dict = field(default_factory=dict)  # quantized backend name -> its artifact directory


def block_suffix(block_size: int) -> str:
    """The folder suffix of quantized exports at a block size other than the default (whose folders
    keep the names they had before tools.bench --block-size)."""
    return "" if block_size == BLOCK_SIZE else f"-b{block_size}"


def _stamped(directory: Path, stamp: dict) -> bool:
    path = directory / STAMP
    return path.is_file() and json.loads(path.read_text()) == stamp


def _stamp(directory: Path, stamp: dict) -> None:
    (directory / STAMP).write_text(json.dumps(stamp))


def prepare(arch: str, root: Path, seed: int = 0, log=print, variants=(), block_size: int = BLOCK_SIZE) -> Prepared:
    from export.build import BuildOptions, build
    from export.checkpoint import build_random
    from export.quantize import DEFAULT_ACCURACY_LEVEL
    from runtime.artifact.manifest import load_manifest

    base = Path(root) / arch
    hf_dir, artifact_dir = base / "hf", base / "artifact"
    stamp = {"arch": arch, "seed": seed}
    if not _stamped(hf_dir, stamp):
        log(f"building random {arch} weights (seed {seed}) into {hf_dir}")
        shutil.rmtree(hf_dir, ignore_errors=True)
        model, tokenizer = build_random(arch, seed=seed)
        model.save_pretrained(str(hf_dir))
        tokenizer.save_pretrained(str(hf_dir))
        del model
        gc.collect()
        _stamp(hf_dir, stamp)
    # the export's own generation too: artifacts made before the layers' fused graphs are rebuilt
    art_stamp = {**stamp, "export": EXPORT_GENERATION}
    if not _stamped(artifact_dir, art_stamp):
        log(f"exporting {hf_dir} to {artifact_dir}")
        build(BuildOptions(model=str(hf_dir), out=str(artifact_dir), progress=cli.progress(quiet=False)),
              log=log)
        _stamp(artifact_dir, art_stamp)  # the manifest names its files: this one it ignores
        gc.collect()
    built = {}
    for name in variants:  # quantized exports of the same checkpoint (tools.bench.rows.QUANTIZED)
        from .rows import QUANTIZED, SAME_EXPORT

        layers, head = QUANTIZED[name]
        out = base / f"artifact-{SAME_EXPORT.get(name, name)}{block_suffix(block_size)}"
        # the accuracy level too: artifacts made before the export's default changed are rebuilt
        vstamp = {**art_stamp, "weights": layers, "head_weights": head, "accuracy_level": DEFAULT_ACCURACY_LEVEL}
        if not _stamped(out, vstamp):
            log(f"exporting {hf_dir} with {layers} layers and {head} head to {out}")
            build(BuildOptions(model=str(hf_dir), out=str(out), weights=layers, head_weights=head,
                               block_size=block_size, progress=cli.progress(quiet=False)), log=log)
            _stamp(out, vstamp)
            gc.collect()
        built[name] = out.resolve()
    manifest = load_manifest(artifact_dir, check_hashes=True)
    m = manifest.model
    config = {"num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_heads": m.num_heads,
              "vocab_size": m.vocab_size, "dtype": manifest.dtype, "pad_token_id": m.pad_token_id,
              "kv_width": m.kv_heads * m.head_dim,  # K/V values per position: smaller under grouped-query attention
              **_shape(hf_dir, manifest), "page_size": manifest.page_size}
    return Prepared(arch, hf_dir, artifact_dir, config, built)


def _shape(hf_dir: Path, manifest) -> dict:
    """The MLP width, and for the Llama family the bytes of one layer and of the head as its graphs
    hold them (grouped-query K/V, gate/up/down: not the OPT formula of tools.bench.stats)."""
    config = json.loads((hf_dir / "config.json").read_text())
    if manifest.model.architecture == "opt":
        return {"ffn_dim": int(config["ffn_dim"])}
    from export.plan import weight_tensors

    size = 2 if manifest.dtype == "float16" else 4
    tensors = weight_tensors(config)
    layer = sum(k * n for name, (k, n), _ in tensors if name.startswith("layers.0."))
    head = sum(k * n for name, (k, n), _ in tensors if name in ("norm", "lm_head", "lm_head.untied"))
    return {"ffn_dim": int(config["intermediate_size"]), "layer_bytes": layer * size, "head_bytes": head * size}


def _peer_export(out: Path, stamp: dict, command: list[str], what: str, log, timeout: float
                 ) -> tuple[Path | None, str]:
    """A peer's export of the checkpoint into ``out`` by ``command`` (its worker, in its venv), once
    per ``stamp``: (out, "") or (None, why it failed)."""
    if _stamped(out, stamp):
        return out, ""
    log(f"{what} into {out}")
    shutil.rmtree(out, ignore_errors=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{what} failed: {exc}"
    if done.returncode != 0:
        lines = [x for x in done.stderr.strip().splitlines() if x.strip()]
        return None, f"{what} failed: {lines[-1] if lines else 'exit ' + str(done.returncode)}"
    _stamp(out, stamp)
    return out, ""


def prepare_optimum(prepared: Prepared, python: str, worker: Path, seed: int = 0, log=print,
                    timeout: float = 3600) -> tuple[Path | None, str]:
    """Optimum's export of the same checkpoint: (directory, "") or (None, why it failed)."""
    out = prepared.hf_dir.parent / "optimum"
    return _peer_export(out, {"arch": prepared.arch, "seed": seed, "python": python},
                        [python, str(worker), "export", str(prepared.hf_dir), str(out)],
                        "Optimum export", log, timeout)


def prepare_ortgenai(prepared: Prepared, python: str, worker: Path, precision: str, threads: int,
                     seed: int = 0, log=print, timeout: float = 3600, block_size: int = BLOCK_SIZE
                     ) -> tuple[Path | None, str]:
    """ONNX Runtime GenAI's build of the same checkpoint at ``precision`` (its model builder, its
    session pinned to ``threads``; int4 in blocks of ``block_size``, whose default is its builder's
    too): (directory, "") or (None, why it failed)."""
    block = block_size if precision == "int4" else BLOCK_SIZE  # fp32 has no blocks
    out = prepared.hf_dir.parent / f"ortgenai-{precision}{block_suffix(block)}"
    stamp = {"arch": prepared.arch, "seed": seed, "python": python, "precision": precision, "threads": threads}
    return _peer_export(out, stamp, [python, str(worker), "build", str(prepared.hf_dir), str(out), "--precision",
                                     precision, "--threads", str(threads), "--block-size", str(block)],
                        f"ONNX Runtime GenAI build ({precision}{', block ' + str(block) if precision == 'int4' else ''})",
                        log, timeout)


def prepare_llamacpp(prepared: Prepared, python: str, worker: Path, kind: str, threads: int,
                     seed: int = 0, log=print, timeout: float = 3600) -> tuple[Path | None, str]:
    """llama.cpp's GGUF of the same checkpoint at ``kind`` (f32, or quantized by llama.cpp from it):
    (the file, "") or (None, why not)."""
    model_type = json.loads((prepared.hf_dir / "config.json").read_text())["model_type"]
    if model_type not in ARCHITECTURES:
        return None, f"llama.cpp rows run the Llama family ({', '.join(ARCHITECTURES)}); {prepared.arch} is {model_type!r}"
    out = prepared.hf_dir.parent / f"llamacpp-{kind}"
    stamp = {"arch": prepared.arch, "seed": seed, "python": python, "type": kind}
    found, reason = _peer_export(out, stamp, [python, str(worker), "build", str(prepared.hf_dir), str(out), "--type",
                                              kind, "--threads", str(threads)],
                                 f"llama.cpp GGUF ({kind})", log, timeout)
    return (found / "model.gguf" if found else None), reason


def prepare_in_subprocess(arch: str, root: Path, seed: int = 0, variants=(), block_size: int = BLOCK_SIZE) -> Prepared:
    """``prepare`` in a child process, so the GBs of a large model leave with it."""
    import sys

    from .runner import REPO, child_env

    done = subprocess.run([sys.executable, "-m", "tools.bench.prepare", arch, str(root), str(seed),
                           f"--block-size={block_size}", *variants],
                          stdout=subprocess.PIPE, text=True, cwd=str(REPO), env=child_env(os.cpu_count() or 1))
    if done.returncode != 0:
        raise RuntimeError(f"preparing {arch} failed (exit {done.returncode}); see the output above")
    d = json.loads(done.stdout.strip().splitlines()[-1])
    return Prepared(d["arch"], Path(d["hf_dir"]), Path(d["artifact_dir"]), d["config"],
                    {k: Path(v) for k, v in d["variants"].items()})


if __name__ == "__main__":
    import sys

    # ARCH ROOT SEED [--block-size=N] [VARIANT ...] (tools.bench.context passes the first three only)
    arch_, root_, seed_, rest = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    block_ = next((int(a.split("=", 1)[1]) for a in rest if a.startswith("--block-size=")), BLOCK_SIZE)
    p = prepare(arch_, root_, seed_, log=lambda *a: print(*a, file=sys.stderr),
                variants=[a for a in rest if not a.startswith("--block-size=")], block_size=block_)
    print(json.dumps({"arch": p.arch, "hf_dir": str(p.hf_dir.resolve()),
                      "artifact_dir": str(p.artifact_dir.resolve()), "config": p.config,
                      "variants": {k: str(v) for k, v in p.variants.items()}}))
