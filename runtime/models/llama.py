"""The skip-aware Llama-family reference in PyTorch: Llama 3.x, SmolLM2, Qwen2/2.5, Qwen3.

The same graph contract as OPT (runtime.models.opt, export.onnx_export): ``LlamaEmbed``,
``CachedLlamaLayer`` and ``LlamaHead`` each become one graph, on the Hugging Face modules' own
weights and names. What differs from OPT, all inside the graphs:

* positions: no learned table; each layer rotates q and k (RoPE) by the positions of its new
  tokens, taken from the attention mask's cumulative sum as transformers' ``generate`` does
  (left padding), with the inverse frequencies of the checkpoint's RoPE (llama3 scaling included)
  held as a constant;
* grouped-query attention: K/V are stored for the KV heads only, (B, nkv, hd, W) and (B, nkv, W,
  hd); the g = nh / nkv query heads of a KV head are stacked along the query axis, so attention is
  plain batched matmuls against the KV head's K/V, never a repeated copy of them;
* Qwen2's q/k/v biases are the projections' own; Qwen3 normalises each head's q and k (RMSNorm over
  head_dim) before RoPE, and its head_dim is not hidden / heads.

RMSNorm, RoPE's angles and the softmax run in fp32 whatever the model dtype, as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..graph_ops import attention_bias, mask_positions, reshape, split_past, unflatten_rows
from . import head_dim, kv_heads
from .base import SkipModel
from .quantized import linear
from .step import StepInputs, fuse_linears, step_attention, step_inputs


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm, step for step: normalised in fp32, scaled in the model dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def step_rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``rms_norm`` as one fused kernel where torch has one (CUDA): the decode step's."""
    return norm.weight * F.rms_norm(x.float(), x.shape[-1:], eps=norm.variance_epsilon).to(x.dtype)


class LlamaEmbed(nn.Module):
    """input_ids (B, T) + attention_mask (B, S) -> hidden states (B, T, D).

    The mask is part of the contract for every family (OPT's embedding reads its positions from it);
    here positions are applied in the layers, so it only shapes the graph's input list."""

    plain_lookup = True  # its graph only gathers rows of embed_tokens: export records the table, which
    # the ONNX Runtime backend looks up instead of running the graph (runtime.artifact.embed_table)

    def __init__(self, model: nn.Module):
        super().__init__()
        self.embed_tokens = model.embed_tokens

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # (B, T, D)
        # A use of the mask that changes nothing, so that the exporter keeps it as the graph's
        # second input (it drops unused inputs). A Gather of a constant index, not a slice:
        # TensorRT 8.6 cannot parse the Slice the exporter writes for [:, :1].
        first = attention_mask.index_select(1, torch.zeros(1, dtype=torch.long, device=input_ids.device))
        return hidden + (first[:, :, None] * 0).to(hidden.dtype)  # (B, 1, 1) zeros


class CachedLlamaLayer(nn.Module):
    """One decoder layer on the rows layout (runtime.models.opt.CachedOPTLayer says why):

    hidden (B, T, D), attention_mask (B, W + T), past_key (B, nkv, hd, W), past_value (B, nkv, W, hd)
    -> hidden (B, T, D), new_key / new_value (B, nkv, T, hd): only the T new positions, rotated.
    """

    def __init__(self, layer: nn.Module, config, inv_freq: torch.Tensor, rope_scale: float):
        super().__init__()
        # The HF modules themselves, under their own names, so the graphs' weights keep the
        # checkpoint's keys (runtime.models._llama_key).
        self.self_attn = layer.self_attn
        self.mlp = layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.num_heads, self.num_kv_heads = config.num_attention_heads, kv_heads(config)
        self.head_dim = head_dim(config)
        self.scaling = self.head_dim ** -0.5
        self.rope_scale = float(rope_scale)  # llama3 and linear: 1.0; attention_factor of others
        # RoPE as transformers writes it, x * cos + rotate_half(x) * sin with rotate_half(x) =
        # cat(-x2, x1), in fewer graph nodes and the same bits: the halves swapped by one Gather of
        # constant indices, times sin with its first half negated (a product by -1 is exact).
        # Made where inv_freq is, the weights' device: the torch backend's layers run on a GPU.
        half, device = self.head_dim // 2, inv_freq.device
        swap = torch.cat([torch.arange(half, 2 * half, device=device), torch.arange(half, device=device)])
        self.register_buffer("swap_halves", swap, persistent=False)  # (hd,) int64
        sign = torch.cat([-torch.ones(half, device=device), torch.ones(half, device=device)])  # (hd,)
        self.register_buffer("sin_scale", sign * self.rope_scale, persistent=False)  # (hd,) fp32
        self.register_buffer("freq", torch.cat([inv_freq, inv_freq]).float(), persistent=False)  # (hd,) fp32
        # Residual dropout, off unless tools.finetune turns it on (training mode only).
        self.dropout = 0.0

    def _rope(self, attention_mask: torch.Tensor, h: torch.Tensor):
        """cos (B, 1, T, hd) and sin with its first half negated, for x * cos + swapped(x) * sin."""
        positions = mask_positions(attention_mask, h)  # (B, T) fp32
        emb = reshape(positions, 0, 1, -1, 1) * self.freq  # (B, 1, T, hd): cat(freqs, freqs)
        return (emb.cos() * self.rope_scale).to(h.dtype), (emb.sin() * self.sin_scale).to(h.dtype)

    def _attention(self, h, attention_mask, past_key, past_value):
        attn = self.self_attn
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim  # g = nh / nkv query heads per KV head
        # Shapes as constants (0: copy the dim, -1: infer) and the split and mask as a few nodes:
        # runtime.graph_ops says why; the values are those of .view / .reshape / slicing.
        q = reshape(attn.q_proj(h), 0, -1, nh, hd)  # (B, T, nh, hd)
        k = reshape(attn.k_proj(h), 0, -1, nkv, hd)  # (B, T, nkv, hd)
        v = reshape(attn.v_proj(h), 0, -1, nkv, hd).transpose(1, 2)  # (B, nkv, T, hd)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head's head_dim
            q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hd), (B, nkv, T, hd)
        cos, sin = self._rope(attention_mask, h)  # (B, 1, T, hd), sin's first half negated
        q = q * cos + q.index_select(3, self.swap_halves) * sin  # (B, nh, T, hd)
        k = k * cos + k.index_select(3, self.swap_halves) * sin  # (B, nkv, T, hd)
        # The g query heads of KV head j are heads j*g .. j*g+g-1 (transformers' repeat_kv):
        # stacked along the query axis they meet K/V of shape (B, nkv, ...) in one matmul.
        qg = reshape(q * self.scaling, 0, nkv, -1, hd)  # (B, nkv, g*T, hd)
        past = torch.matmul(qg, past_key)  # (B, nkv, g*T, W)
        new = torch.matmul(qg, k.transpose(2, 3))  # (B, nkv, g*T, T)
        scores = reshape(torch.cat([past, new], dim=-1).float(), 0, nh, -1, 0)  # (B, nh, T, W + T) fp32
        probs = torch.softmax(scores + attention_bias(attention_mask, scores), dim=-1).to(h.dtype)
        probs = reshape(probs, 0, nkv, -1, 0)  # (B, nkv, g*T, W + T)
        # Split by Slices with constant axes (TensorRT 8.x: see CachedOPTLayer).
        probs_past, probs_new = split_past(probs, past_key)  # (B, nkv, g*T, W), (B, nkv, g*T, T)
        out = torch.matmul(probs_past, past_value)  # (B, nkv, g*T, hd)
        out = out + torch.matmul(probs_new, v)  # (B, nkv, g*T, hd)
        out = reshape(reshape(out, 0, nh, -1, hd).transpose(1, 2), 0, -1, nh * hd)  # (B, T, nh*hd)
        return attn.o_proj(out), k, v

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout) if self.training and self.dropout else x

    def forward(self, hidden, attention_mask, past_key, past_value):
        residual = hidden
        hidden, key, value = self._attention(
            rms_norm(self.input_layernorm, hidden), attention_mask, past_key, past_value)
        hidden = residual + self._dropout(hidden)
        residual = hidden
        hidden = self.mlp(rms_norm(self.post_attention_layernorm, hidden))  # down(silu(gate) * up)
        return residual + self._dropout(hidden), key, value

    # -- the torch backend's decode step (runtime.models.step says why it differs) --------------

    def fuse_for_steps(self) -> None:
        """q/k/v and gate/up as one product each, for ``step``."""
        attn, mlp = self.self_attn, self.mlp
        self.qkv_weight, self.qkv_bias = fuse_linears(attn.q_proj, attn.k_proj, attn.v_proj)
        self.gate_up_weight, _ = fuse_linears(mlp.gate_proj, mlp.up_proj)

    def step(self, hidden, inputs: StepInputs, key, value, keep):
        """hidden (B, T, D) -> (B, T, D); writes the rows' new K/V into ``key`` (B, nkv, hd, W) and
        ``value`` (B, nkv, W, hd) where ``keep`` (B, T | 1, 1, 1). The math of ``forward``."""
        attn, mlp = self.self_attn, self.mlp
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        B, T = hidden.shape[:2]
        qkv = linear(step_rms_norm(self.input_layernorm, hidden), self.qkv_weight, self.qkv_bias)
        qkv = qkv.view(B, T, nh + 2 * nkv, hd)  # (B, T, nh + 2 nkv, hd)
        if hasattr(attn, "q_norm"):  # Qwen3
            qk = torch.cat([step_rms_norm(attn.q_norm, qkv[:, :, :nh]),
                            step_rms_norm(attn.k_norm, qkv[:, :, nh:nh + nkv])], 2)
        else:
            qk = qkv[:, :, : nh + nkv]  # (B, T, nh + nkv, hd)
        qk = qk * inputs.cos + qk.index_select(3, self.swap_halves) * inputs.sin  # RoPE on q and k at once
        q = (qk[:, :, :nh] * self.scaling).view(B, T, nkv, nh // nkv, hd).transpose(1, 2)  # (B, nkv, T, g, hd)
        out = step_attention(q, qk[:, :, nh:], qkv[:, :, nh + nkv:], key, value, keep, inputs)  # (B, T, nh * hd)
        hidden = hidden + attn.o_proj(out)
        gate, up = linear(step_rms_norm(self.post_attention_layernorm, hidden), self.gate_up_weight).chunk(2, -1)
        return hidden + mlp.down_proj(mlp.act_fn(gate) * up)


class LlamaHead(nn.Module):
    """hidden (B, T, D) -> logits (B, T, V): final RMSNorm, then lm_head (tied or not)."""

    def __init__(self, model: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.norm = model.norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = rms_norm(self.norm, hidden)
        # 2-D for one Gemm on the embedding's layout when tied (runtime.models.opt.OPTHead)
        logits = self.lm_head(reshape(hidden, -1, self.lm_head.in_features))  # (B*T, V)
        return unflatten_rows(logits, hidden)  # (B, T, V)

    def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """``forward`` for the torch backend's static steps: the norm as one fused kernel where torch
        has one (the graph's form is eight elementwise kernels in float16, in every step and pass
        whatever the layers it skips)."""
        B, T, D = hidden.shape
        return self.lm_head(step_rms_norm(self.norm, hidden).view(B * T, D)).view(B, T, -1)  # (B, T, V)


def _rope(hf_model: nn.Module) -> tuple[torch.Tensor, float]:
    """The checkpoint's RoPE inverse frequencies (its scaling included) and attention factor, from
    transformers' own rotary module, on the device of the weights."""
    rotary = hf_model.model.rotary_emb
    device = hf_model.model.norm.weight.device  # (the embedding may be an 8-bit table: no .weight)
    if rotary.inv_freq.is_meta:  # a model built on the meta device (the torch backend): a buffer
        # that is no weight holds no values there, so compute it again
        with torch.device("cpu"):
            rotary = type(rotary)(hf_model.config)
    return rotary.inv_freq.to(device if not device.type == "meta" else "cpu"), rotary.attention_scaling


class SkipLlama(SkipModel):
    """A Llama-family causal LM split into embed / layers / head, run under a SkipDecode policy.

    The layers are the graphs' own (rows layout), so the past is K (B, nkv, hd, P) and V (B, nkv,
    P, hd), and ``extend_past`` appends each call's positions."""

    def __init__(self, hf_model: nn.Module):
        config = hf_model.config
        inv_freq, scaling = _rope(hf_model)
        super().__init__(config, LlamaEmbed(hf_model.model),
                         [CachedLlamaLayer(layer, config, inv_freq, scaling) for layer in hf_model.model.layers],
                         LlamaHead(hf_model.model, hf_model.lm_head))

    def step_inputs(self, mask, at, positions, like) -> StepInputs:
        """What every layer of a step shares (runtime.models.step): the bias, and RoPE's tables as
        each layer's graph makes them (every layer holds the same frequencies)."""
        return step_inputs(mask, at, positions, like, self.layers[0]._rope)

    def empty_past(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        nkv, hd = kv_heads(self.config), head_dim(self.config)
        return (torch.zeros(batch, nkv, hd, 0, dtype=self.dtype),  # (B, nkv, hd, 0)
                torch.zeros(batch, nkv, 0, hd, dtype=self.dtype))  # (B, nkv, 0, hd)

    def extend_past(self, past, key, value):
        """The graphs' layers return only the new positions: K (B, nkv, T, hd) and V (B, nkv, T, hd)."""
        past_key, past_value = past
        return torch.cat([past_key, key.transpose(2, 3)], dim=3), torch.cat([past_value, value], dim=2)


__all__ = ["CachedLlamaLayer", "LlamaEmbed", "LlamaHead", "SkipLlama", "rms_norm"]
