"""The PyTorch side of ``export verify``, in a process of its own.

Everything verify needs from PyTorch and transformers is computed here and handed back as numpy:
each graph's outputs on the check shapes (export.parity.Case), transformers' greedy tokens and
logits at full depth, and the skip-aware reference's tokens under a policy. The process then exits,
so torch, transformers and the checkpoint's weights (~370 MB of libraries plus one copy of the
weights) are gone before verify loads ONNX Runtime sessions: verify's peak is the larger of the
two sides, not their sum (issue 12: within 2x of the weights).

``run(...)`` starts ``python -m export.reference DIR RESULT ARGS_JSON`` and reads the pickle it
writes; errors of this toolkit raised here are re-raised in the caller with their own type.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.artifact.manifest import DRAFT_LAYERS, load_manifest
from runtime.errors import HubDownloadError, ModelNotFoundError, SkipDecodeError, VerificationError

REPO = Path(__file__).resolve().parents[1]


@dataclass
class References:
    """What the PyTorch side produced for the end-to-end checks."""
    prompts: list[str]
    max_new_tokens: int
    hf_tokens: list[list[int]]  # transformers' greedy tokens at full depth
    hf_logits: list[np.ndarray]  # per step (B, V)
    policy: object  # the SkipPolicy of the skip check
    skip_tokens: list[list[int]]  # the skip-aware reference's greedy tokens under ``policy``


@dataclass
class TorchSide:
    cases: dict  # graph name -> list[parity.Case]
    references: References | None
    mismatch: bool = False  # the checkpoint's shape differs from the artifact's: nothing else computed


def torch_dtype(manifest):
    """The torch dtype of the artifact's weights: what its reference models load as."""
    import torch

    return torch.float16 if manifest.dtype == "float16" else torch.float32


def reference_model(manifest, model_override: str | None, progress: bool = True):
    """The PyTorch model the artifact was exported from (or ``model_override``)."""
    from . import checkpoint

    src = manifest.source
    dtype = torch_dtype(manifest)
    if model_override is None and src.get("kind") == "random":
        source = checkpoint.resolve(src["location"], random_weights=src["location"] != checkpoint.TINY_RANDOM)
        return checkpoint.load(source, dtype=dtype, seed=src.get("seed", 0))
    spec = model_override or src.get("location") or src.get("model")
    try:
        return checkpoint.load(checkpoint.resolve(spec), dtype=dtype, progress=progress)
    except (ModelNotFoundError, HubDownloadError) as exc:
        raise type(exc)(f"{exc}\nverify needs the checkpoint the artifact was exported from; pass it "
                        f"with --model DIR") from exc


def compute(directory, model: str | None, prompts: list[str], max_new_tokens: int, speedup: float,
            progress: bool = False) -> TorchSide:
    """Everything verify needs from PyTorch, in this process."""
    from tqdm.auto import tqdm

    from runtime.models import skip_model

    from . import checkpoint, parity

    manifest = load_manifest(directory, check_hashes=False)  # the caller checked every byte
    hf_model, _ = reference_model(manifest, model, progress)
    ref = skip_model(hf_model)
    if manifest.model.num_layers != ref.num_layers or manifest.model.vocab_size != ref.config.vocab_size:
        return TorchSide({}, None, mismatch=True)
    cases = {spec.name: parity.torch_cases(ref, spec, manifest.page_size, Path(directory),
                                           manifest.graph_weights(spec.name))
             for spec in tqdm(manifest.checked_graphs, desc="PyTorch reference", unit="graph",
                              disable=not progress)}
    drafted = ref
    if manifest.draft_layers and manifest.source.get("draft_adapter"):  # export build --draft-adapter
        drafted = skip_model(checkpoint.load(checkpoint.resolve(manifest.source["draft_adapter"]),
                                             dtype=torch_dtype(manifest), progress=progress)[0])
    for draft in manifest.draft_layers:  # keyed NAME.draft: the module with the draft graph's weights
        cases[draft.name + parity.DRAFT_KEY] = parity.draft_layer_cases(
            drafted, manifest.graph(draft.name), draft, Path(directory), manifest.weights[DRAFT_LAYERS],
            manifest.page_size)
    return TorchSide(cases, _references(directory, manifest, hf_model, ref, prompts, max_new_tokens, speedup))


def _references(directory, manifest, hf_model, ref, prompts, max_new_tokens, speedup) -> References:
    import torch
    from transformers import AutoTokenizer

    from runtime.generation_config import GenerationConfig
    from runtime.generator import policy_for

    m = manifest.model
    # transformers' own tokenizer, not the runtime's adapter: the reference side stays independent.
    tokenizer = AutoTokenizer.from_pretrained(str(Path(directory) / manifest.tokenizer_dir))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = m.pad_token_id
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():  # full depth: transformers' generate (greedy, same EOS handling)
        hf = hf_model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=m.eos_ids, pad_token_id=m.pad_token_id,
                               output_logits=True, return_dict_in_generate=True)
    policy = policy_for(manifest, GenerationConfig(max_new_tokens=max_new_tokens, speedup=speedup))
    expected = ref.greedy(enc["input_ids"], enc["attention_mask"], max_new_tokens, policy,
                          eos_token_id=m.eos_ids, pad_token_id=m.pad_token_id)
    return References(prompts, max_new_tokens, hf.sequences[:, enc["input_ids"].shape[1]:].tolist(),
                      [step.float().numpy() for step in hf.logits], policy,
                      expected.tokens.tolist())


def run(directory, model: str | None, prompts: list[str], max_new_tokens: int, speedup: float,
        progress: bool = False) -> TorchSide:
    """``compute`` in a child Python; its progress bars and tracebacks go to this stderr."""
    args = {"model": model, "prompts": list(prompts), "max_new_tokens": max_new_tokens,
            "speedup": speedup, "progress": progress}
    # The child finds this checkout's packages whatever the caller's working directory.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory(prefix="skipdecode-verify-") as tmp:
        result = Path(tmp) / "torch_side.pkl"
        done = subprocess.run([sys.executable, "-m", "export.reference", str(Path(directory).resolve()),
                               str(result), json.dumps(args)], env=env)
        if not result.exists():
            raise VerificationError(f"verify's PyTorch reference process failed (exit {done.returncode}); "
                                    f"its error is printed above")
        with open(result, "rb") as f:
            out = pickle.load(f)  # written by our own child just now
    if isinstance(out, SkipDecodeError):
        raise out
    return out


def main(argv=None) -> int:
    directory, result, args = argv if argv is not None else sys.argv[1:]
    args = json.loads(args)
    try:
        out = compute(directory, args["model"], args["prompts"], args["max_new_tokens"], args["speedup"],
                      args["progress"])
    except SkipDecodeError as exc:  # the caller re-raises it: same type, same message
        out = exc
    tmp = Path(result).with_suffix(".partial")
    with open(tmp, "wb") as f:
        pickle.dump(out, f)
    tmp.rename(result)
    return 0


if __name__ == "__main__":
    # Through the package, so the pickle names export.reference.TorchSide, not __main__.TorchSide.
    from export.reference import main as _main

    sys.exit(_main())
