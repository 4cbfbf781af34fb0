"""Whether the cores this process may run on are free of other work: the ONNX Runtime backend's
``spin="auto"`` (the command lines' default) spins its workers only where they are.

Spinning workers win on cores of their own and lose where another process wants them: SmolLM2-360M
int4 at batch 1 on 2 cores decoded at 17.4 ms/token spinning against 22.4 sleeping, but at 40.8
against 30.0 beside one busy process (docs/benchmarks.md, "Spinning where the cores are free"). ONNX
Runtime fixes a pool's spinning when the pool is made, so the choice is made once, at load, from
what the other processes did on these cores over a short window: /proc/stat's busy time of the
CPUs in this process's affinity (steal included: a hypervisor's other guests take cores as a
process does), less this process's own CPU time over the same window.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

WINDOW_S = 0.1  # how long the probe watches: 10 scheduler ticks of USER_HZ=100 on each core
BUSY_CORES = 0.25  # other processes' use, in cores, from which the cores count as taken: a shell
# or a logger stays under it; one busy process is ~1


@dataclass(frozen=True)
class _Sample:
    busy: int  # jiffies the watched CPUs spent on anything but idle and iowait (steal included)
    own: float  # this process's CPU seconds, all its threads
    at: float  # time.monotonic()


def _cpu_lines(text: str, cpus: set[int]) -> list[list[int]]:
    rows = []
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            rows.append([int(v) for v in rest.split()])
    return rows


def _sample(stat: str, cpus: set[int]) -> _Sample | None:
    try:
        with open(stat) as f:
            rows = _cpu_lines(f.read(), cpus)
    except OSError:
        return None
    if not rows:
        return None
    # fields: user nice system idle iowait irq softirq steal [guest guest_nice, counted in user]
    busy = sum(sum(r[:3]) + sum(r[5:8]) for r in rows)
    return _Sample(busy, time.process_time(), time.monotonic())


def others_busy_cores(window_s: float = WINDOW_S, stat: str = "/proc/stat") -> float | None:
    """Cores' worth of CPU time that other processes (and other guests) used on this process's
    CPUs over ``window_s`` seconds; None where /proc/stat cannot say (not Linux)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    first = _sample(stat, cpus)
    if first is None:
        return None
    time.sleep(window_s)
    last = _sample(stat, cpus)
    if last is None:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    seconds = last.at - first.at
    others = (last.busy - first.busy) / tick - (last.own - first.own)
    return max(others, 0.0) / seconds


def cores_free(window_s: float = WINDOW_S, stat: str = "/proc/stat") -> bool:
    """True where other processes used under BUSY_CORES of this process's CPUs over the window;
    False where they used more, or where it cannot be told (sleeping workers are the safe side)."""
    busy = others_busy_cores(window_s, stat)
    return busy is not None and busy < BUSY_CORES


__all__ = ["BUSY_CORES", "cores_free", "others_busy_cores"]
