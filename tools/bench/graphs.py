"""Where a decode step's time goes, per graph and per operator, and session settings side by side.

    python -m tools.bench.graphs NAME=DIR[:option...] [NAME=DIR[:option...] ...] [--steps 200]
    python -m tools.bench.graphs base=DIR --profile             # + per-operator totals per graph

Every candidate (an artifact directory and ONNX Runtime session options) is loaded into one
process and their decode steps alternate (A, B, A, B, ...), so a shared machine's load falls on
all candidates alike. A step is what the runtime's decode runs at ``--batch`` rows (default 1):
embed, every layer at a ``--width`` past, head, with the graphs' own sessions. A layer timed in a
loop reads its weights from the L3 cache (an OPT-125m layer is 28 MB); timed inside a step, from
memory, as decode does.

Reported per candidate: median and 10th-percentile ms of the step, the process's CPU time per
step (steadier than wall time on a loaded machine), median ms of each graph kind and the bytes
per second it reads (its initializers' bytes over its time), against the measured memory read
bandwidth (tools.bench.bandwidth, the higher of a probe before and one after the steps): the
step's floor is the layers' and head's bytes over it (the embedding is a lookup: a step reads one
row of its table; the rows' K/V is not counted, which matters at a large ``--batch``).

Options: ``noprepack`` (``session.disable_prepacking``: MatMul/Gemm read the weights as stored
instead of MLAS's packed copy), ``spin`` (the backend's ``spin=True``: the graphs of every spin
candidate on the process's one pool, whose workers busy-wait for the next operator instead of
sleeping; loaded after the others, which keep pools of their own, but whose steps then compete
with that pool's spinning worker: compare spin candidates with each other, or in runs of their
own), ``huge`` (the backend's ``huge_pages=True``: the
packed weights moved onto 2 MiB pages), ``bind`` (IOBinding with outputs bound once to
preallocated buffers). Without options a candidate's sessions are the backend's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime import cli
from runtime.errors import InvalidArgumentError
from runtime.platform import hugepages

OPTIONS = ("noprepack", "spin", "huge", "bind")


@dataclass
class Candidate:
    name: str
    directory: Path
    options: tuple[str, ...]
    sessions: dict = field(default_factory=dict)  # graph name -> InferenceSession
    bytes: dict = field(default_factory=dict)  # graph name -> initializer bytes it reads
    times: dict = field(default_factory=lambda: defaultdict(list))  # graph name -> seconds per call
    steps: list = field(default_factory=list)  # seconds per step
    cpu: list = field(default_factory=list)  # CPU seconds of the process's threads per step


def parse_candidate(text: str) -> Candidate:
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise InvalidArgumentError(f"candidate {text!r}: write NAME=DIR[:option...], e.g. base=.bench/opt-125m/artifact")
    directory, *options = rest.split(":")
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        raise InvalidArgumentError(f"candidate {text!r}: unknown option(s) {unknown}; choose from {', '.join(OPTIONS)}")
    if not (Path(directory) / "manifest.json").is_file():
        raise InvalidArgumentError(f"candidate {text!r}: {directory} holds no manifest.json; pass an artifact directory")
    return Candidate(name, Path(directory), tuple(options))


def initializer_bytes(path: Path) -> int:
    """Bytes of a graph's initializers (external data included), i.e. what one run reads."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    total = 0
    for t in model.graph.initializer:
        size = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        total += int(np.prod(t.dims, dtype=np.int64)) * size
    return total


def session_options(ort, candidate: Candidate, threads: int, profile_dir: Path | None):
    """The backend's own SessionOptions (runtime.backends.onnxruntime), changed as the candidate asks."""
    from runtime.backends.onnxruntime import session_options as backend_options

    opts = backend_options(ort, threads, spin="spin" in candidate.options)
    if "noprepack" in candidate.options:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    if profile_dir is not None:
        opts.enable_profiling = True  # into profile_dir, one file per graph (load)
    return opts


def load(ort, candidate: Candidate, threads: int, profile_dir: Path | None) -> dict:
    manifest = json.loads((candidate.directory / "manifest.json").read_text())
    names = [g["name"] for g in manifest["graphs"]]
    before = hugepages.snapshot() if "huge" in candidate.options else None
    for name in ["head", *(n for n in names if n != "head")]:  # the runtime's order (peak memory)
        path = candidate.directory / f"{name}.onnx"
        opts = session_options(ort, candidate, threads, profile_dir)
        if profile_dir is not None:  # one prefix per graph: ONNX Runtime names a profile by the millisecond
            opts.profile_file_prefix = str(profile_dir / f"{candidate.name}-{name}")
        candidate.sessions[name] = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        candidate.bytes[name] = initializer_bytes(path)
    hugepages.collapse_new(before)  # as the backend does with huge_pages=True
    return {**manifest["model"], "dtype": manifest["dtype"]}


class Runner:
    """One candidate's decode step at ``batch`` rows: plain ``session.run`` or IOBinding with its
    outputs bound once (the hidden state ping-pongs between two preallocated buffers)."""

    def __init__(self, candidate: Candidate, model: dict, width: int, valid: int, seed: int = 0, batch: int = 1):
        self.c = candidate
        rng = np.random.default_rng(seed)
        # The K/V hold the KV heads only under grouped-query attention (the manifest's num_kv_heads)
        nh = model.get("num_kv_heads") or model["num_heads"]
        hd, D, L = model["head_dim"], model["hidden_size"], model["num_layers"]
        self.dtype = np.dtype(model["dtype"])
        self.layers = [f"layer_{i:02d}" for i in range(L)]
        B = self.batch = batch
        self.past = [(rng.standard_normal((B, nh, hd, width), dtype=np.float32).astype(self.dtype),
                      rng.standard_normal((B, nh, width, hd), dtype=np.float32).astype(self.dtype))
                     for _ in range(L)]  # (B, nh, hd, W), (B, nh, W, hd)
        self.mask = np.zeros((B, width + 1), np.int64)
        self.mask[:, :valid] = 1
        self.mask[:, -1] = 1
        self.ids = np.full((B, 1), model["bos_token_id"], np.int64)
        self.bind = "bind" in candidate.options
        if self.bind:
            self._setup_binding(D, nh, hd, model["vocab_size"])

    def _setup_binding(self, D, nh, hd, V):
        s = self.c.sessions
        B = self.batch
        self.hidden = [np.zeros((B, 1, D), self.dtype), np.zeros((B, 1, D), self.dtype)]  # ping-pong
        self.new_kv = (np.zeros((B, nh, 1, hd), self.dtype), np.zeros((B, nh, 1, hd), self.dtype))
        self.logits = np.zeros((B, 1, V), self.dtype)
        self.io = {}
        io = s["embed"].io_binding()
        io.bind_cpu_input("input_ids", self.ids)
        io.bind_cpu_input("attention_mask", self.mask)
        _bind_out(io, "hidden_states", self.hidden[0])
        self.io["embed"] = io
        for i, name in enumerate(self.layers):
            src, dst = self.hidden[i % 2], self.hidden[(i + 1) % 2]
            io = s[name].io_binding()
            io.bind_cpu_input("hidden_states", src)
            io.bind_cpu_input("attention_mask", self.mask)
            io.bind_cpu_input("past_key", self.past[i][0])
            io.bind_cpu_input("past_value", self.past[i][1])
            _bind_out(io, "hidden_states_out", dst)
            _bind_out(io, "new_key", self.new_kv[0])
            _bind_out(io, "new_value", self.new_kv[1])
            self.io[name] = io
        io = s["head"].io_binding()
        io.bind_cpu_input("hidden_states", self.hidden[len(self.layers) % 2])
        _bind_out(io, "logits", self.logits)
        self.io["head"] = io

    def _call(self, name, feeds):
        start = time.perf_counter()
        if self.bind:
            self.c.sessions[name].run_with_iobinding(self.io[name])
            out = None
        else:
            out = self.c.sessions[name].run(None, feeds)
        self.c.times[name].append(time.perf_counter() - start)
        return out

    def step(self, record: bool = True) -> np.ndarray:
        """One step; returns its logits (B, 1, V)."""
        cpu = time.process_time()
        start = time.perf_counter()
        out = self._call("embed", {"input_ids": self.ids, "attention_mask": self.mask})
        hidden = None if out is None else out[0]
        for i, name in enumerate(self.layers):
            out = self._call(name, None if self.bind else {
                "hidden_states": hidden, "attention_mask": self.mask,
                "past_key": self.past[i][0], "past_value": self.past[i][1]})
            hidden = None if out is None else out[0]
        out = self._call("head", None if self.bind else {"hidden_states": hidden})
        logits = self.logits.copy() if self.bind else out[0]
        if record:
            self.c.steps.append(time.perf_counter() - start)
            self.c.cpu.append(time.process_time() - cpu)
        else:
            for t in self.c.times.values():
                t.pop()
        return logits


def _bind_out(io, name: str, array: np.ndarray) -> None:
    io.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)


def kind(graph: str) -> str:
    return "layer" if graph.startswith("layer_") else graph


def summary(c: Candidate, bandwidth: float) -> dict:
    per_kind = defaultdict(list)
    for graph, times in c.times.items():
        per_kind[kind(graph)].append(statistics.median(times))
    # the embedding is a lookup: a step reads the rows of its tokens, not the table
    total_bytes = sum(b for g, b in c.bytes.items() if g != "embed")
    out = {"candidate": c.name, "options": list(c.options), "step_ms": statistics.median(c.steps) * 1e3,
           "step_p10_ms": float(np.percentile(c.steps, 10)) * 1e3, "cpu_ms": statistics.median(c.cpu) * 1e3,
           "floor_ms": total_bytes / bandwidth * 1e3, "weight_mb": total_bytes / 1e6}
    out["x_floor"] = out["step_ms"] / out["floor_ms"]
    for k, medians in per_kind.items():
        ms = statistics.mean(medians) * 1e3  # mean over the graphs of that kind of each one's median
        nbytes = statistics.mean(c.bytes[g] for g in c.times if kind(g) == k)
        out[f"{k}_ms"] = ms
        out[f"{k}_gbps"] = nbytes / (ms / 1e3) / 1e9
    return out


def profile_totals(files: list[Path]) -> dict:
    """Per graph kind: mean microseconds per call by operator type, and the run's own overhead
    (model_run minus the kernels it ran). ``files``: profiles named CANDIDATE-GRAPH.json."""
    totals: dict = defaultdict(lambda: defaultdict(float))
    runs: dict = defaultdict(int)
    for path in files:
        graph = kind(path.stem.rsplit("-", 1)[-1])
        kernels = model_run = 0.0
        for e in json.loads(path.read_text()):
            if e.get("cat") == "Session" and e.get("name") == "model_run":
                model_run += e["dur"]
                runs[graph] += 1
            elif e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
                totals[graph][e.get("args", {}).get("op_name", "?")] += e["dur"]
                kernels += e["dur"]
        totals[graph]["(outside kernels)"] += model_run - kernels
    return {g: {op: dur / max(runs[g], 1) for op, dur in sorted(ops.items(), key=lambda kv: -kv[1])}
            for g, ops in totals.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.graphs", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("candidates", nargs="+", help="NAME=DIR[:option...]; options: " + ", ".join(OPTIONS))
    p.add_argument("--steps", type=int, default=200, help="timed steps per candidate (default 200)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per candidate first (default 10)")
    p.add_argument("--width", type=int, default=64, help="bound past width W (default 64: two pages)")
    p.add_argument("--valid", type=int, default=40, help="valid past positions of the row (default 40)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads per session (default 2)")
    p.add_argument("--batch", type=int, default=1, help="rows a step decodes (default 1)")
    p.add_argument("--profile", metavar="DIR", help="write ONNX Runtime profiles there and print per-operator totals")
    p.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    p.add_argument("--bandwidth-mib", type=int, default=1024,
                   help="array the bandwidth is measured on, MiB (default 1024: larger than any cache)")
    args = p.parse_args(argv)
    return cli.run(lambda: _main(args))


def _main(args) -> int:
    from . import bandwidth as bandwidth_mod

    for name, value, least in (("--steps", args.steps, 1), ("--width", args.width, 1), ("--valid", args.valid, 0),
                               ("--threads", args.threads, 1), ("--warmup", args.warmup, 0), ("--batch", args.batch, 1),
                               ("--bandwidth-mib", args.bandwidth_mib, 1)):
        if value < least:
            raise InvalidArgumentError(f"{name} must be >= {least}, got {value}")
    if args.valid > args.width:
        raise InvalidArgumentError(f"--valid {args.valid} exceeds --width {args.width}")
    candidates = [parse_candidate(c) for c in args.candidates]
    if len({c.name for c in candidates}) != len(candidates):
        raise InvalidArgumentError("candidate names must differ")
    import onnxruntime as ort

    profile_dir = Path(args.profile) if args.profile else None
    if profile_dir:
        profile_dir.mkdir(parents=True, exist_ok=True)
    bw = bandwidth_mod.measure(args.threads, array_bytes=args.bandwidth_mib << 20)
    runners = {}
    # spin candidates last: the first makes the process's one spinning pool, after which ONNX
    # Runtime gives no session a pool of its own (runtime.backends.onnxruntime.new_session_options)
    for c in sorted(candidates, key=lambda c: "spin" in c.options):
        model = load(ort, c, args.threads, profile_dir)
        runners[c.name] = Runner(c, model, args.width, args.valid, batch=args.batch)
    runners = [runners[c.name] for c in candidates]
    for _ in range(args.warmup):
        for r in runners:
            r.step(record=False)
    for _ in range(args.steps):
        for r in runners:
            r.step()
    best = max(bw.best, bandwidth_mod.measure(args.threads, array_bytes=args.bandwidth_mib << 20).best)
    rows = [summary(c, best) for c in candidates]
    print(f"memory read bandwidth {best / 1e9:.1f} GB/s ({args.threads} threads; the higher of a probe "
          f"before and after the steps); batch {args.batch}, past width "
          f"{args.width} ({args.valid} valid), {args.steps} alternating steps per candidate; medians")
    print("| candidate | step ms | step ms p10 | CPU ms/step | × floor | embed ms | layer ms | layer GB/s | head ms | head GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['candidate']} | {r['step_ms']:.2f} | {r['step_p10_ms']:.2f} | {r['cpu_ms']:.2f} | {r['x_floor']:.2f} | "
              f"{r.get('embed_ms', 0):.3f} | "
              f"{r.get('layer_ms', 0):.3f} | {r.get('layer_gbps', 0):.1f} | {r.get('head_ms', 0):.3f} | "
              f"{r.get('head_gbps', 0):.1f} |")
    if profile_dir:
        for c in candidates:
            files = []
            for name, session in c.sessions.items():
                path = Path(session.end_profiling())
                target = profile_dir / f"{c.name}-{name}.json"
                path.replace(target)
                files.append(target)
            for graph, ops in profile_totals(files).items():
                top = ", ".join(f"{op} {us:.0f}" for op, us in list(ops.items())[:8])
                print(f"{c.name} {graph}: µs per call: {top}")
    if args.json:
        Path(args.json).write_text(json.dumps({"bandwidth": best, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
