"""The peers' own virtual environments: a peer never shares this project's environment.

* Optimum: optimum-onnx pins transformers < 4.58, so it needs its own packages throughout.
* ONNX Runtime GenAI: its wheel alone, over this environment's packages (``--system-site-packages``:
  its model builder reads the checkpoint with the torch and transformers already here, and it runs
  on the same onnxruntime as this project's rows).
* llama.cpp: llama-cpp-python alone, over this environment's packages likewise (its worker writes
  the GGUF with the gguf package and transformers already here).

The tool creates a peer's venv (once) or is pointed at one (``--optimum-python``,
``--ortgenai-python``, ``--llamacpp-python``); when neither works the peer's rows are reported unavailable with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Peer:
    name: str  # as the page and the log say it
    directory: str  # the venv's folder under the work directory
    requirements: tuple[str, ...]  # what pip installs into it
    imports: str  # the module a working venv imports
    packages: tuple[str, ...]  # whose versions the page records
    system_site_packages: bool = False


# torch is pinned: an unpinned torch resolves the CUDA build and several GB of dependencies; the
# machines this project runs on have a local CPU wheel of exactly this version that pip finds.
OPTIMUM = Peer("Optimum", "optimum-venv", ("optimum-onnx", "onnxruntime", "transformers<4.58", "torch==2.13.0"),
               "optimum.onnxruntime", ("optimum-onnx", "onnxruntime", "transformers", "torch"))
ORTGENAI = Peer("ONNX Runtime GenAI", "ortgenai-venv", ("onnxruntime-genai",), "onnxruntime_genai",
                ("onnxruntime-genai", "onnxruntime", "transformers", "torch"), system_site_packages=True)
# llama-cpp-python compiles llama.cpp when installed (~25 min on 2 cores); over this environment's
# packages, since its worker writes the GGUF with the transformers and gguf already here.
LLAMACPP = Peer("llama.cpp", "llamacpp-venv", ("llama-cpp-python",), "llama_cpp", ("llama-cpp-python",),
                system_site_packages=True)
DEFAULT_DIR = Path(".bench") / OPTIMUM.directory


@dataclass
class PeerEnv:
    python: str | None  # interpreter to run the peer's worker with; None when unavailable
    versions: dict  # package -> version inside the venv
    reason: str = ""  # why it is unavailable ("" when it is available)

    @property
    def available(self) -> bool:
        return self.python is not None


def _probe_code(peer: Peer) -> str:
    return (f"import json, {peer.imports}\n"
            "from importlib.metadata import version\n"
            f"print(json.dumps({{k: version(k) for k in {peer.packages!r}}}))")


def probe(python: str, peer: Peer = OPTIMUM) -> PeerEnv:
    """Check that ``python`` imports the peer; report the versions."""
    try:
        done = subprocess.run([python, "-c", _probe_code(peer)], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return PeerEnv(None, {}, f"{python} could not be run: {exc}")
    if done.returncode != 0:
        return PeerEnv(None, {}, f"{python} cannot import {peer.imports}: {last_line(done.stderr)}")
    return PeerEnv(python, json.loads(done.stdout.strip().splitlines()[-1]))


def ensure(directory: Path = DEFAULT_DIR, python: str | None = None, create: bool = True,
           log=print, peer: Peer = OPTIMUM) -> PeerEnv:
    """The peer's environment: ``python`` if given, else ``directory``'s venv, created if missing."""
    if python:
        return probe(python, peer)
    venv_python = Path(directory) / "bin" / "python"
    if venv_python.exists():
        env = probe(str(venv_python), peer)
        if env.available or not create:
            return env
    elif not create:
        return PeerEnv(None, {}, f"no virtual environment at {directory} and creating it was turned off")
    log(f"creating the {peer.name} virtual environment in {directory} (once; pip install "
        f"{' '.join(peer.requirements)})")
    make = [sys.executable, "-m", "venv", *(["--system-site-packages"] if peer.system_site_packages else []),
            str(directory)]
    steps = (make, [str(venv_python), "-m", "pip", "install", "--quiet", *peer.requirements])
    for cmd in steps:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return PeerEnv(None, {}, f"`{' '.join(cmd)}` failed: {exc}")
        if done.returncode != 0:
            return PeerEnv(None, {}, f"`{' '.join(cmd)}` failed: {last_line(done.stderr or done.stdout)}")
    return probe(str(venv_python), peer)


def last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
