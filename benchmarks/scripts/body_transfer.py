"""Where a live resume's ``client_wire -> received`` goes: the body's way over loopback (CPU).

    python -m benchmarks.scripts.body_transfer --tokenizer DIR [--contexts 16384,31744]

`edmm bench live --stages` reports ``client_wire -> received``: from the raw client handing
the JSON body to httpx to the server's `RequestGuard` having read all of it (1.1 ms on the
H200's host at 16K). This splits it, with the bench's own resume body (`Prompts`, the A
group), the bench's client (an ``httpx.Client`` POST) and the server's front (uvicorn, its
default HTTP parser, `RequestGuard`, a route that reads the body), the server in a
process of its own:

- ``httpx before its first write``: the client's request machinery (request object, headers,
  connection pool) up to its first socket write;
- ``client writes``: from the first write's start to the last write's end (httpx writes the
  headers and the body separately: ``writes``);
- ``first bytes at the server``: the first ``data_received`` of uvicorn's protocol;
- ``app called``: the ASGI app got the request (headers parsed, the request's task running);
- ``body read``: `RequestGuard` has the whole body (``reads``: the ``data_received`` calls
  until then).

All from the client's hand-over, wall clock, median and min of ``--runs`` after 5 warm-up
posts. It reaches into httpcore's and uvicorn's classes to time their calls (a measurement
script, not server code). Writes body-transfer.{csv,json,md} into ``--out``.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import statistics
import sys
import time
from typing import Any

from benchmarks.scripts import live_script_parser
from benchmarks.scripts.live_host_stages import CALL
from edmm.bench.live import TOOL, LiveBenchConfig, Prompts, load_tokenizer
from edmm.bench.results import ResultWriter, collect_environment

WARMUP = 5
SWITCH_INTERVAL_S = 0.0002  # as `edmm serve`


def resume_body(tok: Any, context: int) -> bytes:
    """The raw client's JSON body of the A resume at ``context`` tokens."""
    prompts = Prompts(tok, LiveBenchConfig(contexts=(context,), result_tokens=512),
                      random.Random(0))
    first = prompts.conversation(context)
    messages = prompts.resume("A", first, {"role": "assistant", "content": "",
                                           "tool_calls": [CALL]}, "call_1", prompts.text(512))
    return json.dumps({"model": "m", "messages": messages, "tools": [TOOL],
                       "tool_choice": "none", "max_tokens": 8, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


def _serve(port: int) -> None:
    """The server process: uvicorn, `RequestGuard`, a route reading the body; its events'
    wall-clock times (``GET /events`` returns and clears them)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from uvicorn.protocols.http import h11_impl, httptools_impl

    from edmm.server.http_guard import BODY_READ_NS, RequestGuard

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    events: list[tuple[str, int]] = []
    for protocol in (httptools_impl.HttpToolsProtocol, h11_impl.H11Protocol):
        def data_received(self: Any, data: bytes, _orig: Any = protocol.data_received) -> None:
            events.append(("data", time.time_ns()))
            _orig(self, data)
        protocol.data_received = data_received  # type: ignore[method-assign]

    async def body(request: Any) -> JSONResponse:
        size = len(await request.body())
        events.append(("read", request.scope["state"][BODY_READ_NS]))
        return JSONResponse({"bytes": size})

    async def read_events(request: Any) -> JSONResponse:
        out = list(events)
        events.clear()
        return JSONResponse(out)

    app = Starlette(routes=[Route("/body", body, methods=["POST"]),
                            Route("/events", read_events)],
                    middleware=[Middleware(RequestGuard, allowed_hosts=None)])  # type: ignore[arg-type]

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/body":
            events.append(("app", time.time_ns()))
        await app(scope, receive, send)

    uvicorn.run(asgi, host="127.0.0.1", port=port, log_level="warning")


def measure(body: bytes, runs: int, port: int) -> dict[str, list[float]]:
    """Per part (see the module docstring), its milliseconds in each of ``runs`` posts."""
    import httpcore._backends.sync as backend
    import httpx

    proc = multiprocessing.get_context("spawn").Process(target=_serve, args=(port,),
                                                        daemon=True)
    proc.start()
    writes: list[tuple[int, int]] = []
    original_write = backend.SyncStream.write

    def timed_write(self: Any, buffer: bytes, timeout: float | None = None) -> None:
        start = time.time_ns()
        original_write(self, buffer, timeout)
        writes.append((start, time.time_ns()))

    backend.SyncStream.write = timed_write  # type: ignore[method-assign]
    url = f"http://127.0.0.1:{port}"
    parts: dict[str, list[float]] = {}
    try:
        with httpx.Client(timeout=30) as client:
            _wait_up(client, url)
            for i in range(WARMUP + runs):
                client.get(f"{url}/events")  # clears them
                writes.clear()
                wire = time.time_ns()
                client.post(f"{url}/body", content=body,
                            headers={"Content-Type": "application/json"}).raise_for_status()
                posted = list(writes)
                events = client.get(f"{url}/events").json()
                if i >= WARMUP:
                    for name, ms in _parts(wire, posted, events).items():
                        parts.setdefault(name, []).append(ms)
    finally:
        backend.SyncStream.write = original_write  # type: ignore[method-assign]
        proc.terminate()
        proc.join(10)
    return parts


def _wait_up(client: Any, url: str, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.get(f"{url}/events")
            return
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _parts(wire: int, writes: list[tuple[int, int]],
           events: list[tuple[str, int]]) -> dict[str, float]:
    """One post's parts in ms from ``wire`` (the client's hand-over to httpx)."""
    read = next(t for name, t in events if name == "read")
    data = [t for name, t in events if name == "data" and t <= read]
    app = next(t for name, t in events if name == "app")
    return {"httpx before its first write": (writes[0][0] - wire) / 1e6,
            "client writes": (writes[-1][1] - writes[0][0]) / 1e6,
            "first bytes at the server": (data[0] - wire) / 1e6,
            "app called": (app - wire) / 1e6,
            "body read": (read - wire) / 1e6,
            "writes": float(len(writes)), "reads": float(len(data))}


def main() -> None:
    args = live_script_parser(30).parse_args()
    from edmm.bench.peers import free_port as _free_port

    tok = load_tokenizer(str(args.tokenizer))
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        body = resume_body(tok, context)
        for name, values in measure(body, args.runs, _free_port()).items():
            rows.append({"context_tokens": context, "body_bytes": len(body), "part": name,
                         "median": statistics.median(values), "min": min(values),
                         "n": len(values)})
    writer = ResultWriter(args.out, "body-transfer", collect_environment("cpu"))
    writer.add_rows(rows)
    paths = writer.write(rows, title="The resume body's way from the client to the server "
                         "(loopback, CPU)",
                         notes=[f"tokenizer: {args.tokenizer}; milliseconds from the client's "
                                "hand-over to httpx (writes, reads: counts), median and min of "
                                f"{args.runs} posts; see the script's docstring"])
    print("wrote " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
