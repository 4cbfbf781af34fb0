"""The skip-aware OPT reference in PyTorch.

The decoder math is reimplemented on the Hugging Face modules' own weights, so it is independent of
transformers' changing cache API and is exactly what gets traced into the per-layer ONNX graphs:
``OPTEmbed``, ``CachedOPTLayer`` (an ``OPTLayer`` reading its past from rows of a KV buffer) and
``OPTHead`` each become one graph, with the KV cache as explicit inputs and outputs. ``SkipOPT``
strings them together under a ``SkipPolicy`` (runtime.models.base.SkipModel, the base every
family's reference shares) and is the reference every backend is checked against.

It lives in ``runtime`` (imported only by the torch backend, so only with torch) because the
runtime's torch backend runs these layers; ``export`` traces them.

Numerics that matter for fp16 (docs/design.md section 2): softmax and layer norm run in fp32, and masked
attention scores get ``MASK_VALUE`` (runtime.graph_ops), which is finite in fp16, so fully masked
(padding) rows give a uniform softmax instead of NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..graph_ops import attention_bias, mask_positions, reshape, split_past, unflatten_rows
from .base import SkipModel
from .quantized import linear
from .step import StepInputs, fuse_linears, step_attention, step_inputs

POSITION_OFFSET = 2  # OPT's learned positional embedding reserves ids 0 and 1


def _layer_norm(ln: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """LayerNorm computed in fp32 whatever the model dtype (fp16 overflows otherwise)."""
    w = ln.weight.float() if ln.weight is not None else None
    b = ln.bias.float() if ln.bias is not None else None
    return F.layer_norm(x.float(), ln.normalized_shape, w, b, ln.eps).to(x.dtype)


class OPTEmbed(nn.Module):
    """input_ids (B, T) + attention_mask (B, S) -> hidden states (B, T, D).

    Positions come from the mask's cumulative sum (left padding) plus OPT's offset of 2; the last T
    positions of the mask belong to the input ids.
    """

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.embed_tokens = decoder.embed_tokens
        self.embed_positions = decoder.embed_positions
        self.project_in = decoder.project_in  # 350m: word_embed_proj_dim -> hidden_size

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = mask_positions(attention_mask, input_ids).long()  # (B, T): runtime.graph_ops says why fp32
        tokens = self.embed_tokens(input_ids)  # (B, T, E)
        if self.project_in is not None:
            tokens = self.project_in(tokens)  # (B, T, D)
        return tokens + self.embed_positions.weight[positions + POSITION_OFFSET]


class OPTLayer(nn.Module):
    """One decoder layer with explicit KV I/O.

    hidden (B, T, D), attention_mask (B, P+T), past_key / past_value (B, nh, P, hd)
    -> hidden (B, T, D), present_key / present_value (B, nh, P+T, hd).
    """

    def __init__(self, layer: nn.Module, num_heads: int, pre_layer_norm: bool):
        super().__init__()
        attn = layer.self_attn
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj)
        self.self_attn_layer_norm = layer.self_attn_layer_norm
        self.fc1, self.fc2 = layer.fc1, layer.fc2
        self.final_layer_norm = layer.final_layer_norm
        self.activation_fn = layer.activation_fn
        self.num_heads = num_heads
        self.head_dim = self.q_proj.out_features // num_heads
        self.scaling = self.head_dim ** -0.5
        self.pre_layer_norm = pre_layer_norm  # False only for OPT-350m
        # Residual dropout, off unless tools.finetune turns it on (and then only in training mode),
        # so that no inference path can drop activations, whatever the checkpoint's config says.
        self.dropout = 0.0

    def _attention(self, h, attention_mask, past_key, past_value):
        B, T, D = h.shape
        nh, hd = self.num_heads, self.head_dim
        q = (self.q_proj(h) * self.scaling).view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(h).view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        v = self.v_proj(h).view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = torch.cat([past_key, k], dim=2)  # (B, nh, S, hd)
        v = torch.cat([past_value, v], dim=2)  # (B, nh, S, hd)
        scores = torch.matmul(q, k.transpose(2, 3)).float()  # (B, nh, T, S) fp32
        scores = scores + attention_bias(attention_mask, scores)
        probs = torch.softmax(scores, dim=-1).to(h.dtype)  # (B, nh, T, S)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, D)  # (B, T, D)
        return self.out_proj(out), k, v

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout) if self.training and self.dropout else x

    def forward(self, hidden, attention_mask, past_key, past_value):
        return self._block(hidden, lambda h: self._attention(h, attention_mask, past_key, past_value))

    def _block(self, hidden, attend, norm=_layer_norm):
        """The layer around its attention: ``attend`` (the normed hidden -> (out, key, value))."""
        residual = hidden
        if self.pre_layer_norm:
            hidden = norm(self.self_attn_layer_norm, hidden)
        hidden, key, value = attend(hidden)
        hidden = residual + self._dropout(hidden)
        if not self.pre_layer_norm:
            hidden = norm(self.self_attn_layer_norm, hidden)

        residual = hidden
        if self.pre_layer_norm:
            hidden = norm(self.final_layer_norm, hidden)
        hidden = self.fc2(self.activation_fn(self.fc1(hidden)))
        hidden = residual + self._dropout(hidden)
        if not self.pre_layer_norm:
            hidden = norm(self.final_layer_norm, hidden)
        return hidden, key, value


class CachedOPTLayer(OPTLayer):
    """OPTLayer whose past K/V is a block of rows of a preallocated KV buffer: the exported graph contract.

    hidden (B, T, D), attention_mask (B, W + T),
    past_key (B, nh, hd, W), past_value (B, nh, W, hd)
    -> hidden (B, T, D), new_key / new_value (B, nh, T, hd): only the T new positions.

    Why this layout: a runtime keeps one buffer of (rows, nh, hd|W, W|hd) per layer with the rows
    that run packed at the front (runtime.kvcache), so the rows of a step are one contiguous block
    that is bound in place: nothing is copied or concatenated per step, and a step reads the K/V of
    the rows that run, no others. Each row's past fills its own positions [0, length) of the W; the
    mask is 0 wherever a row has no valid K/V (padding, positions past its length, or what an
    earlier occupant of the row left). K is stored transposed (hd, W) so that q @ K needs no
    transpose. The new K/V are not concatenated to the past either: scores and weighted values are
    computed for the past and the new positions separately; only the scores (1/hd the size of K)
    are joined. Masked scores get MASK_VALUE, whose exp is 0, so masked columns contribute nothing.
    """

    def __init__(self, layer: OPTLayer):
        nn.Module.__init__(self)
        for name in ("q_proj", "k_proj", "v_proj", "out_proj", "self_attn_layer_norm", "fc1", "fc2",
                     "final_layer_norm"):
            setattr(self, name, getattr(layer, name))  # shared modules: same weights, same names
        for name in ("activation_fn", "num_heads", "head_dim", "scaling", "pre_layer_norm", "dropout"):
            setattr(self, name, getattr(layer, name))

    def _attention(self, h, attention_mask, past_key, past_value):
        nh, hd = self.num_heads, self.head_dim
        # Shapes as constants (0: copy the dim, -1: infer) and the splits and mask as a few nodes:
        # runtime.graph_ops says why; the values are those of .view / slicing.
        q = reshape(self.q_proj(h) * self.scaling, 0, -1, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = reshape(self.k_proj(h), 0, -1, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        v = reshape(self.v_proj(h), 0, -1, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        past = torch.matmul(q, past_key)  # (B, nh, T, W)
        new = torch.matmul(q, k.transpose(2, 3))  # (B, nh, T, T)
        scores = torch.cat([past, new], dim=-1).float()  # (B, nh, T, W + T) fp32
        probs = torch.softmax(scores + attention_bias(attention_mask, scores), dim=-1).to(h.dtype)
        # Split by Slices with constant axes: TensorRT 8.x cannot parse a Slice whose axes are
        # computed, as the unfolded TorchScript export of probs[..., :W] makes them.
        probs_past, probs_new = split_past(probs, past_key)  # (B, nh, T, W), (B, nh, T, T)
        out = torch.matmul(probs_past, past_value)  # (B, nh, T, hd)
        out = out + torch.matmul(probs_new, v)  # (B, nh, T, hd)
        out = reshape(out.transpose(1, 2), 0, -1, nh * hd)  # (B, T, D)
        return self.out_proj(out), k, v

    # -- the torch backend's decode step (runtime.models.step says why it differs) --------------

    def fuse_for_steps(self) -> None:
        """q/k/v as one product, and the norms' fp32 weights made once, for ``step``."""
        self.qkv_weight, self.qkv_bias = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        # buffers of the norm modules themselves: torch.compile (compile_steps) takes them as inputs,
        # so one compiled graph serves every layer (a dict keyed by the module's id was a constant
        # that differed per layer: a recompile a layer, past torch.compile's limit of 8 on OPT-1.3B)
        for ln in (self.self_attn_layer_norm, self.final_layer_norm):
            for name in ("weight", "bias"):
                value = getattr(ln, name)
                ln.register_buffer(f"{name}32", None if value is None else value.float(), persistent=False)

    @staticmethod
    def _step_norm(ln: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        """``_layer_norm`` over the fp32 weights ``fuse_for_steps`` made."""
        return F.layer_norm(x.float(), ln.normalized_shape, ln.weight32, ln.bias32, ln.eps).to(x.dtype)

    def step(self, hidden, inputs: StepInputs, key, value, keep):
        """hidden (B, T, D) -> (B, T, D); writes the rows' new K/V into ``key`` (B, nh, hd, W) and
        ``value`` (B, nh, W, hd) where ``keep`` (B, T | 1, 1, 1). The math of ``forward``."""
        nh, hd = self.num_heads, self.head_dim

        def attend(h):
            B, T = h.shape[:2]
            q, k, v = linear(h, self.qkv_weight, self.qkv_bias).view(B, T, 3, nh, hd).unbind(2)  # (B, T, nh, hd)
            q = (q * self.scaling).transpose(1, 2)[:, :, :, None]  # (B, nh, T, 1, hd): one query head per KV head
            return self.out_proj(step_attention(q, k, v, key, value, keep, inputs)), None, None

        return self._block(hidden, attend, self._step_norm)[0]


class OPTHead(nn.Module):
    """hidden (B, T, D) -> logits (B, T, V): final layer norm (pre-LN models) or project_out (350m)."""

    def __init__(self, decoder: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.final_layer_norm = decoder.final_layer_norm
        self.project_out = decoder.project_out
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.final_layer_norm is not None:
            hidden = _layer_norm(self.final_layer_norm, hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        # 2-D, so the head graph is one Gemm(transB) on the embedding's own (V, D) layout and
        # the artifact stores the tied matrix once (export.weights.tie_head)
        logits = self.lm_head(reshape(hidden, -1, self.lm_head.in_features))  # (B*T, V)
        return unflatten_rows(logits, hidden)  # (B, T, V)

    step = forward  # the torch backend's static steps (LlamaHead's fuses its norm; this one is F.layer_norm)


class SkipOPT(SkipModel):
    """OPTForCausalLM split into embed / layers / head, run under a SkipDecode policy."""

    def __init__(self, hf_model: nn.Module):
        config = hf_model.config
        if getattr(config, "model_type", None) != "opt":
            raise TypeError(f"SkipOPT needs an OPT model, got model_type={config.model_type!r}")
        decoder = hf_model.model.decoder
        super().__init__(config, OPTEmbed(decoder),
                         [OPTLayer(layer, config.num_attention_heads, config.do_layer_norm_before)
                          for layer in decoder.layers],
                         OPTHead(decoder, hf_model.lm_head))

    def graph_layer(self, index: int) -> nn.Module:
        """The graphs read their past from rows of a KV buffer (CachedOPTLayer)."""
        return CachedOPTLayer(self.layers[index])

    def step_inputs(self, mask, at, positions, like) -> StepInputs:
        """What every layer of a step shares (runtime.models.step): the bias (the positions are
        the embedding's)."""
        return step_inputs(mask, at, positions, like)

    def empty_past(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        nh = self.config.num_attention_heads
        hd = self.config.hidden_size // nh
        empty = torch.zeros(batch, nh, 0, hd, dtype=self.dtype)  # (B, nh, 0, hd)
        return empty, empty.clone()

    def extend_past(self, past: tuple[torch.Tensor, torch.Tensor], key: torch.Tensor, value: torch.Tensor):
        """OPTLayer returns its whole K/V already."""
        return key, value


