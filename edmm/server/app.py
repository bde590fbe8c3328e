"""The FastAPI app: routes, OpenAI-style errors, client-disconnect handling.

`build_app(state)` is the factory: everything the routes use hangs off ``state`` (a
`ServerState`); there is no module-level state, so several apps can live in one process.
The app runs behind `RequestGuard` (Host check, header and body limits); the API docs are off
unless the config enables them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from edmm.openai_errors import error_body
from edmm.server.auth import ApiKeyGuard
from edmm.server.body import ParsedBody, parse_body
from edmm.server.errors import APIError, PayloadTooLargeError
from edmm.server.http_guard import BODY_READ_NS, RequestGuard
from edmm.server.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
    ToolOutputRequest,
)
from edmm.server.responses import (
    STREAM_USAGE,
    ResponseEvents,
    ResponsesRequest,
    from_chat,
    to_chat,
)
from edmm.server.serving import abort_all
from edmm.server.sessions import owner_of
from edmm.server.shutdown import DrainGuard
from edmm.server.state import ServerState
from edmm.server.validation import check_text

logger = logging.getLogger(__name__)

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
SESSION_HEADER = "X-Session-Id"
DISCONNECT_POLL_S = 0.2  # how often a non-streamed request checks that its client is still there
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away (never seen by it)
MAX_SESSION_ID = 256  # as the body field `EdmmExtension.session_id`
# A chat body up to this size is parsed on the event loop (the 16K-token resume's 110 KB took
# 0.12 ms on a dev CPU: less than a hand-off to a thread); a larger one on the default executor.
INLINE_PARSE_BYTES = 1 << 20


def build_app(state: ServerState) -> FastAPI:
    """The OpenAI-compatible app over ``state`` (its engine loop starts with the app)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        try:
            yield
        finally:
            state.stop()

    docs = state.config.api_docs
    app = FastAPI(title="EDMM", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.edmm = state
    _add_error_handlers(app)
    _add_openai_routes(app, state)
    _add_edmm_routes(app, state)
    if docs:
        _document_bodies(app, {"/v1/chat/completions": ChatCompletionRequest,
                               "/v1/completions": CompletionRequest,
                               "/v1/responses": ResponsesRequest})
    if state.config.api_keys:
        app.add_middleware(ApiKeyGuard, keys=state.config.api_keys)  # type: ignore[arg-type]
    app.add_middleware(DrainGuard, draining=state.draining)  # type: ignore[arg-type]
    app.add_middleware(RequestGuard, allowed_hosts=state.config.hosts,  # type: ignore[arg-type]
                       max_body_bytes=state.config.max_body_bytes)
    return app


def _document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Show the bodies of routes that parse their own (`parse_body`: FastAPI does not know
    their schema) in the API docs: ``bodies`` maps each route's path to its body's model."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, definition in body.pop("$defs", {}).items():
                    components.setdefault(name, definition)
                components[model.__name__] = body
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": ref}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        message = "; ".join(_describe(e) for e in errors[:5]) or "invalid request body"
        param = _param(errors[0].get("loc", ())) if errors else None
        return JSONResponse(error_body(message, "invalid_request_error", param,
                                       "invalid_request"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}",
                                       "internal_error"), status_code=500)


def _param(loc: Sequence[Any]) -> str | None:
    """The request parameter of an error location: the top-level field and the list indexes
    right after it (``messages.2``); the message has the rest."""
    parts = [p for p in loc if p not in ("body", "header", "query", "path")]
    if not parts or not isinstance(parts[0], str):
        return None
    head = [parts[0]]
    for p in parts[1:]:
        if not isinstance(p, int):
            break
        head.append(str(p))
    return ".".join(head)


def _describe(error: Any) -> str:
    loc = ".".join(str(p) for p in error.get("loc", ())
                   if p not in ("body", "header", "query", "path"))
    return f"{loc}: {error.get('msg', 'invalid')}" if loc else str(error.get("msg", "invalid"))


def _add_openai_routes(app: FastAPI, state: ServerState) -> None:
    serving = state.serving

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.loop.is_alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body("the engine is not running", "service_unavailable"),
                            status_code=503)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return serving.models()

    @app.get("/v1/models/{model:path}", response_model=ModelCard)
    async def model(model: str) -> ModelCard:
        return serving.model(model)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await serving.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    # The body is parsed by `parse_body` (one pass, FastAPI's errors), not by FastAPI (the
    # API docs get its schema from `_document_bodies`).
    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request,
                   x_session_id: str | None = Header(default=None, min_length=1,
                                                     max_length=MAX_SESSION_ID)) -> Response:
        trace = serving.stages.tracer(getattr(request.state, BODY_READ_NS, None))
        parsed = await _parsed(request, ChatCompletionRequest)
        body = parsed.value
        turn = await serving.start_chat(body, x_session_id, owner_of(request.headers), trace,
                                        surrogate_free=parsed.surrogate_free)
        try:
            more = await serving.more_choices(body, turn) if body.n > 1 else []
        except BaseException:
            serving.abort(turn)
            raise
        headers = {SESSION_HEADER: turn.session_id}

        def abort() -> None:
            serving.abort(turn)
            abort_all(more)

        if body.stream:
            return EventStreamResponse(serving.chat_stream(body, turn, more), abort,
                                       headers=headers,
                                       unreached=lambda: serving.unreached(turn))
        try:
            result = await _until_disconnected(request,
                                               serving.chat_completion(body, turn, more))
        except BaseException:  # the response carries no session name
            serving.unreached(turn)
            raise
        if isinstance(result, Response):  # the client left
            serving.unreached(turn)
        return _json(result, headers)

    @app.post("/v1/responses", response_model=None)
    async def responses(request: Request,
                        x_session_id: str | None = Header(default=None, min_length=1,
                                                          max_length=MAX_SESSION_ID),
                        ) -> Response:
        parsed = await _parsed(request, ResponsesRequest)
        body = parsed.value
        try:
            chat = to_chat(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        if body.stream:
            chat = chat.model_copy(update={"stream": True, "stream_options": STREAM_USAGE})
        turn = await serving.start_chat(chat, x_session_id, owner_of(request.headers),
                                        surrogate_free=parsed.surrogate_free)
        headers = {SESSION_HEADER: turn.session_id}
        if body.stream:
            events = ResponseEvents(body).events(serving.chat_stream(chat, turn))
            return EventStreamResponse(events, lambda: serving.abort(turn), headers=headers,
                                       unreached=lambda: serving.unreached(turn))
        try:
            result = await _until_disconnected(request, serving.chat_completion(chat, turn))
        except BaseException:  # the response carries no session name
            serving.unreached(turn)
            raise
        if isinstance(result, Response):  # the client left
            serving.unreached(turn)
            return result
        return JSONResponse(from_chat(body, result), headers=headers)

    # The body is parsed by `parse_body`, as the chat route's (a prompt of token ids is a long
    # list: FastAPI's two passes took 3.7 ms for 8K ids on an H100's host).
    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        trace = serving.stages.tracer(getattr(request.state, BODY_READ_NS, None))
        parsed = await _parsed(request, CompletionRequest)
        body = parsed.value
        queued = await serving.start_completion(body, owner_of(request.headers), trace,
                                                surrogate_free=parsed.surrogate_free)
        if body.stream:
            streams = [stream for _, stream in queued]
            return EventStreamResponse(serving.completion_stream(body, queued, trace),
                                       lambda: abort_all(streams))
        return _json(await _until_disconnected(request,
                                               serving.completion(body, queued, trace)))


async def _parsed(request: Request, model: type[M]) -> ParsedBody[M]:
    """The request's body parsed as ``model`` (`parse_body`; a body over `INLINE_PARSE_BYTES`
    in the default executor: tens of ms of parsing stay off the event loop)."""
    raw, content_type = await request.body(), request.headers.get("content-type")
    if len(raw) <= INLINE_PARSE_BYTES:
        return parse_body(model, raw, content_type)
    return await asyncio.get_running_loop().run_in_executor(
        None, parse_body, model, raw, content_type)


def _add_edmm_routes(app: FastAPI, state: ServerState) -> None:
    max_chunk = state.config.max_tool_output_bytes

    @app.get("/v1/edmm/sessions/{session_id}")
    async def session(session_id: str, request: Request) -> JSONResponse:
        owner = owner_of(request.headers)
        found = await state.loop.run(lambda b: b.session_state(session_id, owner))
        return JSONResponse({"id": session_id, "object": "edmm.session",
                             "state": found.name.lower()})

    @app.delete("/v1/edmm/sessions/{session_id}")
    async def close_session(session_id: str, request: Request) -> JSONResponse:
        owner = owner_of(request.headers)
        await state.loop.run(lambda b: b.close(session_id, owner))
        return JSONResponse({"id": session_id, "object": "edmm.session", "deleted": True})

    @app.post("/v1/edmm/sessions/{session_id}/tool_output")
    async def tool_output(session_id: str, body: ToolOutputRequest,
                          request: Request) -> JSONResponse:
        size = len(body.content.encode("utf-8", "surrogatepass"))
        if size > max_chunk:
            raise PayloadTooLargeError(f"the chunk is {size} bytes, over the limit of "
                                       f"{max_chunk}: send the output in smaller chunks",
                                       param="content", code="tool_output_too_large")
        check_text(body.model_dump())
        owner = owner_of(request.headers)
        await state.loop.run(lambda b: b.feed_tool_output(
            session_id, owner, body.tool_call_id, body.content, body.final))
        return JSONResponse({"id": session_id, "object": "edmm.tool_output",
                             "tool_call_id": body.tool_call_id, "accepted": len(body.content),
                             "final": body.final})


class EventStreamResponse(StreamingResponse):
    """Server-sent events of engine requests, which ``abort`` aborts however the response ends
    (even when the client leaves before the first event, and the body never starts); a
    finished request is left as it is. ``unreached`` runs instead when the response's start
    (its headers) could not be sent."""

    def __init__(self, events: AsyncIterator[str], abort: Callable[[], None],
                 headers: dict[str, str] | None = None,
                 unreached: Callable[[], None] | None = None) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._abort = abort
        self._unreached = unreached

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        started = False

        async def sending(message: Any) -> None:
            nonlocal started
            await send(message)
            started = started or message["type"] == "http.response.start"

        try:
            await super().__call__(scope, receive, sending)
        finally:
            if started or self._unreached is None:
                self._abort()
            else:
                self._unreached()


def _json(result: ChatCompletion | Completion | Response,
          headers: dict[str, str] | None = None) -> Response:
    if isinstance(result, Response):
        return result
    return Response(result.model_dump_json(), media_type="application/json", headers=headers)


async def _until_disconnected(request: Request,
                              work: Awaitable[T]) -> T | Response:
    """Await ``work`` unless the client goes away first: then cancel it (which aborts its
    engine requests) and return a response nobody will read."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return Response(status_code=CLIENT_CLOSED)
        return task.result()
    finally:
        task.cancel()  # no-op once done; stops the work if this handler itself is cancelled
