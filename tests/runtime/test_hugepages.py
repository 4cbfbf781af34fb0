"""runtime.platform.hugepages: the packed weights onto 2 MiB pages, nothing else touched."""

import platform

import numpy as np
import pytest

from runtime.platform import hugepages


def _kernel() -> tuple[int, int]:
    major, minor = platform.release().split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


needs_collapse = pytest.mark.skipif(
    not hugepages.available() or _kernel() < (6, 1),
    reason="needs Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages not 'never'")


def _huge_bytes(array: np.ndarray) -> int:
    """AnonHugePages of the mappings that hold ``array`` (a collapse may split its mapping)."""
    first, last = array.ctypes.data, array.ctypes.data + array.nbytes
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < last and first < end
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


@needs_collapse
def test_new_resident_memory_is_collapsed_and_lazy_memory_left_alone():
    before = hugepages.snapshot()
    weights = np.ones(16 << 20, np.uint8)  # written: resident, as packed weights are
    lazy = np.zeros(64 << 20, np.uint8)  # mapped, never written: as the KV cache's buffers
    done = hugepages.collapse_new(before)
    assert done >= 8 << 20
    assert _huge_bytes(weights) >= 8 << 20
    assert _huge_bytes(lazy) == 0
    assert hugepages.anonymous_regions()[_region(lazy)][1] < 1 << 20  # still not resident
    assert weights.sum() == 16 << 20  # the values are the same


def _region(array: np.ndarray) -> int:
    address = array.ctypes.data + array.nbytes // 2
    return next(s for s, (e, _) in hugepages.anonymous_regions().items() if s <= address < e)


def test_nothing_happens_where_huge_pages_are_unavailable(monkeypatch):
    monkeypatch.setattr(hugepages, "available", lambda: False)
    assert hugepages.snapshot() is None
    assert hugepages.collapse_new(None) == 0


@needs_collapse
def test_regions_that_existed_before_are_left_as_they_were(monkeypatch):
    # what collapse_new asks the kernel to collapse, not the region's AnonHugePages afterwards: the
    # kernel's own khugepaged may collapse it meanwhile (numpy advises MADV_HUGEPAGE on large arrays)
    asked: list[tuple[int, int]] = []
    resident_runs = hugepages._resident_runs

    def recorded(*args):
        runs = resident_runs(*args)
        asked.extend(runs)
        return runs

    monkeypatch.setattr(hugepages, "_resident_runs", recorded)
    old = np.ones(16 << 20, np.uint8)
    before = hugepages.snapshot()
    new = np.ones(16 << 20, np.uint8)
    hugepages.collapse_new(before)
    first, last = old.ctypes.data, old.ctypes.data + old.nbytes
    assert asked and not [(lo, hi) for lo, hi in asked if lo < last and first < hi]
    assert any(lo < new.ctypes.data + new.nbytes and new.ctypes.data < hi for lo, hi in asked)


def _grow_heap(at_least: int) -> tuple[int, list[bytearray]]:
    """Blocks under malloc's mmap threshold until the heap grew by ``at_least`` (a long-lived
    process's heap first hands out the space earlier tests freed): the heap's start, the blocks."""
    before = hugepages.snapshot()
    blocks: list[bytearray] = []
    while len(blocks) < 4000:
        blocks += [bytearray(bytes([7]) * 100_000) for _ in range(100)]  # 10 MB
        regions = hugepages.anonymous_regions()
        heap = next(s for s, (e, _) in regions.items() if s <= _address(blocks[-1]) < e)
        if heap in before and regions[heap][0] - before[heap] >= at_least:
            return heap, blocks
    pytest.skip("the blocks did not grow one region (a malloc that mmaps them?)")


def _collapsed_or_skip(before) -> int:
    """``collapse_new(before)``; a skip where the kernel cannot collapse even a fresh, touched mapping
    at this moment (no free 2 MiB page: memory fragmented by what ran before), which is not this
    module's fault. Where it can, a 0 stays a failure."""
    import ctypes
    import mmap
    import os

    collapsed = hugepages.collapse_new(before)
    if collapsed:
        return collapsed
    probe = mmap.mmap(-1, 2 * hugepages.HUGE_PAGE)  # holds one aligned 2 MiB range
    probe.write(b"\x01" * len(probe))
    view = (ctypes.c_char * len(probe)).from_buffer(probe)
    aligned = -(-ctypes.addressof(view) // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    failed = libc.madvise(aligned, hugepages.HUGE_PAGE, hugepages.MADV_COLLAPSE) != 0
    why = os.strerror(ctypes.get_errno())
    del view
    probe.close()
    if failed:
        pytest.skip(f"MADV_COLLAPSE collapses not even a fresh mapping on this machine right now ({why})")
    return collapsed


@needs_collapse
def test_the_part_the_heap_grew_by_is_collapsed():
    """glibc serves ONNX Runtime's packed weights from the heap, which exists before a load and
    grows during it: what it grew by is collapsed, with the values as they were."""
    before = hugepages.snapshot()
    heap, blocks = _grow_heap(24 << 20)
    huge_before = _region_huge(heap)
    assert _collapsed_or_skip(before) >= 16 << 20
    assert _region_huge(heap) >= huge_before + (16 << 20)
    assert all(b.count(7) == 100_000 for b in blocks)


@needs_collapse
def test_a_heap_with_memory_given_back_still_has_its_growth_collapsed():
    """A heap with holes malloc gave back to the kernel (a long-lived process's, a server's that
    loaded before) still has what it grew by collapsed, and the holes stay unpopulated."""
    import ctypes

    junk = [bytearray(bytes([1]) * 60_000) for _ in range(500)]
    keep = bytearray(100_000)  # noqa: F841 (holds the heap's top above the holes)
    del junk[::2]  # holes too small for the 100 kB blocks that grow the heap
    ctypes.CDLL(None).malloc_trim(0)  # 15 MB of them given back: no longer resident
    before = hugepages.snapshot()
    heap, blocks = _grow_heap(24 << 20)
    huge_before, resident_before = _region_huge(heap), hugepages.anonymous_regions()[heap][1]
    assert _collapsed_or_skip(before) >= 16 << 20
    assert _region_huge(heap) >= huge_before + (16 << 20)
    assert hugepages.anonymous_regions()[heap][1] <= resident_before + (1 << 20)  # the holes stay out
    assert all(b.count(7) == 100_000 for b in blocks)


def _address(block: bytearray) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(block))


def _region_huge(start: int) -> int:
    """AnonHugePages of the mapping that starts at ``start``."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            inside = int(head.split("-")[0], 16) == start
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0
