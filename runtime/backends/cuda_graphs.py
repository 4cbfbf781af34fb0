"""Captured decode steps for the torch backend: one CUDA graph per (active layers, batch, width).

A decode step at batch 1 launches a few hundred small kernels (embed, ~25 per layer, head); on a
GPU their launch overhead, not the weights' bytes, sets the step time of models up to ~1B. A CUDA
graph records the kernels once and replays them with one launch, but it replays *the same shapes
at the same addresses*. So the step runs on static tensors, and what changes from step to step is
either copied into them or made part of the key:

- **The active-layer set** is part of the key. Under per-row budgets a step runs the union of the
  rows' sets, which is the largest budget's set (the sets are nested), so a policy decaying from
  16 to 8 layers gives 9 sets over a whole generation, whatever the traffic.
- **The rows run** are the first ``batch`` rows of the KV cache, ``batch`` the smallest power of
  two (capped at the cache's rows) that holds the decoding rows, which the cache keeps packed at
  the front: a lone request runs as batch 1 on a cache of 8 rows. The rows between the decoding
  ones and the bucket's end are computed and change nothing (no update, nothing valid).
- **The mask width** (the past positions attention reads) grows by one every step. It is bucketed
  to the next power of two from ``MIN_WIDTH`` up to the capacity: the static mask is 0 between
  the real past and the bucket's end, so attention reads at most twice the live K/V. The other
  choice, every step at the full capacity, reads the whole cache every step: for OPT-1.3B in fp16
  with 2048 positions that is 16 MB per layer per row against 100 MB of weights per layer, +17 %
  at batch 1 and +130 % at batch 8 for a short reply; the buckets cost at most log2(capacity /
  MIN_WIDTH) + 1 graphs (7 for 2048) per set and batch.
- **Ids, mask, positions and the per-layer update masks** are the step's inputs: one int64
  buffer, copied from the host in one transfer per step. New K/V go to each row's position with
  an indexed write of every row, rows not updated writing back what was there (a row-count-free
  form, since ``nonzero`` would synchronise with the host and cannot be captured).

A lossless **verify pass** (T tokens per row at full depth, runtime.engine) is captured the same
way, its token count part of the key: T is padded to a multiple of ``VERIFY_TOKENS`` (passes of 2
to 17 tokens take 5 graphs per batch and width bucket), the padding positions masked and never
written. Eagerly, a pass launches every layer's ~75 kernels from Python and costs several decode
steps (docs/benchmarks-gpu.md), which no draft saves back.

Warm-up runs before a capture execute the step for real: they write the same K/V at the same
positions (each row's new position is masked in its own step), so running a step several times
gives what running it once does. Graphs share one memory pool, as only one runs at a time.

``EagerCapture`` is the stand-in for machines without a GPU: the same static step, run eagerly
every time, so the CPU tests check that the graph path (buckets, static inputs, masked writes)
gives the tokens the plain path gives.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

MIN_WIDTH = 32  # smallest past bucket: shorter pasts cost little to over-read, and need fewer graphs
WARMUP_RUNS = 2  # eager runs on a side stream before a capture (cuBLAS handles, lazy allocations)
# Captured steps kept at once. Each keeps its static inputs and logits (up to 1.6 MB at batch 8 with
# OPT's vocabulary) and its kernels; the key space is sets x batch buckets x width buckets (up to
# 24 x 4 x 7 = 672 for OPT-1.3B with 2048 positions and traffic of every budget), far more than a
# workload revisits: one generation under a 16->8 policy uses ~16 keys per batch bucket. The least
# recently replayed step goes first, and is captured again if it comes back.
MAX_GRAPHS = 128
VERIFY_TOKENS = 4  # a verify pass's tokens are padded to a multiple of this (fewer graphs; the padding
# is compute on a few more rows of each product, which launches, not arithmetic, bound at this size)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def width_bucket(past: int, capacity: int, minimum: int = MIN_WIDTH) -> int:
    """The past width a step of ``past`` positions runs at: a power of two, at most ``capacity``."""
    if past > capacity:
        raise ValueError(f"a past of {past} positions exceeds the capacity {capacity}")
    return min(max(_pow2_at_least(past), minimum), capacity)


def batch_bucket(rows_needed: int, rows: int) -> int:
    """The first rows of the cache a step runs so that it holds ``rows_needed`` (the decoding rows)."""
    if not 0 < rows_needed <= rows:
        raise ValueError(f"a step needs {rows_needed} rows of the {rows} allocated")
    return min(_pow2_at_least(rows_needed), rows)


def tokens_bucket(tokens: int) -> int:
    """The tokens a verify pass of ``tokens`` runs at: a multiple of ``VERIFY_TOKENS``."""
    if tokens < 1:
        raise ValueError(f"a pass runs at least one token, got {tokens}")
    return -(-tokens // VERIFY_TOKENS) * VERIFY_TOKENS


@dataclass(frozen=True)
class GraphKey:
    layers: tuple[int, ...]  # the active-layer set, ascending
    batch: int  # the first `batch` rows of the KV cache run
    width: int  # past positions attention reads
    tokens: int = 0  # a verify pass's tokens per row (tokens_bucket); 0: a decode step (one token)


class EagerCapture:
    """The CPU stand-in for a CUDA graph: "capturing" keeps the function, "replaying" runs it."""

    name = "eager"

    def __call__(self, fn: Callable[[], None]) -> Callable[[], None]:
        return fn


class CudaGraphCapture:
    """Capture ``fn`` (which reads and writes only static tensors) into a CUDA graph."""

    name = "cuda-graph"

    def __init__(self, device: torch.device, warmup: int = WARMUP_RUNS):
        self.device, self.warmup = device, warmup
        self.pool = torch.cuda.graph_pool_handle()  # one pool for all graphs: never two at once
        # PyTorch frees a private pool once the last graph captured into it is gone, and capturing
        # into the freed handle then fails an allocator assert (seen on an H200: a GraphCache
        # cleared for new KV buffers, then the next capture): a fresh handle once none is alive.
        self._alive: weakref.WeakSet = weakref.WeakSet()

    def __call__(self, fn: Callable[[], None]) -> Callable[[], None]:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)  # the inputs were copied on the current stream
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn()
        current.wait_stream(side)
        if not self._alive:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        self._alive.add(graph)
        torch.cuda.synchronize(self.device)  # the warm-up runs' device time is the capture's, not the next call's
        return graph.replay


class GraphCache:
    """Built and captured steps by key, at most ``max_steps`` of them (least recently used out);
    ``build(key)`` makes a step object with a ``run()``."""

    def __init__(self, capture: Callable[[Callable[[], None]], Callable[[], None]],
                 max_steps: int = MAX_GRAPHS):
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.capture, self.max_steps = capture, max_steps
        self.steps: OrderedDict[GraphKey, tuple[object, Callable[[], None]]] = OrderedDict()
        self.captures = 0  # how many captures so far, evicted steps captured again included
        self.setup_seconds = 0.0  # the time they took, warm-up runs included

    def get(self, key: GraphKey, build: Callable[[GraphKey], object]):
        """(step, replay) for ``key``, built and captured on first use."""
        found = self.steps.get(key)
        if found is not None:
            self.steps.move_to_end(key)
            return found
        if len(self.steps) >= self.max_steps:
            self.steps.popitem(last=False)  # its graph and static tensors go with it
        began = time.perf_counter()
        step = build(key)
        found = self.steps[key] = (step, self.capture(step.run))
        self.captures += 1
        self.setup_seconds += time.perf_counter() - began
        return found

    def clear(self) -> None:
        self.steps.clear()  # the graphs hold the old buffers' addresses


def default_capture(device: torch.device, cuda_graphs: bool | None):
    """The capture a TorchBackend on ``device`` uses: None = plain eager steps.

    ``cuda_graphs`` None means on for CUDA, off elsewhere; True on a CPU is an error, since there
    is nothing to capture (tests use EagerCapture directly for the same code path).
    """
    if cuda_graphs is None:
        cuda_graphs = device.type == "cuda"
    if not cuda_graphs:
        return None
    if device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs device='cuda', got device={str(device)!r}; "
                         f"pass cuda_graphs=False (or leave it unset) on the CPU")
    return CudaGraphCapture(device)


__all__ = ["CudaGraphCapture", "EagerCapture", "GraphCache", "GraphKey", "MAX_GRAPHS", "MIN_WIDTH", "VERIFY_TOKENS",
           "batch_bucket", "default_capture", "tokens_bucket", "width_bucket"]
