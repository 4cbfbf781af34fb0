"""The SkipDecode policy as a training mask, and the masked parallel forward pass."""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from runtime.models.base import SkipModel
from runtime.policy import SkipPolicy


def layer_mask(policies: list[SkipPolicy], prompt_lens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(B, T, L) bool: does row b's position t run layer l when decoding under policies[b].

    Positions before prompt_len are the prompt: they run policy.prefill_layers() (full depth, or
    step 0's active set). Position prompt_len + g holds the g-th generated token, the input of
    decode step g, so it runs policy.active_layers(g).
    """
    L = policies[0].num_layers
    mask = torch.ones((len(policies), seq_len, L), dtype=torch.bool)
    for b, (policy, p) in enumerate(zip(policies, prompt_lens.tolist())):
        if policy.is_full_depth:
            continue
        table = _step_table(policy, seq_len)  # (seq_len, L)
        if policy.prefill == "policy":
            mask[b, :p] = table[0]
        if seq_len > p:
            mask[b, p:] = table[:seq_len - p]
    return mask


@lru_cache(maxsize=64)
def _step_table(policy: SkipPolicy, steps: int) -> torch.Tensor:
    """(steps, L) bool: the layers decode step g runs, for g < steps. Cached: every training step
    draws from the same few policies."""
    table = torch.zeros((steps, policy.num_layers), dtype=torch.bool)
    for g in range(steps):
        table[g, list(policy.active_layers(g))] = True
    return table


def skip_forward(model: SkipModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 mask: torch.Tensor, bridges: dict | None = None) -> torch.Tensor:
    """Logits (B, T, V) of the whole sequence, each position through the layers ``mask`` gives it.

    Every layer runs over every position up to the last one that runs it in any row (one dense pass);
    where mask[b, t, l] is False the layer's output is dropped and the hidden state passes on
    unchanged, as when decoding skips the layer.
    ``bridges`` ({layer: (D + 1, D) map}, tools.finetune.bridge) replace that unchanged state by its
    linear map where a position runs a layer right after skipped ones.
    """
    # no past: the layers see the whole sequence (a family's own empty past: OPT's or the rows layout's)
    empty = [t.to(input_ids.device) for t in model.empty_past(input_ids.shape[0])]
    hidden = model.embed(input_ids, attention_mask)  # (B, T, D)
    if model.training and model.layers[0].dropout:
        hidden = F.dropout(hidden, model.layers[0].dropout)
    for i, layer in enumerate(model.layers):
        keep = mask[:, :, i]  # (B, T)
        if not bool(keep.any()):
            continue
        if bridges and i in bridges:
            jumps = keep & ~mask[:, :, i - 1]  # (B, T): the first layer run after skipped ones
            if bool(jumps.any()):
                hidden = torch.where(jumps[..., None], bridge(hidden, bridges[i]), hidden)
        # the positions after the last one any row runs this layer at are cut from its call: attention
        # is causal, so the others' outputs do not change (a decaying budget drops the middle layers
        # from the later positions: at 2x the pass runs ~half the layer-positions it did)
        end = int(keep.any(dim=0).nonzero()[-1]) + 1
        part = hidden[:, :end]  # (B, end, D)
        out, _, _ = layer(part, attention_mask[:, :end], *empty)  # (B, end, D)
        if not bool(keep[:, :end].all()):
            out = torch.where(keep[:, :end, None], out, part)
        hidden = out if end == hidden.shape[1] else torch.cat([out, hidden[:, end:]], dim=1)
    return model.head(hidden)  # (B, T, V)


def bridge(hidden: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(B, T, D) hidden states through a bridge ``m`` (D + 1, D): its first D rows the linear map,
    its last the offset."""
    return hidden @ m[:-1].to(hidden.dtype) + m[-1].to(hidden.dtype)


def set_dropout(model: SkipModel, p: float) -> None:
    """Dropout on the embeddings and each layer's residual branches, in training mode only (as
    transformers' OPT applies ``config.dropout``)."""
    for layer in model.layers:
        layer.dropout = p


@dataclass(frozen=True)
class PolicySampler:
    """Which policy each training row decodes under.

    speedups: theoretical speedups to draw from uniformly per row (1.0 = full depth); one value
    trains one policy. The policies are ``SkipPolicy.for_speedup`` over ``horizon`` steps, as the
    runtime picks them for ``--speedup``.
    """

    num_layers: int
    speedups: tuple[float, ...] = (1.0,)  # full depth only: plain fine-tuning
    horizon: int = 64  # decode steps the decay spans; the runtime must use the same (manifest)
    warmup_layers: int = 1  # the paper's setting
    decay: str = "linear"  # the budget curve (SkipPolicy.decay); the paper's is linear
    exponent: float = 2.0  # of the "power" decay
    prefill: str = "full"  # the prompt's layers (SkipPolicy.prefill); the paper runs it at full depth
    own: tuple[tuple[float, int, int], ...] = ()  # (speedup, max_layers, min_layers): a policy of the
    # run's own for that speedup instead of for_speedup's pick (--policy; skipdecode.json's speedup_policies)

    def policies(self) -> list[SkipPolicy]:
        own, shape = {s: (hi, lo) for s, hi, lo in self.own}, self._shape
        return [SkipPolicy(self.num_layers, *own[s], **shape) if s in own
                else SkipPolicy.for_speedup(self.num_layers, s, **shape) for s in self.speedups]

    @property
    def _shape(self) -> dict:
        return dict(horizon=self.horizon, warmup_layers=self.warmup_layers, decay=self.decay,
                    exponent=self.exponent, prefill=self.prefill)

    def speedup_policies(self) -> dict:
        """The run's own policies as skipdecode.json's ``speedup_policies`` (checked: each is its
        speedup's within 0.05, runtime.policy.speedup_policies)."""
        from runtime.policy import speedup_policies

        default = SkipPolicy.for_speedup(self.num_layers, 1.0, **self._shape)
        return speedup_policies(default, {f"{s:g}": {"max_layers": hi, "min_layers": lo} for s, hi, lo in self.own})

    def sample(self, batch_size: int, rng: random.Random) -> list[SkipPolicy]:
        choices = self.policies()
        return [rng.choice(choices) for _ in range(batch_size)]
