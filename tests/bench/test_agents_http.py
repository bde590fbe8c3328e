"""`edmm bench agents --http` on the CPU: a small trace through `edmm serve` (tiny model) with
the openai SDK, EDMM off (lru) and on, two jobs at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edmm.bench.agents.trace import GeneratorConfig, generate, scale

pytest.importorskip("openai")
pytest.importorskip("fastapi")


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the server subprocess too


def test_http_replay_of_two_policies(tmp_path: Path) -> None:
    from edmm.bench.agents.http import HttpReplayConfig, run_http_bench

    jobs = scale(generate(GeneratorConfig(num_jobs=2, turns=(2, 3), context_start=(40, 80),
                                          growth_per_turn=(20, 40), output_tokens=(3, 6)), 0),
                 time=0.01)
    paths = run_http_bench(jobs, HttpReplayConfig(load=2, start_timeout_s=120,
                                                  request_timeout_s=60), tmp_path)
    doc = json.loads(paths["json"].read_text())
    assert [r["policy"] for r in doc["summary"]] == ["lru", "edmm"]
    turns = [r for r in doc["rows"] if r["kind"] == "turn"]
    assert len(turns) == 2 * sum(len(j.turns) for j in jobs)
    resumes = [t for t in turns if t["turn"] > 0]
    assert all(t["cached_tokens"] > 0 for t in resumes)  # the conversation's prefix was kept
    for r in doc["summary"]:
        assert r["jobs"] == 2 and r["wait_mean_s"] > 0


def test_http_config_refuses_policies_the_server_cannot_run() -> None:
    from edmm.bench.agents.http import HttpReplayConfig

    with pytest.raises(ValueError, match="ttl"):
        HttpReplayConfig(policies=("lru", "ttl"))
