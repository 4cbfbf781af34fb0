"""The artifact's tokenizer over the ``tokenizers`` library alone, so the runtime needs no transformers.

Importing transformers took seconds of every start. Its fast tokenizers are a Python layer over a
``tokenizers.Tokenizer`` read from ``tokenizer.json``; what that layer adds for the artifacts we
export is small and reproduced here: the named special tokens of ``tokenizer_config.json``
(bos/eos/pad/unk), left padding, and ``decode(..., skip_special_tokens=True)``. The BOS that OPT
prepends is tokenizer.json's own TemplateProcessing post-processor, which transformers 5 writes there.

The adapter answers the subset of transformers' tokenizer interface that the runtime, the server,
export verification and the tools call (``tok(texts, padding=True, return_tensors="np")``,
``tok(text)["input_ids"]``, ``decode``, the special-token ids, ``len``), and
tests/runtime/test_tokenizer.py checks that it gives the same ids and text as ``AutoTokenizer``.

A tokenizer directory it cannot reproduce exactly (no tokenizer.json, a special token missing from
the vocabulary, options that change encoding such as ``add_bos_token``, a model-specific class)
raises ``UnsupportedTokenizerError``, which says why; ``load_tokenizer`` then falls back to
transformers' AutoTokenizer if it is installed, with a warning, and otherwise raises it with how
to fix it (re-export, or install transformers).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np

from .errors import ArtifactError, InvalidArgumentError

SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
# tokenizer_config.json classes that are transformers' generic layer over tokenizer.json; a model
# specific class (e.g. LlamaTokenizer) may rebuild the normalizer or pre-tokenizer in Python.
GENERIC_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast"}
# transformers' Qwen2 split pattern (models/qwen2/tokenization_qwen2.py, PRETOKENIZE_REGEX)
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def _qwen2_pipeline(config: dict) -> dict:
    """tokenizer.json's parts as transformers 5's Qwen2Tokenizer builds them from the vocabulary and
    merges (it reads neither the file's normalizer nor its pre-tokenizer)."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    tok = Backend(BPE(vocab={}, merges=[], dropout=None, unk_token=None, continuing_subword_prefix="",
                      end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.decoder = decoders.ByteLevel()
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space")), use_regex=False)])
    return json.loads(tok.to_str())


# Model-specific classes whose Python code builds the pipeline from fixed parts instead of reading
# tokenizer.json's: the adapter takes them when the file holds exactly those parts, so that the
# file alone encodes as transformers does (Qwen2/2.5/3 checkpoints name Qwen2Tokenizer).
REBUILT_CLASSES = {"Qwen2Tokenizer": _qwen2_pipeline, "Qwen2TokenizerFast": _qwen2_pipeline}
# Parts that change offsets only, never ids or text
_OFFSETS_ONLY = {"trim_offsets"}


def _ids_only(part):
    if isinstance(part, dict):
        return {k: _ids_only(v) for k, v in part.items() if k not in _OFFSETS_ONLY}
    return [_ids_only(v) for v in part] if isinstance(part, list) else part


def _check_rebuilt(path: Path, ours: dict, cls_name: str, config: dict) -> None:
    """UnsupportedTokenizerError unless tokenizer.json (``ours``, read from ``path``) holds the
    parts ``cls_name`` builds."""
    theirs = REBUILT_CLASSES[cls_name](config)
    for part in ("normalizer", "pre_tokenizer", "decoder"):
        if _ids_only(ours.get(part)) != _ids_only(theirs[part]):
            raise UnsupportedTokenizerError(f"{path}'s {part} is not the one transformers' {cls_name} builds")
    model = {k: v for k, v in ours.get("model", {}).items() if k not in ("vocab", "merges")}
    if model != {k: v for k, v in theirs["model"].items() if k not in ("vocab", "merges")}:
        raise UnsupportedTokenizerError(f"{path}'s model options are not those transformers' {cls_name} uses")
    # transformers adds no token around a Qwen prompt (no BOS): the file's post-processor must add
    # none either (transformers 5 writes an empty TemplateProcessing; Qwen's own files a ByteLevel)
    post = ours.get("post_processor") or {"type": "ByteLevel"}
    adds = post.get("type") not in ("ByteLevel", "TemplateProcessing") or post.get("special_tokens") \
        or any("SpecialToken" in piece for piece in post.get("single", []))
    if adds:
        raise UnsupportedTokenizerError(f"{path}'s post-processor ({post.get('type')}) adds tokens that "
                                        f"transformers' {cls_name} does not")


# Config options whose default we match; any other value changes ids or text in transformers.
NEUTRAL_OPTIONS = {"split_special_tokens": False, "clean_up_tokenization_spaces": False,
                   "additional_special_tokens": [], "extra_special_tokens": {}}
# Flags with which transformers rebuilds the BOS/EOS template in Python. transformers 5 saves the
# template into tokenizer.json and not these flags; a config that has them comes from elsewhere.
REBUILT_BY_FLAGS = {"add_bos_token", "add_eos_token"}


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5's save_pretrained writes it


def read_chat_template(directory, config: dict) -> str | dict[str, str] | None:
    """The chat template shipped with a tokenizer: chat_template.jinja (transformers 5), else
    tokenizer_config.json's ``chat_template``, a string or a list of named templates (returned as
    {name: template}, as transformers holds them); None when there is none (OPT)."""
    path = Path(directory) / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    return template


class UnsupportedTokenizerError(ArtifactError):
    """A tokenizer directory the tokenizers-only adapter cannot reproduce exactly."""


class Encoding(dict):
    """``input_ids`` and ``attention_mask``, as keys and as attributes (like transformers' BatchEncoding)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the named special tokens and transformers' call conventions."""

    padding_side = "left"  # the decode loop appends on the right; OPT positions follow the mask

    def __init__(self, backend, special_tokens: dict[str, str | None], pad_token_id: int | None = None,
                 chat_template: str | dict[str, str] | None = None):
        self.backend = backend
        # The Jinja chat template the checkpoint's tokenizer shipped (transformers' attribute of the
        # same name); None for a model without one. The runtime only reads it: the server renders it.
        self.chat_template = chat_template
        ids = {name: (backend.token_to_id(tok) if tok is not None else None) for name, tok in special_tokens.items()}
        self.bos_token_id, self.eos_token_id = ids.get("bos_token"), ids.get("eos_token")
        self.unk_token_id = ids.get("unk_token")
        self.pad_token_id = ids.get("pad_token") if ids.get("pad_token") is not None else pad_token_id

    @classmethod
    def from_dir(cls, directory, pad_token_id: int | None = None) -> "Tokenizer":
        """The tokenizer of ``directory`` (tokenizer.json + tokenizer_config.json), or
        UnsupportedTokenizerError saying what it cannot reproduce."""
        from tokenizers import Tokenizer as Backend

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise UnsupportedTokenizerError(f"{directory} has no tokenizer.json")
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        text = path.read_text(encoding="utf-8")  # read once: checked (a rebuilt class) and loaded
        cls_name = config.get("tokenizer_class", "TokenizersBackend")
        if cls_name in REBUILT_CLASSES:
            _check_rebuilt(path, json.loads(text), cls_name, config)
        elif cls_name not in GENERIC_CLASSES:
            raise UnsupportedTokenizerError(f"{config_path} names tokenizer_class {cls_name!r}, whose Python "
                                            f"code may change encoding (known: {sorted(GENERIC_CLASSES)})")
        for key, neutral in NEUTRAL_OPTIONS.items():
            if config.get(key) not in (None, neutral):
                raise UnsupportedTokenizerError(f"{config_path} sets {key}={config[key]!r}")
        if flags := sorted(REBUILT_BY_FLAGS & config.keys()):
            raise UnsupportedTokenizerError(f"{config_path} sets {', '.join(flags)}, which transformers "
                                            f"may apply on top of tokenizer.json's post-processor")
        backend = Backend.from_str(text)
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        special = {}
        for name in SPECIAL_NAMES:
            token = config.get(name)
            token = token.get("content") if isinstance(token, dict) else token  # a serialised AddedToken
            if token is not None and token not in added:
                # transformers would add it as a new token, with an id the model never saw
                raise UnsupportedTokenizerError(f"{config_path}: {name} {token!r} is not a token of tokenizer.json")
            special[name] = token
        # The padding and truncation a transformers-saved tokenizer.json may carry; this adapter pads itself.
        backend.no_padding()
        backend.no_truncation()
        return cls(backend, special, pad_token_id, read_chat_template(directory, config))

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' ``vocab_size``)."""
        return self.backend.get_vocab_size(with_added_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | list[str], padding: bool = False, return_tensors: str | None = None,
                 add_special_tokens: bool = True) -> Encoding:
        """transformers' ``tokenizer(text_or_texts, padding=..., return_tensors=...)``: lists of ids
        (left padded with ``padding=True``), or arrays with return_tensors "np" (or "pt")."""
        single = isinstance(text, str)
        texts = [text] if single else list(text)
        rows = [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]
        width = max(map(len, rows), default=0)
        if padding:
            if self.pad_token_id is None:
                raise InvalidArgumentError("this tokenizer has no pad token; set tokenizer.pad_token_id")
            masks = [[0] * (width - len(r)) + [1] * len(r) for r in rows]
            rows = [[self.pad_token_id] * (width - len(r)) + r for r in rows]
        else:
            if return_tensors and len(set(map(len, rows))) > 1:
                raise InvalidArgumentError("rows of different lengths need padding=True to become one tensor")
            masks = [[1] * len(r) for r in rows]
        if return_tensors is None:
            return Encoding(input_ids=rows[0] if single else rows, attention_mask=masks[0] if single else masks)
        if return_tensors not in ("np", "pt"):
            raise InvalidArgumentError(f"return_tensors must be None, 'np' or 'pt', got {return_tensors!r}")
        ids = np.array(rows, dtype=np.int64).reshape(len(rows), width)  # (B, T)
        mask = np.array(masks, dtype=np.int64).reshape(len(rows), width)  # (B, T)
        if return_tensors == "pt":
            import torch  # only for callers that already use torch (export verify, tests)

            ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
        return Encoding(input_ids=ids, attention_mask=mask)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(directory, pad_token_id: int | None = None):
    """The tokenizer of an artifact: this module's adapter, or transformers' AutoTokenizer (with a
    warning) for a tokenizer directory the adapter cannot reproduce exactly."""
    try:
        return Tokenizer.from_dir(directory, pad_token_id)
    except UnsupportedTokenizerError as exc:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise UnsupportedTokenizerError(
                f"{exc}. The runtime reads tokenizers that `python -m export build` writes with "
                f"transformers 5 (tokenizer.json and the named special tokens); re-export the artifact, "
                f"or pip install transformers to load this one through AutoTokenizer") from None
        warnings.warn(f"{exc}: loading it with transformers' AutoTokenizer (slower start); "
                      f"re-export the artifact to load it without transformers", stacklevel=2)
    tok = AutoTokenizer.from_pretrained(str(directory))
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token_id = pad_token_id
    return tok
