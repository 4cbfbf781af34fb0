"""Build settings of the engines: limits (batch, sequence, prompt), workspace, precision.

The limits become the optimization profiles (see profiles.py) and the sizes of the runtime's
preallocated KV buffers, so they are checked against the model here, before any TensorRT call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from runtime.artifact.manifest import ModelInfo

from .errors import EngineConfigError

GiB = 1024**3
PRECISIONS = ("fp32", "fp16")
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3}


@dataclass
class EngineBuildConfig:
    max_batch: int = 8  # largest batch the engines accept; the runtime's KV buffers are this wide
    max_seq: int = 1024  # prompt + new tokens; profiles bind a past up to it in whole pages; KV buffers this wide
    max_prompt: int | None = None  # most prompt tokens one call takes (prefill profile; longer prompts run in chunks); None = max_seq
    workspace: int = 2 * GiB  # builder memory-pool limit for tactic scratch space; 1GiB on 8 GB boards
    precision: str = "fp32"  # "fp32" or "fp16"; an fp16 artifact always builds fp16
    timing_cache: str | None = None  # shared timing cache file; None = ENGINE_DIR/timing.cache

    @classmethod
    def default_max_seq(cls, max_position_embeddings: int) -> int:
        """The --max-seq a build takes when given none: 1024, capped at the model's positions (the
        demo model has 256; validate refuses more)."""
        return min(cls.max_seq, max_position_embeddings)

    @property
    def prompt_limit(self) -> int:
        return self.max_seq if self.max_prompt is None else self.max_prompt

    def validate(self, model: ModelInfo) -> None:
        """Raise EngineConfigError naming the broken limit and the flag that fixes it."""
        for name in ("max_batch", "max_seq", "workspace"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise EngineConfigError(f"{name} must be a positive int, got {value!r}; pass {flag}")
        limit = model.max_position_embeddings
        if self.max_seq > limit:
            raise EngineConfigError(
                f"max_seq {self.max_seq} exceeds max_position_embeddings {limit} of this model: "
                f"positions past {limit} have no embedding; pass --max-seq {limit} or less")
        prompt = self.prompt_limit
        if isinstance(prompt, bool) or not isinstance(prompt, int) or prompt < 1:
            raise EngineConfigError(f"max_prompt must be a positive int, got {prompt!r}; pass --max-prompt")
        if prompt > self.max_seq:
            raise EngineConfigError(
                f"max_prompt {prompt} exceeds max_seq {self.max_seq}: a prompt must fit in the "
                f"sequence; pass --max-prompt {self.max_seq} or less, or raise --max-seq")
        if self.precision not in PRECISIONS:
            raise EngineConfigError(f"precision must be fp32 or fp16, got {self.precision!r}")


def parse_size(text) -> int:
    """Bytes from "2GiB", "512MiB", "1.5GiB", "2GB" (decimal), "1048576"; ints pass through."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = match and _UNITS.get(match.group(2).lower())
        if not unit:
            raise EngineConfigError(
                f"workspace {text!r} is not a size: pass bytes or a number with KiB, MiB or GiB "
                f"(e.g. 2GiB, 512MiB)")
        value = int(float(match.group(1)) * unit)
    if value < 1:
        raise EngineConfigError(f"workspace {text!r} must be at least 1 byte (e.g. 1GiB)")
    return value


def format_size(n: int) -> str:
    """2147483648 -> "2GiB" (for logs and messages)."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return f"{n}B"
