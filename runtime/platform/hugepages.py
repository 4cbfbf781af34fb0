"""Transparent huge pages under the weights a backend has just packed: best effort, Linux only.

Why: ONNX Runtime pre-packs every MatMul/Gemm weight into anonymous memory of its own, and a
decode step at batch 1 streams all of it. Where transparent huge pages are "madvise" (many
distributions' default) those buffers sit on 4 KiB pages, and streaming them misses the TLB: on
the 2-core EPYC an OPT-125m head read at ~26 GB/s, at ~31 GB/s on 2 MiB pages, and a step ran 8-9%
faster (docs/benchmarks.md, "Huge pages"). ``MADV_COLLAPSE`` (Linux 6.1+) moves a populated range
onto huge pages synchronously, so the process does not wait for khugepaged's slow scan; it copies
them, ~2 ms per MiB at load (0.6 s for OPT-125m's 336 MiB), which is why the library's
``huge_pages`` is off by default. A process started with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
(glibc 2.35+) gets huge pages for every large allocation as it is made, at no load cost.

Only what appeared while the backend loaded (``snapshot`` before, ``collapse_new`` after) and is
resident is collapsed: new regions, and the part a region grew by, since glibc serves most packed
weights from the heap, which exists before the load (new regions alone were 110 of Qwen3-0.6B
int4's 468 MB, and gained nothing; with the heap's growth 416 MB, and a decode step is 6-11%
faster). The KV cache, mapped lazily and allocated later, is never touched, and collapsing a
populated range adds no memory.
``python -m runtime serve`` turns it on by default (a server's load is paid once), ``python -m
runtime`` with ``--huge-pages``. Any failure (another OS, an older kernel,
THP "never", no free huge page) leaves the pages as they were.
"""

from __future__ import annotations

import ctypes
import mmap
import re
import sys
from pathlib import Path

MADV_COLLAPSE = 25  # linux/mman.h, Linux 6.1+
HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
_PAGE = mmap.PAGESIZE  # mincore's unit
_SMAPS = Path("/proc/self/smaps")
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")


def available() -> bool:
    """Linux with transparent huge pages not turned off."""
    try:
        return sys.platform.startswith("linux") and "[never]" not in _THP.read_text()
    except OSError:
        return False


def anonymous_regions() -> dict[int, tuple[int, int]]:
    """Private writable anonymous mappings of this process: start -> (end, resident bytes)."""
    regions: dict[int, tuple[int, int]] = {}
    start = end = None
    for line in _SMAPS.read_text().splitlines():
        header = _HEADER.match(line)
        if header:
            perms, path = header[3], header[4].strip()
            anonymous = perms.startswith("rw") and perms.endswith("p") and path in ("", "[heap]")
            start, end = (int(header[1], 16), int(header[2], 16)) if anonymous else (None, None)
        elif start is not None and line.startswith("Rss:"):
            regions[start] = (end, int(line.split()[1]) * 1024)
    return regions


def snapshot() -> dict[int, int] | None:
    """The anonymous regions now (start -> end), to tell later what appeared or grew; None where
    huge pages are unavailable."""
    if not available():
        return None
    try:
        return {start: end for start, (end, _) in anonymous_regions().items()}
    except OSError:
        return None


def collapse_new(before: dict[int, int] | None) -> int:
    """Collapse what appeared since ``before`` onto huge pages: in new anonymous regions and in the
    part a region grew by (the heap: glibc serves ONNX Runtime's packed weights from it, 356 of
    468 MB at Qwen3-0.6B int4), every aligned 2 MiB range whose pages are all resident. Ranges with
    a page not resident (a lazily mapped KV buffer, memory malloc gave back) are left alone, so
    collapsing adds no memory. The bytes now on huge pages (0 where nothing could be)."""
    if before is None:
        return 0
    try:
        regions = anonymous_regions()
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    done = 0
    for start, (end, _) in regions.items():
        start = before.get(start, start)  # a region that existed: only the part it grew by
        for first, last in _resident_runs(libc, start, end):
            if libc.madvise(first, last - first, MADV_COLLAPSE) == 0:
                done += last - first
    return done


def _resident_runs(libc: ctypes.CDLL, start: int, end: int) -> list[tuple[int, int]]:
    """Runs of aligned 2 MiB ranges inside [start, end) whose base pages are all resident."""
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE  # aligned inside
    if last <= first:
        return []
    vector = (ctypes.c_ubyte * ((last - first) // _PAGE))()  # one byte per base page, bit 0: resident
    if libc.mincore(first, last - first, vector) != 0:
        return []
    per_huge = HUGE_PAGE // _PAGE
    runs: list[tuple[int, int]] = []
    for i in range(0, len(vector), per_huge):
        if all(b & 1 for b in vector[i:i + per_huge]):
            lo = first + i * _PAGE
            if runs and runs[-1][1] == lo:
                runs[-1] = (runs[-1][0], lo + HUGE_PAGE)
            else:
                runs.append((lo, lo + HUGE_PAGE))
    return runs
