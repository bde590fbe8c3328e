"""The proxy app: OpenAI-compatible passthrough to vLLM, session tagging, speculative prefill.

Routes: ``POST /v1/chat/completions`` (tagged, watched for tool calls), ``POST /v1/completions``
and ``GET /v1/models`` (passed through as they are), ``GET /metrics`` (the proxy's own).
Upstream bodies, status codes and errors pass through unchanged and streams unbuffered; an
unreachable upstream is a 502 and a malformed request a 400, both OpenAI error objects.

Every chat request gets ``kv_transfer_params`` for EDMM's vLLM connector (keys the client set
itself win)::

    {"edmm_session": <session id>, "edmm_tool_s": <expected tool seconds>,
     "edmm_awaiting_tool": <the request offers tools>}

The session id is the ``X-Session-Id`` header (`ProxyConfig.session_header`), else the
``edmm_session`` the client already put in ``kv_transfer_params``, else derived: a hash of the
model and the messages up to the first user message (stable across the turns of one
conversation). When a response ends in tool calls, a background task renders the next prompt
up to the first tool result (`edmm.proxy.speculation.speculation_prompt`) and sends it as a
1-token ``/v1/completions`` request tagged with the session, so that the connector keeps its
KV for the resume. A new request of the session cancels a speculation not sent yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from edmm.openai_errors import error_body
from edmm.proxy.speculation import StreamAccumulator, speculation_prompt, tool_calls_of

logger = logging.getLogger(__name__)

# hop-by-hop or recomputed headers, never copied between the two legs
_DROP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection",
                           "keep-alive", "accept-encoding", "content-encoding"})

Render = Callable[[Mapping[str, Any], Mapping[str, Any]], list[int]]


@dataclass(frozen=True)
class ProxyConfig:
    """Options of ``edmm proxy``.

    ``tokenizer``: folder or Hugging Face id of the tokenizer whose chat template the upstream
    uses (default: each request's ``model``). ``tool_seconds``: expected tool duration sent
    to the connector (it keeps a paused session ``2 x tool_seconds + 30`` s by default).
    """

    upstream: str
    host: str = "127.0.0.1"
    port: int = 8001
    session_header: str = "X-Session-Id"
    tool_seconds: float = 10.0
    tokenizer: str | None = None
    speculate: bool = True
    timeout_s: float = 600.0


class ProxyError(Exception):
    """An error answered to the client as an OpenAI error object whose ``code`` is the HTTP
    status, as the vLLM upstream writes its own (`edmm.openai_errors` owns the shape)."""

    status = 500
    type = "internal_error"

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(str(self), self.type, None, self.status)


class BadRequestError(ProxyError):
    """The request body is not a JSON object, or a field has the wrong type (400)."""

    status = 400
    type = "invalid_request_error"


class UpstreamError(ProxyError):
    """The upstream server could not be reached or broke the connection (502)."""

    status = 502
    type = "upstream_error"


@dataclass
class _Speculation:
    task: asyncio.Task[None]
    sent: bool = False


@dataclass
class ProxyMetrics:
    """The proxy's Prometheus registry (one per app)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.tool_calls = Counter("edmm_proxy_tool_calls", "Tool calls seen in responses",
                                  registry=self.registry)
        self.speculations = Counter(
            "edmm_proxy_speculations",
            "Speculative prefills by outcome: sent (upstream answered 200), failed, cancelled "
            "(the client resumed first), skipped (nothing to render)",
            ["outcome"], registry=self.registry)
        self.speculated_tokens = Counter("edmm_proxy_speculated_tokens",
                                         "Prompt tokens of the speculations sent",
                                         registry=self.registry)

    def value(self, name: str, **labels: str) -> float:
        """One sample's current value (0 if never set)."""
        return self.registry.get_sample_value(name, labels) or 0.0


class Proxy:
    """State of one proxy app: the upstream client, pending speculations, metrics.

    ``transport`` replaces the network (tests); ``render`` replaces `speculation_prompt` with
    the tokenizer of `ProxyConfig.tokenizer` (``render(request_body, assistant_message)``).
    """

    def __init__(self, config: ProxyConfig, transport: httpx.AsyncBaseTransport | None = None,
                 render: Render | None = None) -> None:
        self.config = config
        self.client = httpx.AsyncClient(base_url=config.upstream.rstrip("/"),
                                        timeout=config.timeout_s, transport=transport)
        self.metrics = ProxyMetrics()
        self.render = render or self._render
        self._tokenizers: dict[str, Any] = {}
        self._speculations: dict[str, _Speculation] = {}

    async def close(self) -> None:
        """Cancel pending speculations and close the upstream connections."""
        for spec in list(self._speculations.values()):
            spec.task.cancel()
        await asyncio.gather(*(s.task for s in self._speculations.values()),
                             return_exceptions=True)
        await self.client.aclose()

    # -- forwarding ---------------------------------------------------------------------------
    async def send(self, request: Request, content: bytes) -> httpx.Response:
        """Send ``request`` (with ``content`` as its body) upstream; the response is open
        (streamed). Raises `UpstreamError` if the upstream cannot be reached."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_HEADERS}
        req = self.client.build_request(request.method, request.url.path, content=content,
                                        headers=headers, params=request.query_params)
        try:
            return await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            raise UpstreamError(f"upstream {self.config.upstream} unreachable: "
                                f"{type(e).__name__}: {e}") from e

    @staticmethod
    def relay(resp: httpx.Response, on_chunk: Callable[[bytes], None] | None = None,
              on_end: Callable[[], None] | None = None) -> StreamingResponse:
        """Stream an open upstream response to the client chunk by chunk, unchanged;
        ``on_end`` runs once the upstream stream ended normally."""
        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_bytes():
                    if on_chunk is not None:
                        on_chunk(chunk)
                    yield chunk
            except httpx.HTTPError as e:  # headers are out: report in the stream, as vLLM does
                err = UpstreamError(f"upstream stream broke: {type(e).__name__}: {e}")
                yield f"data: {json.dumps(err.body())}\n\n".encode()
                return
            finally:
                await resp.aclose()
            if on_end is not None:
                on_end()

        return StreamingResponse(body(), status_code=resp.status_code,
                                 headers=_response_headers(resp))

    # -- chat ---------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        """Forward a chat completion, tagged; watch its response for tool calls."""
        body = _json_object(await request.body())
        session = self.session_id(request.headers, body)
        self.cancel(session)  # the client is back: a speculation not sent yet is too late
        params = body.get("kv_transfer_params") or {}
        if not isinstance(params, dict):
            raise BadRequestError("kv_transfer_params must be an object")
        tag = {"edmm_session": session, "edmm_tool_s": self.config.tool_seconds,
               "edmm_awaiting_tool": bool(body.get("tools"))}
        body["kv_transfer_params"] = params = {**tag, **params}
        try:
            tool_s = float(params["edmm_tool_s"])
        except (TypeError, ValueError) as e:
            raise BadRequestError("kv_transfer_params.edmm_tool_s must be a number") from e
        resp = await self.send(request, json.dumps(body).encode())
        if body.get("stream") and resp.status_code == 200:
            acc = StreamAccumulator()
            return self.relay(resp, acc.feed,
                              lambda: self.on_message(session, tool_s, body, acc.message()))
        content = await _read(resp)
        if resp.status_code == 200:
            try:
                message = json.loads(content)["choices"][0]["message"]
            except (ValueError, LookupError, TypeError):
                message = None  # not a chat completion: nothing to watch
            if isinstance(message, dict):
                self.on_message(session, tool_s, body, message)
        return Response(content, status_code=resp.status_code, headers=_response_headers(resp))

    def session_id(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
        """The request's session id (header, client's ``edmm_session``, or derived)."""
        if headers.get(self.config.session_header):
            return headers[self.config.session_header]
        params = body.get("kv_transfer_params")
        if isinstance(params, dict) and params.get("edmm_session"):
            return str(params["edmm_session"])
        messages = body.get("messages")
        head: Any = messages
        if isinstance(messages, list):
            users = [i for i, m in enumerate(messages)
                     if isinstance(m, dict) and m.get("role") == "user"]
            head = messages[: users[0] + 1] if users else messages
        key = json.dumps([body.get("model"), head], sort_keys=True, default=str)
        return "auto-" + hashlib.blake2b(key.encode(), digest_size=12).hexdigest()

    def on_message(self, session: str, tool_s: float, body: Mapping[str, Any],
                   message: Mapping[str, Any]) -> None:
        """A response's assistant message arrived: count its tool calls and speculate."""
        calls = tool_calls_of(message)
        if not calls:
            return
        self.metrics.tool_calls.inc(len(calls))
        if not self.config.speculate:
            return
        self.cancel(session)
        task = asyncio.get_running_loop().create_task(
            self._speculate(session, tool_s, body, message))
        spec = self._speculations[session] = _Speculation(task)

        def forget(_: asyncio.Task[None]) -> None:
            if self._speculations.get(session) is spec:
                del self._speculations[session]

        task.add_done_callback(forget)

    def cancel(self, session: str) -> None:
        """Cancel the session's speculation if it was not sent upstream yet."""
        spec = self._speculations.get(session)
        if spec is not None and not spec.sent:
            spec.task.cancel()
            del self._speculations[session]

    async def _speculate(self, session: str, tool_s: float, body: Mapping[str, Any],
                         message: Mapping[str, Any]) -> None:
        outcome = "failed"
        try:
            try:
                ids = await asyncio.to_thread(self.render, body, message)
            except (ValueError, KeyError, TypeError) as e:
                outcome = "skipped"
                logger.info("speculation of %s skipped: %s", session, e)
                return
            spec = self._speculations.get(session)
            if spec is not None:
                spec.sent = True
            req = {"model": body.get("model"), "prompt": ids, "max_tokens": 1,
                   "temperature": 0, "kv_transfer_params": {
                       "edmm_session": session, "edmm_tool_s": tool_s,
                       "edmm_awaiting_tool": True}}
            resp = await self.client.post("/v1/completions", json=req)
            if resp.status_code == 200:
                outcome = "sent"
                self.metrics.speculated_tokens.inc(len(ids))
            else:
                logger.warning("speculation of %s: upstream %d %s", session, resp.status_code,
                               resp.text[:200])
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception:
            logger.exception("speculation of %s failed", session)
        finally:
            self.metrics.speculations.labels(outcome).inc()

    def _render(self, body: Mapping[str, Any], message: Mapping[str, Any]) -> list[int]:
        """`speculation_prompt` with the configured (or the request model's) tokenizer."""
        if body.get("chat_template") or body.get("chat_template_kwargs"):
            raise ValueError("request-specific chat templates are not rendered")
        name = self.config.tokenizer or str(body.get("model"))
        if name not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[name] = AutoTokenizer.from_pretrained(name)
        return speculation_prompt(self._tokenizers[name], body, message)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise BadRequestError(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequestError("request body must be a JSON object")
    return body


async def _read(resp: httpx.Response) -> bytes:
    try:
        return await resp.aread()
    except httpx.HTTPError as e:
        raise UpstreamError(f"upstream response broke: {type(e).__name__}: {e}") from e
    finally:
        await resp.aclose()


def _response_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_HEADERS}


def build_app(proxy: Proxy) -> FastAPI:
    """The FastAPI app serving ``proxy`` (its upstream client is closed on shutdown)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.close()

    app = FastAPI(title="edmm proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.exception_handler(ProxyError)
    async def _proxy_error(_: Request, exc: ProxyError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error", exc_info=exc)
        return JSONResponse(ProxyError(f"{type(exc).__name__}: {exc}").body(), status_code=500)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.chat(request)

    @app.post("/v1/completions")
    @app.get("/v1/models")
    async def passthrough(request: Request) -> Response:
        return proxy.relay(await proxy.send(request, await request.body()))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
