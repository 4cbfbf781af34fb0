"""Replicas on Ray Serve: the same HTTP API from N Generators, each a Ray actor on its own device.

Ray Serve's HTTP proxy accepts the requests and routes each to a replica (the one with the fewest
requests in flight, among two it samples); each replica runs this package's Starlette app over its
own Generator, so batching, streaming (the proxy streams the replica's ASGI messages through),
errors and /metrics are one server's (/metrics: the replica that answered the scrape). Ray
restarts a replica that dies; the others go on. The requests in flight on it get a clear error
from ``ReplicaLost``, a middleware this module installs in Ray's proxy (through Ray's
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``): a 503 in OpenAI's error shape, or, for a stream
already under way, an error event and ``data: [DONE]`` (Ray alone answers a bare 500 or cuts the
stream mid-chunk).

Three ways in:

* ``python -m runtime serve ART --replicas N`` starts a local Ray instance (or joins one with
  ``--ray-address``) and deploys ``application(...)``;
* ``serve run runtime.serve.replicas:build_app directory=ART replicas=2 threads=1`` (Ray's CLI,
  arguments as the server's options without dashes);
* a Serve config file naming ``import_path: runtime.serve.replicas:build_app`` (docs/serving.md).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SkipDecodeError

DEPLOYMENT = "SkipDecode"  # the deployment's name, in Ray's dashboards, logs and config files
APP_NAME = "skipdecode"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"  # Ray's hook for proxy middlewares
PROXY_CALLBACK = "runtime.serve.replicas.proxy_middlewares"
REPLICA_LOST = ("the replica serving this request stopped before it finished (Ray restarts it; the other "
                "replicas are serving): retry the request")


class ReplicaLost:
    """ASGI middleware in Ray's HTTP proxy: a response that ends without finishing (its replica
    died) is finished clearly instead: a 503 in OpenAI's error shape when nothing was sent yet, an
    error event and ``data: [DONE]`` when a stream was under way."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "finished": False, "sse": False}

        async def watch(message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                headers = {k.lower(): v for k, v in message.get("headers", [])}
                state["sse"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["finished"] = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if not state["finished"]:
                await self._finish(send, state)

    @staticmethod
    async def _finish(send, state) -> None:
        import json

        from .protocol import error_body

        error = error_body(REPLICA_LOST, "server_error", code="replica_lost")
        try:
            if not state["started"]:
                body = json.dumps(error).encode()
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
            elif state["sse"]:
                await send({"type": "http.response.body",
                            "body": f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()})
            else:
                await send({"type": "http.response.body", "body": b""})
        except Exception:  # noqa: BLE001 - the client is gone too: nobody to tell
            pass


def proxy_middlewares() -> list:
    """Called by Ray in its HTTP proxy (PROXY_CALLBACK_ENV names it)."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaLost)]


@dataclass
class ReplicaSettings:
    """What each replica builds, and what Ray reserves for it."""

    directory: str
    load_kwargs: dict  # runtime.load's keyword arguments (backend, device, threads, max_batch, ...)
    config_kwargs: dict = field(repr=False)  # ServeConfig's (the API key among them: never repr'd)
    replicas: int = 1
    num_cpus: float = 1  # CPU cores Ray reserves per replica: its ONNX Runtime threads
    num_gpus: float = 0  # 1 where the cluster has GPUs: each replica its own device
    max_ongoing_requests: int = 32  # requests Ray routes to one replica at once; more wait in Ray's queue


def _replica_app(settings: ReplicaSettings):
    """Runs on each replica: its Generator and the app over it (the app closes the Generator when
    Ray stops the replica)."""
    from ..generator import load
    from .app import ServeConfig, create_app

    gen = load(settings.directory, **settings.load_kwargs)
    return create_app(gen, ServeConfig(**{**settings.config_kwargs, "close_generator": True}))


def application(settings: ReplicaSettings):
    """The Ray Serve application: a deployment of ``settings.replicas`` replicas of the app."""
    from ray import serve

    def build():  # a plain function, so Ray calls it on each replica, not on this process
        return _replica_app(settings)

    @serve.deployment(name=DEPLOYMENT, num_replicas=settings.replicas,
                      ray_actor_options={"num_cpus": settings.num_cpus, "num_gpus": settings.num_gpus},
                      max_ongoing_requests=settings.max_ongoing_requests)
    @serve.ingress(build)
    class SkipDecode:
        pass

    return SkipDecode.bind()


def settings_from_args(args, gpus: bool) -> ReplicaSettings:
    """The replicas of ``python -m runtime serve``'s options; ``gpus``: the cluster has GPUs."""
    from .app import ServeConfig
    from ..cli import backend_options

    threads = args.threads or 1
    max_batch = args.max_batch or 8
    load_kwargs = dict(backend=args.backend, max_batch=args.max_batch, max_queue=args.max_queue,
                       max_length=args.max_length, prefill_chunk=args.prefill_chunk,
                       prefix_cache_mb=args.prefix_cache_mb, batch_invariant=args.batch_invariant,
                       **backend_options(argparse.Namespace(**{**vars(args), "threads": threads})))
    config = ServeConfig.from_args(args)
    config_kwargs = {k: getattr(config, k) for k in ("model_name", "speedup", "shutdown_timeout", "api_key",
                                                     "allowed_origins")}
    # Ray queues what a replica cannot take: its rows, and as many again waiting (the engine's own
    # queue then never refuses; --max-queue still bounds it when set)
    ongoing = max_batch + (args.max_queue if args.max_queue is not None else max_batch)
    return ReplicaSettings(str(Path(args.directory).resolve()), load_kwargs, config_kwargs, args.replicas or 1,
                           num_cpus=0 if gpus else threads, num_gpus=1 if gpus else 0,
                           max_ongoing_requests=ongoing)


def build_app(args: dict):
    """``serve run runtime.serve.replicas:build_app directory=ART [replicas=2 threads=1 ...]``: the
    application of the server's own options (``max_batch=8`` is ``--max-batch 8``)."""
    from .options import check_args, parser

    args = dict(args)
    directory = args.pop("directory", None)
    if directory is None:
        raise SkipDecodeError("build_app needs directory=ARTIFACT (the artifact to serve)")
    argv = [str(directory)]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            argv += [flag] if str(value).lower() == "true" else []
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    parsed = parser().parse_args(argv)
    check_args(parsed)
    import ray

    gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    return application(settings_from_args(parsed, gpus))


def main(args) -> int:
    """``python -m runtime serve ART --replicas N [--ray-address ADDR]``: deploy, serve until
    SIGTERM/Ctrl-C, then shut the application down. Checks what it can before starting Ray."""
    from ..artifact.manifest import load_manifest
    from ..generation_config import GenerationConfig
    from ..generator import policy_for
    from .options import bind, check_args

    check_args(args)
    probe = bind(args.host, args.port)  # a port in use or a bad host: one line now, not a Ray traceback
    port = probe.getsockname()[1]  # --port 0: the free port the OS picked, which Ray's proxy then takes
    probe.close()
    manifest = load_manifest(args.directory, check_hashes=False)  # the replicas check the hashes
    if args.speedup is not None:
        try:
            policy_for(manifest, GenerationConfig(max_new_tokens=16, speedup=args.speedup))
        except SkipDecodeError as exc:
            raise SkipDecodeError(f"--speedup: {exc}") from None
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise SkipDecodeError(f"--replicas needs Ray Serve ({exc.name}): pip install -e \".[ray]\"") from None

    # the proxy this process starts inherits the environment (a cluster joined with --ray-address
    # needs it set where its proxies start: docs/serving.md)
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    ray.init(address=args.ray_address, include_dashboard=False, logging_level="warning",
             log_to_driver=args.log_level == "debug")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        settings = settings_from_args(args, gpus)
        serve.start(http_options={"host": args.host, "port": port})
        try:
            serve.run(application(settings), name=APP_NAME, route_prefix="/")
        except Exception as exc:  # noqa: BLE001 - a replica that could not start: Ray says why
            raise SkipDecodeError(f"the replicas did not start: {_why(serve, exc)}") from None
        where = "GPU" if gpus else f"{settings.num_cpus:g} CPU"
        print(f"serving {args.model_name or manifest_name(args.directory)!r} from {settings.replicas} "
              f"replica(s) on Ray Serve ({where} each) on http://{args.host}:{port}"
              f"{' (API key required)' if args.api_key else ''}", flush=True)
        stop.wait()
        print("Shutting down", flush=True)
        serve.delete(APP_NAME)
        if args.ray_address is None:
            serve.shutdown()
        return 0
    finally:
        ray.shutdown()


def manifest_name(directory) -> str:
    return Path(directory).resolve().name


def _why(serve, exc: BaseException) -> str:
    """The replica's own error (the last "...Error: ..." line of the traceback Ray keeps in the
    deployment's status), else Ray's summary."""
    try:
        text = serve.status().applications[APP_NAME].deployments[DEPLOYMENT].message
    except Exception:  # noqa: BLE001 - no status: Ray's exception is all there is
        text = ""
    lines = [line.strip() for line in f"{exc}\n{text}".splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line)]
    return (errors[-1] if errors else lines[0] if lines else type(exc).__name__)[:500]

