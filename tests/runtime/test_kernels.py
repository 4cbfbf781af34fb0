"""runtime.platform.kernels: this project's int4 kernel computes what ONNX Runtime's MatMulNBits computes
(bits 4, blocks of 32, int8 activations), alone, inside a session in place of MatMulNBits, and
under the ONNX Runtime backend, where the tokens stay those of MatMulNBits; machines that cannot
build or run it fall back to MatMulNBits with the reason, and a request for it there is refused."""

import platform

import numpy as np
import pytest

import runtime
from tests.conftest import first_logits as first_logits_of
from runtime.errors import InvalidArgumentError
from runtime.platform import kernels

HERE_WHY_NOT = kernels.why_not()
HERE_ISAS = kernels.MACHINES.get(platform.machine(), ())  # the instruction sets written for this machine
needs_kernel = pytest.mark.skipif(HERE_WHY_NOT is not None, reason=f"runtime.platform.kernels cannot run here: {HERE_WHY_NOT}")


def random_weight(rng, k, n, zero_points=True):
    """MatMulNBits' B (n, k/32, 16), scales (n * k/32) and zero points (n * ceil(k/64)) or None."""
    blocks = k // 32
    b = rng.integers(0, 256, (n, blocks, 16), dtype=np.uint8)
    scales = (rng.random(n * blocks, dtype=np.float32) * 0.02 + 0.001)
    zp = rng.integers(0, 256, n * ((blocks + 1) // 2), dtype=np.uint8) if zero_points else None
    return b, scales, zp


def dequantized(b, scales, zp, k):
    """The (n, k) float weight MatMulNBits' inputs stand for."""
    n, blocks, _ = b.shape
    q = np.empty((n, blocks, 32), np.float32)
    q[..., 0::2], q[..., 1::2] = b & 15, b >> 4  # input 2j in byte j's low nibble
    if zp is None:
        z = np.full((n, blocks), 8, np.float32)
    else:
        z = np.empty((n, (blocks + 1) // 2 * 2), np.float32)
        z[:, 0::2], z[:, 1::2] = zp.reshape(n, -1) & 15, zp.reshape(n, -1) >> 4
        z = z[:, :blocks]
    return ((q - z[..., None]) * scales.reshape(n, blocks)[..., None]).reshape(n, k)


def matmulnbits_model(k, n, b, scales, zp, accuracy_level=4, block_size=32, rank=2):
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "scales")]
    inputs = ["A", "B", "scales"]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "zero_points"))
        inputs.append("zero_points")
    node = helper.make_node("MatMulNBits", inputs, ["Y"], name="proj", domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block_size, accuracy_level=accuracy_level)
    lead = ["batch", "sequence"][:rank - 1]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [*lead, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [*lead, n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def session(model, threads=2, library=None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    if library is not None:
        opts.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def built(isa: str):
    """The library built for instruction set ``isa`` (skips where this CPU lacks it)."""
    if HERE_WHY_NOT is not None:
        pytest.skip(f"runtime.platform.kernels cannot run here: {HERE_WHY_NOT}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kernels.ISA_ENV, isa)
        found, reason = kernels.isa()
        if found is None:
            pytest.skip(f"runtime.platform.kernels cannot run here for {isa}: {reason}")
        path, reason = kernels.library()
    assert path is not None and path.name.startswith(f"q4_vnni-{isa}-"), reason
    return path


@pytest.fixture(scope="module", params=list(HERE_ISAS) or ["none"])
def kernel(request):
    """The kernel built for each instruction set this CPU has: every product test runs on each."""
    return kernels.Kernel(built(request.param))


# (k, n, m, zero points): n not a multiple of 16 (a padded group), k not a multiple of 128, batches
# that are not a multiple of the kernel's 4-row tile
SHAPES = [(960, 1600, 1, True), (2560, 96, 3, True), (64, 8, 2, False), (96, 7, 5, True), (32, 33, 9, False)]


@pytest.mark.parametrize("k,n,m,zp", SHAPES)
def test_products_match_matmulnbits(kernel, k, n, m, zp):
    rng = np.random.default_rng(k + n + m)
    b, scales, zero_points = random_weight(rng, k, n, zp)
    a = rng.standard_normal((m, k), dtype=np.float32)
    exact = a @ dequantized(b, scales, zero_points, k).T
    theirs = session(matmulnbits_model(k, n, b, scales, zero_points)).run(None, {"A": a})[0]
    ours = kernel.matmul(kernel.pack(b, scales, zero_points, k, n), a)
    scale = np.abs(exact).max()
    # both quantize the activations to int8 per block of 32: each is within ~1% of the float
    # product, and they agree with each other as closely
    assert np.abs(ours - exact).max() / scale < 0.02
    assert np.abs(theirs - exact).max() / scale < 0.02
    assert np.abs(ours - theirs).max() / scale < 0.02


def random_weight8(rng, k, n, zero_points=True):
    """An 8-bit MatMulNBits weight: B (n, k/32, 32), scales (n * k/32), zero points (n * k/32) or None."""
    blocks = k // 32
    b = rng.integers(0, 256, (n, blocks, 32), dtype=np.uint8)
    scales = rng.random(n * blocks, dtype=np.float32) * 0.002 + 0.0001
    zp = rng.integers(0, 256, n * blocks, dtype=np.uint8) if zero_points else None
    return b, scales, zp


def matmulnbits8_model(k, n, b, scales, zp):
    model = matmulnbits_model(k, n, b, scales, zp)
    for a in model.graph.node[0].attribute:
        if a.name == "bits":
            a.i = 8
    return model


@pytest.mark.parametrize("k,n,m,zp", SHAPES)
def test_8_bit_products_match_matmulnbits(kernel, k, n, m, zp):
    """The Q8_0 head a GGUF keeps (export.gguf_blocks) and int8 artifacts: the same kernel, a byte
    a weight."""
    rng = np.random.default_rng(k + n + m + 8)
    b, scales, zero_points = random_weight8(rng, k, n, zp)
    a = rng.standard_normal((m, k), dtype=np.float32)
    z = (np.full(n * (k // 32), 128.0, np.float32) if zero_points is None else zero_points.astype(np.float32))
    weight = (b.reshape(n, -1, 32) - z.reshape(n, -1, 1)) * scales.reshape(n, -1, 1)  # (n, blocks, 32)
    exact = a @ weight.reshape(n, k).T
    model = matmulnbits8_model(k, n, b, scales, zero_points)
    theirs = session(model).run(None, {"A": a})[0]
    ours = kernel.matmul(kernel.pack(b, scales, zero_points, k, n, bits=8), a)
    scale = np.abs(exact).max()
    assert np.abs(ours - exact).max() / scale < 0.02
    assert np.abs(theirs - exact).max() / scale < 0.02
    assert np.abs(ours - theirs).max() / scale < 0.02
    assert len(kernels.rewrite(model, kernel)) == 1 and [nd.op_type for nd in model.graph.node] == ["Q4MatMul"]
    np.testing.assert_allclose(session(model, library=kernel.path).run(None, {"A": a})[0], ours, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n,m,zp", SHAPES[:3])
def test_16_bit_activations_make_the_products_exact(kernel, bits, k, n, m, zp):
    """MatMulNBits at accuracy level 1 (float activations: a GGUF's carried blocks) runs on the
    kernel with activations of 16 bits (two int8 passes): within ~2e-5-5e-5 of the float product's
    scale where int8 activations leave ~2e-3-5e-3, as the rewritten graph's session gives it and as close to
    MatMulNBits' own float path. (The scales float16, as a GGUF's are: the kernel keeps them so.)"""
    rng = np.random.default_rng(k + n + m + bits)
    b, scales, zero_points = (random_weight if bits == 4 else random_weight8)(rng, k, n, zp)
    scales = scales.astype(np.float16).astype(np.float32)
    a = rng.standard_normal((m, k), dtype=np.float32)
    model = matmulnbits_model(k, n, b, scales, zero_points, accuracy_level=1) if bits == 4 else \
        matmulnbits8_model(k, n, b, scales, zero_points)
    for attr in model.graph.node[0].attribute:
        if attr.name == "accuracy_level":
            attr.i = 1
    weight = session(model).run(None, {"A": np.eye(k, dtype=np.float32)})[0]  # (k, n): what it multiplies by
    exact = a.astype(np.float64) @ weight.astype(np.float64)
    handle = kernel.pack(b, scales, zero_points, k, n, bits=bits)
    wide, narrow = kernel.matmul(handle, a, activations=16), kernel.matmul(handle, a, activations=8)
    scale = np.abs(exact).max()
    wide_error, narrow_error = np.abs(wide - exact).max() / scale, np.abs(narrow - exact).max() / scale
    assert wide_error < 1e-4 and narrow_error > 20 * wide_error, (wide_error, narrow_error)
    assert kernels.rewrite(model, kernel) and [nd.op_type for nd in model.graph.node] == ["Q4MatMul"]
    np.testing.assert_array_equal(session(model, library=kernel.path).run(None, {"A": a})[0], wide)
    with pytest.raises(ValueError, match="activations must be 8 or 16 bits, got 12"):
        kernel.matmul(handle, a, activations=12)


def test_weights_packed_from_many_threads_at_once_each_keep_their_own_entry(kernel):
    """ctypes lets go of the GIL: packs from several threads (two models loading at once) race for
    the table, and a session may read it meanwhile; every handle must stay its own weight's."""
    from concurrent.futures import ThreadPoolExecutor

    k, n = 64, 40
    rng = np.random.default_rng(3)
    weights = [random_weight(rng, k, n) for _ in range(64)]
    with ThreadPoolExecutor(8) as pool:
        handles = list(pool.map(lambda w: kernel.pack(*w, k, n), weights))
    assert len(set(handles)) == len(handles)
    a = rng.standard_normal((2, k), dtype=np.float32)
    for handle, (b, scales, zp) in zip(handles, weights):
        exact = a @ dequantized(b, scales, zp, k).T
        assert np.abs(kernel.matmul(handle, a) - exact).max() < 0.02 * np.abs(exact).max()
        kernel.free(handle)
    with pytest.raises(ValueError, match="no packed weight"):
        kernel.matmul(handles[0], a)


def _anonymous_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 1024


def test_small_weights_share_huge_pages_and_a_large_one_leaves_when_freed(kernel):
    """Packed weights share 2 MiB-page arenas: 64 products of SmolLM2-135M's q/k/v size (0.3 MiB
    each) take ~20 MiB, not a 2 MiB huge page each (128 MiB). A weight over half an arena has one of
    its own, which goes when it is freed (a shared arena goes with its last weight)."""
    rng = np.random.default_rng(3)
    b, scales, zp = random_weight(rng, 576, 960)
    before = _anonymous_mib()
    handles = [kernel.pack(b, scales, zp, 576, 960) for _ in range(64)]
    grown = _anonymous_mib() - before
    for h in handles:
        kernel.free(h)
    assert grown < 48, f"64 weights of 0.3 MiB made {grown:.0f} MiB resident"
    b, scales, zp = random_weight(rng, 8192, 4096)  # 17 MiB packed
    before = _anonymous_mib()
    kernel.free(kernel.pack(b, scales, zp, 8192, 4096))
    assert _anonymous_mib() - before < 4


@pytest.mark.parametrize("rank", [2, 3])
def test_the_rewritten_graph_runs_the_kernel_in_place_of_matmulnbits(kernel, rank):
    k, n = 256, 200
    rng = np.random.default_rng(1)
    b, scales, zp = random_weight(rng, k, n)
    model = matmulnbits_model(k, n, b, scales, zp, rank=rank)
    a = rng.standard_normal((2, 3, k) if rank == 3 else (5, k), dtype=np.float32)
    theirs = session(model).run(None, {"A": a})[0]
    handles = kernels.rewrite(model, kernel)
    assert len(handles) == 1 and [nd.op_type for nd in model.graph.node] == ["Q4MatMul"]
    assert not model.graph.initializer  # the packed copy is the only one
    ours = session(model, threads=2, library=kernel.path).run(None, {"A": a})[0]
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, atol=0.02 * np.abs(theirs).max())
    exact = a @ dequantized(b, scales, zp, k).T
    assert np.abs(ours - exact).max() < 0.02 * np.abs(exact).max()


def q4_1_product(tmp_path, k, n, rank):
    """A MatMul graph whose weight (k, n) is a GGUF's Q4_1 blocks, carried as export writes it
    (MatMulNBits at zero points 0 and the minimums' term), and that weight as floats."""
    import gguf
    from onnx import TensorProto, helper, numpy_helper

    from export.gguf_blocks import BlockIndex, carry

    rng = np.random.default_rng(k + n)
    raw = gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32), gguf.GGMLQuantizationType.Q4_1)
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        write()
    weight = np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).T)  # (k, n)
    lead = ["batch", "sequence"][:rank - 1]
    graph = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"], name="proj")], "g",
                              [helper.make_tensor_value_info("A", TensorProto.FLOAT, [*lead, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [*lead, n])],
                              [numpy_helper.from_array(weight, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    assert carry(model, BlockIndex.from_gguf(tmp_path / "q.gguf"), 4, 4) == ["W"]
    return model, weight


@pytest.mark.parametrize("rank", [2, 3])
def test_a_q4_1_products_minimums_fold_into_the_kernel(kernel, tmp_path, rank):
    k, n = 96, 40
    model, weight = q4_1_product(tmp_path, k, n, rank)
    assert [nd.op_type for nd in model.graph.node] == ["MatMulNBits", "Reshape", "ReduceSum", "MatMul", "Add"]
    a = np.random.default_rng(0).standard_normal((2, 3, k) if rank == 3 else (5, k), dtype=np.float32)
    theirs = session(model).run(None, {"A": a})[0]
    assert len(kernels.rewrite(model, kernel)) == 1
    assert [nd.op_type for nd in model.graph.node] == ["Q4MatMul"] and not model.graph.initializer
    ours = session(model, library=kernel.path).run(None, {"A": a})[0]
    exact = a @ weight
    # the minimums' term is float on both sides; the rest int8 activations, as MatMulNBits
    assert np.abs(ours - exact).max() < 0.02 * np.abs(exact).max()
    np.testing.assert_allclose(ours, theirs, atol=0.02 * np.abs(theirs).max())


def test_a_graph_whose_weights_are_gone_is_refused_with_the_reason(kernel):
    """A rewritten graph names its weights by a handle of this process's table: loaded in another
    process, or after its backend closed, it must fail at load with a message, never read freed
    memory."""
    k, n = 64, 16
    model = matmulnbits_model(k, n, *random_weight(np.random.default_rng(4), k, n))
    (handle,) = kernels.rewrite(model, kernel)
    kernel.free(handle)
    with pytest.raises(Exception, match="Q4MatMul: its handle names no packed weight of this process"):
        session(model, library=kernel.path)


@pytest.mark.parametrize("what", [dict(accuracy_level=2), dict(block_size=64)])
def test_what_the_kernel_does_not_compute_stays_matmulnbits(kernel, what):
    k, n = 128, 16
    b, scales, zp = random_weight(np.random.default_rng(2), k, n)
    if what.get("block_size") == 64:
        b, scales = b.reshape(n, k // 64, 32), scales.reshape(n, -1)[:, ::2].reshape(-1).copy()
        zp = zp.reshape(n, -1)[:, :1].reshape(-1).copy()
    model = matmulnbits_model(k, n, b, scales, zp, **what)
    assert kernels.rewrite(model, kernel) == []
    assert [nd.op_type for nd in model.graph.node] == ["MatMulNBits"] and len(model.graph.initializer) == 3


def fake_cpu(monkeypatch, system, machine, flags):
    real_read = kernels.Path.read_text
    monkeypatch.setattr(kernels.platform, "system", lambda: system)
    monkeypatch.setattr(kernels.platform, "machine", lambda: machine)
    key = "Features" if machine in ("aarch64", "arm64") else "flags"  # as each architecture's /proc/cpuinfo spells it
    monkeypatch.setattr(kernels.Path, "read_text", lambda self, *a, **k: f"processor\t: 0\n{key}\t\t: {flags}\n"
                        if str(self) == "/proc/cpuinfo" else real_read(self, *a, **k))


@pytest.mark.parametrize("system,machine,flags,reason", [
    ("Linux", "riscv64", "rv64imafdc", "it is written for x86-64 and ARM64 Linux, not Linux riscv64"),
    ("Darwin", "arm64", "", "it is written for x86-64 and ARM64 Linux, not Darwin arm64"),
    ("Linux", "aarch64", "fp asimd evtstrm crc32", "this CPU lacks asimddp (NEON dot product)"),  # a Cortex-A72: Pi 4
    ("Linux", "x86_64", "fpu sse avx2 avx512f avx512bw avx512vl avx512dq f16c",
     "this CPU lacks avx512_vnni (AVX-512 VNNI); fma (AVX2)"),
    ("Linux", "x86_64", "fpu avx f16c",
     "this CPU lacks avx512f, avx512bw, avx512vl, avx512dq, avx512_vnni (AVX-512 VNNI); avx2, fma (AVX2)"),
])
def test_a_cpu_the_kernel_is_not_written_for_is_named(monkeypatch, system, machine, flags, reason):
    fake_cpu(monkeypatch, system, machine, flags)
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    assert kernels.why_not() == reason and kernels.isa() == (None, reason)


@pytest.mark.parametrize("flags,isa,label", [
    ("fpu avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni", "avx512vnni", "the AVX-512 VNNI kernel"),
    ("fpu avx2 fma f16c avx512f", "avx2", "the AVX2 kernel"),  # a laptop's CPU, or AVX-512 without VNNI
    ("fp asimd evtstrm fphp asimdhp asimddp", "neon", "the NEON dot product kernel"),  # Jetson Orin, Pi 5
])
def test_the_best_instruction_set_the_cpu_has_is_built(monkeypatch, flags, isa, label):
    fake_cpu(monkeypatch, "Linux", "aarch64" if isa == "neon" else "x86_64", flags)
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    assert kernels.isa() == (isa, "") and kernels.label() == label


def test_the_instruction_set_asked_for_is_checked(monkeypatch):
    fake_cpu(monkeypatch, "Linux", "x86_64", "fpu avx2 fma f16c")
    monkeypatch.setenv(kernels.ISA_ENV, "avx512vnni")
    assert kernels.isa() == (None, "this CPU lacks avx512f, avx512bw, avx512vl, avx512dq, avx512_vnni (AVX-512 VNNI)")
    monkeypatch.setenv(kernels.ISA_ENV, "neon")
    assert kernels.isa() == (None, f"{kernels.ISA_ENV}=neon names no instruction set it is written for here "
                                   f"(avx512vnni, avx2)")
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    assert kernels.isa() == ("avx2", "")


def test_every_instruction_set_computes_the_same_products_to_the_bit():
    """AVX2 computes vpdpbusd's integer sums with maddubs/madd (8-bit weights as signed bytes) and
    every float step in the AVX-512 path's order, so its products are that path's exactly."""
    built_for = {isa: kernels.Kernel(built(isa)) for isa in HERE_ISAS}
    rng = np.random.default_rng(7)
    for bits in (4, 8):
        for k, n, m, zero_points, minimums in [(960, 100, 1, True, False), (2560, 33, 3, True, True),
                                               (64, 8, 5, False, True)]:
            b, scales, zp = (random_weight if bits == 4 else random_weight8)(rng, k, n, zero_points)
            mins = rng.standard_normal(scales.size).astype(np.float32) * 0.01 if minimums else None
            a = rng.standard_normal((m, k)).astype(np.float32)
            for acts in (8, 16):
                ys = [kn.matmul(kn.pack(b, scales, zp, k, n, mins, bits), a, acts) for kn in built_for.values()]
                assert all(np.array_equal(ys[0], y) for y in ys[1:]), (bits, acts, k, n, m)


def test_a_machine_without_a_compiler_falls_back_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(kernels, "_BUILT", {})
    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path))
    reason = kernels.why_not()
    if HERE_WHY_NOT is None:
        assert reason == "no C compiler (cc, gcc or $CC) to build it with"
        assert kernels.library() == (None, reason)


def test_a_failed_build_says_why_and_leaves_no_file(monkeypatch, tmp_path):
    if HERE_WHY_NOT is not None:
        pytest.skip(HERE_WHY_NOT)
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    monkeypatch.setattr(kernels, "_BUILT", {})
    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path))
    path, reason = kernels.library()
    assert path is None and reason.startswith("false failed to build q4_vnni.c")
    assert not any((tmp_path / "kernels").iterdir())  # the temporary file is gone


def test_a_cache_folder_that_cannot_be_written_falls_back_with_the_fix(monkeypatch, tmp_path):
    if HERE_WHY_NOT is not None:
        pytest.skip(HERE_WHY_NOT)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(kernels, "_BUILT", {})
    monkeypatch.setenv("SKIPDECODE_CACHE", str(blocker))
    path, reason = kernels.library()
    assert path is None and reason.startswith(f"cannot write its build to {blocker / 'kernels'} (")
    assert reason.endswith("set SKIPDECODE_CACHE to a writable folder")
    assert blocker.read_text() == "not a folder"


@needs_kernel
def test_the_library_is_built_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "_BUILT", {})
    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path))
    path, _ = kernels.library()
    assert path.parent == tmp_path / "kernels" and path.name.startswith("q4_vnni-")
    stamp = path.stat().st_mtime_ns
    monkeypatch.setattr(kernels, "_BUILT", {})
    assert kernels.library()[0] == path and path.stat().st_mtime_ns == stamp  # reused, not rebuilt


# ---- under the ONNX Runtime backend ----

@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """A tiny Llama (every K a multiple of 32) exported twice: float32 and int4 in blocks of 32."""
    from export.build import BuildOptions, build
    from tests.families import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("q4-ckpt"), "llama3", hidden_size=64,
                                intermediate_size=96, head_dim=16)
    out = {}
    for weights in ("float", "int4"):
        out[weights] = tmp_path_factory.mktemp(f"q4-artifact-{weights}") / "model"
        build(BuildOptions(model=str(ckpt), out=str(out[weights]), progress=False, weights=weights),
              log=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def int4_artifact(artifacts):
    return artifacts["int4"]


PROMPTS = ["hello world", "the quick brown fox jumps", "a", "one two three four five six seven"]


def first_logits(artifact, **options):
    gen = runtime.load(artifact, threads=2, **options)
    try:
        return first_logits_of(gen, PROMPTS)  # (B, V)
    finally:
        gen.close()


@needs_kernel
@pytest.mark.parametrize("fused", [None, False])
def test_the_backend_is_as_close_to_the_float_model_as_matmulnbits(artifacts, fused):
    """Both kernels read the same int4 weights (ours keeps the scales as float16); MatMulNBits
    quantizes the activations to int8 (as the backend runs it), ours to 16 bits. Ours may be no
    further from the float model's logits than MatMulNBits by more than a tenth of what int4 itself
    costs (on this random model ~0.51 of the logits' norm; with the zero points ignored 1.31, the
    nibbles swapped 1.48)."""
    exact = first_logits(artifacts["float"], fused=fused)
    error = {k: np.linalg.norm(first_logits(artifacts["int4"], int4_kernel=k, fused=fused) - exact)
             / np.linalg.norm(exact) for k in ("onnxruntime", "skipdecode")}
    assert error["onnxruntime"] < 0.7 and error["skipdecode"] < 1.1 * error["onnxruntime"], error


@needs_kernel
@pytest.mark.parametrize("fused", [None, False])
def test_the_backend_gives_matmulnbits_tokens_but_for_near_ties(int4_artifact, fused):
    """Greedy tokens are MatMulNBits' (at float activations: deterministic=True) until a step where
    MatMulNBits itself had nearly as good a case for our token: a random model's flat logits, where
    the kernels' small difference decides a near tie; the logits stay within that difference at
    every step before it."""
    steps = {}
    for choice in ("onnxruntime", "skipdecode"):
        # the rows prefilled together: both kernels' steps carry the same rows
        gen = runtime.load(int4_artifact, threads=2, int4_kernel=choice, fused=fused, batch_invariant=False,
                           deterministic=True)
        try:
            assert gen.backend.int4_kernel == choice
            steps[choice] = [(e.token_ids, e.logits) for e in gen.stream(PROMPTS, 16, ignore_eos=True)]
        finally:
            gen.close()
    agreed = 0
    for (theirs, their_logits), (ours, our_logits) in zip(steps["onnxruntime"], steps["skipdecode"]):
        scale = np.abs(their_logits).max()
        assert np.abs(our_logits - their_logits).max() < 0.1 * scale
        if ours != theirs:
            for row, (o, t) in enumerate(zip(ours, theirs)):
                assert their_logits[row, t] - their_logits[row, o] < 0.1 * scale
            break
        agreed += 1
    assert agreed >= 3  # the same model: its first steps agree outright


def test_the_backend_on_each_instruction_set_gives_the_same_logits_to_the_bit(int4_artifact, monkeypatch):
    runs = []
    for isa in HERE_ISAS:
        built(isa)  # (skips where this CPU lacks one)
        monkeypatch.setenv(kernels.ISA_ENV, isa)
        gen = runtime.load(int4_artifact, threads=2, int4_kernel="skipdecode")
        try:
            runs.append([(e.token_ids, e.logits) for e in gen.stream(PROMPTS, 8, ignore_eos=True)])
        finally:
            gen.close()
    for steps in zip(*runs):
        assert all(ids == steps[0][0] and np.array_equal(logits, steps[0][1]) for ids, logits in steps[1:])


@needs_kernel
def test_a_layer_graph_keeps_its_other_weights_in_weights_bin(int4_artifact, kernel):
    """Only the packed weights leave a graph: the rest (the RoPE tables every layer shares, ~21 MB
    a layer on Qwen3-0.6B) stay external, one mapping of weights.bin for all layers, not a copy per
    layer (a copy per layer tripled Qwen3-0.6B's resident memory)."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(int4_artifact / "layer_00.gqa.onnx"), load_external_data=False)
    external = {t.name for t in model.graph.initializer if uses_external_data(t)}
    handles = kernels.rewrite(model, kernel, str(int4_artifact))
    assert len(handles) == 4  # q/k/v, o, gate/up, down
    kept = {t.name: uses_external_data(t) for t in model.graph.initializer}
    assert any(name.startswith("rope.") for name in kept) and all(kept[n] for n in kept if n in external)
    assert not any(name.endswith(("_Q4", "_scales", "_zero_points")) for name in kept)


def test_auto_falls_back_where_the_kernel_cannot_run_and_a_request_for_it_is_refused(int4_artifact, monkeypatch):
    monkeypatch.setattr(kernels, "library", lambda: (None, "this CPU lacks avx512_vnni"))
    gen = runtime.load(int4_artifact, threads=1)
    try:
        assert gen.backend.int4_kernel == "onnxruntime"
        assert gen.backend.int4_kernel_note == (
            "runtime/platform/kernels cannot run here: this CPU lacks avx512_vnni; 21 products exported at float "
            "activations run at int8 ones on MatMulNBits, whose float path is 1.2x-40x slower (deterministic=True "
            "keeps them: greedy text independent of the batch)")
        assert len(gen.generate("hello", 3, ignore_eos=True).token_ids[0]) == 3
    finally:
        gen.close()
    with pytest.raises(InvalidArgumentError, match=r"int4_kernel='skipdecode' cannot run here: this CPU lacks "
                                                   r"avx512_vnni; load with int4_kernel='auto' or 'onnxruntime'"):
        runtime.load(int4_artifact, threads=1, int4_kernel="skipdecode")
    with pytest.raises(InvalidArgumentError, match="int4_kernel must be one of auto, skipdecode, onnxruntime"):
        runtime.load(int4_artifact, threads=1, int4_kernel="mlas")


def test_the_command_line_says_which_kernel_ran_the_int4_products_and_why(int4_artifact, capsys, monkeypatch):
    from runtime.__main__ import main

    argv = [str(int4_artifact), "hello", "--max-new-tokens", "2", "--threads", "1", "--no-check-hashes"]
    assert main([*argv, "--int4-kernel", "onnxruntime"]) == 0
    assert ("int4 products on ONNX Runtime's MatMulNBits (int4_kernel='onnxruntime'; 21 products exported at "
            "float activations run at int8 ones" in capsys.readouterr().err)
    if HERE_WHY_NOT is None:
        assert main(argv) == 0
        err = capsys.readouterr().err
        assert ("int4 products on the AVX-512 VNNI kernel of runtime/platform/kernels (21 of its 21 products at "
                "float activations, computed at 16 bits)\n" in err)
    monkeypatch.setattr(kernels, "library", lambda: (None, "this CPU lacks avx512_vnni"))
    assert main(argv) == 0
    assert ("int4 products on ONNX Runtime's MatMulNBits (runtime/platform/kernels cannot run here: this CPU lacks "
            "avx512_vnni; 21 products" in capsys.readouterr().err)
    assert main([*argv, "--deterministic"]) == 0
    assert ("int4 products on ONNX Runtime's MatMulNBits (runtime/platform/kernels cannot run here: this CPU lacks "
            "avx512_vnni)\n" in capsys.readouterr().err)  # as exported: float activations
    assert main([*argv, "--int4-kernel", "skipdecode"]) == 2
    assert "error: int4_kernel='skipdecode' cannot run here: this CPU lacks avx512_vnni" in capsys.readouterr().err


@needs_kernel
def test_int4_rows_give_what_they_give_alone(artifacts):
    """An int4 artifact runs each prompt's prefill alone by default (batch_invariant): a prompt's
    logits and greedy tokens beside others are its own alone, to the bit (padded beside a longer
    prompt, its activations' int8 rounding moved and, on the real model, half of 8 chat answers
    changed from the first token). A float artifact keeps the padded prefill."""
    gen = runtime.load(artifacts["int4"], threads=2)
    try:
        assert gen.batch_invariant
        together = list(gen.stream(PROMPTS, 12, ignore_eos=True))  # an event per step: rows at it
        for row, prompt in enumerate(PROMPTS):
            alone = list(gen.stream(prompt, 12, ignore_eos=True))
            mine = [e for e in together if e.token_ids[row] is not None]
            assert [e.token_ids[0] for e in alone] == [e.token_ids[row] for e in mine]
            assert np.array_equal(alone[0].logits[0], mine[0].logits[row])
    finally:
        gen.close()
    with runtime.load(artifacts["float"], threads=2) as plain:
        assert not plain.batch_invariant
