"""``python -m tools.bench.server_load ARTIFACT``: load-test ``python -m runtime serve`` over HTTP.

Starts the server in a subprocess on 127.0.0.1, then for each SkipDecode speedup and each number
of concurrent clients sends streaming /v1/completions requests (each client sends its next one when
the previous ends) and prints a Markdown table: throughput (completion tokens and requests per
second over the level's wall time) and p50/p90 of time to first token, time per output token
after the first, and whole-request latency. Needs the serve extra (httpx).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from .stats import percentile


@dataclass
class Sample:
    ttft: float  # seconds from sending the request to its first text
    latency: float  # seconds from sending to [DONE]
    tokens: int  # completion tokens (usage)


def load_prompts(path: str, column: str) -> list[str]:
    """The unique values of ``column``, in file order, from a .csv / .jsonl, optionally gzip (.gz)."""
    from tools.finetune.data import DataError, read_rows

    rows = read_rows(path)
    if column not in rows[0]:
        raise DataError(f"{path} has no column {column!r}; its columns are {', '.join(map(repr, rows[0]))}")
    return list(dict.fromkeys(str(row[column]) for row in rows))


async def one_request(client, body: dict) -> Sample:
    start = time.perf_counter()
    first, tokens = None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error in stream: {chunk['error']}")
            if first is None and any(c["text"] for c in chunk["choices"]):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return Sample((first or end) - start, end - start, tokens or 0)


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


def row(speedup: float, clients: int, samples: list[Sample], wall: float) -> str:
    tokens = sum(s.tokens for s in samples)
    tpot = [(s.latency - s.ttft) / (s.tokens - 1) for s in samples if s.tokens > 1]
    ttft, lat = [s.ttft for s in samples], [s.latency for s in samples]
    return (f"| {speedup:g}x | {clients} | {len(samples)} | {tokens / len(samples):.1f} | {tokens / wall:.0f} | "
            f"{len(samples) / wall:.1f} | {ms(percentile(ttft, 50))} / {ms(percentile(ttft, 90))} | "
            f"{percentile(tpot, 50) * 1e3:.1f} / {percentile(tpot, 90) * 1e3:.1f} | "
            f"{ms(percentile(lat, 50))} / {ms(percentile(lat, 90))} |")


HEADER = ("| speedup | clients | requests | tokens/request | tokens/s | requests/s | TTFT p50 / p90 ms "
          "| per output token p50 / p90 ms | latency p50 / p90 ms |\n"
          "|---|---|---|---|---|---|---|---|---|")


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
    p.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch (default 8)")
    p.add_argument("--threads", type=int, default=1, help="the server's intra-op threads (default 1)")
    p.add_argument("--prompts", default="data/e2e/devset.csv.gz",
                   help="CSV of prompts, plain or gzip (default data/e2e/devset.csv.gz, the shipped E2E "
                        "development split)")
    p.add_argument("--prompt-column", default="mr", help="its prompt column (default mr)")
    p.add_argument("--warmup", type=int, default=8, help="untimed requests first (default 8)")
    args = p.parse_args(argv)
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
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "runtime", "serve", args.artifact, "--port", str(port), "--max-batch",
           str(args.max_batch), "--threads", str(args.threads), "--no-access-log", "--log-level", "warning"]
    print("server:", " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(url, proc, timeout=300)
        lines = [HEADER]
        for speedup in args.speedups:
            body = {"max_tokens": args.max_tokens, "temperature": 0, "speedup": speedup, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
            asyncio.run(run_level(url, prompts, min(args.warmup, 8) or 1, args.warmup, body))
            for clients in args.clients:
                n = max(clients * args.requests_per_client, args.min_requests)
                samples, wall = asyncio.run(run_level(url, prompts, clients, n, body))
                lines.append(row(speedup, clients, samples, wall))
                print(lines[-1], flush=True)
        print("\n" + "\n".join(lines))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
