"""Memory read bandwidth: sum a large array that no cache holds, best of N."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass
class Bandwidth:
    one_thread: float  # bytes/s, numpy sum on one thread
    threads: int
    all_threads: float  # bytes/s, the array split over `threads` threads (numpy drops the GIL)
    array_bytes: int

    @property
    def best(self) -> float:
        """What the floor uses: the most this machine showed with the run's threads."""
        return max(self.one_thread, self.all_threads)


def measure(threads: int = 1, array_bytes: int = 1 << 30, repeats: int = 5) -> Bandwidth:
    import numpy as np

    data = np.ones(array_bytes // 4, dtype=np.float32)  # written once, so every page is resident
    size = data.nbytes

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return size / min(times)

    one = best(data.sum)
    many = one
    if threads > 1:
        parts = np.array_split(data, threads)
        with ThreadPoolExecutor(threads) as pool:
            many = best(lambda: list(pool.map(np.sum, parts)))
    del data
    return Bandwidth(one, threads, many, size)


def as_record(bw: Bandwidth) -> dict:
    """The JSON a benchmark run keeps; ``best`` is what its floor uses."""
    return {"one_thread": bw.one_thread, "all_threads": bw.all_threads, "threads": bw.threads,
            "array_bytes": bw.array_bytes, "best": bw.best}


def with_end(start: dict, end: Bandwidth) -> dict:
    """A run's record with a second probe taken after its rows: the floor uses the higher of the
    two, as a probe that ran at a slow moment of a shared machine would put the floor too low and
    let a row meet it by the machine's luck."""
    record = as_record(end)
    return {**start, "end": record, "best": max(start["best"], record["best"])}
