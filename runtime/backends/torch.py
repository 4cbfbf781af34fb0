"""PyTorch backend: the skip-aware reference layers (runtime.modeling) with preallocated KV buffers.

The weights come from the artifact itself, not from a source checkpoint: the graphs were exported
without constant folding, so their initializers keep the exported modules' state_dict names. They
are loaded into an ``OPTForCausalLM`` built on the meta device from ``hf_config/`` (no random init,
whatever the model size) and wrapped with ``SkipOPT``.

Each layer's K/V live in one buffer of shape (B, nh, max_length, hd), allocated at its first run
after ``reset`` and written in place at the current position (as gpt-fast does): nothing is
concatenated or copied between steps, and the buffer's address never changes within a batch.

Runs on CPU or CUDA (``device="cuda"``). Hidden states stay torch tensors on the device between
calls; only the logits of the last position come back to the host. CUDA graph capture
(``cuda_graphs=True``) is not implemented yet.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ArtifactError
from ..manifest import REBUILD_HINT, Manifest
from .base import Backend, CacheReleasedError

HF_CONFIG_DIR = "hf_config"  # written by `python -m export build` beside the graphs
_DTYPES = {"float32": torch.float32, "float16": torch.float16}
_ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj")  # under self_attn. in the HF layer


@dataclass
class LayerCache:
    """One layer's preallocated K/V; positions [:length] hold the batch's past."""

    key: torch.Tensor  # (B, nh, max_length, hd)
    value: torch.Tensor  # (B, nh, max_length, hd)
    length: int = 0  # positions written so far

    @property
    def capacity(self) -> int:
        return self.key.shape[2]


# -- weights -----------------------------------------------------------------------------------


def read_graph_weights(path: Path) -> dict[str, np.ndarray]:
    """Initializers of one graph by name, with the exporter's deduplicated names resolved.

    The exporter keeps one initializer per distinct tensor value and names the others as outputs of
    ``Identity(kept)`` nodes (e.g. ``Identity(q_proj.bias) -> k_proj.bias`` when both are zero).
    External data files are read from the graph's own directory (the artifact directory).
    """
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(path), load_external_data=True)
    weights = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    alias = {n.output[0]: n.input[0] for n in proto.graph.node if n.op_type == "Identity"}
    for name in alias:
        source, hops = name, 0
        while source not in weights and source in alias and hops <= len(alias):  # chains, no cycles
            source, hops = alias[source], hops + 1
        if source in weights and name not in weights:
            weights[name] = weights[source]
    return weights


def hf_key(graph: str, name: str) -> str:
    """The OPTForCausalLM state_dict key of weight ``name`` of graph ``graph``.

    embed: embed_tokens.weight -> model.decoder.embed_tokens.weight (also embed_positions, project_in)
    layer_NN: q_proj.weight -> model.decoder.layers.N.self_attn.q_proj.weight; fc1.bias ->
        model.decoder.layers.N.fc1.bias
    head: lm_head.weight -> lm_head.weight; final_layer_norm.weight -> model.decoder.final_layer_norm.weight
    """
    if graph == "embed":
        return f"model.decoder.{name}"
    if graph == "head":
        return name if name.startswith("lm_head.") else f"model.decoder.{name}"
    index = int(graph.split("_")[1])
    attn = "self_attn." if name.split(".")[0] in _ATTENTION else ""
    return f"model.decoder.layers.{index}.{attn}{name}"


def load_hf_model(directory: Path, manifest: Manifest, device: torch.device):
    """OPTForCausalLM from ``hf_config/`` with every weight taken from the artifact's graphs."""
    from transformers import OPTConfig, OPTForCausalLM

    from runtime.modeling import SkipOPT
    from export.onnx_export import module_for

    config_dir = directory / HF_CONFIG_DIR
    if not (config_dir / "config.json").is_file():
        raise ArtifactError(
            f"{config_dir / 'config.json'} is missing: the torch backend builds the model from it; "
            f"{REBUILD_HINT}")
    config = OPTConfig.from_pretrained(str(config_dir))
    with torch.device("meta"):  # shapes only: no memory, no random init, whatever the model size
        model = OPTForCausalLM(config)
    expected = model.state_dict()  # meta tensors: key -> shape
    skeleton = SkipOPT(model)  # what each graph was traced from, so which weights it must hold
    dtype = _DTYPES[manifest.dtype]

    state: dict[str, torch.Tensor] = {}
    for spec in manifest.graphs:
        found = read_graph_weights(directory / spec.file)
        converted: dict[int, torch.Tensor] = {}  # one tensor per distinct array: aliases share it
        for name in module_for(skeleton, spec.name).state_dict():
            key = hf_key(spec.name, name)
            if name not in found:
                raise ArtifactError(
                    f"{directory / spec.file} has no weight {name!r} ({key}), which the model in "
                    f"{HF_CONFIG_DIR}/config.json needs: the graph was modified or comes from "
                    f"another export; {REBUILD_HINT}")
            array = found[name]
            if tuple(array.shape) != tuple(expected[key].shape):
                raise ArtifactError(
                    f"{directory / spec.file}: weight {name!r} has shape {list(array.shape)}, but "
                    f"{HF_CONFIG_DIR}/config.json implies {list(expected[key].shape)} ({key}); "
                    f"{REBUILD_HINT}")
            if id(array) not in converted:
                # to_array gives read-only views of the protobuf bytes: copy once, then move.
                converted[id(array)] = torch.from_numpy(np.array(array)).to(device=device, dtype=dtype)
            state[key] = converted[id(array)]
    _share_tied_embeddings(state)
    missing = sorted(set(expected) - set(state))
    if missing:  # a key no graph maps to: hf_key and the exported modules disagree
        raise ArtifactError(f"no graph of {directory} provides {missing}; {REBUILD_HINT}")
    model.load_state_dict(state, strict=True, assign=True)
    model.eval().requires_grad_(False)
    return model


def _share_tied_embeddings(state: dict[str, torch.Tensor]) -> None:
    """Point lm_head at the embedding when they are equal (tied in OPT): one copy, not two."""
    embed, lm_head = state.get("model.decoder.embed_tokens.weight"), state.get("lm_head.weight")
    if (embed is not None and lm_head is not None and embed is not lm_head
            and embed.shape == lm_head.shape and torch.equal(embed, lm_head)):
        state["lm_head.weight"] = embed


# -- the layer with in-place KV --------------------------------------------------------------


@functools.cache
def in_place_layer_class() -> type:
    """``InPlaceOPTLayer``, defined on first use so that torch is imported only with this backend."""
    from runtime.modeling import OPTLayer

    class InPlaceOPTLayer(OPTLayer):
        """OPTLayer whose attention writes the new K/V into a preallocated buffer in place.

        ``forward(hidden, bias, key, value)`` is OPTLayer's (residuals, layer norms, MLP); only the
        attention differs: ``key`` / ``value`` are (B, nh, S, hd) views of the buffer whose first
        S - T positions hold the past; the new T positions are written at [S - T, S) and attention
        reads the view, so nothing is concatenated. ``bias`` is ``attention_bias(mask, T)``
        (B, 1, T, S), computed once per step for all layers instead of once per layer.
        """

        def _attention(self, h, bias, key, value):
            B, T, D = h.shape
            nh, hd = self.num_heads, self.head_dim
            S = key.shape[2]
            q = (self.q_proj(h) * self.scaling).view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
            key[:, :, S - T:] = self.k_proj(h).view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
            value[:, :, S - T:] = self.v_proj(h).view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
            scores = torch.matmul(q, key.transpose(2, 3)).float()  # (B, nh, T, S) fp32, as OPTLayer
            probs = torch.softmax(scores + bias, dim=-1).to(h.dtype)  # (B, nh, T, S)
            out = torch.matmul(probs, value).transpose(1, 2).reshape(B, T, D)  # (B, T, D)
            return self.out_proj(out), key, value

    return InPlaceOPTLayer


# -- the backend -------------------------------------------------------------------------------


def _resolve_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={str(device)!r}: no CUDA device is visible to PyTorch (torch "
                f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use device='cpu', "
                f"or install a CUDA build of torch on a machine with a GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r}: only {torch.cuda.device_count()} CUDA "
                             f"device(s) are visible; use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    return dev


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, directory, manifest: Manifest, device: str | torch.device = "cpu",
                 cuda_graphs: bool = False, threads: int | None = None):
        if cuda_graphs:
            raise NotImplementedError(
                "cuda_graphs=True is not implemented yet in the torch backend (CUDA graph capture "
                "per active-layer set is a later step); pass cuda_graphs=False")
        self.device = _resolve_device(device)
        if threads:
            torch.set_num_threads(threads)  # process-wide: PyTorch has no per-module thread pool
        self.manifest = manifest
        self.dtype = _DTYPES[manifest.dtype]
        from runtime.modeling import SkipOPT

        self.hf_model = load_hf_model(Path(directory), manifest, self.device)
        self.model = SkipOPT(self.hf_model)  # embed and head; also the reference to compare with
        config, cls = self.hf_model.config, in_place_layer_class()
        decoder_layers = self.hf_model.model.decoder.layers
        # Same parameters as self.model.layers, only the attention's KV handling differs.
        self.layers = [cls(layer, config.num_attention_heads, config.do_layer_norm_before).eval()
                       for layer in decoder_layers]
        m = manifest.model
        self._kv_shape = (m.num_heads, m.head_dim)
        self.caches: dict[int, LayerCache] = {}
        self._released: set[int] = set()
        self._batch = 0
        self._max_length = 0
        self._bias_mask: np.ndarray | None = None  # the mask the cached bias was computed from
        self._bias: torch.Tensor | None = None  # (B, 1, T, S) fp32

    # -- helpers ---------------------------------------------------------------------------

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def _hidden(self, hidden) -> torch.Tensor:
        """The loop passes back what embed/layer returned; accept host arrays too (e.g. tests)."""
        if isinstance(hidden, np.ndarray):
            hidden = torch.from_numpy(np.ascontiguousarray(hidden))
        return hidden.to(device=self.device, dtype=self.dtype)

    def _attention_bias(self, attention_mask: np.ndarray, query_len: int) -> torch.Tensor:
        """attention_bias of the step's mask, shared by every layer the step runs."""
        from runtime.modeling import attention_bias

        same = (self._bias is not None and self._bias.shape[2] == query_len
                and self._bias_mask.shape == attention_mask.shape
                and np.array_equal(self._bias_mask, attention_mask))
        if not same:
            self._bias = attention_bias(self._tensor(attention_mask), query_len)  # (B, 1, T, S)
            self._bias_mask = np.array(attention_mask, copy=True)  # a copy: callers may reuse theirs
        return self._bias

    def _cache_for(self, index: int) -> LayerCache:
        cache = self.caches.get(index)
        if cache is None:
            if not self._batch:
                raise RuntimeError("call reset(batch_size, max_length) before running layers")
            nh, hd = self._kv_shape
            shape = (self._batch, nh, self._max_length, hd)  # (B, nh, max_length, hd)
            cache = LayerCache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                               torch.zeros(shape, dtype=self.dtype, device=self.device))
            self.caches[index] = cache
        return cache

    # -- Backend -----------------------------------------------------------------------------

    def reset(self, batch_size: int, max_length: int) -> None:
        self.caches.clear()  # buffers are allocated per layer at its first run
        self._released.clear()
        self._batch, self._max_length = batch_size, max_length
        self._bias_mask = self._bias = None

    @torch.inference_mode()
    def embed(self, input_ids, attention_mask):
        return self.model.embed(self._tensor(input_ids), self._tensor(attention_mask))  # (B, T, D)

    @torch.inference_mode()
    def layer(self, index, hidden, attention_mask):
        if index in self._released:
            raise CacheReleasedError(f"layer {index} ran after its cache was released")
        hidden = self._hidden(hidden)  # (B, T, D)
        B, T, _ = hidden.shape
        cache = self._cache_for(index)
        total = cache.length + T
        if B != self._batch:
            raise ValueError(f"layer {index}: hidden states have batch {B}, but reset() set {self._batch}")
        if attention_mask.shape != (B, total):
            raise ValueError(
                f"layer {index}: attention_mask has shape {tuple(attention_mask.shape)}, expected "
                f"({B}, {total}) for {cache.length} cached + {T} new positions")
        if total > cache.capacity:
            raise ValueError(
                f"layer {index}: {cache.length} cached + {T} new positions exceed max_length "
                f"{cache.capacity} given to reset(); reset with a larger max_length")
        bias = self._attention_bias(attention_mask, T)  # (B, 1, T, S)
        hidden, _, _ = self.layers[index](hidden, bias, cache.key[:, :, :total], cache.value[:, :, :total])
        cache.length = total
        return hidden

    @torch.inference_mode()
    def head(self, hidden):
        last = self._hidden(hidden)[:, -1:, :]  # (B, 1, D): only the next token's logits
        # .cpu() waits for the device, so the loop's timings include the queued GPU work.
        return self.model.head(last)[:, -1, :].float().cpu().numpy()  # (B, V) fp32

    def release(self, index):
        self.caches.pop(index, None)  # on CUDA the memory returns to PyTorch's caching allocator
        self._released.add(index)

    def cache_length(self, index):
        cache = self.caches.get(index)
        return 0 if cache is None else cache.length

    def close(self):
        self.caches.clear()
        self._bias_mask = self._bias = None
        self.layers = []
        self.model = self.hf_model = None  # drop the weights (device memory on CUDA)


__all__ = ["TorchBackend", "LayerCache", "in_place_layer_class", "read_graph_weights", "hf_key",
           "load_hf_model"]
