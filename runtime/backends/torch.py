"""PyTorch backend: the skip-aware reference layers (runtime.models.opt) with preallocated KV buffers.

The weights come from the artifact itself, not from a source checkpoint: the graphs were exported
without constant folding, so their initializers keep the exported modules' state_dict names. They
are loaded into the checkpoint's causal LM (``OPTForCausalLM``, ``LlamaForCausalLM``, ...) built on
the meta device from ``hf_config/`` (no random init, whatever the model size) and wrapped with its
family's skip-aware reference (runtime.models).

Each layer's K/V live in buffers of the whole capacity, K (rows, nh, hd, capacity) and V (rows, nh,
capacity, hd), allocated once by the KV cache (``ArrayStorage(fixed=True)``); a step writes only
the new positions of each row (as gpt-fast does) and attention reads a strided view of the rows
that run at the cache's width: nothing is concatenated or copied between steps, and the buffers'
addresses never change.

Runs on CPU or CUDA (``device="cuda"``). Hidden states stay torch tensors on the device between
calls; only the logits of the last position come back to the host (a static step's greedy rows:
their argmax alone, picked on the device). On CUDA a decode step is replayed from a CUDA graph
captured per active-layer set, batch bucket and width bucket (backends/cuda_graphs.py, which says
how the shapes are made static), and so is a lossless verify pass, per batch, width and token
bucket; ``cuda_graphs=False`` runs every step eagerly.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from ..artifact.manifest import MINS, REBUILD_HINT, TRANSPOSED, Manifest, split_fused
from ..errors import ArtifactError, InvalidArgumentError
from ..kvcache import ArrayStorage, KVCache
from ..models import family_named
from .base import Backend, DecodeStep, VerifyPass, run_decode, run_verify
from .cuda_graphs import GraphCache, GraphKey, batch_bucket, default_capture, tokens_bucket, width_bucket

HF_CONFIG_DIR = "hf_config"  # written by `python -m export build` beside the graphs
_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def to_host(logits: torch.Tensor) -> np.ndarray:
    """``logits`` (or token ids) on the host, once the device has computed them (so the loop's
    timings include the queued device work). From a GPU through pinned memory: a copy to pageable
    memory is staged by the driver at a fraction of the link's speed, and a step's logits are 4 MB at
    batch 8 of a 128,256-token vocabulary. The pinned block is PyTorch's caching host allocator's: returned to
    it when the array is dropped, never handed out while a copy into it is queued."""
    if logits.device.type != "cuda":
        return logits.cpu().numpy()
    out = torch.empty(logits.shape, dtype=logits.dtype, pin_memory=True)
    out.copy_(logits, non_blocking=True)
    torch.cuda.current_stream(logits.device).synchronize()
    return out.numpy()


# -- weights -----------------------------------------------------------------------------------


def read_graph_weights(path: Path) -> dict[str, np.ndarray]:
    """Initializers of one graph by name, with the exporter's deduplicated names resolved.

    The exporter keeps one initializer per distinct tensor value and names the others as outputs of
    ``Identity(kept)`` nodes (e.g. ``Identity(q_proj.bias) -> k_proj.bias`` when both are zero);
    a linear weight is stored transposed as ``W.T`` (the layout MatMul reads), sibling ones fused
    into one (``runtime.artifact.manifest.split_fused``). External data files are read from the graph's own
    directory (the artifact directory).
    """
    import onnx

    return graph_weights(onnx.load(str(path), load_external_data=True))


def graph_weights(proto) -> dict[str, np.ndarray]:
    """``read_graph_weights`` of a graph already loaded (weights inside). A quantized product's
    codes, scales and zero points are not float weights (runtime.models.quantized reads them)."""
    from onnx import numpy_helper

    blocks = {i for n in proto.graph.node if n.op_type == "MatMulNBits" or MINS + "/" in n.name for i in n.input[1:]}
    weights = split_fused({t.name: numpy_helper.to_array(t) for t in proto.graph.initializer
                           if t.name not in blocks})
    for name in [n for n in weights if n.endswith(TRANSPOSED)]:  # stored as MatMul reads them
        weights[name[: -len(TRANSPOSED)]] = weights.pop(name).T
    alias = {n.output[0]: n.input[0] for n in proto.graph.node if n.op_type == "Identity"}
    for name in alias:
        source, hops = name, 0
        while source not in weights and source in alias and hops <= len(alias):  # chains, no cycles
            source, hops = alias[source], hops + 1
        if source in weights and name not in weights:
            weights[name] = weights[source]
    return weights


def load_hf_model(directory: Path, manifest: Manifest, device: torch.device):
    """The checkpoint's causal LM (OPTForCausalLM, LlamaForCausalLM, ...: runtime.models) from
    ``hf_config/`` with every weight taken from the artifact's graphs."""
    from transformers import AutoConfig

    from ..models.base import graph_module

    import onnx

    from ..models.quantized import read_products

    config_dir = directory / HF_CONFIG_DIR
    if not (config_dir / "config.json").is_file():
        raise ArtifactError(
            f"{config_dir / 'config.json'} is missing: the torch backend builds the model from it; "
            f"{REBUILD_HINT}")
    config = AutoConfig.from_pretrained(str(config_dir))
    family = family_named(manifest.model.architecture)
    with torch.device("meta"):  # shapes only: no memory, no random init, whatever the model size
        model = family.model_class()(config)
    expected = model.state_dict()  # meta tensors: key -> shape
    skeleton = family.skip_model(model)  # what each graph was traced from, so which weights it must hold
    dtype = _DTYPES[manifest.dtype]

    state: dict[str, torch.Tensor] = {}
    blocks = {}  # key -> Blocks: the products an int4/int8 artifact holds in MatMulNBits' blocks
    for spec in manifest.graphs:
        proto = onnx.load(str(directory / spec.file), load_external_data=True)
        products = read_products(proto) if manifest.quantized else {}  # (first: it names a form it cannot read)
        found = graph_weights(proto)
        converted: dict[int, torch.Tensor] = {}  # one tensor per distinct array: aliases share it
        for name in graph_module(skeleton, spec.name).state_dict():
            key = family.hf_key(spec.name, name)
            if name in products:
                blocks[key] = products[name]
                shape = (products[name].out_features, products[name].in_features)
            elif name in found:
                shape = tuple(found[name].shape)
            else:
                raise ArtifactError(
                    f"{directory / spec.file} has no weight {name!r} ({key}), which the model in "
                    f"{HF_CONFIG_DIR}/config.json needs: " + (
                        f"its graph holds it in a form the torch backend does not read ({manifest.weights_label}); "
                        f"use the onnxruntime backend, or re-export with --weights float"
                        if manifest.quantized else
                        f"the graph was modified or comes from another export; {REBUILD_HINT}"))
            if shape != tuple(expected[key].shape):
                raise ArtifactError(
                    f"{directory / spec.file}: weight {name!r} has shape {list(shape)}, but "
                    f"{HF_CONFIG_DIR}/config.json implies {list(expected[key].shape)} ({key}); "
                    f"{REBUILD_HINT}")
            if key in blocks:
                continue
            array = found[name]
            if id(array) not in converted:
                # to_array gives read-only views of the protobuf bytes: copy once, then move.
                converted[id(array)] = torch.from_numpy(np.array(array)).to(device=device, dtype=dtype)
            state[key] = converted[id(array)]
    _share_tied_embeddings(state, family.embed_key)
    missing = sorted(set(expected) - set(state) - set(blocks))
    if missing:  # a key no graph maps to: the family's hf_key and the exported modules disagree
        raise ArtifactError(f"no graph of {directory} provides {missing}; {REBUILD_HINT}")
    model.load_state_dict(state, strict=not blocks, assign=True)
    _quantized_modules(model, blocks, device, dtype)
    model.eval().requires_grad_(False)
    return model


def _quantized_modules(model, blocks: dict, device: torch.device, dtype: torch.dtype) -> None:
    """Each nn.Linear (nn.Embedding) whose weight ``blocks`` holds (by its state_dict key) replaced
    by a QuantLinear (QuantEmbedding) over those blocks, on ``device``: what the CPU's graph multiplies
    by (looks up)."""
    from ..models.quantized import QuantEmbedding, QuantLinear

    for key, found in blocks.items():
        path = key.removesuffix(".weight")
        parent, _, child = path.rpartition(".")
        module = model.get_submodule(path)
        setattr(model.get_submodule(parent) if parent else model, child,
                QuantEmbedding(found, device, dtype) if isinstance(module, torch.nn.Embedding)
                else QuantLinear.from_blocks(found, module.bias, device, dtype))


def _share_tied_embeddings(state: dict[str, torch.Tensor], embed_key: str) -> None:
    """Point lm_head at the embedding when they are equal (tied in OPT, Llama 3.2, Qwen3 ...): one
    copy, not two."""
    embed, lm_head = state.get(embed_key), state.get("lm_head.weight")
    if (embed is not None and lm_head is not None and embed is not lm_head
            and embed.shape == lm_head.shape and torch.equal(embed, lm_head)):
        state["lm_head.weight"] = embed


# -- the backend -------------------------------------------------------------------------------


INT4_KERNELS = ("auto", "tinygemm")


def _check_int4_kernel(kernel) -> None:
    if kernel not in INT4_KERNELS:
        raise InvalidArgumentError(
            f"int4_kernel={kernel!r}: the torch backend takes 'auto' (the Triton kernel on a GPU, the blocks "
            f"dequantized a slice at a time on the CPU) or 'tinygemm' (PyTorch's own int4 product, "
            f"torch.ops.aten._weight_int4pack_mm); 'skipdecode' and 'onnxruntime' are the onnxruntime "
            f"backend's", param="int4_kernel")


def _resolve_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(
                f"device={str(device)!r}: no CUDA device is visible to PyTorch (torch "
                f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use device='cpu', "
                f"or install a CUDA build of torch on a machine with a GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InvalidArgumentError(f"device={str(device)!r}: only {torch.cuda.device_count()} CUDA "
                             f"device(s) are visible; use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    return dev


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, directory, manifest: Manifest, device: str | torch.device = "cpu",
                 cuda_graphs: bool | None = None, threads: int | None = None, compile_steps: bool = False,
                 int4_kernel: str = "auto"):
        if threads:
            torch.set_num_threads(threads)  # process-wide: PyTorch has no per-module thread pool
        self.manifest = manifest
        device = _resolve_device(device)
        _check_int4_kernel(int4_kernel)
        self._setup(load_hf_model(Path(directory), manifest, device), device, cuda_graphs, compile_steps, int4_kernel)

    @classmethod
    def from_model(cls, hf_model, cuda_graphs: bool | None = None, compile_steps: bool = False,
                   int4_kernel: str = "auto") -> "TorchBackend":
        """A backend over an OPTForCausalLM already in memory, on its device and in its dtype: what
        ``python -m tools.bench.gpu`` times, random weights at real shapes with no export."""
        _check_int4_kernel(int4_kernel)
        backend = cls.__new__(cls)
        backend.manifest = None
        backend._setup(hf_model.eval().requires_grad_(False), hf_model.device, cuda_graphs, compile_steps,
                       int4_kernel)
        return backend

    def _setup(self, hf_model, device: torch.device, cuda_graphs: bool | None, compile_steps: bool,
               int4_kernel: str) -> None:
        from ..models import head_dim, kv_heads, skip_model

        self.device = device
        # int4_kernel "tinygemm": the 4-bit products it takes on PyTorch's own int4 product instead of
        # the Triton kernel (runtime.models.quantized_tinygemm), before the layers are wrapped
        self.int4_kernel = None  # (what the command line reports: only a kernel asked for)
        self.int4_kernel_note = ""
        if int4_kernel == "tinygemm":
            from ..models.quantized_tinygemm import use_tinygemm

            if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
                raise InvalidArgumentError(
                    f"int4_kernel='tinygemm' needs tensor cores of compute capability 8.0 or later (Ampere: "
                    f"A100, Jetson Orin; this {torch.cuda.get_device_name(device)} is "
                    f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}); use int4_kernel='auto'",
                    param="int4_kernel")

            done, why = use_tinygemm(hf_model)
            if not done:  # asked for, and nothing runs on it: say why rather than report it
                warnings.warn(f"int4_kernel='tinygemm' takes none of this model's products ("
                              f"{'; '.join(why) or 'it has no int4 weights'}): they run as with int4_kernel='auto'",
                              stacklevel=3)
            else:
                self.int4_kernel = int4_kernel
                self.int4_kernel_note = f"{done} products on tinygemm" + (
                    f"; the others on the blocks' kernel: {'; '.join(why)}" if why else "")
        # compile_steps: each layer of a static step (a decode step or a verify pass, what a CUDA graph
        # captures) compiled by torch.compile (inductor: norms, RoPE and the elementwise work fused
        # into fewer kernels). One function for every layer, its weights inputs rather than constants,
        # so one compile serves all layers and sets; shapes (batch and width buckets) recompile, then
        # go dynamic (torch.compile's default). What a decode step runs besides its layers (the
        # embedding and the inputs every layer shares; the head and its argmax) is compiled too: it is
        # paid in every step, whatever the layers the step skips. (A pass's head too; its inputs stay
        # eager: inductor (torch 2.13) fails on them once shapes go dynamic, in sympy's value ranges,
        # and a pass makes them once for T tokens.)
        steps = (layer_step, layer_pass, step_prologue, step_head, pass_head)
        (self.layer_step, self.layer_pass, self.step_prologue, self.step_head, self.pass_head) = (
            tuple(torch.compile(f) for f in steps) if compile_steps else steps)
        self.hf_model = hf_model
        self.model = skip_model(hf_model)  # embed and head; also the reference to compare with
        self.dtype = self.model.dtype
        # The exported layer itself, reading a strided view of the buffers: the torch backend
        # runs exactly the graphs' math (decode steps: its ``step``, runtime.models.step).
        self.layers = [self.model.graph_layer(i) for i in range(self.model.num_layers)]
        self._nh, self._hd = kv_heads(hf_model.config), head_dim(hf_model.config)  # the K/V stored
        self.storage: ArrayStorage | None = None
        self.graphs = None
        # verify passes' logits (B, T, V) fp32 by shape, one buffer for every width's graph: only one
        # pass runs at a time and its logits are read before the next (a graph of its own each would
        # hold 31 MB at batch 8, 20 tokens and a 49k vocabulary, for each width bucket)
        self.pass_logits: dict[tuple[int, int], torch.Tensor] = {}
        capture = default_capture(device, cuda_graphs)  # None on the CPU unless asked
        if capture is not None:
            self.use_graphs(capture)

    # -- helpers ---------------------------------------------------------------------------

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def _hidden(self, hidden) -> torch.Tensor:
        """The loop passes back what embed/layer returned; accept host arrays too (e.g. tests)."""
        if isinstance(hidden, np.ndarray):
            hidden = torch.from_numpy(np.ascontiguousarray(hidden))
        return hidden.to(device=self.device, dtype=self.dtype)

    def _zeros(self, shape) -> torch.Tensor:
        if self.device.type == "cpu":  # numpy's zeros are mapped lazily: untouched rows cost nothing
            return torch.from_numpy(np.zeros(shape, np.dtype(str(self.dtype).removeprefix("torch."))))
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # -- Backend -----------------------------------------------------------------------------

    def kv_storage(self) -> ArrayStorage:
        self.storage = ArrayStorage(len(self.layers), self._nh, self._hd, self._zeros, fixed=True,
                                    index=self._tensor)
        if self.graphs is not None:
            self.graphs.clear()  # captured steps hold the old buffers' addresses
        return self.storage

    def use_graphs(self, capture) -> None:
        """Run decode steps as static steps through ``capture`` (cuda_graphs.CudaGraphCapture, or
        EagerCapture, which runs the very same step eagerly: the CPU tests of the graph path)."""
        if self.graphs is None:
            for layer in self.layers:
                layer.fuse_for_steps()  # the modules' weights become views: no memory added
        self.graphs = GraphCache(capture)

    def setup_seconds(self) -> float:
        return 0.0 if self.graphs is None else self.graphs.setup_seconds

    @torch.inference_mode()
    def embed(self, input_ids, attention_mask):
        return self.model.embed(self._tensor(input_ids), self._tensor(attention_mask))  # (B, T, D)

    @torch.inference_mode()
    def layer(self, index, hidden, attention_mask, past_key, past_value):
        # (B, T, D), then new K/V (B, nh, T, hd)
        return self.layers[index](self._hidden(hidden), self._tensor(attention_mask), past_key, past_value)

    @torch.inference_mode()
    def keep(self, update, out, hidden):
        return torch.where(self._tensor(update)[:, None, None], out, self._hidden(hidden))

    @torch.inference_mode()
    def decode(self, step: DecodeStep, cache: KVCache):
        if self.graphs is None:
            return run_decode(self, step, cache)
        key = GraphKey(tuple(step.layers), batch_bucket(step.rows, cache.max_rows),
                       width_bucket(cache.width, cache.capacity))
        static, replay = self.graphs.get(key, lambda k: StaticStep(self, k))
        static.load(step, cache.length[: step.rows])
        replay()
        return to_host((static.argmax if step.argmax else static.logits)[: step.rows])  # (R,) int64 or (R, V) fp32

    @torch.inference_mode()
    def verify(self, check: VerifyPass, cache: KVCache):
        if self.graphs is None:
            return run_verify(self, check, cache)
        T = check.input_ids.shape[1]
        key = GraphKey(tuple(range(check.depth)), batch_bucket(check.rows, cache.max_rows),
                       width_bucket(cache.width, cache.capacity), tokens_bucket(T))
        static, replay = self.graphs.get(key, lambda k: StaticVerify(self, k))
        static.load(check, cache.length[: check.rows])
        replay()
        if check.argmax:  # every row's ids come back (8 bytes a position), the rows picked on the host
            return to_host(static.argmax)[check.verified, :T]  # (n, T) int64
        return to_host(static.logits[self._tensor(check.verified), :T])  # (n, T, V) fp32

    @torch.inference_mode()
    def head(self, hidden, rows=None):
        hidden = self._hidden(hidden)
        last = hidden[:, -1:, :] if rows is None else hidden[self._tensor(rows), -1:, :]  # (R, 1, D)
        return to_host(self.model.head(last)[:, -1, :].float())  # (R, V) fp32

    @torch.inference_mode()
    def head_all(self, hidden, rows):
        picked = self._hidden(hidden)[self._tensor(rows)]  # (R, T, D)
        return to_host(self.model.head(picked).float())  # (R, T, V) fp32

    def close(self):
        if self.storage is not None:
            self.storage.close()
        self.layers, self.graphs, self.pass_logits = [], None, {}
        self.model = self.hf_model = None  # drop the weights (device memory on CUDA)


def step_prologue(model, ids, mask, at, positions):
    """A static step's or pass's embedding (B, T, D) and what its layers share (StepInputs)."""
    hidden = model.embed(ids, mask)  # (B, T, D)
    return hidden, model.step_inputs(mask, at, positions, hidden)


def step_head(model, hidden):
    """A static step's logits (B, V) fp32 and their argmax (B,)."""
    logits = model.head.step(hidden)[:, -1, :].float()  # (B, V)
    return logits, logits.argmax(-1)


def pass_head(model, hidden, out):
    """A static pass's logits into ``out`` (B, T, V) fp32 -> their argmax (B, T)."""
    out.copy_(model.head.step(hidden))  # widened to fp32
    return out.argmax(-1)


def layer_step(layer, hidden, shared, key, value, keep):
    """One layer of a static decode step: it writes its K/V for the rows that run it (``keep`` (B, 1,
    1, 1)); the others keep their hidden state. (A function of the layer, not a method of it, so that
    torch.compile makes one graph for every layer.)"""
    out = layer.step(hidden, shared, key, value, keep)  # (B, 1, D)
    return torch.where(keep[..., 0], out, hidden)


def layer_pass(layer, hidden, shared, key, value, write):
    """One layer of a static verify pass: every row runs it, writing its K/V where ``write``."""
    return layer.step(hidden, shared, key, value, write)  # (B, T, D)


class _StaticInputs:
    """A static call's int64 inputs: one device buffer of ``sizes`` parts, staged on the host and
    copied in one transfer per call (what a CUDA graph reads at fixed addresses)."""

    def __init__(self, backend: TorchBackend, key: GraphKey, sizes: list[int]):
        self.backend, self.key, self._sizes = backend, key, sizes
        self.inputs = torch.zeros(sum(sizes), dtype=torch.int64, device=backend.device)
        # Pinned on CUDA: the copy is queued ahead of the replay without a staging copy or a wait (the
        # host writes the buffer again only after the step's logits came back, so after the copy).
        self._host = torch.zeros(sum(sizes), dtype=torch.int64, pin_memory=backend.device.type == "cuda")
        self.host = self._host.numpy()  # the same memory
        self.at = torch.arange(key.batch, device=backend.device)[:, None]  # (B, 1) each row's own cache row

    def _parts(self) -> list[torch.Tensor]:
        """The device buffer's parts, flat."""
        return list(torch.split(self.inputs, self._sizes))

    def _staging(self) -> list[np.ndarray]:
        """The host buffer's parts, flat and zeroed: padding rows and tokens stay 0."""
        self.host[:] = 0
        return np.split(self.host, np.cumsum(self._sizes[:-1]))

    def _upload(self) -> None:
        self.inputs.copy_(self._host, non_blocking=self.inputs.is_cuda)


class StaticStep(_StaticInputs):
    """One decode step of fixed shape (cuda_graphs.GraphKey) reading and writing static tensors.

    It runs the KV cache's first ``batch`` rows (the decoding rows are packed at the front, so a
    step of R rows runs the smallest bucket >= R; the rows past R are computed and change nothing)
    over a past of ``width`` positions. Its inputs live in one int64 buffer (one host-to-device
    copy per step): ids (B, 1), the mask (B, W + 1) with the real past left-aligned and the new
    position last, positions (B,) and one update row (B,) per layer. ``run`` is what a CUDA graph
    captures; ``logits`` (B, V) fp32 and their ``argmax`` (B,) are where the replay leaves its result.
    """

    def __init__(self, backend: TorchBackend, key: GraphKey):
        B, W, n = key.batch, key.width, len(key.layers)
        super().__init__(backend, key, [B, B * (W + 1), B, n * B])
        ids, mask, positions, updates = self._parts()
        self.ids, self.mask = ids.view(B, 1), mask.view(B, W + 1)  # (B, 1), (B, W + 1)
        self.positions, self.updates = positions, updates.view(n, B)  # (B,), (n, B)
        self.logits: torch.Tensor | None = None  # (B, V) fp32, set by run
        self.argmax: torch.Tensor | None = None  # (B,) int64: the logits' argmax, set by run

    def load(self, step: DecodeStep, positions: np.ndarray) -> None:
        """The step's inputs; ``positions`` (R,): where each row's new K/V go (the rows' lengths)."""
        B, W, R = self.key.batch, self.key.width, step.rows
        past = step.attention_mask.shape[1] - 1
        ids, mask, pos, upd = self._staging()  # rows past R: pad ids, nothing valid, no updates
        ids[:R] = step.input_ids[:, 0]
        mask = mask.reshape(B, W + 1)
        mask[:R, :past], mask[:R, W] = step.attention_mask[:, :past], step.attention_mask[:, past]
        pos[:R] = positions
        upd.reshape(-1, B)[:, :R] = np.asarray(step.updates, dtype=np.int64)
        self._upload()

    def run(self) -> None:
        backend, W, B = self.backend, self.key.width, self.key.batch
        storage = backend.storage
        hidden, shared = backend.step_prologue(backend.model, self.ids, self.mask, self.at, self.positions)  # (B, 1, D)
        for k, index in enumerate(self.key.layers):
            keep = self.updates[k].bool()[:, None, None, None]  # (B, 1, 1, 1): rows that skip write back what was there
            key = storage.keys[index][:B, ..., :W]  # (B, nh, hd, W): a view of the cache rows
            value = storage.values[index][:B, :, :W]  # (B, nh, W, hd)
            hidden = backend.layer_step(backend.layers[index], hidden, shared, key, value, keep)  # (B, 1, D)
        self.logits, self.argmax = backend.step_head(backend.model, hidden)  # (B, V), (B,): greedy rows' tokens


class StaticVerify(_StaticInputs):
    """One lossless verify pass of fixed shape (cuda_graphs.GraphKey with ``tokens``): T tokens for
    each of the KV cache's first ``batch`` rows at full depth, over a past of ``width`` positions.

    The decode step's road (each layer's ``step``, runtime.models.step) over T tokens: each layer
    writes the verified rows' new K/V into the cache rows, then attends over them; a row that rides
    along (not verified), a padding token and the bucket's extra rows write back what was there.
    Inputs, in one int64 buffer: ids (B, T), the mask (B, W + T) with the real past left-aligned
    and the new positions last, positions (B,) (each row's length: where its first new K/V go),
    writes (B, T) (1 where a new position is written). ``logits`` (B, T, V) fp32 is the result, in
    a buffer the backend's passes of this batch and token bucket share (``pass_logits``), and ``argmax``
    (B, T) their argmax.
    """

    def __init__(self, backend: TorchBackend, key: GraphKey):
        B, W, T = key.batch, key.width, key.tokens
        super().__init__(backend, key, [B * T, B * (W + T), B, B * T])
        ids, mask, positions, writes = self._parts()
        self.ids, self.mask = ids.view(B, T), mask.view(B, W + T)  # (B, T), (B, W + T)
        self.positions, self.writes = positions, writes.view(B, T)  # (B,), (B, T)
        if (B, T) not in backend.pass_logits:  # made here, before any capture: outside the graphs' pool
            V = backend.hf_model.lm_head.out_features
            backend.pass_logits[B, T] = torch.zeros(B, T, V, dtype=torch.float32, device=backend.device)
        self.logits = backend.pass_logits[B, T]  # (B, T, V) fp32, written by run
        self.argmax: torch.Tensor | None = None  # (B, T) int64: their argmax, set by run

    def load(self, check: VerifyPass, positions: np.ndarray) -> None:
        """The pass's inputs; ``positions`` (R,): the rows' lengths, where their first new K/V go."""
        B, W, T = self.key.batch, self.key.width, self.key.tokens
        R, t = check.input_ids.shape
        past = check.attention_mask.shape[1] - t
        ids, mask, pos, writes = self._staging()  # padding tokens and rows past R: nothing valid or written
        ids.reshape(B, T)[:R, :t] = check.input_ids
        mask = mask.reshape(B, W + T)
        mask[:R, :past], mask[:R, W:W + t] = check.attention_mask[:, :past], check.attention_mask[:, past:]
        pos[:R] = positions
        writes.reshape(B, T)[:R, :t] = check.attention_mask[:, past:] * check.updates[:, None]
        self._upload()

    def run(self) -> None:
        backend, B, W = self.backend, self.key.batch, self.key.width
        storage = backend.storage
        write = self.writes.bool()[:, :, None, None]  # (B, T, 1, 1)
        hidden, shared = step_prologue(backend.model, self.ids, self.mask, self.at, self.positions)  # (B, T, D)
        for index in self.key.layers:
            key = storage.keys[index][:B, ..., :W]  # (B, nh, hd, W): a view of the cache rows
            value = storage.values[index][:B, :, :W]  # (B, nh, W, hd)
            hidden = backend.layer_pass(backend.layers[index], hidden, shared, key, value, write)  # writes its K/V
        self.argmax = backend.pass_head(backend.model, hidden, self.logits)  # (B, T): greedy rows' tokens


__all__ = ["StaticStep", "StaticVerify", "TorchBackend", "read_graph_weights", "load_hf_model"]
