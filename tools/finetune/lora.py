"""LoRA fine-tuning through ``peft``: adapters on every linear layer of the decoder, saved in peft's
own format (``adapter_config.json`` + ``adapter_model.safetensors``), merged into the weights at the end.

Why LoRA here: on a CPU, a rank-16 adapter's step costs about 60 % of a full fine-tune's (no weight
gradients for the frozen matrices, no AdamW state for them), and the result ships as a few MB that
``export`` merges into the installed base model (export/adapter.py) instead of a full checkpoint.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from export.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX

# Every linear layer inside a decoder layer, by name: Llama family q/k/v/o_proj, gate/up/down_proj;
# OPT q/k/v/out_proj, fc1, fc2. Not the embeddings or the (tied) head: they stay the base model's.
TARGET_MODULES = r".*layers\.\d+\..*(proj|fc1|fc2)$"


def _peft():
    try:
        import peft
    except ImportError as exc:  # an optional dependency: say how to get it
        raise ImportError("--lora-rank needs peft: pip install 'skipdecode-edge[train]' (or pip install peft)") from exc
    return peft


def inject(model: nn.Module, rank: int, alpha: float) -> nn.Module:
    """Add LoRA adapters of ``rank`` to ``model`` in place and freeze everything else; returns it.
    The modules stay where the skip-aware layers look them up (``attn.q_proj``), so
    runtime.models' layers run the adapted projections without knowing of them."""
    peft = _peft()
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGET_MODULES, lora_dropout=0.0)
    return peft.inject_adapter_in_model(config, model)


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors under peft's saved names (``base_model.model.<module>.lora_A.weight``)."""
    state = _peft().get_peft_model_state_dict(model)
    return {PEFT_PREFIX + k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def save(model: nn.Module, directory: Path, rank: int, alpha: float, base: str) -> None:
    """Write the adapters as peft does, so ``PeftModel.from_pretrained`` reads them too."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state(model), directory / ADAPTER_WEIGHTS)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": TARGET_MODULES,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "task_type": "CAUSAL_LM", "base_model_name_or_path": base}
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def load(model: nn.Module, directory: Path) -> None:
    """Set the injected adapters of ``model`` to those saved in ``directory`` (resume, best weights)."""
    from safetensors.torch import load_file

    state = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(directory / ADAPTER_WEIGHTS).items()}
    result = _peft().set_peft_model_state_dict(model, state)
    if result.unexpected_keys:
        raise ValueError(f"{directory}: adapter tensors that fit no module: {result.unexpected_keys[:3]}")


@contextlib.contextmanager
def disabled(model: nn.Module):
    """``model`` as it was before its adapters, inside the block (peft's ``disable_adapter`` for a
    model whose adapters were injected, not wrapped)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)  # (makes the adapters trainable again, as they were)


@contextlib.contextmanager
def gated(model: nn.Module, gate: torch.Tensor | None):
    """Inside the block, each adapter's contribution at position (b, t) is scaled by ``gate[b, t]``
    (B, T), 0 where the base weights alone apply: the adapters of a ``--skipping-only`` run act on
    the tokens that skip layers and nowhere else. None: everywhere, as without this block. A call
    over the first T' < T positions (skip_forward cuts a layer's call where no row runs it further)
    takes the gate's first T' columns."""
    if gate is None:
        yield model
        return
    from peft.tuners.lora import LoraLayer

    scale = gate[..., None].to(next(model.parameters()).dtype)  # (B, T, 1)
    hooks = [b.register_forward_hook(lambda module, args, out: out * scale[:, :out.shape[1]])
             for m in model.modules() if isinstance(m, LoraLayer) for b in m.lora_B.values()]
    try:
        yield model
    finally:
        for h in hooks:
            h.remove()


def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W + B A * alpha / r) and put the plain nn.Linear back,
    so ``save_pretrained`` writes an ordinary checkpoint."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, module.get_base_layer())
    for p in model.parameters():
        p.requires_grad_(True)
    return model
