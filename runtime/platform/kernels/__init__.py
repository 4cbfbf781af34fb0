"""This project's own int4 kernel for ONNX Runtime's CPU provider (``q4_vnni.c``).

ONNX Runtime's MatMulNBits kernel (MLAS) reads an int4 decode step at ~2.2x the memory's floor on
a 2-core Zen 4, where llama.cpp's q4_0 reads it at ~1.7x (docs/benchmarks.md, "Issue 28
re-measured"): at batch 1 the int4 products are compute-bound there. ``q4_vnni.c`` computes what
MatMulNBits computes for bits=4, block_size=32 at accuracy level 4 (int8 activations, the same
weights, zero points or none; its scales kept as float16) from a layout that feeds 16 output rows
per 64-byte load: int4 steps 1.3x-1.6x faster there (docs/benchmarks.md, "This project's int4
kernel"). It is written for two x86-64 instruction sets (``ISAS``): AVX-512 VNNI (Zen 4/5, Intel
server CPUs) and AVX2 with FMA and F16C (every x86-64 laptop and desktop CPU since 2013-2015), and
for ARMv8.2 NEON with dot products (Cortex-A76/A78: Raspberry Pi 5, Jetson Orin), whose products are
the same to the bit (the NEON path checked under emulation: tests/runtime/test_kernels_neon.py); the
best one the CPU has is built (``SKIPDECODE_KERNEL_ISA=avx2`` builds another, to measure or test it
on a CPU that has both).

MatMulNBits at accuracy level 1 (float activations: ONNX Runtime runs it ~15x slower) it computes
with activations of 16 bits per block of 32, two int8 passes over the same unpacked weights
(``ACTIVATION_BITS``): within 1/64516 of each block's largest value instead of 1/254, at the cost
of the products' second pass (docs/quality.md, "The GGUF's own blocks").

``rewrite`` swaps a graph's eligible MatMulNBits nodes for ``skipdecode.Q4MatMul`` nodes whose
weights it packed into the library's table (the graph keeps no copy of them); ``library`` builds
the library with the machine's C compiler once, into a cache folder, and says why not where it
cannot (not x86-64 Linux, neither instruction set, no compiler, an ONNX Runtime too old for its API).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from runtime.artifact.manifest import MINS, minimums_term

SOURCE = Path(__file__).with_name("q4_vnni.c")
CHOICES = ("auto", "skipdecode", "onnxruntime")  # int4_kernel: auto = skipdecode where it can run
WEIGHTS = ("int4", "int8")  # the manifest's weights whose MatMulNBits products it takes (4 and 8 bits)
DOMAIN = "skipdecode"
OP = "Q4MatMul"
BLOCK = 32  # the block size the kernel reads (MatMulNBits' default, and the export's)
# MatMulNBits' accuracy levels it computes -> the bits of its quantized activations: 4 (int8, as
# llama.cpp's q8 activations) and 1 (float32, which two int8 passes stand in for)
ACTIVATION_BITS = {4: 8, 1: 16}
MIN_ORT = (1, 17)  # KernelContext_ParallelFor: the kernel runs on the session's own threads
# The instruction sets q4_vnni.c is written for, best first: (its name, the CPU flags it needs as
# /proc/cpuinfo spells them, the compiler flags that select its code)
ISAS = {
    "avx512vnni": ("AVX-512 VNNI", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c"),
                   ("-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni")),
    "avx2": ("AVX2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    "neon": ("NEON dot product", ("asimd", "asimddp"), ("-march=armv8.2-a+dotprod",)),
}
MACHINES = {"x86_64": ("avx512vnni", "avx2"), "AMD64": ("avx512vnni", "avx2"), "aarch64": ("neon",),
            "arm64": ("neon",)}  # platform.machine() -> the instruction sets written for it
CFLAGS = ("-O3", "-fPIC", "-shared")
ISA_ENV = "SKIPDECODE_KERNEL_ISA"

_LOCK = threading.Lock()
_BUILT: dict[str, tuple[Path | None, str]] = {}


def cache_dir() -> Path:
    """Where built libraries go: $SKIPDECODE_CACHE, else $XDG_CACHE_HOME or ~/.cache, /skipdecode."""
    root = os.environ.get("SKIPDECODE_CACHE")
    if root:
        return Path(root) / "kernels"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "skipdecode" / "kernels"


def _cpu_flags() -> list[str] | str:
    """The CPU's flags (x86's "flags", ARM's "Features"), or why they cannot be read."""
    try:
        return next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith(("flags", "Features"))), [])
    except OSError as exc:
        return f"/proc/cpuinfo unreadable ({exc})"


def isa() -> tuple[str | None, str]:
    """(the instruction set to build the kernel for, "") or (None, why none): the best one the CPU
    has, or the one $SKIPDECODE_KERNEL_ISA names."""
    written = MACHINES.get(platform.machine(), ())
    if platform.system() != "Linux" or not written:
        return None, f"it is written for x86-64 and ARM64 Linux, not {platform.system()} {platform.machine()}"
    flags = _cpu_flags()
    if isinstance(flags, str):
        return None, flags
    asked = os.environ.get(ISA_ENV)
    if asked and asked not in written:
        return None, f"{ISA_ENV}={asked} names no instruction set it is written for here ({', '.join(written)})"
    lacking = {name: [f for f in ISAS[name][1] if f not in flags] for name in written if not asked or name == asked}
    found = next((name for name, missing in lacking.items() if not missing), None)
    if found:
        return found, ""
    return None, "this CPU lacks " + "; ".join(f"{', '.join(missing)} ({ISAS[name][0]})"
                                               for name, missing in lacking.items())


def label() -> str:
    """The kernel as a user reads it: "the AVX2 kernel" (the instruction set it runs here)."""
    found, _ = isa()
    return f"the {ISAS[found][0]} kernel" if found else "this project's kernel"


def why_not() -> str | None:
    """Why this machine cannot run the kernel (None: it can, once built)."""
    return _why_not(*isa())


def _why_not(found: str | None, reason: str) -> str | None:
    """why_not, given isa()'s answer."""
    if found is None:
        return reason
    import onnxruntime

    version = tuple(int(p) for p in onnxruntime.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_ORT:
        return f"ONNX Runtime {onnxruntime.__version__} predates {'.'.join(map(str, MIN_ORT))}"
    if not _compiler():
        return "no C compiler (cc, gcc or $CC) to build it with"
    return None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library() -> tuple[Path | None, str]:
    """(the built library, "") or (None, why not). Built once per source and compiler flags into
    cache_dir(); a build writes to a temporary name and renames, so concurrent processes never
    load half a file."""
    source = SOURCE.read_bytes()
    found, unsupported = isa()  # (/proc/cpuinfo read once a call)
    flags = (*CFLAGS, *(ISAS[found][2] if found else ()))
    key = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    with _LOCK:
        if key in _BUILT:
            return _BUILT[key]
        reason = _why_not(found, unsupported)
        if reason:
            _BUILT[key] = (None, reason)
            return _BUILT[key]
        target = cache_dir() / f"q4_vnni-{found}-{key}.so"
        if not target.is_file():
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            except OSError as exc:
                _BUILT[key] = (None, f"cannot write its build to {target.parent} ({exc.strerror or exc}); "
                                     f"set SKIPDECODE_CACHE to a writable folder")
                return _BUILT[key]
            os.close(fd)
            cc = _compiler()
            done = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True)
            if done.returncode != 0:
                os.unlink(tmp)
                _BUILT[key] = (None, f"{cc} failed to build {SOURCE.name}: {done.stderr.strip()[-500:]}")
                return _BUILT[key]
            os.replace(tmp, target)
        _BUILT[key] = (target, "")
        return _BUILT[key]


class Kernel:
    """The built library, loaded: packs weights into its table and multiplies by them."""

    def __init__(self, path: Path):
        self.path = path
        self._lib = ctypes.CDLL(str(path))  # the same handle ONNX Runtime's dlopen of the path gets
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        for pack in (self._lib.q4_pack, self._lib.q8_pack):
            pack.argtypes = [ptr, ptr, ptr, ptr, i64, i64]
            pack.restype = i64
        self._lib.q4_matmul.argtypes = [i64, ptr, i64, ptr, i64]
        self._lib.q4_matmul.restype = ctypes.c_int
        self._lib.q4_free.argtypes = [i64]
        self._cols: dict[int, int] = {}  # handle -> N

    def pack(self, b, scales, zero_points, k: int, n: int, mins=None, bits: int = 4) -> int:
        """A MatMulNBits weight of ``bits`` 4 or 8 (B (n, k/32, 16 or 32) uint8, scales (n * k/32)
        float32, zero points (n * ceil(k/64) or n * k/32) uint8 or None) into the table, with a GGUF
        Q4_1 product's minimums (n, k/32) float32 (its term: minimum times the block's sum of the
        activations) or None; returns its handle."""
        import numpy as np

        b, scales = np.ascontiguousarray(b, np.uint8), np.ascontiguousarray(scales, np.float32)
        zp = None if zero_points is None else np.ascontiguousarray(zero_points, np.uint8)
        mn = None if mins is None else np.ascontiguousarray(mins, np.float32)
        blocks = k // BLOCK
        zp_size = n * ((blocks + 1) // 2) if bits == 4 else n * blocks
        if bits not in (4, 8) or b.size != n * k * bits // 8 or scales.size != n * blocks or (
                zp is not None and zp.size != zp_size) or (mn is not None and mn.size != scales.size):
            raise ValueError(f"MatMulNBits weight of {bits} bits, K={k}, N={n} has B {b.size} bytes, scales {scales.size}, "
                             f"zero points {zp.size if zp is not None else 0}, minimums {mn.size if mn is not None else 0}")
        address = lambda a: None if a is None else a.ctypes.data  # noqa: E731
        packer = self._lib.q4_pack if bits == 4 else self._lib.q8_pack
        handle = packer(b.ctypes.data, scales.ctypes.data, address(zp), address(mn), k, n)
        if handle < 0:
            raise MemoryError(f"packing a {bits}-bit weight of {k} x {n} for {SOURCE.name}: out of memory")
        self._cols[int(handle)] = n
        return int(handle)

    def matmul(self, handle: int, a, activations: int = 8):
        """a (m, k) float32, quantized to ``activations`` bits (8 or 16) per block, times the packed
        weight's transpose, on this thread: (m, n)."""
        import numpy as np

        if handle not in self._cols:
            raise ValueError(f"no packed weight {handle}")
        if activations not in ACTIVATION_BITS.values():
            raise ValueError(f"activations must be 8 or 16 bits, got {activations!r}")
        a = np.ascontiguousarray(a, np.float32)
        y = np.empty((a.shape[0], self._cols[handle]), np.float32)
        if self._lib.q4_matmul(handle, a.ctypes.data, a.shape[0], y.ctypes.data, activations) != 0:
            raise ValueError(f"q4_matmul failed on weight {handle}")
        return y

    def free(self, handle: int) -> None:
        self._cols.pop(handle, None)
        self._lib.q4_free(handle)


def eligible(node, inits: dict) -> bool:
    """Whether a MatMulNBits node computes what Q4MatMul does: 4 or 8 bits, blocks of 32, int8 or
    float activations (accuracy level 4 or 1: ``ACTIVATION_BITS``), constant weights and uint8 zero
    points (or none), no g_idx or bias."""
    import onnx

    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
        return False
    attrs = {a.name: a.i for a in node.attribute}
    inputs = list(node.input) + [""] * (6 - len(node.input))
    if attrs.get("bits", 4) not in (4, 8) or attrs.get("block_size") != BLOCK or attrs.get("accuracy_level", 0) not in ACTIVATION_BITS:
        return False
    if any(inputs[4:6]) or inputs[1] not in inits or inputs[2] not in inits:
        return False
    if inputs[3] and (inputs[3] not in inits or inits[inputs[3]].data_type != onnx.TensorProto.UINT8):
        return False
    return inits[inputs[2]].data_type == onnx.TensorProto.FLOAT and attrs.get("K", 0) % BLOCK == 0


def set_accuracy_level(model, level: int) -> int:
    """Sets ``model``'s MatMulNBits products at accuracy level 1 or 4 (float or int8 activations) to
    ``level``, for where only MatMulNBits runs them: 4 for speed (its float path is 1.2x-9x slower at 4
    bits, 20x-40x at 8), 1 for batch-invariant output (deterministic=True). Returns how many changed."""
    changed = 0
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
            for a in node.attribute:
                if a.name == "accuracy_level" and a.i in ACTIVATION_BITS and a.i != level:
                    a.i, changed = level, changed + 1
    return changed


def _minimums_term(graph, node, inits) -> list | None:
    """The nodes of ``node``'s minimums' term (a GGUF Q4_1 product: runtime.artifact.manifest.MINS), in
    order, when they read ``node``'s input and output as export writes them; else None. The
    minimums are the term's MatMul's initializer (a fused layer graph renames the nodes, not it)."""
    p = f"{node.name}{MINS}"
    found = {n.name: n for n in minimums_term(graph.node, node.name)}
    term = [found.get(f"{p}/{part}") for part in ("reshape", "sum", "term", "add")]
    if any(t is None for t in term) or len(found) != 4:
        return None
    reshape, _, matmul, add = term
    if reshape.input[0] != node.input[0] or matmul.input[1] not in inits or node.output[0] not in add.input:
        return None
    return term


def rewrite(model, kernel: Kernel, base_dir: str = "", activations: int | None = None) -> list[int]:
    """Swaps ``model``'s eligible MatMulNBits nodes for ``skipdecode.Q4MatMul`` nodes over weights
    packed into ``kernel`` (external data read from ``base_dir``); the weights' initializers leave
    the graph where nothing else reads them, the others stay as they are (external ones too: the
    RoPE tables every layer shares stay one mapping of weights.bin). ``activations``: their bits (8
    or 16) whatever the nodes' accuracy levels say (None: as they say, ``ACTIVATION_BITS``). Returns
    the packed handles (none: the model is unchanged)."""
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    handles, nodes, folded = [], [], set()
    for node in graph.node:
        if node.name in folded:
            continue
        if not eligible(node, inits):
            nodes.append(node)
            continue
        attrs = {a.name: a.i for a in node.attribute}
        k, n = attrs["K"], attrs["N"]
        read = lambda name: numpy_helper.to_array(inits[name], base_dir)  # noqa: E731
        zp = read(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        term = _minimums_term(graph, node, inits)
        mins = None if term is None else read(term[2].input[1]).T  # (n, k/32)
        handle = kernel.pack(read(node.input[1]), read(node.input[2]), zp, k, n, mins, attrs.get("bits", 4))
        handles.append(handle)
        outputs = list(node.output) if term is None else list(term[-1].output)
        folded.update(t.name for t in term or [])
        nodes.append(helper.make_node(OP, [node.input[0]], outputs, name=node.name, domain=DOMAIN,
                                      K=k, N=n, handle=handle,
                                      activations=activations or ACTIVATION_BITS[attrs["accuracy_level"]]))
    if not handles:
        return []
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for node in graph.node for i in node.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return handles
