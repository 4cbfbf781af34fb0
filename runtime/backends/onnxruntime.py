"""ONNX Runtime backend: one InferenceSession per graph, KV cache as host arrays.

Providers default to CUDA when onnxruntime-gpu offers it, else CPU. The TensorRT provider is used
only when asked for (its first run builds engines, which takes minutes).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ArtifactError
from ..manifest import GraphSpec, Manifest
from .base import Backend, CacheReleasedError


def _import_ort():
    try:
        import onnxruntime
    except ImportError as exc:
        raise ImportError(
            "the onnxruntime backend needs ONNX Runtime: pip install 'skipdecode-edge[cpu]' "
            "(or [gpu] for onnxruntime-gpu; never both)") from exc
    return onnxruntime


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

    def __init__(self, directory, manifest: Manifest, providers: list | None = None,
                 threads: int | None = None):
        ort = _import_ort()
        available = ort.get_available_providers()
        if providers is None:
            providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
        missing = [p if isinstance(p, str) else p[0] for p in providers]
        missing = [p for p in missing if p not in available]
        if missing:
            raise ValueError(f"ONNX Runtime providers {missing} are not available here "
                             f"(available: {available}); install onnxruntime-gpu for CUDA/TensorRT")
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        # One session per graph means one thread pool per graph; spinning pools of idle sessions
        # steal the cores from the one running (measured on 2 cores: 7.7x slower per token).
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
        if threads:
            opts.intra_op_num_threads = threads
        self.providers = providers
        self.manifest = manifest
        directory = Path(directory)
        self._sessions = {g.name: self._open(ort, directory, g, opts) for g in manifest.graphs}
        m = manifest.model
        self._dtype = np.dtype(manifest.dtype)
        self._kv_shape = (m.num_heads, m.head_dim)
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._released: set[int] = set()
        self._batch = 0

    def _open(self, ort, directory: Path, spec: GraphSpec, opts):
        session = ort.InferenceSession(str(directory / spec.file), opts, providers=self.providers)
        names = ([i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()])
        expected = ([t.name for t in spec.inputs], [t.name for t in spec.outputs])
        if names != expected:
            raise ArtifactError(
                f"{spec.file} has inputs {names[0]} and outputs {names[1]}, but the manifest says "
                f"{expected[0]} and {expected[1]}: graph and manifest come from different exports; "
                f"rebuild the artifact with `python -m export build`")
        return session

    def reset(self, batch_size: int, max_length: int) -> None:
        self._batch = batch_size
        self._cache.clear()
        self._released.clear()

    def embed(self, input_ids, attention_mask):
        return self._sessions["embed"].run(None, {"input_ids": input_ids, "attention_mask": attention_mask})[0]

    def layer(self, index, hidden, attention_mask):
        if index in self._released:
            raise CacheReleasedError(f"layer {index} ran after its cache was released")
        past = self._cache.get(index)
        if past is None:
            empty = np.zeros((self._batch, self._kv_shape[0], 0, self._kv_shape[1]), self._dtype)
            past = (empty, empty)
        name = self.manifest.layers[index].name
        hidden, key, value = self._sessions[name].run(None, {
            "hidden_states": hidden, "attention_mask": attention_mask,
            "past_key": past[0], "past_value": past[1]})
        self._cache[index] = (key, value)  # (B, nh, P+T, hd)
        return hidden

    def head(self, hidden):
        last = np.ascontiguousarray(hidden[:, -1:, :])  # (B, 1, D): only the next token's logits
        return self._sessions["head"].run(None, {"hidden_states": last})[0][:, -1, :].astype(np.float32)

    def release(self, index):
        self._cache.pop(index, None)
        self._released.add(index)

    def cache_length(self, index):
        entry = self._cache.get(index)
        return 0 if entry is None else entry[0].shape[2]

    def close(self):
        self._sessions.clear()
        self._cache.clear()
