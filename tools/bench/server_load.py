"""``python -m tools.bench.server_load ARTIFACT``: load-test ``python -m runtime serve`` over HTTP.

Starts the server in a subprocess on 127.0.0.1 (``--replicas 0``: one Generator, no Ray; ``N``: N
replicas on Ray Serve; several values: one server after the other), then for each SkipDecode
speedup and each number of concurrent clients sends streaming /v1/completions requests (``--whole``:
non-streamed ones; each client sends its next one when the previous ends) and prints a Markdown table: throughput
(completion tokens and requests per second over the level's wall time) and p50/p90 of time to
first token, time per output token after the first, and whole-request latency. Needs the serve
extra (httpx; Ray for --replicas).

``--kill-replica-after S`` is the fault test instead: clients send requests for ``--duration``
seconds, one replica process is killed (SIGKILL) S seconds in, and every request is counted as
completed, failed (an HTTP error, an error event, a stream cut before [DONE]) or lost (no answer
within ``--request-timeout``), split by whether it started before the kill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from .stats import percentile


@dataclass
class Sample:
    ttft: float | None  # seconds from sending the request to its first text (None: a whole answer)
    latency: float  # seconds from sending to [DONE] (to the answer)
    tokens: int  # completion tokens (usage)


class RequestFailed(RuntimeError):
    """A request the server answered with an error, or whose stream ended before [DONE]."""


def load_prompts(path: str, column: str) -> list[str]:
    """The unique values of ``column``, in file order, from a .csv / .jsonl, optionally gzip (.gz)."""
    from tools.finetune.data import DataError, read_rows

    rows = read_rows(path)
    if column not in rows[0]:
        raise DataError(f"{path} has no column {column!r}; its columns are {', '.join(map(repr, rows[0]))}")
    return list(dict.fromkeys(str(row[column]) for row in rows))


async def one_request(client, body: dict) -> Sample:
    start = time.perf_counter()
    if not body["stream"]:  # a whole answer: its latency and tokens only
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            raise RequestFailed(f"HTTP {r.status_code}: {r.text[:300]}")
        return Sample(None, time.perf_counter() - start, r.json()["usage"]["completion_tokens"])
    first, tokens = None, None
    import httpx

    done = False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RequestFailed(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RequestFailed(f"error in stream: {chunk['error']}")
                if first is None and any(c["text"] for c in chunk["choices"]):
                    first = time.perf_counter()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.RemoteProtocolError as exc:  # the server (a replica) went away mid-response
        raise RequestFailed(f"stream cut: {exc}") from None
    if not done:
        raise RequestFailed("the stream ended without data: [DONE]")
    end = time.perf_counter()
    return Sample((first or end) - start, end - start, tokens or 0)


async def whole_request(client, body: dict) -> None:
    """A non-streamed request; RequestFailed unless it is answered 200 with its choices."""
    whole = {k: v for k, v in body.items() if k != "stream_options"}  # OpenAI allows it with streams only
    r = await client.post("/v1/completions", json={**whole, "stream": False})
    if r.status_code != 200:
        raise RequestFailed(f"HTTP {r.status_code}: {r.text[:300]}")


async def run_level(url: str, prompts: list[str], clients: int, requests: int, body: dict) -> tuple[list[Sample], float]:
    import httpx

    queue = list(range(requests))
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker() -> None:
            while queue:
                i = queue.pop()
                samples.append(await one_request(client, {**body, "prompt": prompts[i % len(prompts)]}))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - start
    return samples, wall


def ms(x: float) -> str:
    return f"{x * 1e3:.0f}"


def server_label(replicas: int) -> str:
    return "1 (no Ray)" if replicas == 0 else f"{replicas} (Ray)"


def row(replicas: int, speedup: float, clients: int, samples: list[Sample], wall: float) -> str:
    tokens = sum(s.tokens for s in samples)
    lat = [s.latency for s in samples]
    if any(s.ttft is None for s in samples):  # whole answers: no first token seen
        ttft = tpot = "-"
    else:
        firsts = [s.ttft for s in samples]
        per = [(s.latency - s.ttft) / (s.tokens - 1) for s in samples if s.tokens > 1]
        ttft = f"{ms(percentile(firsts, 50))} / {ms(percentile(firsts, 90))}"
        tpot = f"{percentile(per, 50) * 1e3:.1f} / {percentile(per, 90) * 1e3:.1f}"
    return (f"| {server_label(replicas)} | {speedup:g}x | {clients} | {len(samples)} | {tokens / len(samples):.1f} | "
            f"{tokens / wall:.0f} | {len(samples) / wall:.1f} | {ttft} | {tpot} | "
            f"{ms(percentile(lat, 50))} / {ms(percentile(lat, 90))} |")


HEADER = ("| replicas | speedup | clients | requests | tokens/request | tokens/s | requests/s | TTFT p50 / p90 ms "
          "| per output token p50 / p90 ms | latency p50 / p90 ms |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was up")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not up within {timeout:g} s")


def replica_pids() -> list[int]:
    """Process ids of the Ray Serve replicas of ``python -m runtime serve --replicas`` on this machine."""
    from runtime.serve.replicas import APP_NAME, DEPLOYMENT

    tag = f"ServeReplica:{APP_NAME}:{DEPLOYMENT}"
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    return sorted(int(line.split(None, 1)[0]) for line in out.splitlines() if tag in line)


@dataclass
class Fault:
    """The fault test's counts: requests started before / after the kill, by outcome."""

    killed: int  # the replica's process id
    in_flight: int  # requests in flight (on any replica) when it was killed
    outcomes: dict  # ("before" | "after", "completed" | "failed" | "lost") -> count
    errors: list  # a few failures' messages

    def table(self) -> str:
        lines = ["| requests | completed | failed | lost |", "|---|---|---|---|"]
        for when in ("before", "after"):
            c = [self.outcomes.get((when, k), 0) for k in ("completed", "failed", "lost")]
            lines.append(f"| started {when} the kill | {c[0]} | {c[1]} | {c[2]} |")
        return "\n".join(lines)


async def fault_run(url: str, prompts: list[str], clients: int, duration: float, kill_after: float,
                    timeout: float, body: dict, kill=None, headers: dict | None = None) -> Fault:
    """Clients send requests for ``duration`` s (every other client streams); ``kill_after`` s in,
    ``kill()`` (default: SIGKILL to the first replica process) takes one replica down. Each request
    is counted as completed, failed or lost, by whether it started before the kill."""
    import httpx

    outcomes: dict = {}
    errors: list = []
    in_flight = 0
    killed_at = None
    state = {"pid": 0, "in_flight": 0}

    def default_kill() -> int:
        pid = replica_pids()[0]
        os.kill(pid, signal.SIGKILL)
        return pid

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, headers=headers) as client:
        start = time.monotonic()

        async def worker(w: int) -> None:
            nonlocal in_flight
            i = w
            while time.monotonic() - start < duration:
                began = time.monotonic()
                in_flight += 1
                try:
                    send = one_request if w % 2 == 0 else whole_request
                    await send(client, {**body, "prompt": prompts[i % len(prompts)]})
                    outcome = "completed"
                except httpx.TimeoutException:
                    outcome = "lost"
                except (RequestFailed, httpx.TransportError) as exc:
                    outcome = "failed"
                    if len(errors) < 5:
                        errors.append(str(exc)[:200])
                finally:
                    in_flight -= 1
                when = "before" if killed_at is None or began < killed_at else "after"
                outcomes[(when, outcome)] = outcomes.get((when, outcome), 0) + 1
                i += clients

        async def killer() -> None:
            nonlocal killed_at
            await asyncio.sleep(kill_after)
            state["in_flight"] = in_flight
            state["pid"] = (kill or default_kill)()
            killed_at = time.monotonic()

        await asyncio.gather(killer(), *(worker(w) for w in range(clients)))
    return Fault(state["pid"], state["in_flight"], outcomes, errors)


def start_server(args, replicas: int, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """``python -m runtime serve`` of ``args.artifact`` on a free port (``extra``: more of its options)."""
    port = free_port()
    cmd = [sys.executable, "-m", "runtime", "serve", args.artifact, "--port", str(port), "--max-batch",
           str(args.max_batch), "--threads", str(args.threads), "--no-access-log", "--log-level", "warning",
           *extra]
    if replicas:
        cmd += ["--replicas", str(replicas)]
    print("server:", " ".join(cmd[1:]), flush=True)
    return subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}), f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.server_load", description=__doc__.splitlines()[0])
    p.add_argument("artifact", help="artifact directory (python -m export build)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 32], help="concurrency levels (default 1 4 16 32)")
    p.add_argument("--requests-per-client", type=int, default=4,
                   help="requests per level = clients x this, at least --min-requests (default 4)")
    p.add_argument("--min-requests", type=int, default=16, help="fewest requests per level (default 16)")
    p.add_argument("--speedups", type=float, nargs="+", default=[1, 2], help="SkipDecode speedups (default 1 2)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default 64)")
    p.add_argument("--ignore-eos", action="store_true", help="generate max_tokens every time")
    p.add_argument("--whole", action="store_true",
                   help="non-streamed requests (whole answers: latency and throughput, no TTFT or per-token time)")
    p.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch, per replica (default 8)")
    p.add_argument("--threads", type=int, default=1, help="the server's intra-op threads, per replica (default 1)")
    p.add_argument("--replicas", type=int, nargs="+", default=[0],
                   help="0: one Generator, no Ray (default); N: N replicas on Ray Serve; several: each in turn")
    p.add_argument("--prompts", default="data/e2e/devset.csv.gz",
                   help="CSV of prompts, plain or gzip (default data/e2e/devset.csv.gz, the shipped E2E "
                        "development split)")
    p.add_argument("--prompt-column", default="mr", help="its prompt column (default mr)")
    p.add_argument("--warmup", type=int, default=8, help="untimed requests first (default 8)")
    fault = p.add_argument_group("fault test (needs --replicas N >= 2)")
    fault.add_argument("--kill-replica-after", type=float, metavar="S",
                       help="kill one replica S seconds into the run and count completed / failed / lost requests")
    fault.add_argument("--duration", type=float, default=20.0, help="seconds the fault test's clients send requests")
    fault.add_argument("--request-timeout", type=float, default=60.0,
                       help="seconds after which the fault test counts a request as lost")
    args = p.parse_args(argv)
    if args.kill_replica_after is not None and (len(args.replicas) != 1 or args.replicas[0] < 2):
        print("error: --kill-replica-after needs one --replicas N with N >= 2 (a replica must survive)",
              file=sys.stderr)
        return 2
    try:
        import httpx  # noqa: F401
    except ImportError:
        print('error: python -m tools.bench.server_load needs httpx: pip install -e ".[serve]"', file=sys.stderr)
        return 2
    from tools.finetune.data import DataError

    from .serving import data_path

    try:
        prompts = load_prompts(str(data_path(args.prompts)), args.prompt_column)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lines = [HEADER]
    for replicas in args.replicas:
        proc, url = start_server(args, replicas)
        try:
            wait_healthy(url, proc, timeout=300)
            for speedup in args.speedups:
                body = {"max_tokens": args.max_tokens, "temperature": 0, "speedup": speedup, "stream": not args.whole,
                        "ignore_eos": args.ignore_eos}
                if not args.whole:
                    body["stream_options"] = {"include_usage": True}
                asyncio.run(run_level(url, prompts, min(args.warmup, 8) or 1, args.warmup, body))
                if args.kill_replica_after is not None:
                    result = asyncio.run(fault_run(url, prompts, args.clients[0], args.duration,
                                                   args.kill_replica_after, args.request_timeout, body))
                    print(f"\nkilled replica process {result.killed} with {result.in_flight} requests in flight "
                          f"(on all replicas); {args.clients[0]} clients, {args.duration:g} s\n")
                    print(result.table())
                    for error in result.errors:
                        print("  failure:", error)
                    return 0
                for clients in args.clients:
                    n = max(clients * args.requests_per_client, args.min_requests)
                    samples, wall = asyncio.run(run_level(url, prompts, clients, n, body))
                    lines.append(row(replicas, speedup, clients, samples, wall))
                    print(lines[-1], flush=True)
        finally:
            stop_server(proc)
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
