"""ONNX Runtime backend: one InferenceSession per graph, the KV cache in host buffers.

Each layer's K and V live in numpy buffers (rows, nh, hd|W, W|hd) laid out by the KV cache
(runtime/kvcache.py, ``ArrayStorage``): a step binds its block of rows as the graph's past (a
contiguous view: ONNX Runtime reads the numpy memory in place) and the cache writes the graph's
new K/V into each row's own position; nothing is concatenated or copied per step.

Providers default to CUDA when onnxruntime-gpu offers it, else CPU. The TensorRT provider is used
only when asked for (its first run builds engines, which takes minutes).
"""

from __future__ import annotations

import platform
import sys
import threading
import warnings
from pathlib import Path

import numpy as np

from .. import gqa
from ..artifact.embed_table import EmbedTable
from ..artifact.manifest import DRAFT_HEAD, DRAFT_LAYERS, GraphSpec, Manifest
from ..errors import ArtifactError, InvalidArgumentError
from ..kvcache import ArrayStorage
from ..platform import cpu_idle, hugepages
from .base import Backend
from .fused_layers import FusedLayers


def import_ort():
    try:
        import onnxruntime
    except ImportError as exc:
        raise ImportError(
            "the onnxruntime backend needs ONNX Runtime: pip install 'skipdecode-edge[cpu]' "
            "(or [gpu] for onnxruntime-gpu; never both)") from exc
    return onnxruntime


_ARENA_LOCK = threading.Lock()
_ARENA_REGISTERED = False


def _register_shared_cpu_arena(ort) -> None:
    """Register the process-wide CPU arena that sessions with ``session.use_env_allocators`` use."""
    global _ARENA_REGISTERED
    with _ARENA_LOCK:
        if not _ARENA_REGISTERED:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, None)  # None: ONNX Runtime's default arena settings
            _ARENA_REGISTERED = True


def _outside_runtime() -> int:
    """The ``stacklevel`` that makes a warning name the first caller outside the runtime package
    (the user's ``runtime.load`` or ``generate``), whichever path led here."""
    package = str(Path(__file__).resolve().parents[1])
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def names_only(providers) -> list[str]:
    """Provider names, of names or (name, options) pairs."""
    return [p if isinstance(p, str) else p[0] for p in providers]


def _x86_cpu_only(providers) -> bool:
    return set(names_only(providers)) == {"CPUExecutionProvider"} and platform.machine().lower() in ("x86_64", "amd64")


SPIN_US = 50  # spin=True without the shared pool: longest busy-wait of an idle worker (µs); a
# layer's operators come µs apart, and ONNX Runtime's default duration cost 2x more than this
# beside a busy process

_POOL_LOCK = threading.Lock()
_POOL_THREADS: list = []  # [intra-op threads] of this process's shared pool, once a spin=True load made it


def _make_shared_pool(threads: int | None) -> bool:
    """ONNX Runtime's global intra-op thread pool, ``threads`` threads (None: one per physical
    core), made once per process; False where this ONNX Runtime cannot make it."""
    try:
        from onnxruntime.capi.onnxruntime_pybind11_state import set_global_thread_pool_sizes
    except ImportError:  # an ONNX Runtime without the binding
        return False
    with _POOL_LOCK:
        if not _POOL_THREADS:
            try:
                set_global_thread_pool_sizes(threads or 0, 1)
            except Exception:  # made by other code of this process: not ours to share
                return False
            _POOL_THREADS.append(threads)
    return True


def new_session_options(ort):
    """A SessionOptions every ONNX Runtime session of the toolkit starts from: once a spin=True
    load made the shared pool, ONNX Runtime refuses any session with a pool of its own
    ("use_per_session_threads must be false when using a global thread pool"), so every later
    session of the process (other loads, export's checks) runs on the shared pool too."""
    opts = ort.SessionOptions()
    if _POOL_THREADS:
        opts.use_per_session_threads = False
    return opts


def session_options(ort, threads: int | None = None, spin: bool = False):
    """The SessionOptions every graph's session gets (tools.bench.graphs starts from them too)."""
    # spin=True, for a device of its own: every graph runs on ONE pool of workers that busy-wait
    # between operators, across the boundaries of the graphs' runs, as a peer's single-graph
    # session does. A decode step on SmolLM2-360M shapes (int4, 2 threads) took 20.5-21.4 ms
    # against 22.4-23.1 with a spinning pool per graph and 25.6-27.2 with sleeping ones
    # (docs/benchmarks.md, "One spinning pool"). Beside a busy process spinning costs more than it
    # gives (1.4x slower per step there), hence not the default. The pool is the process's, and there is no other once
    # it exists: see new_session_options.
    if spin:
        _make_shared_pool(threads)
    opts = new_session_options(ort)
    opts.log_severity_level = 3
    # One CPU arena for every session of the process, not one per graph: each arena keeps the
    # high-water mark of its own graph's largest run, so 14 graphs' prefills held ~400 MB on
    # OPT-125m at batch 4 x 512 tokens, against ~200 MB for one shared arena (export.measure).
    _register_shared_cpu_arena(ort)
    opts.add_session_config_entry("session.use_env_allocators", "1")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    if _POOL_THREADS:
        if _POOL_THREADS[0] != threads or not spin:
            warnings.warn(
                f"spin={spin}, threads={threads}: this process's ONNX Runtime sessions all run on the "
                f"spinning pool of threads={_POOL_THREADS[0]} that its first spin=True load made "
                f"(ONNX Runtime allows no other pool beside it, nor a new size); load with spin=True "
                f"in a process of its own for other settings", stacklevel=_outside_runtime())
        return opts
    # One session per graph means one thread pool per graph. By default its workers sleep
    # whenever they wait: pools left spinning for ONNX Runtime's default duration stole the
    # running graph's cores (7.7x slower per token on 2 cores), and a spinning worker competes with
    # any other process for them (1.2x-2x slower per step beside one busy process). Where the
    # shared pool cannot be had, spin=True spins each graph's pool for at most SPIN_US and stops
    # it when the run returns (force_spinning_stop: the guard where an older ONNX Runtime lacks
    # the duration key).
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if spin:
        opts.add_session_config_entry("session.intra_op.spin_duration_us", str(SPIN_US))
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    if threads:
        opts.intra_op_num_threads = threads
    return opts


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    narrows_rows = True  # its plain layer graphs take and give host arrays: a layer may run on a span of rows (run_layers)
    looks_up_embeddings = True  # where the manifest records the embedding's table (runtime.artifact.embed_table)

    def __init__(self, directory, manifest: Manifest, providers: list | None = None,
                 threads: int | None = None, spin: bool | str = False, huge_pages: bool = False,
                 fused: bool | None = None, int4_kernel: str = "auto", deterministic: bool = False):
        ort = import_ort()
        available = ort.get_available_providers()
        if providers is None:
            providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
        missing = [p for p in names_only(providers) if p not in available]
        if missing:
            raise ValueError(f"ONNX Runtime providers {missing} are not available here "
                             f"(available: {available}); install onnxruntime-gpu for CUDA/TensorRT")
        # "auto" (the command lines' default): spin where no other process uses these cores now
        self.spin = cpu_idle.cores_free() if spin == "auto" else bool(spin)
        opts = session_options(ort, threads, self.spin)
        self.providers = providers
        self.manifest = manifest
        if manifest.dtype == "float16" and _x86_cpu_only(providers):
            warnings.warn(
                "this float16 artifact runs on ONNX Runtime's CPU provider, whose x86 kernels compute "
                "in float32: it holds float32 copies of the weights (2.5x-2.9x the artifact's weight "
                "bytes, docs/benchmarks.md 'Memory') and runs no faster than float32. On a CPU, build "
                "with --dtype fp32, or --weights int8/int4 for a smaller footprint; float16 is for "
                "the CUDA and TensorRT providers", stacklevel=_outside_runtime())
        # fused: the layers' fused-operator variant (export.fused) where the manifest lists it; None:
        # wherever it can run (the CPU provider alone: the runtime binds host buffers as its K/V)
        if fused and not manifest.fused:
            raise ArtifactError("fused=True, but this artifact has no fused layer graphs (export writes "
                                "them for float32 or MatMulNBits Llama-family artifacts with head_dim a "
                                "multiple of 16); load with fused=None or rebuild it with `python -m export build`")
        cpu_only = names_only(providers) == ["CPUExecutionProvider"]
        if fused and not cpu_only:
            raise ValueError(f"fused=True runs on the CPU provider alone, not {names_only(providers)}")
        wants_fused = bool(manifest.fused) and fused is not False and cpu_only
        # an artifact exported where onnxruntime runs them, loaded where it cannot: the plain graphs
        self.fused_note = gqa.why_unsupported() if wants_fused else None
        if fused and self.fused_note:
            raise InvalidArgumentError(f"fused=True: {self.fused_note}; or load with fused=None (the plain "
                                       f"layer graphs where the fused ones cannot run)")
        if self.fused_note:
            warnings.warn(f"{directory}: running the plain layer graphs, not the fused ones: {self.fused_note}",
                          stacklevel=_outside_runtime())
        use_fused = wants_fused and self.fused_note is None
        directory = Path(directory)
        # int4_kernel: the int4 (and int8) products on this project's kernel (runtime/platform/kernels) or ONNX Runtime's
        self._q4, self.int4_kernel, self.int4_kernel_note = self._int4_kernel(int4_kernel, manifest, cpu_only)
        self._q4_handles: list[int] = []
        # deterministic: every product at float activations (16 bits on our kernel, level 1 on MatMulNBits,
        # 1.2x-40x slower there); else MatMulNBits runs them at int8 ones (kernels.set_accuracy_level): all
        # of them, or those our kernel does not take (a Q6_K file's blocks of 16)
        self.deterministic = bool(deterministic)
        self._ort_level = (1 if self.deterministic else 4) if cpu_only and self.int4_kernel else None
        self._relevelled = self._wide = 0  # MatMulNBits products set to _ort_level; our kernel's at 16 bits
        if self._q4 is not None:
            opts.register_custom_ops_library(str(self._q4.path))
        if self._q4 is not None or self._ort_level:
            # a rewritten graph comes as bytes: its other external weights are read from here
            opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(directory))
        # The head first: a session maps its weights from the artifact's weights.bin and, where a
        # kernel packs them (MatMul, Gemm), holds the packed copy and lets the mapping go; for a
        # moment both exist. The head's matrix is the largest (vocab x hidden), so its moment
        # comes while nothing else is resident, and the peak stays at the packed weights.
        layers = manifest.fused if use_fused else manifest.layers
        # the embedding looked up where it is a plain table (runtime.artifact.embed_table): no graph to open
        lookup = manifest.embed_table is not None and self.looks_up_embeddings
        self._table = EmbedTable(directory, manifest.embed_table, manifest.dtype) if lookup else None
        graphs = [manifest.head, *([] if lookup else [manifest.embed]), *layers, *filter(None, [manifest.draft_head])]
        drafts = manifest.draft_layers if use_fused else []  # they run as fused layers do
        before = hugepages.snapshot() if huge_pages else None
        self._sessions = {g.name: self._open(ort, directory, g, opts) for g in graphs}
        draft_sessions = [self._open(ort, directory, g, opts, manifest.weights.get(DRAFT_LAYERS)) for g in drafts]
        # huge_pages: the packed weights onto 2 MiB pages, which a step streams (runtime/platform/hugepages.py)
        self.huge_page_bytes = hugepages.collapse_new(before)
        if self._q4 is not None and not self._q4_handles:  # no product it could take: say what ran
            self._q4, self.int4_kernel = None, "onnxruntime"
            self.int4_kernel_note = "no MatMulNBits of 4 or 8 bits, blocks of 32 and accuracy level 4 or 1 to take"
        if self._wide:  # what a user reads beside the kernel: the products' activations
            self.int4_kernel_note = (f"{self._wide} of its {len(self._q4_handles)} products at float activations, "
                                     f"computed at 16 bits")
        if self._relevelled and self._ort_level == 4:
            self.int4_kernel_note += (f"; {self._relevelled} products exported at float activations run at int8 "
                                      f"ones on MatMulNBits, whose float path is 1.2x-40x slower (deterministic=True "
                                      f"keeps them: greedy text independent of the batch)")
        elif self._relevelled:
            self.int4_kernel_note += (f"; deterministic: {self._relevelled} products exported at int8 activations "
                                      f"run at float ones on MatMulNBits (1.2x-40x slower)")
        self._layer_names = [g.name for g in manifest.layers]
        # the fused graphs write the cache themselves: run as one call (backends/fused_layers.py)
        self._fused = FusedLayers(ort, [self._sessions[n] for n in self._layer_names]) if use_fused else None
        # lossless rows' draft steps: the same graphs with their products quantized (export --draft-layers)
        self._draft_fused = FusedLayers(ort, draft_sessions) if draft_sessions else None
        m = manifest.model
        self._dtype = np.dtype(manifest.dtype)
        self._nh, self._hd = m.kv_heads, m.head_dim

    @property
    def fused(self) -> bool:
        """Whether the layers run as their fused graphs (export.fused)."""
        return self._fused is not None

    @staticmethod
    def _int4_kernel(choice: str, manifest: Manifest, cpu_only: bool):
        """(the loaded kernel or None, which kernel the int4 products run on: "skipdecode",
        "onnxruntime", or None for an artifact without int4 weights, and why not ours, or "")."""
        from ..platform import kernels

        if choice not in kernels.CHOICES:
            raise InvalidArgumentError(f"int4_kernel must be one of {', '.join(kernels.CHOICES)}, got {choice!r}")
        if not any(v in kernels.WEIGHTS for v in manifest.weights.values()):
            return None, None, ""
        if choice == "onnxruntime":
            return None, "onnxruntime", "int4_kernel='onnxruntime'"
        path, reason = kernels.library() if cpu_only else (None, "it runs on the CPU provider alone")
        if path is None:
            if choice == "skipdecode":
                raise InvalidArgumentError(f"int4_kernel='skipdecode' cannot run here: {reason}; load with "
                                           f"int4_kernel='auto' or 'onnxruntime' (ONNX Runtime's MatMulNBits)")
            return None, "onnxruntime", f"runtime/platform/kernels cannot run here: {reason}"
        return kernels.Kernel(path), "skipdecode", ""

    def _open(self, ort, directory: Path, spec: GraphSpec, opts, weights: str | None = None):
        """The session of graph ``spec``, whose products are ``weights`` (None: the manifest's for its
        name; a draft layer's are its own, export --draft-layers)."""
        source = str(directory / spec.file)
        from ..platform import kernels

        # 8-bit graphs too (an int8 artifact; an int4 one's Q8_0 head from its GGUF: export.gguf_blocks)
        weights = weights or self.manifest.graph_weights(spec.name)
        if (self._q4 is not None or self._ort_level) and weights in kernels.WEIGHTS:
            import onnx

            model = onnx.load(source, load_external_data=False)  # rewrite reads what it packs
            changed = 0
            if self._q4 is not None:
                handles = kernels.rewrite(model, self._q4, str(directory), 16 if self.deterministic else None)
                self._q4_handles += handles
                self._wide += sum(a.name == "activations" and a.i == 16 for n in model.graph.node
                                  if n.op_type == kernels.OP for a in n.attribute)
                changed = len(handles)
            if self._ort_level:  # what is left on MatMulNBits
                relevelled = kernels.set_accuracy_level(model, self._ort_level)
                self._relevelled += relevelled
                changed += relevelled
            if changed:
                source = model.SerializeToString()
        session = ort.InferenceSession(source, opts, providers=self.providers)
        names = ([i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()])
        expected = ([t.name for t in spec.inputs], [t.name for t in spec.outputs])
        if names != expected:
            raise ArtifactError(
                f"{spec.file} has inputs {names[0]} and outputs {names[1]}, but the manifest says "
                f"{expected[0]} and {expected[1]}: graph and manifest come from different exports; "
                f"rebuild the artifact with `python -m export build`")
        for arg, t in zip([*session.get_inputs(), *session.get_outputs()], [*spec.inputs, *spec.outputs]):
            # sizes both name (the graph's own may be symbolic where ONNX shape inference lost them)
            fixed = [(a, b) for a, b in zip(arg.shape, t.dims) if isinstance(a, int) and isinstance(b, int)]
            if len(arg.shape) != len(t.dims) or any(a != b for a, b in fixed):
                raise ArtifactError(
                    f"{spec.file}'s {t.name} has dims {list(arg.shape)}, but the manifest says {t.dims}: "
                    f"graph and manifest come from different exports; rebuild the artifact with "
                    f"`python -m export build`")
        return session

    def kv_storage(self) -> ArrayStorage:
        # np.zeros maps untouched memory lazily (calloc), so only the positions rows write become
        # resident: a capacity of the model's whole context costs nothing until it is used.
        return ArrayStorage(len(self._layer_names), self._nh, self._hd,
                            lambda shape: np.zeros(shape, self._dtype), transposed_keys=not self.fused)

    def embed(self, input_ids, attention_mask):
        if self._table is not None:
            return self._table(input_ids)  # (B, T, D)
        return self._sessions["embed"].run(None, {"input_ids": input_ids, "attention_mask": attention_mask})[0]

    def layer(self, index, hidden, attention_mask, past_key, past_value):
        if self.fused:  # its graphs take other inputs and write the cache themselves
            raise RuntimeError("this backend runs the fused layer graphs: call run_layers, or load with fused=False")
        out, new_key, new_value = self._sessions[self._layer_names[index]].run(None, {
            "hidden_states": hidden, "attention_mask": attention_mask,
            "past_key": past_key, "past_value": past_value})  # new_*: (B, nh, T, hd)
        return out, new_key, new_value

    def run_layers(self, cache, start, count, hidden, mask, layers, updates=None, draft=False):
        if self._fused is None:
            return super().run_layers(cache, start, count, hidden, mask, layers, updates)
        fused = self._draft_fused if draft and self._draft_fused is not None else self._fused
        return fused.run(cache, start, count, hidden, mask, layers, updates)

    def keep(self, update, out, hidden):
        return np.where(update[:, None, None], out, hidden)

    def head(self, hidden, rows=None):
        return self._next_logits("head", hidden, rows)

    def draft_head(self, hidden):
        return self._next_logits(DRAFT_HEAD if self.manifest.draft_head else "head", hidden)

    def _next_logits(self, graph, hidden, rows=None):
        last = hidden[:, -1:, :] if rows is None else hidden[rows, -1:, :]  # (R, 1, D): next token only
        last = np.ascontiguousarray(last)
        # a float32 head's logits come as they are (a fresh array each run: 1.5 MB a step at batch 8 of a
        # 49152-token vocabulary was copied here), a float16 one's are widened
        return self._sessions[graph].run(None, {"hidden_states": last})[0][:, -1, :].astype(np.float32, copy=False)

    def head_all(self, hidden, rows):
        picked = np.ascontiguousarray(hidden[rows])  # (R, T, D): one run for every position
        return self._sessions["head"].run(None, {"hidden_states": picked})[0].astype(np.float32, copy=False)  # (R, T, V)

    def close(self):
        self._sessions.clear()
        if self._table is not None:
            self._table.close()
            self._table = None
        self._fused = self._draft_fused = None
        if self._q4 is not None:  # no session is left to read them
            for handle in self._q4_handles:
                self._q4.free(handle)
            self._q4_handles = []
