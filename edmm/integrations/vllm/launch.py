"""Start vLLM's OpenAI server with EDMM's connector, and ``edmm proxy`` in front of it, as
child processes on loopback ports (tests and benchmarks; no vLLM import here)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from edmm.integrations.vllm import CONNECTOR_MODULE, CONNECTOR_NAME


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_transfer_config(store: Path | str, **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` of EDMM's connector keeping sessions under ``store``
    (``extra``: more ``kv_connector_extra_config`` keys)."""
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"edmm_store_path": str(store), **extra}}


def post_json(url: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """POST ``body`` as JSON; the decoded answer (``{}`` if empty)."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data = resp.read()
    return json.loads(data) if data else {}


@contextmanager
def child_server(args: Sequence[str], ready_url: str, log: Path,
                 env: dict[str, str] | None = None, timeout_s: float = 300.0) -> Iterator[None]:
    """Run ``args`` (logging to ``log``) until ``ready_url`` answers; stop it on exit."""
    with log.open("w") as out:
        proc = subprocess.Popen(list(args), env={**os.environ, **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT, cwd=log.parent)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{args[:4]} exited:\n{log.read_text()[-4000:]}")
                try:
                    urllib.request.urlopen(ready_url, timeout=2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{ready_url} did not come up") from None
                    time.sleep(0.5)
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def vllm_server(model: Path | str, workdir: Path, store: Path | None = None,
                args: Sequence[str] = ()) -> Iterator[str]:
    """vLLM's OpenAI server on ``model`` (float32, eager, prompt-token details, dev mode for
    ``/reset_prefix_cache``), with EDMM's connector when ``store`` is given; yields its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--dtype", "float32", "--enforce-eager", "--port", str(port),
           "--enable-prompt-tokens-details", *args]
    if store is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config(store))]
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_SERVER_DEV_MODE": "1"}
    url = f"http://127.0.0.1:{port}"
    with child_server(cmd, f"{url}/health", workdir / f"vllm-{port}.log", env):
        yield url


@contextmanager
def edmm_proxy(upstream: str, workdir: Path, args: Sequence[str] = ()) -> Iterator[str]:
    """``edmm proxy --upstream upstream [args]`` on a free port; yields its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "edmm", "proxy", "--upstream", upstream, "--port", str(port),
           "--log-level", "warning", *args]
    url = f"http://127.0.0.1:{port}"
    with child_server(cmd, f"{url}/metrics", workdir / f"proxy-{port}.log", timeout_s=60):
        yield url
