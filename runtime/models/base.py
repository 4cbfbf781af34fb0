"""The skip-aware reference every family shares: embed, layers and head run under a SkipDecode policy.

A family's reference (runtime.models.opt.SkipOPT, runtime.models.llama.SkipLlama) builds its three parts on
the Hugging Face modules' own weights and says how a layer's K/V returns from a call
(``empty_past``, ``extend_past``) and which module a layer's graph is traced from
(``graph_layer``). Everything else is here: the forward pass over a set of active layers, greedy
decoding under a policy, and which module each graph ("embed", "layer_NN", "head") is, so export,
the torch backend and tools.finetune are written against ``SkipModel`` and know no family.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..artifact.manifest import DRAFT_HEAD
from ..policy import SkipPolicy


@dataclass
class ReferenceOutput:
    """What ``SkipModel.greedy`` produced, for comparison with other backends."""

    tokens: torch.Tensor  # (B, N) generated ids, pad_token_id after a row finished
    step_logits: list[torch.Tensor] = field(default_factory=list)  # N x (B, V), fp32
    step_layers: list[tuple[int, ...]] = field(default_factory=list)  # layers run by decode step g


class SkipModel(nn.Module):
    """A causal LM split into embed / layers / head, run under a SkipDecode policy."""

    def __init__(self, config, embed: nn.Module, layers, head: nn.Module):
        super().__init__()
        self.config = config
        self.embed = embed  # (ids (B, T), mask (B, P + T)) -> hidden (B, T, D)
        self.layers = nn.ModuleList(layers)  # (hidden, mask, past_key, past_value) -> (hidden, key, value)
        self.head = head  # hidden (B, T, D) -> logits (B, T, V)
        self.eval()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        lm_head = self.head.lm_head
        return lm_head.weight.dtype if isinstance(lm_head, nn.Linear) else lm_head.dtype  # (blocks: their own)

    def graph_layer(self, index: int) -> nn.Module:
        """The module layer ``index``'s graph is traced from (and the torch backend runs)."""
        return self.layers[index]

    def empty_past(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's (key, value) before the first call, in the layout its forward reads."""
        raise NotImplementedError

    def extend_past(self, past: tuple[torch.Tensor, torch.Tensor], key: torch.Tensor, value: torch.Tensor):
        """A layer's past after a call that returned ``key`` and ``value``."""
        raise NotImplementedError

    @torch.no_grad()
    def forward(self, input_ids, attention_mask, past=None, active=None):
        """Run ``input_ids`` through the layers in ``active`` (default: all).

        ``past`` is a list of per-layer (key, value) or None; layers not in ``active`` keep theirs
        untouched. Returns fp32 logits (B, T, V) and the updated past.
        """
        B = input_ids.shape[0]
        past = list(past) if past is not None else [self.empty_past(B) for _ in self.layers]
        active = range(self.num_layers) if active is None else active
        hidden = self.embed(input_ids, attention_mask)
        for i in active:
            hidden, k, v = self.layers[i](hidden, attention_mask, *past[i])
            past[i] = self.extend_past(past[i], k, v)
        return self.head(hidden).float(), past

    @torch.no_grad()
    def greedy(self, input_ids, attention_mask, max_new_tokens: int, policy: SkipPolicy | None = None,
               eos_token_id: int | list[int] | None = None, pad_token_id: int = 1) -> ReferenceOutput:
        """Greedy decoding under ``policy``: the prompt runs its prefill layers, step g its active set."""
        policy = policy or SkipPolicy.full_depth(self.num_layers)
        logits, past = self(input_ids, attention_mask, active=policy.prefill_layers())
        out = ReferenceOutput(tokens=input_ids.new_zeros((input_ids.shape[0], 0)))
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        eos = None if eos_token_id is None else torch.tensor(eos_token_id).reshape(-1)  # one id or several (Llama 3 Instruct's)
        for g in range(max_new_tokens):
            last = logits[:, -1, :]  # (B, V)
            token = torch.where(finished, pad_token_id, last.argmax(-1))  # (B,)
            out.step_logits.append(last)
            out.tokens = torch.cat([out.tokens, token[:, None]], dim=1)
            if eos is not None:
                finished |= torch.isin(token, eos)
            if g == max_new_tokens - 1 or bool(finished.all()):
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(token), 1))], 1)
            active = policy.active_layers(g)
            out.step_layers.append(active)
            logits, past = self(token[:, None], attention_mask, past, active)
        return out


def graph_module(model: SkipModel, name: str) -> nn.Module:
    """The module graph ``name`` ("embed", "layer_NN", "head", "head_draft": the head's, quantized)
    is traced from, for any family."""
    if name == "embed":
        return model.embed
    if name in ("head", DRAFT_HEAD):
        return model.head
    return model.graph_layer(int(name.split("_")[1]))


__all__ = ["ReferenceOutput", "SkipModel", "graph_module"]
