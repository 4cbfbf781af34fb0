"""``python -m tools.bench.board ART``: the table a board's first run should produce (docs/jetson.md,
"Measure on your board"): this toolkit's prompt and decode tokens/s at each speedup, beside llama.cpp's
``llama-bench`` and TensorRT Edge-LLM's ``llm_bench`` on the same board and the same prompt and
generation lengths, with the memory each took and the watts the module drew while it ran.

    python -m tools.bench.board ART --speedups 1 2 --llama-bench ~/llama.cpp/build/bin/llama-bench --gguf M.gguf
    python -m tools.bench.board ART --edgellm-bench ~/TensorRT-Edge-LLM/build/examples/llm/llm_bench --edgellm-engine DIR

Every row runs ``--rounds`` times after one untimed warm-up, on one prompt of exactly
``--prompt-tokens`` tokens and ``--new-tokens`` new tokens (EOS ignored). tegrastats (when on the
PATH, or ``--tegrastats CMD``) runs throughout, every ``--interval`` ms, and each line it prints is
stamped as it arrives: a row's watts are the mean of the power rail (``--rail``; by default the
module's input rail, VDD_IN on an Orin Nano or NX, VIN_SYS_5V0 on an AGX Orin, VIN on a Thor) over
its runs, and its memory the most RAM used during them less the idle value read before the first
row (the GPU's memory is the board's RAM). Without tegrastats (not a Jetson) the memory column is
the peak resident memory of this process and of each peer's process, and there are no watts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime import cli
from runtime.errors import SkipDecodeError

INPUT_RAILS = ("VDD_IN", "VIN_SYS_5V0", "VIN")  # the module's input power, per module (docs/jetson.md)
RAM = re.compile(r"\bRAM (\d+)/(\d+)MB")
RAIL = re.compile(r"\b([A-Z][A-Z0-9_]*) (\d+)mW/(\d+)mW")


class BoardBenchError(SkipDecodeError):
    """A peer that failed or printed nothing this tool can read, or options that do not go together."""


@dataclass(frozen=True)
class Sample:
    """One tegrastats line: RAM used (MB) and each rail's current power (mW)."""

    at: float  # time.monotonic() when the line arrived
    ram_mb: int | None
    rails: dict


def parse_line(line: str, at: float = 0.0) -> Sample:
    """A tegrastats line as a Sample: ``RAM 2345/7620MB ... VDD_IN 4720mW/4690mW ...`` (the second
    figure of a rail is its average since tegrastats started; the first, the current one, is kept)."""
    ram = RAM.search(line)
    rails = {m.group(1): int(m.group(2)) for m in RAIL.finditer(line)}
    return Sample(at, int(ram.group(1)) if ram else None, rails)


@dataclass
class Tegrastats:
    """tegrastats running in the background, its lines stamped as they arrive."""

    command: list[str]
    interval_ms: int
    samples: list = field(default_factory=list)

    def __enter__(self) -> "Tegrastats":
        self.process = subprocess.Popen([*self.command, "--interval", str(self.interval_ms)], stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        for line in self.process.stdout:
            self.samples.append(parse_line(line, time.monotonic()))

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.thread.join(timeout=5)

    def wait_for_samples(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.samples) < count and time.monotonic() < deadline:
            time.sleep(self.interval_ms / 4000)

    def window(self, start: float, end: float) -> list[Sample]:
        """The lines printed during [start, end] and the first after it (which reports the
        interval the end fell in): a run shorter than the interval still has one."""
        inside = [s for s in self.samples if start <= s.at <= end]
        after = next((s for s in self.samples if s.at > end), None)
        return inside + ([after] if after is not None else [])


@dataclass
class Row:
    tool: str
    setting: str
    prompt_tps: float
    decode_tps: float
    windows: list = field(default_factory=list)  # (start, end) monotonic times of the timed runs
    peak_rss_mb: float | None = None  # off a Jetson: the process's peak resident memory


def rail_of(samples: list[Sample], asked: str | None) -> str | None:
    """The rail to report: ``asked``, else the first input rail the lines carry."""
    names = set().union(*(s.rails for s in samples)) if samples else set()
    if asked:
        if samples and asked not in names:
            raise BoardBenchError(f"--rail {asked}: tegrastats printed no such rail; it printed "
                                  f"{', '.join(sorted(names))}")
        return asked
    return next((r for r in INPUT_RAILS if r in names), None)


def measured(row: Row, stats: Tegrastats | None, idle_mb: int | None, rail: str | None) -> tuple:
    """(memory MB, watts) of ``row``: from tegrastats' lines during its runs, else its peak RSS."""
    if stats is None:
        return row.peak_rss_mb, None
    samples = [s for start, end in row.windows for s in stats.window(start, end)]
    used = [s.ram_mb for s in samples if s.ram_mb is not None]
    memory = max(used) - idle_mb if used and idle_mb is not None else None
    power = [s.rails[rail] for s in samples if rail in s.rails]
    return memory, (sum(power) / len(power) / 1e3 if power else None)


def ours(artifact: str, options: dict, prompt_tokens: int, new_tokens: int, speedups, rounds: int) -> list[Row]:
    """This toolkit's rows: one load, one row per speedup."""
    import runtime

    rows = []
    with runtime.load(artifact, max_batch=1, **options) as gen:
        vocab = gen.manifest.model.vocab_size
        prompt = [(17 + 31 * i) % vocab for i in range(prompt_tokens)]  # exactly prompt_tokens ids
        for speedup in speedups:
            kw = dict(max_new_tokens=new_tokens, speedup=speedup, ignore_eos=True)
            gen.generate([prompt], **kw)  # warm-up: lazy kernel loading, first execution
            row = Row("skipdecode-edge", f"{options.get('backend', 'onnxruntime')}, {speedup:g}x", 0.0, 0.0)
            prefill, decode = [], []
            for _ in range(rounds):
                start = time.monotonic()
                s = gen.generate([prompt], **kw).stats
                row.windows.append((start, time.monotonic()))
                prefill.append(prompt_tokens / s.prefill_seconds)
                decode.append(1e3 / s.decode_ms_per_token)
            row.prompt_tps, row.decode_tps = _median(prefill), _median(decode)
            row.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            rows.append(row)
    return rows


def _child(argv: list[str], name: str) -> tuple[str, str, float, float, float]:
    """Run a peer: (its stdout, its stderr, the monotonic start and end, its own peak resident MB,
    read by wait4 for this child alone); a failure is a BoardBenchError with its last lines."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.monotonic()
        try:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True)
        except OSError as exc:
            raise BoardBenchError(f"{name} did not start: {shlex.join(argv)}: {exc.strerror or exc}") from None
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        end = time.monotonic()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-5:])
        raise BoardBenchError(f"{name} failed (exit {proc.returncode}): {shlex.join(argv)}\n{tail}")
    return stdout, stderr, start, end, usage.ru_maxrss / 1024


def llama_bench(command: list[str], gguf: str, prompt_tokens: int, new_tokens: int, rounds: int) -> Row:
    """llama.cpp's llama-bench on the same lengths (all layers on the GPU: -ngl 99), its JSON read."""
    argv = [*command, "-m", gguf, "-p", str(prompt_tokens), "-n", str(new_tokens), "-r", str(rounds),
            "-ngl", "99", "-o", "json"]
    text, _, start, end, rss = _child(argv, "llama-bench")
    try:
        tests = json.loads(text)
        pp = next(t["avg_ts"] for t in tests if t["n_prompt"] == prompt_tokens and t["n_gen"] == 0)
        tg = next(t["avg_ts"] for t in tests if t["n_gen"] == new_tokens and t["n_prompt"] == 0)
        backends = tests[0].get("backends", "")
    except (ValueError, KeyError, StopIteration, TypeError, IndexError) as exc:
        raise BoardBenchError(f"llama-bench printed no pp {prompt_tokens} / tg {new_tokens} results in its -o json "
                              f"output ({type(exc).__name__}); its output began: {text[:200]!r}") from None
    return Row("llama.cpp llama-bench", f"{backends or '?'}, -ngl 99", pp, tg, [(start, end)], rss)


EDGELLM_TPS = re.compile(r"Tokens/sec \(E2E\): ([\d.]+)")


def edgellm_bench(command: list[str], engine: str, prompt_tokens: int, new_tokens: int, rounds: int) -> Row:
    """TensorRT Edge-LLM's llm_bench (examples/llm/llm_bench.cpp) on the same lengths, batch 1: a
    prefill run of the prompt's tokens and a decode run of the new tokens after as many past
    positions, each after a warm-up; its "Tokens/sec (E2E)" lines read (prefill: the prompt's tokens
    per second; decode: the new tokens after the first per second, as it computes them)."""
    found, windows, peak = {}, [], 0.0
    for mode, lengths in (("prefill", ["--inputLen", str(prompt_tokens)]),
                          ("decode", ["--pastKVLen", str(prompt_tokens), "--osl", str(new_tokens)])):
        argv = [*command, "--engineDir", engine, "--mode", mode, *lengths, "--batchSize", "1", "--warmup", "1",
                "--iterations", str(rounds)]
        stdout, stderr, start, end, rss = _child(argv, f"llm_bench --mode {mode}")
        text = stdout + stderr  # (its LOG_INFO lines: either stream, by build)
        tps = EDGELLM_TPS.findall(text)
        if not tps:
            raise BoardBenchError(f"llm_bench --mode {mode} printed no 'Tokens/sec (E2E): N' line; its output "
                                  f"ended: {text.strip()[-300:]!r}")
        found[mode], peak = float(tps[-1]), max(peak, rss)
        windows.append((start, end))
    return Row("TensorRT Edge-LLM llm_bench", "batch 1", found["prefill"], found["decode"], windows, peak)


def table(rows: list[Row], stats: Tegrastats | None, idle_mb: int | None, rail: str | None) -> str:
    memory = "RAM used MB (tegrastats, over idle)" if stats is not None else "peak RSS MB"
    power = f"watts ({rail})" if rail else "watts"
    lines = [f"| tool | setting | prompt tokens/s | decode tokens/s | {memory} | {power} | mJ/token |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        mem, watts = measured(row, stats, idle_mb, rail)
        energy = f"{watts / row.decode_tps * 1e3:.1f}" if watts and row.decode_tps else "-"
        mem_text = "-" if mem is None else f"{mem:.0f}"
        watts_text = "-" if watts is None else f"{watts:.2f}"
        lines.append(f"| {row.tool} | {row.setting} | {row.prompt_tps:.1f} | {row.decode_tps:.1f} | {mem_text} | "
                     f"{watts_text} | {energy} |")
    return "\n".join(lines)


def _median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def _parser() -> argparse.ArgumentParser:
    p = cli.parser("python -m tools.bench.board", __doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("artifact", help="an artifact directory (python -m export build; with engines for tensorrt)")
    p.add_argument("--backend", choices=("onnxruntime", "torch", "tensorrt"),
                   help="what runs the graphs (default: tensorrt where ART/engines holds engines, else onnxruntime)")
    p.add_argument("--device", help="the backend's device (onnxruntime, torch: cpu or cuda)")
    p.add_argument("--speedups", type=float, nargs="+", default=[1.0, 2.0], help="this toolkit's rows (default 1 2)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="the prompt's length, llama-bench's -p (default 128)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated, llama-bench's -n (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="timed runs per row after a warm-up (default 3)")
    p.add_argument("--tegrastats", help="the tegrastats command (default: tegrastats when on the PATH; 'none': off)")
    p.add_argument("--interval", type=int, default=500, help="tegrastats' interval in ms (default 500)")
    p.add_argument("--rail", help="the power rail to report (default: the module's input rail)")
    p.add_argument("--llama-bench", metavar="BIN", help="llama.cpp's llama-bench (a CUDA build on a Jetson)")
    p.add_argument("--gguf", help="the GGUF file llama-bench runs: the same model as ART")
    p.add_argument("--edgellm-bench", metavar="BIN", help="TensorRT Edge-LLM's llm_bench (built on the board)")
    p.add_argument("--edgellm-engine", metavar="DIR",
                   help="the Edge-LLM engine directory llm_bench runs: the same model as ART")
    p.add_argument("--out", help="also write the table to this Markdown file")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    return cli.run(lambda: _run(args))


def _run(args) -> int:
    for name in ("prompt_tokens", "new_tokens", "rounds", "interval"):
        if getattr(args, name) < 1:
            raise BoardBenchError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if bool(args.llama_bench) != bool(args.gguf):
        raise BoardBenchError("--llama-bench and --gguf go together: llama-bench needs the GGUF of the same model")
    if args.gguf and not Path(args.gguf).is_file():
        raise BoardBenchError(f"--gguf {args.gguf}: no such file")
    if bool(args.edgellm_bench) != bool(args.edgellm_engine):
        raise BoardBenchError("--edgellm-bench and --edgellm-engine go together: llm_bench needs the engine "
                              "directory of the same model (built with TensorRT Edge-LLM's builder)")
    if args.edgellm_engine and not Path(args.edgellm_engine).is_dir():
        raise BoardBenchError(f"--edgellm-engine {args.edgellm_engine}: no such directory")
    backend = args.backend or ("tensorrt" if (Path(args.artifact) / "engines" / "engines.json").is_file()
                               else "onnxruntime")
    options = {"backend": backend, **({"device": args.device} if args.device else {})}
    command = (None if args.tegrastats == "none" else shlex.split(args.tegrastats) if args.tegrastats
               else ["tegrastats"] if shutil.which("tegrastats") else None)
    stats = Tegrastats(command, args.interval) if command else None
    with stats if stats is not None else contextlib.nullcontext():
        idle = None
        if stats is not None:
            stats.wait_for_samples(2, timeout=10 * args.interval / 1000 + 5)
            used = [s.ram_mb for s in stats.samples if s.ram_mb is not None]
            if not used:
                raise BoardBenchError(f"{shlex.join(command)} printed no 'RAM used/totalMB' line in "
                                      f"{10 * args.interval} ms; pass --tegrastats none to run without it")
            idle = used[-1]
        rows = ours(args.artifact, options, args.prompt_tokens, args.new_tokens, args.speedups, args.rounds)
        if args.llama_bench:
            rows.append(llama_bench(shlex.split(args.llama_bench), args.gguf, args.prompt_tokens, args.new_tokens,
                                    args.rounds))
        if args.edgellm_bench:
            rows.append(edgellm_bench(shlex.split(args.edgellm_bench), args.edgellm_engine, args.prompt_tokens,
                                      args.new_tokens, args.rounds))
        if stats is not None:  # the line that reports the last run's interval
            stats.wait_for_samples(len(stats.samples) + 1, timeout=10 * args.interval / 1000 + 5)
    rail = rail_of(stats.samples, args.rail) if stats is not None else None
    text = (f"{args.artifact}: prompt {args.prompt_tokens} tokens, {args.new_tokens} new, batch 1, median of "
            f"{args.rounds} runs after a warm-up" + (f"; tegrastats every {args.interval} ms" if stats else "")
            + "\n\n" + table(rows, stats, idle, rail))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
