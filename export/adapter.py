"""A LoRA adapter in peft's format, merged into a loaded model's weights (no peft needed).

``python -m tools.finetune --lora-rank R`` writes one (``adapter/`` in its output); a model under
models/ that ships as an adapter (smollm2-135m-e2e) is its base model plus this merge, done at export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.errors import SkipDecodeError

if TYPE_CHECKING:  # torch is imported where an adapter is merged: `python -m export` starts without it
    from torch import nn

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's saved names: base_model.model.<module>.lora_A.weight


class AdapterError(SkipDecodeError):
    """An adapter folder is incomplete, of a kind this merge does not handle, or fits no module."""


def is_adapter(directory: Path) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def read_config(directory: Path) -> dict:
    directory = Path(directory)
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{directory / ADAPTER_CONFIG} is missing or not JSON ({exc})") from exc
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("fan_in_fan_out"):
        raise AdapterError(f"{directory}: only plain LoRA adapters merge here (peft_type LORA, no DoRA, "
                           f"fan_in_fan_out false); this one is {config.get('peft_type')!r}")
    return config


def apply(model: "nn.Module", directory: Path) -> int:
    """Add every adapter of ``directory`` to its linear layer's weight in ``model``: W += B @ A * s,
    s = lora_alpha / r (/ sqrt(r) with rsLoRA). Returns the number of layers changed."""
    import torch
    from safetensors.torch import load_file
    from torch import nn

    directory = Path(directory)
    config = read_config(directory)
    r = int(config["r"])
    alpha = float(config.get("lora_alpha", r))
    scale = alpha / (r ** 0.5 if config.get("use_rslora") else r)
    try:
        tensors = load_file(directory / ADAPTER_WEIGHTS)
    except Exception as exc:  # a missing or truncated file: safetensors' own errors vary
        raise AdapterError(f"{directory / ADAPTER_WEIGHTS} is missing or unreadable ({exc}); "
                           f"copy the adapter folder again") from exc
    changed = 0
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module_name = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        try:
            linear = model.get_submodule(module_name)
        except AttributeError:
            linear = None
        if b is None or not isinstance(linear, nn.Linear) or \
                linear.weight.shape != (b.shape[0], a.shape[1]):
            raise AdapterError(f"{directory}: adapter {module_name!r} fits no linear layer of this model "
                               f"(is it the adapter of another base model? its base: "
                               f"{config.get('base_model_name_or_path')!r})")
        with torch.no_grad():
            linear.weight += ((b.float() @ a.float()) * scale).to(linear.weight.dtype)  # (out, in)
        changed += 1
    if not changed:
        raise AdapterError(f"{directory / ADAPTER_WEIGHTS} holds no LoRA tensors")
    return changed
