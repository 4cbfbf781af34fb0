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
