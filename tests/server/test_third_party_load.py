"""A third-party load generator against `edmm serve`: GuideLLM (the vLLM project's) streams
chat completions at a fixed concurrency and reports TTFT and inter-token latency.

GuideLLM pins its own dependencies (click, uvloop, datasets, ...), so it lives in a venv of its
own (`.ci/run-guidellm` makes one) and this test runs its CLI from there: ``EDMM_GUIDELLM``
names the ``guidellm`` executable; without it the test is skipped (the CI's thorough tier sets
it).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import MODEL, LiveServer, serve, server_config

from edmm.server import ServerState

GUIDELLM = os.environ.get("EDMM_GUIDELLM")
REQUESTS, STREAMS, PROMPT_TOKENS, OUTPUT_TOKENS = 24, 4, 64, 32

pytestmark = [
    pytest.mark.slow,  # a server, and a subprocess that imports torch and transformers
    pytest.mark.skipif(GUIDELLM is None, reason="EDMM_GUIDELLM (a guidellm executable) unset"),
]


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[LiveServer]:
    yield from serve(ServerState(server_config(tiny_dir)))


def test_guidellm_streams_complete_with_ttft_and_itl(server: LiveServer, tiny_dir: Path,
                                                     tmp_path: Path) -> None:
    assert GUIDELLM is not None
    report = tmp_path / "guidellm.json"
    run = subprocess.run([
        GUIDELLM, "run",
        "--backend", f"kind=openai_http,target={server.url},model={MODEL}",
        "--profile", f"kind=concurrent,streams={STREAMS}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                  f"output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=hf_auto,model={tiny_dir}",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--output", f"kind=json,path={report}", "--disable-console-interactive",
    ], capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    bench = json.loads(report.read_text())["benchmarks"][0]
    made = bench["scheduler_metrics"]["requests_made"]
    assert (made["successful"], made["errored"], made["incomplete"]) == (REQUESTS, 0, 0)
    metrics = bench["metrics"]
    ttft = metrics["time_to_first_token_ms"]["successful"]
    itl = metrics["inter_token_latency_ms"]["successful"]
    assert ttft["count"] == REQUESTS and ttft["min"] > 0
    # every streamed token after the first is a gap: the server streamed token by token
    assert itl["count"] == REQUESTS * (OUTPUT_TOKENS - 1) and itl["min"] > 0
    assert metrics["output_token_count"]["successful"]["total_sum"] == REQUESTS * OUTPUT_TOKENS
