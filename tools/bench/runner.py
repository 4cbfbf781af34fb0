"""Run the jobs: each measurement in a fresh subprocess, rounds interleaved, progress on stderr.

Every round runs every (shape, row) job of an architecture once, in an order shuffled with a
seeded generator per round, so that drift (thermal, page cache, noisy neighbours) spreads over all
rows instead of landing on the ones measured last.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .rows import LLAMACPP, ORTGENAI

REPO = Path(__file__).resolve().parents[2]
OPTIMUM_WORKER = Path(__file__).resolve().parent / "optimum_worker.py"
ORTGENAI_WORKER = Path(__file__).resolve().parent / "ortgenai_worker.py"
LLAMACPP_WORKER = Path(__file__).resolve().parent / "llamacpp_worker.py"


@dataclass
class Job:
    arch: str
    shape: object  # rows.Shape
    row: object  # rows.Row
    spec: dict  # what the worker gets
    python: str | None = None  # interpreter of a peer's worker (its own venv)
    unavailable: str = ""  # set: the job is not run and this is the reason

    @property
    def label(self) -> str:
        return f"{self.arch} {self.shape} {self.row.name}"


@dataclass
class Outcome:
    job: Job
    round: int
    record: dict | None = None
    error: str = ""
    wall_s: float = 0.0


def schedule(jobs: list[Job], rounds: int, seed: int = 0) -> list[tuple[int, Job]]:
    """(round, job) in run order: every job once per round, shuffled per round."""
    order = []
    for r in range(rounds):
        this = list(jobs)
        random.Random(seed * 1000 + r).shuffle(this)
        order.extend((r, job) for job in this)
    return order


def command(job: Job) -> list[str]:
    spec = json.dumps(job.spec)
    if job.row.backend == "optimum":
        return [job.python, str(OPTIMUM_WORKER), "measure", spec]
    if job.row.backend in ORTGENAI:
        return [job.python, str(ORTGENAI_WORKER), "bench", spec]
    if job.row.backend in LLAMACPP:
        return [job.python, str(LLAMACPP_WORKER), "bench", spec]
    return [sys.executable, "-m", "tools.bench.worker", spec]


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    return env


def run_one(job: Job, round_: int, threads: int, timeout: float) -> Outcome:
    if job.unavailable:
        return Outcome(job, round_, error=job.unavailable)
    start = time.perf_counter()
    try:
        done = subprocess.run(command(job), capture_output=True, text=True, timeout=timeout,
                              cwd=str(REPO), env=child_env(threads))
    except subprocess.TimeoutExpired:
        return Outcome(job, round_, error=f"timed out after {timeout:g}s", wall_s=timeout)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        lines = [x for x in done.stderr.strip().splitlines() if x.strip()]
        return Outcome(job, round_, error=lines[-1] if lines else f"exit {done.returncode}", wall_s=wall)
    try:
        record = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return Outcome(job, round_, error=f"no JSON from the worker: {done.stdout[-200:]!r}", wall_s=wall)
    return Outcome(job, round_, record=record, wall_s=wall)


def run_all(order: list[tuple[int, Job]], threads: int, timeout: float, progress: bool = True,
            on_outcome=None) -> list[Outcome]:
    from tqdm.auto import tqdm

    outcomes = []
    bar = tqdm(order, desc="bench", unit="run", disable=not progress, dynamic_ncols=True)
    for round_, job in bar:
        bar.set_postfix_str(f"round {round_ + 1}: {job.label}")
        outcome = run_one(job, round_, threads, timeout)
        if outcome.error and not job.unavailable:
            bar.write(f"  {job.label} (round {round_ + 1}) failed: {outcome.error}")
        outcomes.append(outcome)
        if on_outcome:
            on_outcome(outcome)
    return outcomes
