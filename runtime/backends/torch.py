"""PyTorch backend: the skip-aware reference layers (runtime.modeling) with preallocated KV buffers.

The weights come from the artifact itself, not from a source checkpoint: the graphs were exported
without constant folding, so their initializers keep the exported modules' state_dict names. They
are loaded into an ``OPTForCausalLM`` built on the meta device from ``hf_config/`` (no random init,
whatever the model size) and wrapped with ``SkipOPT``.

Each layer's K/V live in one buffer of shape (slots, nh, capacity, hd), allocated once by
``allocate``; a step writes only the new positions of each row (as gpt-fast does) and attention
reads a view of the buffer's first positions: nothing is concatenated or copied between steps, and
the buffers' addresses never change.

Runs on CPU or CUDA (``device="cuda"``). Hidden states stay torch tensors on the device between
calls; only the logits of the last position come back to the host. CUDA graph capture
(``cuda_graphs=True``) is not implemented yet.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import ArtifactError
from ..manifest import REBUILD_HINT, Manifest
from .base import Backend, check_slots

HF_CONFIG_DIR = "hf_config"  # written by `python -m export build` beside the graphs
_DTYPES = {"float32": torch.float32, "float16": torch.float16}
_ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj")  # under self_attn. in the HF layer


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

    from ..modeling import SkipOPT, graph_module

    if manifest.quantized:  # its graphs hold packed integer weights, not the modules' state_dict
        raise ArtifactError(
            f"{directory} has quantized weights ({manifest.weights_label}); the torch backend reads "
            f"float weights only: use the onnxruntime backend, or re-export with --weights float")
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
        for name in graph_module(skeleton, spec.name).state_dict():
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
        from ..modeling import PagedOPTLayer, SkipOPT

        self.hf_model = load_hf_model(Path(directory), manifest, self.device)
        self.model = SkipOPT(self.hf_model)  # embed and head; also the reference to compare with
        # The exported layer itself: its paged attention reads a strided view of the buffer as
        # one page, so the torch backend runs exactly the graphs' math.
        self.layers = [PagedOPTLayer(layer) for layer in self.model.layers]
        m = manifest.model
        self._nh, self._hd = m.num_heads, m.head_dim
        self.keys: list[torch.Tensor] = []  # per layer (slots, nh, capacity, hd)
        self.values: list[torch.Tensor] = []
        self.slots = self.capacity = 0

    # -- helpers ---------------------------------------------------------------------------

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def _hidden(self, hidden) -> torch.Tensor:
        """The loop passes back what embed/layer returned; accept host arrays too (e.g. tests)."""
        if isinstance(hidden, np.ndarray):
            hidden = torch.from_numpy(np.ascontiguousarray(hidden))
        return hidden.to(device=self.device, dtype=self.dtype)

    def _zeros(self, shape) -> torch.Tensor:
        if self.device.type == "cpu":  # numpy's zeros are mapped lazily: untouched slots cost nothing
            return torch.from_numpy(np.zeros(shape, np.dtype(self.manifest.dtype)))
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # -- Backend -----------------------------------------------------------------------------

    def allocate(self, slots: int, capacity: int) -> None:
        shape = (slots, self._nh, capacity, self._hd)  # (slots, nh, capacity, hd)
        self.keys = [self._zeros(shape) for _ in self.layers]
        self.values = [self._zeros(shape) for _ in self.layers]
        self.slots, self.capacity = slots, capacity

    @torch.inference_mode()
    def embed(self, input_ids, attention_mask):
        return self.model.embed(self._tensor(input_ids), self._tensor(attention_mask))  # (B, T, D)

    @torch.inference_mode()
    def layer(self, index, hidden, attention_mask, slots, positions, update=None):
        hidden = self._hidden(hidden)  # (B, T, D)
        B, T, _ = hidden.shape
        past = attention_mask.shape[1] - T
        check_slots(self.name, slots, past, self.slots, positions, T, self.capacity)
        key, value = self.keys[index], self.values[index]
        if past:  # the buffer's first positions as one page: views, nothing copied
            past_key = key[:, :, :past].transpose(2, 3).unsqueeze(0)  # (1, S, nh, hd, past)
            past_value = value[:, :, :past].unsqueeze(0)  # (1, S, nh, past, hd)
            mask = attention_mask
        else:  # prefill: one all-masked position stands for the empty past
            past_key = hidden.new_zeros((1, B, self._nh, self._hd, 1))
            past_value = hidden.new_zeros((1, B, self._nh, 1, self._hd))
            mask = np.concatenate([np.zeros((B, 1), np.int64), attention_mask], axis=1)
        out, new_key, new_value = self.layers[index](hidden, self._tensor(mask), past_key, past_value)
        rows = np.arange(B) if update is None else np.flatnonzero(update)
        where = self._tensor(positions[rows][:, None] + np.arange(T))  # (R, T)
        at = self._tensor(slots[rows])[:, None]  # (R, 1)
        key[at, :, where] = new_key[rows].transpose(1, 2)  # (R, T, nh, hd): only the new positions
        value[at, :, where] = new_value[rows].transpose(1, 2)
        if update is not None and not update.all():
            out = torch.where(self._tensor(update)[:, None, None], out, hidden)
        return out

    @torch.inference_mode()
    def head(self, hidden, rows=None):
        hidden = self._hidden(hidden)
        last = hidden[:, -1:, :] if rows is None else hidden[self._tensor(rows), -1:, :]  # (R, 1, D)
        # .cpu() waits for the device, so the loop's timings include the queued GPU work.
        return self.model.head(last)[:, -1, :].float().cpu().numpy()  # (R, V) fp32

    def close(self):
        self.keys, self.values = [], []
        self.layers = []
        self.model = self.hf_model = None  # drop the weights (device memory on CUDA)


__all__ = ["TorchBackend", "read_graph_weights", "hf_key", "load_hf_model"]
