"""runtime.platform.kernels on ARM (NEON dot products: Jetson Orin's Cortex-A78AE, Raspberry Pi 5's
A76), where no CI machine runs: q4_vnni.c's NEON path cross-compiled with zig's clang for the
Cortex-A78AE and run under emulation (unicorn, QEMU's ARMv8 'max' CPU) over weights the x86 kernel
packed; its products must be the x86 kernel's to the bit, at 4 and 8 bits, 8- and 16-bit
activations, with and without zero points and a GGUF's minimums."""

import ctypes
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.platform import kernels
from tests.runtime.test_kernels import HERE_ISAS, built, random_weight, random_weight8

unicorn = pytest.importorskip("unicorn", reason="the ARM emulation needs unicorn (pip install -e '.[dev]')")
pytest.importorskip("ziglang", reason="the ARM cross-compile needs ziglang (pip install -e '.[dev]')")
from unicorn import arm64_const as arm  # noqa: E402

HARNESS = Path(__file__).with_name("neon_harness.c")


@pytest.fixture(scope="module")
def neon_elf(tmp_path_factory):
    """harness() and q4_vnni.c for the Cortex-A78AE, a static ELF with no C library."""
    out = tmp_path_factory.mktemp("neon")
    zig = [sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-musl"]
    obj, elf = out / "harness.o", out / "harness.elf"
    for cmd in ([*zig, "-O3", "-mcpu=cortex_a78ae", "-fno-builtin", "-fno-pic", "-I", str(kernels.SOURCE.parent),
                 "-c", str(HARNESS), "-o", str(obj)],
                [*zig, "-nostdlib", "-static", "-Wl,-e,harness", str(obj), "-o", str(elf)]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    return elf.read_bytes()


def _segments(elf: bytes):
    """(address, bytes, size in memory) of an ELF64's loadable segments, and its entry."""
    entry, phoff = struct.unpack_from("<QQ", elf, 24)
    phentsize, phnum = struct.unpack_from("<HH", elf, 54)
    segs = []
    for i in range(phnum):
        kind, _, offset, vaddr, _, filesz, memsz, _ = struct.unpack_from("<IIQQQQQQ", elf, phoff + i * phentsize)
        if kind == 1:  # PT_LOAD
            segs.append((vaddr, elf[offset:offset + filesz], memsz))
    return segs, entry


def emulate(elf: bytes, data, mins, a, n: int, bits: int, wide: bool) -> np.ndarray:
    uc = unicorn.Uc(unicorn.UC_ARCH_ARM64, unicorn.UC_MODE_ARM)
    uc.ctl_set_cpu_model(arm.UC_CPU_ARM64_MAX)  # ARMv8.x with dot products and float16
    page = 0x1000
    segs, entry = _segments(elf)
    for vaddr, body, memsz in segs:
        start, end = vaddr // page * page, (vaddr + memsz + page - 1) // page * page
        uc.mem_map(start, end - start)
        uc.mem_write(vaddr, body)
    heap = 0x40000000
    uc.mem_map(heap, 64 << 20)
    cursor = [heap]

    def put(array) -> int:
        raw = np.ascontiguousarray(array).tobytes()
        address = cursor[0]
        uc.mem_write(address, raw)
        cursor[0] += (len(raw) + 127) // 64 * 64
        return address

    m, k = a.shape
    args = [put(data), put(mins) if mins is not None else 0, k, n, bits, put(a), m, int(wide)]
    y, act = put(np.zeros((m, n), np.float32)), put(np.zeros(m * (k // 32) * 128, np.uint8))
    stack = 0x70000000
    uc.mem_map(stack - (1 << 20), 1 << 20)
    uc.reg_write(arm.UC_ARM64_REG_SP, stack - 64)
    uc.mem_write(stack - 64, struct.pack("<QQ", y, act))  # the 9th and 10th arguments
    uc.reg_write(arm.UC_ARM64_REG_CPACR_EL1, 0x300000)  # FP/SIMD on
    for i, value in enumerate(args):
        uc.reg_write(getattr(arm, f"UC_ARM64_REG_X{i}"), value)
    stopped = []
    uc.hook_add(unicorn.UC_HOOK_INTR, lambda uc, intno, user: (stopped.append(intno), uc.emu_stop()))
    uc.emu_start(entry, 1 << 47)
    assert stopped, "the harness did not reach its brk"
    return np.frombuffer(bytes(uc.mem_read(y, m * n * 4)), np.float32).reshape(m, n)


def packed(kernel, handle: int, n: int, k: int):
    """The table entry's bytes and minimums, as q4_pack laid them out."""
    lib = kernel._lib
    lib.q4_packed.restype = ctypes.c_void_p
    lib.q4_packed.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_void_p)]
    size, mins = ctypes.c_int64(), ctypes.c_void_p()
    data = np.frombuffer(ctypes.string_at(lib.q4_packed(handle, ctypes.byref(size), ctypes.byref(mins)), size.value),
                         np.uint8)
    count = (n + 15) // 16 * (k // 32) * 16
    return data, (np.frombuffer(ctypes.string_at(mins.value, count * 2), np.uint16) if mins.value else None)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n,m,zero_points,minimums", [(960, 100, 1, True, False), (2560, 33, 3, True, True),
                                                        (64, 8, 5, False, True), (96, 7, 9, False, False)])
def test_the_neon_path_computes_the_x86_products_to_the_bit(neon_elf, bits, k, n, m, zero_points, minimums):
    x86 = kernels.Kernel(built(HERE_ISAS[0] if HERE_ISAS else "none"))  # the best this machine runs
    rng = np.random.default_rng(k + n + m + bits)
    b, scales, zp = (random_weight if bits == 4 else random_weight8)(rng, k, n, zero_points)
    mins = rng.standard_normal(scales.size).astype(np.float32) * 0.01 if minimums else None
    a = rng.standard_normal((m, k)).astype(np.float32)
    handle = x86.pack(b, scales, zp, k, n, mins, bits)
    data, packed_mins = packed(x86, handle, n, k)
    for wide in (False, True):
        theirs = x86.matmul(handle, a, 16 if wide else 8)
        ours = emulate(neon_elf, data, packed_mins, a, n, bits, wide)
        assert np.array_equal(ours, theirs), (wide, np.abs(ours - theirs).max())
    x86.free(handle)
