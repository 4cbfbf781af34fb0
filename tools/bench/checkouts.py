"""Measuring other copies of this repository side by side: each ``--checkout`` runs its own runtime.

Shared by ``tools.bench.slots`` and ``tools.bench.gap``, after ``tools.bench.startup``'s
``--checkout``: a measured process is ``python -c CODE`` whose working directory (first on
``sys.path``) and ``PYTHONPATH`` are the checkout, so ``import runtime`` imports that checkout's
runtime, while the measuring code comes from here. The parent process imports no runtime at all,
so it runs while this checkout's runtime is being rewritten.

Artifacts: a checkout's runtime may read only its own manifest schema, so each checkout exports
its own with its own ``python -m export build --model ARCH --random-weights`` (seed 0: the same
weights for every checkout), into ``WORK/checkouts/ARCH-KEY/artifact``, where KEY is the
checkout's git HEAD plus, when ``export/`` or ``runtime/`` differ from it, a digest of that
difference (a folder that is not a git work tree: a digest of its path). A stamp marks a finished
build, which later runs reuse.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .runner import REPO, child_env

SOURCES = ("export", "runtime")  # what decides an artifact's format and how it is read
STAMP = "bench-stamp.json"


class CheckoutError(RuntimeError):
    """A checkout's export or measured process failed: the message ends with its stderr's tail."""


def _git(checkout: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.decode("utf-8", "surrogateescape") if done.returncode == 0 else None


def checkout_key(checkout: Path) -> str:
    """HEAD's short hash, ``-dirty-DIGEST`` when export/ or runtime/ differ from HEAD (tracked
    changes and untracked files alike), or ``path-DIGEST`` outside git."""
    checkout = Path(checkout).resolve()
    head = _git(checkout, "rev-parse", "HEAD")
    if not head:
        return "path-" + hashlib.sha256(str(checkout).encode()).hexdigest()[:12]
    key = head.strip()[:12]
    status = _git(checkout, "status", "--porcelain", "--untracked-files=all", "--", *SOURCES) or ""
    if status.strip():
        h = hashlib.sha256((_git(checkout, "diff", "HEAD", "--binary", "--", *SOURCES) or "").encode(
            "utf-8", "surrogateescape"))
        for line in sorted(status.splitlines()):
            if line.startswith("?? "):
                path = checkout / line[3:].strip().strip('"')
                h.update(line.encode("utf-8", "surrogateescape"))
                if path.is_file():
                    h.update(path.read_bytes())
        key += "-dirty-" + h.hexdigest()[:10]
    return key


def env(checkout: Path, threads: int) -> dict:
    """The measured process's environment: ``runner.child_env``'s thread settings, the checkout's
    code first on the path."""
    e = child_env(threads)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))
    return e


def artifact_for(checkout: Path, arch: str, work: Path, seed: int = 0, log=print, timeout: float = 3600,
                 key: str | None = None) -> Path:
    """The checkout's own export of random ``arch`` weights, built once per checkout key (``key``:
    one already computed, so that a run names the key its artifact was built for)."""
    checkout = Path(checkout).resolve()
    key = key or checkout_key(checkout)
    base = Path(work).resolve() / "checkouts" / f"{arch}-{key}"
    out = base / "artifact"
    stamp = {"arch": arch, "seed": seed, "key": key}
    stamp_path = base / STAMP
    if stamp_path.is_file() and json.loads(stamp_path.read_text()) == stamp and out.is_dir():
        return out
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    model = ["--model", arch] if arch == "tiny-random" else ["--model", arch, "--random-weights", "--seed", str(seed)]
    cmd = [sys.executable, "-m", "export", "build", *model, "--out", str(out), "-q"]
    log(f"{checkout}: {' '.join(cmd[1:])}")
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=checkout, env=env(checkout, os.cpu_count() or 1),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise CheckoutError(f"{checkout}: the export timed out after {timeout:g}s") from exc
    if done.returncode != 0:
        raise CheckoutError(f"{checkout}: `{' '.join(cmd[1:])}` failed (exit {done.returncode}):\n"
                            f"{done.stderr[-2000:]}")
    stamp_path.write_text(json.dumps(stamp))
    log(f"{checkout}: exported {arch} in {time.perf_counter() - started:.0f} s to {out}")
    return out


def run_child(code: str, spec: dict, checkout: Path, threads: int, timeout: float = 900) -> dict:
    """Run ``python -c code SPEC_JSON`` in ``checkout``; its last stdout line is the JSON result."""
    checkout = Path(checkout).resolve()
    try:
        done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                              cwd=checkout, env=env(checkout, threads), timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise CheckoutError(f"{checkout}: the measured process timed out after {timeout:g}s") from exc
    if done.returncode != 0:
        raise CheckoutError(f"{checkout}: the measured process failed (exit {done.returncode}):\n"
                            f"{done.stderr[-2000:]}")
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise CheckoutError(f"{checkout}: no JSON from the measured process: {done.stdout[-300:]!r}") from exc


def parse_options(pairs) -> dict:
    """``KEY=VALUE`` strings to keyword arguments; a VALUE that parses as JSON (``64``, ``true``,
    ``"x"``, ``[1, 2]``) is that value, anything else the string itself."""
    out = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{pair!r} is not KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def tokenizer_of(artifact: Path):
    """The artifact's tokenizer as ``tok(text)["input_ids"]``, read with ``tokenizers`` alone from
    its tokenizer.json (whose post-processor adds OPT's BOS, as the runtime's adapter does); the
    measured processes check the counts with their own runtime's tokenizer."""
    from tokenizers import Tokenizer

    manifest = json.loads((Path(artifact) / "manifest.json").read_text())
    tk = Tokenizer.from_file(str(Path(artifact) / manifest.get("tokenizer_dir", "tokenizer") / "tokenizer.json"))
    return lambda text: {"input_ids": tk.encode(text).ids}


def label(checkout: Path) -> str:
    """How a checkout is named in tables: its path as given, the current one as ``.``."""
    return "." if Path(checkout).resolve() == REPO else str(checkout)


def describe_checkout(checkout: Path, key: str | None = None) -> str:
    return f"{label(checkout)} (key {key or checkout_key(checkout)})"


def log(*args) -> None:
    """Progress on stderr, so that stdout is the table."""
    print(*args, file=sys.stderr, flush=True)


def parser(prog: str, doc: str):
    """The argument parser of a before/after benchmark, with the --arch/--artifact it always takes."""
    from runtime import cli

    p = cli.parser(prog, doc.split("\n\n")[0])
    p.add_argument("--arch", default="opt-125m", help="random weights at this architecture's shapes")
    p.add_argument("--artifact", help="run this artifact in every checkout instead of their own --arch exports")
    return p


def header(prog: str, argv, started: float) -> str:
    """The first lines of a before/after benchmark's output: its command, then the machine and how long it ran."""
    from .machine import describe

    m = describe()
    return (f"{prog}{''.join(f' {a}' for a in argv)}\n\n{m['date']}; {m['cpu']}, {m['cores']} cores; "
            f"Python {m['python']}; onnxruntime {m['versions']['onnxruntime']}; load average "
            f"{os.getloadavg()[0]:.1f} at the end; {(time.perf_counter() - started) / 60:.1f} min")


def add_common_arguments(parser, name: str) -> None:
    """The options every before/after benchmark takes (``name``: its default JSON file's stem)."""
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    parser.add_argument("--load-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a runtime.load keyword for every checkout, e.g. prefill_chunk=16 (VALUE "
                             "parsed as JSON when it can be); repeatable")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians across them")
    parser.add_argument("--seed", type=int, default=0, help="round order (the weights are seed 0)")
    parser.add_argument("--checkout", nargs="+", action="extend", type=Path,
                        help="copies of this repository whose runtimes to measure, interleaved (default: this one)")
    parser.add_argument("--work-dir", default=".bench", help="the checkouts' exports")
    parser.add_argument("--json", help=f"write every run's record here (default WORK_DIR/{name}.json)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per measured process")


def setup(parser, args) -> tuple[dict, list[Path], Path]:
    """(load options, checkouts, work directory) of a before/after benchmark's --load-option,
    --checkout and --work-dir, checked (parser.error on a bad one)."""
    try:
        options = parse_options(args.load_option)
    except ValueError as exc:
        parser.error(f"--load-option: {exc}")
    checkouts = [c.resolve() for c in (args.checkout or [REPO])]
    for c in checkouts:
        if not (c / "runtime").is_dir():
            parser.error(f"--checkout {c}: no runtime/ there; pass a copy of this repository")
    if args.artifact and not (Path(args.artifact) / "manifest.json").is_file():
        parser.error(f"--artifact {args.artifact}: no manifest.json there; pass a directory written by "
                     f"`python -m export build`")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    (work / ".gitignore").write_text("*\n")
    return options, checkouts, work


def prepare(args, checkouts: list[Path], work: Path) -> tuple[dict, dict]:
    """(key, artifact) of every checkout: its own export of --arch, or --artifact for all."""
    keys = {c: checkout_key(c) for c in checkouts}  # at the start: a checkout may change while it runs
    artifacts = {c: Path(args.artifact).resolve() if args.artifact
                 else artifact_for(c, args.arch, work, 0, log=log, key=keys[c]) for c in checkouts}
    return keys, artifacts


def exit_code(run, *args) -> int:
    """``run(*args)``, or 2 with one ``error:`` line when a checkout could not be measured."""
    try:
        return run(*args)
    except CheckoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
