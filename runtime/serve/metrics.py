"""``GET /metrics``: the server's Prometheus metrics, through ``prometheus_client``.

One registry per app (not the process-wide default), so that several apps in one process (tests,
Ray replicas sharing a worker) never count into each other. Names follow Prometheus' conventions
(``_total`` counters, ``_seconds`` histograms) and vLLM's choice of what a serving engine reports.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds; from a 2-core CPU's tens of milliseconds per token to a queue's seconds
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class Metrics:
    """The metrics of one served Generator."""

    def __init__(self, engine, num_layers: int):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("skipdecode_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("skipdecode_prompt_tokens", "Prompt tokens of accepted requests "
                                     "(each prompt once, whatever n)", registry=r)
        self.generation_tokens = Counter("skipdecode_generation_tokens", "Tokens generated, all rows", registry=r)
        self.prefix_hits = Counter("skipdecode_prefix_cache_hits", "Requests whose prompt began with cached pages "
                                   "(--prefix-cache-mb)", registry=r)
        self.prefix_tokens = Counter("skipdecode_prefix_cache_tokens", "Prompt tokens whose K/V came from the prefix "
                                     "cache instead of a prefill", registry=r)
        self.drafted = Counter("skipdecode_lossless_drafted_tokens", "Tokens drafted by lossless rows' "
                               "policy layers", registry=r)
        self.accepted = Counter("skipdecode_lossless_accepted_tokens", "Drafted tokens a full-depth verify "
                                "pass kept (acceptance: this over drafted)", registry=r)
        self.verify_passes = Counter("skipdecode_lossless_verify_passes", "Full-depth verify passes, counted "
                                     "per request", registry=r)
        queue = Gauge("skipdecode_queue_depth", "Requests waiting for a KV row", registry=r)
        running = Gauge("skipdecode_running_rows", "KV rows holding a request's row (prefilling or decoding)",
                        registry=r)
        queue.set_function(lambda: _locked(engine, lambda: len(engine.waiting)))
        running.set_function(lambda: _locked(engine, lambda: sum(o is not None for o in engine.cache.owners)))
        self.ttft = Histogram("skipdecode_time_to_first_token_seconds", "Request received to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("skipdecode_inter_token_latency_seconds", "Time between a request's tokens "
                             "(one observation per step, whatever its rows)", buckets=ITL_BUCKETS, registry=r)
        self.layers = Histogram("skipdecode_layers_per_token", "Decoder layers a generated token ran through, by "
                                "the request's speedup ('policy': an explicit policy, 'default': neither)",
                                ["speedup"], buckets=tuple(range(1, num_layers + 1)), registry=r)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def finished(self, label: str, stats) -> None:
        """A request's result is in: its layers per step, prompt reuse and lossless drafts."""
        hist = self.layers.labels(label)
        for n in stats.layers_per_step:
            hist.observe(n)
        if stats.cached_tokens:
            self.prefix_hits.inc()
            self.prefix_tokens.inc(stats.cached_tokens)
        if stats.verify_passes:
            self.drafted.inc(stats.drafted_tokens)
            self.accepted.inc(stats.accepted_tokens)
            self.verify_passes.inc(stats.verify_passes)


def speedup_label(speedup: float | None, policy: dict | None) -> str:
    return "policy" if policy is not None else "default" if speedup is None else f"{speedup:g}"


def _locked(engine, read):
    with engine.lock:
        return read()


class RequestTimer:
    """Times one request's tokens as its handler receives them (a stream's events), or as the engine
    chose them (a whole answer's ``steps``): TTFT from the request's arrival."""

    def __init__(self, metrics: Metrics):
        self.metrics, self.start, self.last = metrics, time.perf_counter(), None

    def event(self, event) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.metrics.generation_tokens.inc(sum(t is not None for t in event.token_ids))

    def steps(self, times: list[float], tokens: int) -> None:
        """A whole answer's steps, at the engine's ``times`` (perf_counter), ``tokens`` in all; nothing
        when events came (``event`` counted them)."""
        if self.last is not None or not times:
            return
        self.metrics.ttft.observe(times[0] - self.start)
        for before, after in zip(times, times[1:]):
            self.metrics.itl.observe(after - before)
        self.last = times[-1]
        self.metrics.generation_tokens.inc(tokens)


class CountRequests:
    """ASGI middleware: every HTTP answer counted by endpoint (unknown paths as "other") and status."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "/v1/models" if path.startswith("/v1/models/") else "other"
        status = []

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0] if status else 499)).inc()
