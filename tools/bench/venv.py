"""The Optimum peer's own virtual environment: optimum-onnx pins transformers < 4.58, so it can
never share this project's environment. The tool creates it (once) or is pointed at one with
``--optimum-python``; when neither works the Optimum row is reported unavailable with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DIR = Path(".bench") / "optimum-venv"
# torch is pinned: an unpinned torch resolves the CUDA build and several GB of dependencies; the
# machines this project runs on have a local CPU wheel of exactly this version that pip finds.
REQUIREMENTS = ("optimum-onnx", "onnxruntime", "transformers<4.58", "torch==2.13.0")
PROBE = ("import json, optimum.onnxruntime, onnxruntime, transformers, torch\n"
         "from importlib.metadata import version\n"
         "print(json.dumps({k: version(k) for k in ('optimum-onnx', 'onnxruntime', 'transformers', "
         "'torch')}))")


@dataclass
class OptimumEnv:
    python: str | None  # interpreter to run optimum_worker.py with; None when unavailable
    versions: dict  # package -> version inside the venv
    reason: str = ""  # why it is unavailable ("" when it is available)

    @property
    def available(self) -> bool:
        return self.python is not None


def probe(python: str) -> OptimumEnv:
    """Check that ``python`` imports Optimum's ONNX Runtime classes; report the versions."""
    try:
        done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return OptimumEnv(None, {}, f"{python} could not be run: {exc}")
    if done.returncode != 0:
        return OptimumEnv(None, {}, f"{python} cannot import optimum.onnxruntime: {_last_line(done.stderr)}")
    return OptimumEnv(python, json.loads(done.stdout.strip().splitlines()[-1]))


def ensure(directory: Path = DEFAULT_DIR, python: str | None = None, create: bool = True,
           log=print) -> OptimumEnv:
    """The Optimum environment: ``python`` if given, else ``directory``'s venv, created if missing."""
    if python:
        return probe(python)
    venv_python = Path(directory) / "bin" / "python"
    if venv_python.exists():
        env = probe(str(venv_python))
        if env.available or not create:
            return env
    elif not create:
        return OptimumEnv(None, {}, f"no virtual environment at {directory} and --no-optimum-venv given")
    log(f"creating the Optimum virtual environment in {directory} (once; pip install "
        f"{' '.join(REQUIREMENTS)})")
    steps = ([sys.executable, "-m", "venv", str(directory)],
             [str(venv_python), "-m", "pip", "install", "--quiet", *REQUIREMENTS])
    for cmd in steps:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return OptimumEnv(None, {}, f"`{' '.join(cmd)}` failed: {exc}")
        if done.returncode != 0:
            return OptimumEnv(None, {}, f"`{' '.join(cmd)}` failed: {_last_line(done.stderr or done.stdout)}")
    return probe(str(venv_python))


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
