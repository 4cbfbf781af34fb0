"""The HTTP layer: a Starlette app over one Generator (its continuous-batching engine).

The engine decodes on its own thread and hands each request's events through a blocking queue.
A handler never blocks the event loop on it: every blocking ``next(stream)`` runs in a worker
thread (``anyio.to_thread.run_sync``), abandoned at once if the client goes away, and the stream
is closed then, so the request's KV slots go to the next request at the engine's next step.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine import EngineClosedError, QueueFullError
from ..errors import InputTooLongError, InvalidArgumentError, PolicyError
from ..generator import GenerationStream, Generator
from .chat import ChatTemplate
from .metrics import CountRequests, Metrics, RequestTimer, speedup_label
from .protocol import (CHAT, JSON_MAX_TOKENS, TEXT, Completion, CompletionRequest, RequestError, StopHoldback, completion_response,
                       error_body, openai_finish_reason, parse_chat, parse_completion, policy_error_param,
                       request_param, skipdecode_info, timings, usage)

log = logging.getLogger("runtime.serve")


@dataclass
class ServeConfig:
    """Server settings beyond the Generator's own (max_batch, max_queue are the Generator's)."""

    model_name: str | None = None  # id in /v1/models and responses; None: the artifact directory's name
    speedup: float | None = None  # for requests with neither speedup nor policy; None: the artifact's policy
    default_max_tokens: int = 16  # OpenAI's default when a request has no max_tokens
    retry_after: int = 1  # seconds a 503 (queue full) asks the client to wait before retrying
    shutdown_timeout: float = 30.0  # seconds SIGTERM waits for requests in flight before cancelling them
    close_generator: bool = True  # close the Generator at shutdown; False when the caller owns it
    waiter_threads: int = 64  # worker threads blocked on engine streams at once; more requests wait
    # for one without holding a thread (the engine runs them regardless, so nothing deadlocks)
    api_key: str | None = field(default=None, repr=False)  # bearer token /v1/* requires; None: open.
    # Never logged or repr'd
    allowed_origins: list[str] | None = None  # CORS origins ("*": any); None: no CORS headers at all

    @classmethod
    def from_args(cls, args, **overrides) -> "ServeConfig":
        """The settings of ``python -m runtime serve``'s options."""
        return cls(model_name=args.model_name, speedup=args.speedup, shutdown_timeout=args.shutdown_timeout,
                   close_generator=False, api_key=args.api_key, allowed_origins=args.allowed_origins,
                   **overrides)


class _EventStream(StreamingResponse):
    """Server-sent events that end the engine request however the response ends: finished,
    client gone (noticed while waiting too, not only when a send fails), or cancelled."""

    media_type = "text/event-stream"

    def __init__(self, content, on_close):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def respond() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-send
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(respond)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close()
            with contextlib.suppress(RuntimeError):
                await self.body_iterator.aclose()


def _next_event(stream: GenerationStream, timer: RequestTimer):
    event = next(stream, None)
    if event is not None:
        timer.event(event)
    return event


def _drain(stream: GenerationStream, timer: RequestTimer):
    """A whole answer's result; its stream sends no event per step (``_submit``), so its token times
    are the engine's."""
    for event in stream:
        timer.event(event)
    timer.steps(stream.step_times, sum(map(len, stream.result.token_ids)))
    return stream.result


def _error_response(exc: RequestError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return JSONResponse(exc.to_dict(), status_code=exc.status, headers=headers)


def _internal_error(exc: BaseException) -> dict:
    return error_body(f"internal error while generating: {type(exc).__name__}: {exc}", "server_error",
                      code="internal_error")


class CompletionServer:
    """Routes and state of one served Generator."""

    def __init__(self, generator: Generator, config: ServeConfig):
        self.gen, self.config = generator, config
        self.model_id = config.model_name or Path(generator.directory).resolve().name
        self.limiter = anyio.CapacityLimiter(config.waiter_threads)
        # when the artifact was written (its manifest is written last), as OpenAI's Unix seconds
        self.created = int((Path(generator.directory) / "manifest.json").stat().st_mtime)
        self.metrics = Metrics(generator.engine, generator.num_layers)
        self.template = ChatTemplate.from_dir(Path(generator.directory) / generator.manifest.tokenizer_dir)

    async def _wait(self, fn, *args):
        return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True, limiter=self.limiter)

    # -- endpoints ---------------------------------------------------------------------------

    async def health(self, request: Request) -> JSONResponse:
        engine = self.gen.engine
        with engine.lock:
            running, waiting, closing = len(engine.running), len(engine.waiting), engine.closing
        body = {"status": "shutting_down" if closing else "ok", "model": self.model_id,
                "running": running, "waiting": waiting, "max_batch": self.gen.max_batch,
                "max_queue": engine.max_queue}
        return JSONResponse(body, status_code=503 if closing else 200)

    def _model_card(self) -> dict:
        m = self.gen.manifest
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "skipdecode-edge",
                "skipdecode": {"num_layers": m.model.num_layers, "default_policy": m.policy,
                               "default_speedup": self.config.speedup,
                               "max_length": self.gen.max_length, "max_batch": self.gen.max_batch}}

    async def prometheus(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> JSONResponse:
        if request.path_params["model"] != self.model_id:
            err = RequestError(f"model {request.path_params['model']!r} is not served here; this "
                               f"server serves {self.model_id!r}", "model", 404, "model_not_found")
            return _error_response(err)
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, TEXT, self._completion_request)

    def _completion_request(self, body) -> CompletionRequest:
        req = parse_completion(body, self.model_id, self.gen.max_batch, self.config.default_max_tokens,
                               self.config.speedup)
        if req.max_tokens:
            return req
        # a JSON answer with no max_tokens: JSON_MAX_TOKENS, or what the longest prompt leaves
        longest = max(len(p) if not isinstance(p, str) else len(self.gen.tokenizer(p)["input_ids"])
                      for p in req.prompts)
        return replace(req, max_tokens=max(1, min(JSON_MAX_TOKENS, self.gen.max_length - longest)))

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, CHAT, self._chat_request)

    def _chat_request(self, body) -> CompletionRequest:
        """The messages rendered by the tokenizer's chat template into one token-id prompt."""
        if self.template is None:
            raise RequestError(
                f"{self.model_id!r} has no chat template (its tokenizer ships none, as OPT's; a chat model's "
                f"tokenizer_config.json or chat_template.jinja carries one), so messages cannot become a "
                f"prompt: use /v1/completions with a text prompt in the format the model was trained on",
                "messages", code="no_chat_template")
        req, messages = parse_chat(body, self.model_id, self.gen.max_batch, self.config.speedup)
        text = self.template.render(messages)
        ids = self.gen.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template holds the BOS
        limit = self.gen.max_length
        room = limit - len(ids)
        if room < 1:
            raise RequestError(f"the messages take {len(ids)} tokens of this server's {limit} positions per row "
                               f"(--max-length), which leaves none for the answer; shorten the conversation",
                               "messages", code="context_length_exceeded")
        if req.max_tokens and req.max_tokens > room:
            raise RequestError(f"the messages take {len(ids)} tokens of this server's {limit} positions per row "
                               f"(--max-length), which leaves {room} for the answer, but max_tokens is "
                               f"{req.max_tokens}; ask for at most {room} or shorten the conversation",
                               "max_tokens", code="context_length_exceeded")
        # none given: the rest of the context, as OpenAI
        return replace(req, prompts=[ids], max_tokens=req.max_tokens or room)

    async def _serve(self, request: Request, fmt, parse) -> Response:
        """A completion or chat request: parse the body, submit it, answer it whole or streamed."""
        timer = RequestTimer(self.metrics)
        try:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                raise RequestError(f"the request body is not valid JSON ({exc}); send a JSON object "
                                   f"with Content-Type: application/json", None, code="invalid_json")
            req = parse(body)
            stream = self._submit(req)
        except RequestError as exc:
            return _error_response(exc)
        prompt_tokens = sum(stream.prompt_lengths[:: req.n])  # each prompt once, whatever n
        self.metrics.prompt_tokens.inc(prompt_tokens)
        echoes = [self._text(p) if req.echo else "" for p in req.rows]
        completion = Completion(self.model_id, fmt)
        if req.stream:
            return _EventStream(self._events(stream, timer, req, completion, prompt_tokens, echoes), stream.close)
        try:
            return await self._complete(request, stream, timer, req, completion, prompt_tokens, echoes)
        finally:
            stream.close()

    def _text(self, prompt) -> str:
        return prompt if isinstance(prompt, str) else self.gen.tokenizer.decode(prompt, skip_special_tokens=True)

    # -- the work ----------------------------------------------------------------------------

    def _submit(self, req: CompletionRequest) -> GenerationStream:
        """Submit to the engine at once; its refusals become the HTTP errors they mean."""
        try:
            # a whole answer's handler waits for the result: no event per step to wake it; the events
            # of a streamed one carry no logits (greedy rows' tokens may then be picked on a GPU)
            return self.gen.stream(req.rows, config=req.generation_config(), events=req.stream, logits=False)
        except QueueFullError as exc:
            engine = self.gen.engine
            raise RequestError(
                f"the server is at capacity: its {self.gen.max_batch} rows are taken and {engine.max_queue} "
                f"requests already wait for one (--max-batch {self.gen.max_batch}, --max-queue {engine.max_queue}); "
                f"retry after {self.config.retry_after} s, or start the server with a larger --max-queue or "
                f"--max-batch", None, 503, "queue_full", "server_error",
                retry_after=self.config.retry_after) from exc
        except EngineClosedError as exc:
            raise RequestError("the server is shutting down; retry on another instance", None, 503,
                               "shutting_down", "server_error") from exc
        except PolicyError as exc:
            raise RequestError(str(exc), policy_error_param(exc, req), code="invalid_policy") from exc
        except InputTooLongError as exc:
            # the runtime's argument is max_new_tokens; say it in the request's terms
            raise RequestError(str(exc).replace("max_new_tokens", "max_tokens"), "max_tokens",
                               code="context_length_exceeded") from exc
        except InvalidArgumentError as exc:  # the Generator's argument checks; parse_completion ran most
            if exc.param == "json_schema":
                raise RequestError(str(exc), "response_format", code="invalid_json_schema") from exc
            raise RequestError(str(exc), request_param(exc.param)) from exc

    async def _complete(self, request: Request, stream: GenerationStream, timer: RequestTimer,
                        req: CompletionRequest, completion: Completion, prompt_tokens: int,
                        echoes: list[str]) -> Response:
        """Wait for the whole result, giving up (and freeing the slots) if the client leaves."""
        outcome: dict = {}

        async with anyio.create_task_group() as tg:
            async def wait() -> None:
                try:
                    outcome["result"] = await self._wait(_drain, stream, timer)
                except Exception as exc:  # noqa: BLE001 - this request's failure, answered below
                    outcome["error"] = exc
                tg.cancel_scope.cancel()

            async def watch() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                stream.close()
                tg.cancel_scope.cancel()

            tg.start_soon(wait)
            tg.start_soon(watch)
        if "result" in outcome:
            self._finished(req, outcome["result"])
            return JSONResponse(completion_response(completion, outcome["result"], req, prompt_tokens, echoes,
                                                    self.gen.tokenizer))
        if "error" in outcome:
            exc = outcome["error"]
            if isinstance(exc, EngineClosedError):
                return _error_response(RequestError(str(exc), None, 503, "shutting_down", "server_error"))
            log.error("request %s failed", completion.id, exc_info=exc)
            return JSONResponse(_internal_error(exc), status_code=500)
        return Response(status_code=499)  # the client left; nobody reads this

    def _finished(self, req: CompletionRequest, result) -> None:
        self.metrics.finished(speedup_label(req.speedup, req.policy), result.stats)

    async def _events(self, stream: GenerationStream, timer: RequestTimer, req: CompletionRequest,
                      completion: Completion, prompt_tokens: int, echoes: list[str]):
        """OpenAI's stream: the echoed prompts first (with echo), then one chunk per choice per step
        that adds text, a token's logprobs or ends the choice, then (with
        stream_options.include_usage) a chunk with no choices and the usage, then [DONE]."""
        fmt = completion.format
        holds = [StopHoldback(req.stop) for _ in echoes]
        logprobs = [fmt.logprobs(self.gen.tokenizer, len(e)) for e in echoes]

        def chunk(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        try:
            for opening in fmt.opening(len(echoes)):
                yield chunk(completion.envelope([opening], chunk=True))
            for b, echo in enumerate(echoes):
                if echo:
                    yield chunk(completion.envelope([fmt.chunk_choice(b, echo, None)], chunk=True))
            while (event := await self._wait(_next_event, stream, timer)) is not None:
                for b, delta in enumerate(event.texts):
                    if event.token_ids[b] is None:  # this choice had already finished
                        continue
                    reason = event.finish_reasons[b]
                    text = holds[b].push(delta) if reason is None else holds[b].finish(delta, reason)
                    lp = None if event.logprobs is None else logprobs[b].add([event.logprobs[b]], [delta])
                    if text or lp or reason is not None:
                        yield chunk(completion.envelope(
                            [fmt.chunk_choice(b, text, openai_finish_reason(reason), lp)], chunk=True))
            if stream.result is not None:
                self._finished(req, stream.result)
            if req.include_usage and stream.result is not None:
                yield chunk({**completion.envelope([], chunk=True), "usage": usage(prompt_tokens, stream.result),
                             "timings": timings(prompt_tokens, stream.result),
                             "skipdecode": skipdecode_info(stream.result, req)})
        except EngineClosedError as exc:
            yield chunk(error_body(str(exc), "server_error", code="shutting_down"))
        except Exception as exc:  # noqa: BLE001 - the headers are out: report in the stream
            log.error("request %s failed mid-stream", completion.id, exc_info=exc)
            yield chunk(_internal_error(exc))
        yield "data: [DONE]\n\n"


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Unknown paths and methods in OpenAI's error shape, not Starlette's plain text."""
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}",
                                   "invalid_request_error", code=str(exc.status_code)),
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(_internal_error(exc), status_code=500)


class BearerAuth:
    """``Authorization: Bearer KEY`` on /v1/*, answered 401 in OpenAI's error shape otherwise.
    /health and /metrics stay open (load balancers and Prometheus scrape them)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and scope["method"] != "OPTIONS":
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                said = "no API key was sent" if not token else "the API key sent is not this server's"
                body = error_body(f"{said}: send the server's --api-key as 'Authorization: Bearer KEY'",
                                  "invalid_request_error", code="invalid_api_key")
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(generator: Generator, config: ServeConfig | None = None) -> Starlette:
    """The ASGI app serving ``generator``: /v1/completions, /v1/models, /health."""
    config = config or ServeConfig()
    server = CompletionServer(generator, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # uvicorn has stopped accepting and waited for the requests in flight (up to its graceful
        # timeout, then cancelled them, which closed their streams): nothing is left to finish.
        if config.close_generator:
            await anyio.to_thread.run_sync(lambda: generator.close(cancel=True, timeout=config.shutdown_timeout))

    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.model, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
    ]
    middleware = [Middleware(CountRequests, metrics=server.metrics)]  # outermost: counts the 401s too
    if config.allowed_origins:  # CORS only when asked for: a browser page elsewhere may not call us otherwise
        middleware.append(Middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                                     allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
    if config.api_key:  # inside CORS, so that a browser's preflight and a 401 still carry its headers
        middleware.append(Middleware(BearerAuth, api_key=config.api_key))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.server = server
    return app
