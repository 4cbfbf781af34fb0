"""``python -m runtime serve ARTIFACT [--port 8000] [--max-batch 8] [--speedup 2] [--replicas N] ...``.

Every startup error (a bad option, a port in use, a host that does not resolve, a broken artifact)
is one ``error:`` line and exit 2, before anything claims to be serving: the listening socket is
bound before the model loads, and "serving 'MODEL' (...) on http://HOST:PORT" is printed once it is."""

from __future__ import annotations

import sys

from .. import cli
from ..errors import SkipDecodeError
from .options import bind, check_args, parser

MISSING_EXTRA = ("error: `python -m runtime serve` needs the serve extra ({missing}); install it with "
                 "pip install -e \".[serve]\"")


def main(argv=None, load=None) -> int:
    """Run the server until SIGTERM or Ctrl-C; 0 after a graceful shutdown.

    ``load`` replaces ``runtime.load`` (tests wrap the backend with it)."""
    args = parser().parse_args(argv)
    try:
        import uvicorn  # noqa: F401

        from .app import ServeConfig  # noqa: F401 - the extra's packages, all of them, before any work
        from .server import GracefulServer  # noqa: F401
    except ImportError as exc:
        print(MISSING_EXTRA.format(missing=exc.name or exc), file=sys.stderr)
        return 2
    if args.replicas is not None or args.ray_address is not None:
        from .replicas import main as replicas_main

        return cli.run(lambda: replicas_main(args))
    return cli.run(lambda: _serve(args, load))


def _serve(args, load) -> int:
    import uvicorn

    from .app import ServeConfig, create_app
    from .server import GracefulServer

    check_args(args)
    if load is None:
        from ..generator import load
    sock = bind(args.host, args.port)
    try:
        try:
            gen = load(args.directory, backend=args.backend, max_batch=args.max_batch, max_queue=args.max_queue,
                       max_length=args.max_length, prefill_chunk=args.prefill_chunk,
                       prefix_cache_mb=args.prefix_cache_mb, batch_invariant=args.batch_invariant,
                       **cli.backend_options(args))
        except ValueError as exc:  # an argument check of load's that is not a SkipDecodeError
            raise SkipDecodeError(str(exc)) from None
        try:
            try:
                gen.policy_for(16, speedup=args.speedup)  # a bad --speedup fails now, not per request
            except SkipDecodeError as exc:
                raise SkipDecodeError(f"--speedup: {exc}") from None
            config = ServeConfig.from_args(args)
            app = create_app(gen, config)
            port = sock.getsockname()[1]
            default = f"speedup {args.speedup:g}" if args.speedup else f"the artifact's {gen.manifest.policy}"
            print(f"serving {app.state.server.model_id!r} ({gen.num_layers} layers, max_batch "
                  f"{gen.max_batch}, default policy: {default}) on http://{args.host}:{port}"
                  f"{' (API key required)' if args.api_key else ''}", flush=True)
            server = GracefulServer(uvicorn.Config(
                app, log_level=args.log_level, access_log=not args.no_access_log, lifespan="on",
                timeout_graceful_shutdown=args.shutdown_timeout))
            server.run(sockets=[sock])
            return 0 if server.started else 1
        finally:
            # Requests still running were cancelled by uvicorn after --shutdown-timeout.
            gen.close(cancel=True, timeout=args.shutdown_timeout)
    finally:
        sock.close()
