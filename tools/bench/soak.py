"""``python -m tools.bench.soak ARTIFACT``: a mixed load on ``python -m runtime serve``, as users send it.

Starts the server on 127.0.0.1 (one Generator, ``--api-key``), then runs ``--rounds`` rounds of
``--requests`` requests from ``--clients`` threads through the official ``openai`` client: greedy
plain, SkipDecode 2x, lossless 2x (4x as long), a long shared prefix, JSON-schema output (where llguidance is
installed), sampled, streams abandoned after two chunks, and bad requests. Before the first round
each greedy request runs alone once: its text is the reference every loaded run of it must give.

Prints one row per round: requests, 2xx, the bad requests' 4xx, 5xx and other failures, greedy
answers identical to their reference, abandoned streams, and the server's resident memory after
the round; then a SIGTERM while streams run: how many finished, the exit code and how long it
took. Exits 1 when any request got a 5xx or failed otherwise, or SIGTERM lost a stream (greedy
differences are reported, not failed on: int8/int4 artifacts are not batch-invariant yet).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .server_load import load_prompts, start_server, stop_server, wait_healthy

API_KEY = "soak-key"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "rating": {"type": "integer"}},
          "required": ["name", "rating"]}
PREFIX_WORDS = ("You are a concise assistant for a restaurant guide. Answer in one sentence, name the venue, "
                "and say nothing you were not told. ").split()


@dataclass(frozen=True)
class Kind:
    """One sort of request of the mix."""

    name: str
    extra: dict = field(default_factory=dict)  # body fields beyond the prompt and max_tokens
    greedy: bool = True  # its text must equal its reference
    abandon: bool = False  # a stream closed after two chunks
    bad: bool = False  # must get a 4xx
    prefix: bool = False  # the long shared prefix before the prompt
    tokens: int = 1  # max_tokens, in --max-tokens: lossless rows run long, so their verify passes
    # carry the other rows along across many page boundaries (where issue 55's 500s were)


def kinds(json_output: bool) -> list[Kind]:
    mix = [Kind("plain"), Kind("skip 2x", {"speedup": 2}),
           Kind("lossless 2x", {"speedup": 2, "lossless": True}, tokens=4),
           Kind("shared prefix", prefix=True), Kind("sampled", {"temperature": 0.8}, greedy=False),
           Kind("abandoned", greedy=False, abandon=True), Kind("bad", {"max_tokens": -3}, greedy=False, bad=True)]
    if json_output:
        mix.append(Kind("json", {"response_format": {"type": "json_schema", "json_schema": {"name": "venue",
                                                                                          "schema": SCHEMA}}}))
    return mix


@dataclass
class Outcome:
    kind: Kind
    status: str  # ok, 4xx, 5xx, error, abandoned
    text: str = ""
    key: tuple = ()  # (kind, prompt): the greedy reference it is compared with
    detail: str = ""


def body(kind: Kind, prompt: str, prefix: str, max_tokens: int, seed: int) -> dict:
    extra = dict(kind.extra)
    if kind.name == "sampled":
        extra["seed"] = seed
    elif kind.greedy:
        extra["temperature"] = 0  # OpenAI's default is 1: sampled
    return {"prompt": (prefix + prompt) if kind.prefix else prompt, "max_tokens": max_tokens * kind.tokens, **extra}


def send(client, model: str, kind: Kind, request: dict) -> Outcome:
    import openai

    fields = dict(request)
    prompt, max_tokens = fields.pop("prompt"), fields.pop("max_tokens")
    known = {k: fields.pop(k) for k in ("temperature", "seed") if k in fields}  # the rest: extra_body
    try:
        if kind.abandon:
            stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                               extra_body=fields, **known)
            for i, _ in enumerate(stream):
                if i == 1:
                    break
            stream.close()
            return Outcome(kind, "abandoned")
        done = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                         extra_body=fields or None, **known)
        return Outcome(kind, "ok", done.choices[0].text)
    except openai.APIStatusError as exc:
        return Outcome(kind, "5xx" if exc.status_code >= 500 else "4xx", detail=str(exc)[:300])
    except openai.APIError as exc:
        return Outcome(kind, "error", detail=str(exc)[:300])


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def sigterm(proc: subprocess.Popen, client, model: str, prompts: list[str], streams: int,
            max_tokens: int) -> tuple[int, int, float]:
    """SIGTERM while ``streams`` streams run: (streams that ended with a finish reason, exit code, seconds)."""
    finished = []

    def one(prompt):
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                           extra_body={"ignore_eos": True})
        reason = None
        for chunk in stream:
            reason = chunk.choices[0].finish_reason if chunk.choices else reason
        finished.append(reason is not None)

    threads = [threading.Thread(target=one, args=(p,)) for p in itertools.islice(itertools.cycle(prompts), streams)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the streams are under way
    began = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    seconds = time.perf_counter() - began
    for t in threads:
        t.join(timeout=30)
    return sum(finished), code, seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.soak", description=__doc__.splitlines()[0])
    p.add_argument("artifact", help="artifact directory (python -m export build)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the mix (default 3)")
    p.add_argument("--requests", type=int, default=240, help="requests a round (default 240)")
    p.add_argument("--clients", type=int, default=16, help="client threads (default 16)")
    p.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch (default 8)")
    p.add_argument("--threads", type=int, default=2, help="the server's intra-op threads (default 2)")
    p.add_argument("--max-tokens", type=int, default=48, help="max_tokens a request (default 48)")
    p.add_argument("--prefix-words", type=int, default=250,
                   help="words of the shared prefix the 'shared prefix' requests start with (default 250, ~330 tokens)")
    p.add_argument("--prompts", default="data/e2e/devset.csv.gz", help="CSV of prompts (default: the E2E dev split's MRs)")
    p.add_argument("--prompt-column", default="mr", help="its prompt column (default mr)")
    p.add_argument("--distinct", type=int, default=12, help="distinct prompts the mix draws from (default 12)")
    p.add_argument("--sigterm-streams", type=int, default=4, help="streams running at the SIGTERM (default 4)")
    p.add_argument("--seed", type=int, default=0, help="the mix's order (default 0)")
    args = p.parse_args(argv)
    try:
        import openai
    except ImportError as exc:
        raise SystemExit(f"tools.bench.soak sends requests with the official openai client, which is not "
                         f"installed ({exc}); pip install openai") from None
    import importlib.util

    prompts = load_prompts(args.prompts, args.prompt_column)[: args.distinct]
    prefix = " ".join(itertools.islice(itertools.cycle(PREFIX_WORDS), args.prefix_words)) + "\n"
    mix = kinds(importlib.util.find_spec("llguidance") is not None)
    proc, url = start_server(args, 0, extra=("--api-key", API_KEY))
    failed = False
    try:
        wait_healthy(url, proc, timeout=300)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=600)
        model = client.models.list().data[0].id  # the id the server serves
        references = {}
        for kind, prompt in itertools.product([k for k in mix if k.greedy], prompts):
            alone = send(client, model, kind, body(kind, prompt, prefix, args.max_tokens, 0))
            if alone.status != "ok":
                raise RuntimeError(f"{kind.name} alone failed: {alone.status} {alone.detail}")
            references[kind.name, prompt] = alone.text
        print(f"\n{len(mix)} kinds of request: {', '.join(k.name for k in mix)}; {len(references)} greedy references, "
              f"each run alone first\n")
        print("| round | requests | 2xx | bad -> 4xx | 5xx | other failures | greedy identical | abandoned | RSS MB |")
        print("|---|---|---|---|---|---|---|---|---|")
        rng = random.Random(args.seed)
        for round_ in range(1, args.rounds + 1):
            plan = [(rng.choice(mix), rng.choice(prompts), rng.randrange(1 << 30)) for _ in range(args.requests)]

            def run(item):
                kind, prompt, seed = item
                outcome = send(client, model, kind, body(kind, prompt, prefix, args.max_tokens, seed))
                outcome.key = (kind.name, prompt)
                return outcome

            with ThreadPoolExecutor(args.clients) as pool:
                outcomes = list(pool.map(run, plan))
            count = lambda status: sum(o.status == status for o in outcomes)  # noqa: E731
            bad = [o for o in outcomes if o.kind.bad]
            greedy = [o for o in outcomes if o.kind.greedy and o.status == "ok"]
            same = sum(o.text == references[o.key] for o in greedy)
            others = [o for o in outcomes if o.status in ("error", "5xx") or (o.status == "4xx" and not o.kind.bad)]
            print(f"| {round_} | {len(outcomes)} | {count('ok')} | {sum(o.status == '4xx' for o in bad)} of {len(bad)} | "
                  f"{count('5xx')} | {len(others) - count('5xx')} | {same} of {len(greedy)} | {count('abandoned')} | "
                  f"{rss_mb(proc.pid):.0f} |", flush=True)
            differ = collections.Counter(o.kind.name for o in greedy if o.text != references[o.key])
            if differ:
                print(f"  greedy answers unlike their reference, by kind: "
                      f"{', '.join(f'{k} {n}' for k, n in differ.most_common())}", file=sys.stderr)
            for o in others[:3]:
                print(f"  {o.kind.name}: {o.status} {o.detail}", file=sys.stderr)
            failed = failed or bool(others) or any(o.status != "4xx" for o in bad)
        finished, code, seconds = sigterm(proc, client, model, prompts, args.sigterm_streams, args.max_tokens)
        print(f"\nSIGTERM with {args.sigterm_streams} streams running: {finished} finished, the server exited "
              f"{code} in {seconds:.1f} s")
        failed = failed or finished != args.sigterm_streams or code != 0
    finally:
        if proc.poll() is None:
            stop_server(proc)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
