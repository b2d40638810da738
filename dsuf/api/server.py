"""The HTTP front end: OpenAI chat completions and responses, Anthropic messages (streaming and
not), models, health, metrics.

Requests are converted, rendered and parsed by deepseek-recipe (`dsuf.api.chat`); generation
happens in the engine. Every failure a client can cause gets an error body of its API with the
right status, and a client that goes away frees its batch slot at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from aiohttp import web

from dsuf.api.chat import CHAT_COMPLETIONS, CONVERSATION_NAME_MAX, MESSAGES, RESPONSES, ChatError, ChatFrontend, PreparedChat, Protocol
from dsuf.api.metrics import Metrics
from dsuf.engine.engine import Engine, WorkerGone
from dsuf.engine.scheduler import ErrorEvent, FinishEvent, QueueFull, Request, TokenEvent
from dsuf.kvcache.cache import ConversationCache
from dsuf.worker.sampling import SamplingParams

log = logging.getLogger("dsuf.api")

ENGINE = web.AppKey("engine", Engine)
CHAT = web.AppKey("chat", ChatFrontend)
METRICS = web.AppKey("metrics", Metrics)
STATE = web.AppKey("state", "ServerState")


@dataclass
class ServerState:
    api_key: str | None = None
    draining: bool = False
    open_streams: int = 0
    cache: ConversationCache | None = None  # conversation caches, when the server keeps them


def error_response(status: int, message: str, type_: str | None = None, code: str | None = None, param: str | None = None,
                   headers: dict | None = None, protocol: Protocol = CHAT_COMPLETIONS) -> web.Response:
    return web.json_response(protocol.error_body(status, message, type_, code, param), status=status, headers=headers)


def protocol_of(request: web.Request) -> Protocol:
    """The API a path belongs to, for the shape of its error bodies."""
    return MESSAGES if request.path.rstrip("/").endswith(("/messages", "/messages/count_tokens")) else CHAT_COMPLETIONS


@web.middleware
async def errors_as_api_bodies(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        reason = {413: "request body too large", 404: "no such route", 405: "method not allowed"}.get(exc.status, exc.reason)
        message = f"{reason}: {request.method} {request.path}" if exc.status in (404, 405) else reason
        return error_response(exc.status, message, protocol=protocol_of(request))
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:  # the client went away (e.g. as its stream started): no one to answer, nothing to log
        log.debug("client gone during %s %s", request.method, request.path)
        return web.Response(status=499)  # (nginx's "client closed request", for the access log; never sent)
    except Exception:  # a bug must cost one request a 500, never the server or an HTML page
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "internal server error", code="internal_error", protocol=protocol_of(request))


@web.middleware
async def api_key_auth(request: web.Request, handler):
    key = request.app[STATE].api_key
    if key and request.path not in ("/readyz", "/healthz", "/metrics"):
        bearer = request.headers.get("Authorization")  # (Anthropic clients send x-api-key; a bearer token wins, as at DeepSeek)
        if (bearer != f"Bearer {key}") if bearer is not None else request.headers.get("x-api-key") != key:
            return error_response(401, "invalid or missing API key", "authentication_error", "invalid_api_key", protocol=protocol_of(request))
    return await handler(request)


def sampling_params(p: PreparedChat) -> SamplingParams:
    return SamplingParams(
        temperature=1.0 if p.temperature is None else p.temperature,
        top_p=1.0 if p.top_p is None else p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs or 0,
        logit_bias=p.logit_bias or None,
        forced=p.forced_tokens,
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, CHAT_COMPLETIONS)


async def messages(request: web.Request) -> web.StreamResponse:
    return await _completion(request, MESSAGES)


async def responses(request: web.Request) -> web.StreamResponse:
    return await _completion(request, RESPONSES)


async def count_message_tokens(request: web.Request) -> web.Response:
    """Anthropic's /v1/messages/count_tokens: the prompt's length, as the model would see it."""
    try:
        body = json.loads(await request.read())
        if isinstance(body, dict):
            body = {**body, "max_tokens": 1}  # (not part of a count request; the conversion wants one)
        prepared = await asyncio.to_thread(request.app[CHAT].prepare, body, MESSAGES)
    except ChatError as exc:
        return web.json_response(exc.body(MESSAGES), status=exc.status)
    except ValueError as exc:
        return error_response(400, f"invalid JSON request body: {exc}", protocol=MESSAGES)
    return web.json_response({"input_tokens": len(prepared.prompt_ids)})


async def _completion(request: web.Request, protocol: Protocol) -> web.StreamResponse:
    state, engine, chat, metrics = request.app[STATE], request.app[ENGINE], request.app[CHAT], request.app[METRICS]

    def fail(status: int, message: str, *args, **kw) -> web.Response:
        return error_response(status, message, *args, protocol=protocol, **kw)

    if state.draining:
        return fail(503, "the server is shutting down", code="server_shutting_down")
    if not engine.ready.is_set():
        return fail(503, engine.unavailable, code="model_not_ready", headers={"Retry-After": "5"})
    header = request.headers.get("X-Conversation-Id")  # (checked before the prompt is encoded)
    if header is not None and len(header) > CONVERSATION_NAME_MAX:
        return fail(400, f"X-Conversation-Id must be 1 to {CONVERSATION_NAME_MAX} characters", param="X-Conversation-Id")
    body = await request.read()
    try:
        # Off the event loop: the recipe's encoder releases the GIL, and a long prompt takes it
        # long (a million tokens ~1.5 s), during which the other streams would stall.
        prepared = await asyncio.to_thread(chat.prepare, body, protocol)
        params = sampling_params(prepared)
    except ChatError as exc:
        return web.json_response(exc.body(protocol), status=exc.status)
    except ValueError as exc:
        return fail(400, str(exc))
    req = Request(prepared.prompt_ids, params, prepared.max_tokens)
    conversation = prepared.conversation or header or None
    if state.cache is not None:
        try:
            await state.cache.attach(req, conversation)
        except Exception:  # the cache is an optimisation: a bug in it costs a recompute, not the request
            log.exception("conversation cache lookup failed; recomputing the prompt")
            req = Request(prepared.prompt_ids, params, prepared.max_tokens)
    try:
        engine.submit(req)
    except (QueueFull, WorkerGone) as exc:
        req.unpin()
        if isinstance(exc, QueueFull):
            return fail(429, f"too many requests waiting ({exc}); retry shortly", "rate_limit_error", "rate_limit_exceeded", headers={"Retry-After": "1"})
        return fail(503, str(exc), code="model_not_ready")
    metrics.prompt_tokens.inc(len(prepared.prompt_ids))
    stream = prepared.new_stream()
    state.open_streams += 1
    try:
        if prepared.stream:
            return await _stream(request, prepared, req, stream, engine, metrics)
        return await _complete(prepared, req, stream, engine, metrics)
    finally:
        state.open_streams -= 1
        engine.finish(req)  # no-op when already finished; frees the slot on disconnect or error
        stream.close()


async def _generate(req: Request, stream, engine: Engine, metrics: Metrics, emit):
    """Pump engine events through the recipe parser; `emit(chunks)` gets the protocol's JSON chunks.

    The stream starts (role chunk, prompt usage) with the first event, once the worker has
    accepted or refused the request's cached prefix, so prompt_cache_hit_tokens is what was reused."""
    first = last = None
    while True:
        event = await req.events.get()
        now = time.monotonic()
        if first is None and not isinstance(event, ErrorEvent):
            await emit(stream.start(len(req.prompt), req.cached))
            metrics.cache_hit_tokens.inc(req.cached)
        if isinstance(event, TokenEvent):
            if first is None:
                first = now
                metrics.ttft.observe(now - req.arrived)
            else:
                metrics.itl.observe(now - last)
            last = now
            metrics.generation_tokens.inc()
            choice = event.choice
            logprobs = [(choice.logprob, list(choice.top or []))] if req.params.logprobs else None
            await emit(stream.push_tokens([choice.token], logprobs))
            if stream.finished:  # a stop string: the parser is done, so is generation
                engine.finish(req)
                await emit(stream.finish("stop"))
                return None
        elif isinstance(event, FinishEvent):
            await emit(stream.finish(event.reason))
            return None
        else:
            assert isinstance(event, ErrorEvent)
            return event


async def _stream(request: web.Request, prepared: PreparedChat, req: Request, stream, engine: Engine, metrics: Metrics):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": prepared.request_id})
    await resp.prepare(request)

    protocol = prepared.protocol

    async def emit(chunks: list[str]) -> None:
        if chunks:
            await resp.write("".join(map(protocol.sse, chunks)).encode())

    error = await _generate(req, stream, engine, metrics, emit)
    if error is not None:
        await resp.write(protocol.sse(json.dumps(protocol.stream_error(error.status, error.message))).encode())
    if protocol.done is not None:
        await resp.write(f"data: {protocol.done}\n\n".encode())
    await resp.write_eof()
    return resp


async def _complete(prepared: PreparedChat, req: Request, stream, engine: Engine, metrics: Metrics) -> web.Response:
    async def emit(chunks: list[str]) -> None:
        pass  # the stream accumulates the response itself

    error = await _generate(req, stream, engine, metrics, emit)
    if error is not None:
        return error_response(error.status, error.message, protocol=prepared.protocol)
    return web.Response(text=stream.response_json(), content_type="application/json", headers={"X-Request-Id": prepared.request_id})


async def list_models(request: web.Request) -> web.Response:
    created = int(time.time())
    chat = request.app[CHAT]
    # max_model_len as vLLM reports it: clients size their prompts by it
    data = [{"id": name, "object": "model", "created": created, "owned_by": "dsuf", "max_model_len": chat.context_limit} for name in chat.models()]
    return web.json_response({"object": "list", "data": data})


async def readyz(request: web.Request) -> web.Response:
    engine, state = request.app[ENGINE], request.app[STATE]
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    if not engine.ready.is_set():
        status = "failed" if engine.failure else "restarting" if engine.down else "loading"
        return web.json_response({"status": status, "detail": engine.failure or engine.down}, status=503)
    return web.json_response({"status": "ready"})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def metrics_route(request: web.Request) -> web.Response:
    m, engine = request.app[METRICS], request.app[ENGINE]
    m.running.set(engine.running)
    m.waiting.set(engine.waiting)
    m.worker_restarts.set(engine.restarts)
    cache = request.app[STATE].cache
    if cache is not None:
        m.kv_bytes.set(cache.store.bytes_used)
        m.kv_entries.set(len(cache.store))
        for kind, count in cache.stats.items():
            m.kv_events.labels(kind).set(count)
    body, content_type = m.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def log_stats(engine: Engine, metrics: Metrics, interval: float) -> None:
    """Every `interval` seconds in which something ran: throughput and queue lengths, in one line."""
    names = ("dsuf:prompt_tokens_total", "dsuf:generation_tokens_total", "dsuf:prompt_cache_hit_tokens_total")
    before = [0.0] * len(names)
    while True:
        await asyncio.sleep(interval)
        now = [metrics.registry.get_sample_value(n) or 0.0 for n in names]
        prompt, generated, hits = (b - a for a, b in zip(before, now))
        before = now
        if prompt or generated or engine.running or engine.waiting:
            log.info("%.1f prompt tokens/s (%.0f%% from caches), %.1f generated tokens/s; %d running, %d waiting",
                     prompt / interval, 100 * hits / prompt if prompt else 0, generated / interval, engine.running, engine.waiting)


def create_app(engine: Engine, chat: ChatFrontend, state: ServerState, max_body: int = 16 << 20, stats_interval: float = 0) -> web.Application:
    app = web.Application(client_max_size=max_body, middlewares=[errors_as_api_bodies, api_key_auth])
    metrics = Metrics()
    app[ENGINE], app[CHAT], app[STATE], app[METRICS] = engine, chat, state, metrics
    if stats_interval:
        async def stats_task(app: web.Application):
            task = asyncio.create_task(log_stats(engine, metrics, stats_interval))
            yield
            task.cancel()

        app.cleanup_ctx.append(stats_task)

    def count_step(done, roundtrip: float) -> None:
        metrics.steps.inc()
        metrics.step_model_seconds.inc(done.seconds)
        metrics.step_roundtrip_seconds.inc(roundtrip)

    engine.on_step = count_step
    for prefix in ("/v1", ""):
        app.router.add_post(f"{prefix}/chat/completions", chat_completions)
        app.router.add_get(f"{prefix}/models", list_models)
        app.router.add_post(f"{prefix}/responses", responses)
    for prefix in ("/v1", "/anthropic/v1", "/anthropic"):  # (DeepSeek's base URL for Anthropic clients is …/anthropic)
        app.router.add_post(f"{prefix}/messages", messages)
        app.router.add_post(f"{prefix}/messages/count_tokens", count_message_tokens)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics_route)
    return app


