"""Tensor parallelism on the CPU: TP=2 over gloo (a spawned rank on 127.0.0.1) against TP=1.

Two tiny models: the embedded one (4 heads, 2 KV heads: one KV head per rank) and a Llama-shaped
one with 1 KV head (replicated on both ranks), tied embeddings, every bias (row-parallel biases
are added once) and a vocabulary of 1025 rows (the last rank's shard is padded). For each, greedy
tokens of prefill (chunked), decode, prefix reuse and an agent session with speculation and
zero-copy commit equal TP=1's; after every test each rank's arena passes check_integrity(), the
ranks' arenas agree slot for slot and page for page, and every page comes back.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_weights import randomize_
from safetensors.torch import save_file

from edmm import LLM
from edmm.agent import AgentEngine, ToolCall, ToolResult
from edmm.agent.types import TokenLayout
from edmm.engine import Engine, EngineConfig, SamplingParams
from edmm.engine.errors import EngineConfigError
from edmm.engine.tp import build_engine, leader_hooks
from edmm.model.config import resolve_preset
from edmm.model.errors import ShardingError
from edmm.model.loader import build_empty, export_hf_state_dict
from edmm.model.parallel import HeadLayout, head_layout, local_config
from edmm.server.cli import build_parser, config_from_args

HOST_PAGE = 4096  # 4 tokens of the tiny model per page at TP=1, 4-8 per rank
MAX_LEN = 192


def _write_replicated_model(folder: Path, tiny_dir: Path) -> Path:
    """A tiny Llama with one KV head, tied embeddings, all biases, 1025 vocab rows."""
    cfg = resolve_preset("tiny").replace(
        architecture="LlamaForCausalLM", num_kv_heads=1, vocab_size=1025,
        tie_word_embeddings=True, attention_bias=True, o_proj_bias=True, mlp_bias=True)
    model = build_empty(cfg, "cpu", torch.float32, max_positions=1)
    randomize_(model, seed=3)
    folder.mkdir(parents=True)
    save_file(export_hf_state_dict(model), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module", params=[  # each starts a TP=2 process group
    "kv-divides", pytest.param("kv-replicated", marks=pytest.mark.slow)])
def model_dir(request: pytest.FixtureRequest, tiny_dir: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "kv-divides":
        return tiny_dir
    return _write_replicated_model(tmp_path_factory.mktemp("tp") / "replicated", tiny_dir)


SMALL: dict[str, Any] = dict(dtype="float32", host_page_size=HOST_PAGE, max_model_len=MAX_LEN,
                             num_slots=16, max_num_seqs=4, num_pages=300,
                             max_num_batched_tokens=64)


def _config(folder: Path, tp: int) -> EngineConfig:
    return EngineConfig(model=str(folder), tensor_parallel_size=tp, **SMALL)


@pytest.fixture(scope="module")
def engines(model_dir: Path, tiny_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    """(TP=1 engine, TP=2 engine) on the same model; shared by the module's tests. The
    embedded model's TP engine comes from ``LLM(..., tensor_parallel_size=2)``."""
    ref = Engine(_config(model_dir, 1))
    if model_dir == tiny_dir:
        tp = LLM(str(model_dir), tensor_parallel_size=2, **SMALL).llm_engine
    else:
        tp = build_engine(_config(model_dir, 2), timeout_s=120)
    yield ref, tp
    tp.close()
    ref.close()


@pytest.fixture
def pair(engines: tuple[Engine, Engine]) -> Iterator[tuple[Engine, Engine]]:
    """The module's engines; afterwards every rank is sound, in step, and empties fully."""
    yield engines
    ref, tp = engines
    tp.check_integrity()  # rank 0's own, then every other rank's, and their layouts agree
    reports = leader_hooks(tp).reports()
    assert [r.error for r in reports] == [None, None]
    assert reports[0].stats == reports[1].stats
    assert reports[0].layout == reports[1].layout
    ref.reset_prefix_cache()
    tp.reset_prefix_cache()
    empty = leader_hooks(tp).reports()
    assert [(r.stats.pages_used, r.stats.slots_in_use) for r in empty] == [(0, 0), (0, 0)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _generate(engine: Engine, prompts: dict[str, list[int]], n: int) -> dict[str, Any]:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, _greedy(n))
    done: dict[str, Any] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _tokens(outs: dict[str, Any]) -> dict[str, list[int]]:
    return {rid: out.outputs[0].token_ids for rid, out in outs.items()}


def _prompt(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, 1000, (n,), generator=gen).tolist()


def test_prefill_and_decode_match_tp1(pair: tuple[Engine, Engine]) -> None:
    """A batch with a prompt longer than the step budget (chunked prefill) and short ones."""
    prompts = {"long": _prompt(1, 150), "a": _prompt(2, 7), "b": _prompt(3, 33)}
    ref, tp = pair
    want = _tokens(_generate(ref, prompts, 10))
    assert _tokens(_generate(tp, prompts, 10)) == want
    assert len(set(map(tuple, want.values()))) == 3


def test_prefix_reuse_matches_tp1(pair: tuple[Engine, Engine]) -> None:
    """A second request extending the first one's prompt reuses its KV on every rank."""
    base = _prompt(4, 70)
    ref, tp = pair
    for engine in pair:
        _generate(engine, {"first": base}, 4)
    ext = {"second": base + _prompt(5, 9)}
    want, got = _generate(ref, ext, 8), _generate(tp, ext, 8)
    assert _tokens(got) == _tokens(want)
    assert got["second"].num_cached_tokens == want["second"].num_cached_tokens > 0


CALL = ToolCall("c0", "search", "{}")
LAYOUT = TokenLayout(before=(3,), after=(4,), suffix=(2, 1, 10))


def _session(agent: AgentEngine, sid: str, result: list[int],
             prediction: list[int]) -> tuple[list[int], Any]:
    """One turn, a tool call whose result is predicted (speculated in the window), the
    resume; the session's tokens and metrics."""
    agent.add_request(f"{sid}-0", _prompt(6, 40), _greedy(5), session_id=sid)
    while agent.has_unfinished():
        agent.step()
    agent.await_tools(sid, [CALL], layout=LAYOUT, predictions={"c0": prediction})
    while agent.has_speculation():
        agent.step()
    agent.engine.check_integrity()  # with TP: the branches are the same slots on each rank
    agent.resume(sid, f"{sid}-1", [ToolResult("c0", result)], _greedy(6))
    while agent.has_unfinished():
        agent.step()
    agent.engine.check_integrity()  # committed and truncated alike on each rank
    context, metrics = agent.session_context(sid), agent.session_metrics(sid)
    agent.close_session(sid)
    return context, metrics


@pytest.mark.parametrize("prediction", ["right", "partly right"])
def test_agent_session_with_speculation_and_commit(pair: tuple[Engine, Engine],
                                                   prediction: str) -> None:
    """AgentEngine over the TP engine: the predicted result is prefilled in a branch on both
    ranks, committed by slot swap at resume (and truncated where a partial prediction
    diverges); the tokens equal TP=1's."""
    result = _prompt(7, 12)
    guess = result if prediction == "right" else result[:6] + _prompt(8, 6)
    runs = []
    for engine in pair:
        agent = AgentEngine(engine)
        runs.append(_session(agent, "s", result, guess))
        agent.close()
    (want, ref_metrics), (got, tp_metrics) = runs
    assert got == want
    assert tp_metrics.tokens_speculated > 0
    hits = (tp_metrics.spec_hits, tp_metrics.spec_partial)
    assert hits == ((1, 0) if prediction == "right" else (0, 1))
    assert hits == (ref_metrics.spec_hits, ref_metrics.spec_partial)


# ---------------------------------------------------------------------- in one process
def test_engine_refuses_tp_without_hooks(tiny_dir: Path) -> None:
    with pytest.raises(EngineConfigError, match="build_engine"):
        Engine(_config(tiny_dir, 2))
    with pytest.raises(EngineConfigError, match="tensor_parallel_size"):
        _config(tiny_dir, 0)
    with pytest.raises(EngineConfigError, match="offload"):
        EngineConfig(tensor_parallel_size=2, kv_offload_bytes=1 << 20)


def test_serve_option() -> None:
    args = build_parser().parse_args(["--tensor-parallel-size", "2", "--device", "cuda"])
    assert config_from_args(args).engine == {"tensor_parallel_size": 2}
    assert "tensor_parallel_size" not in config_from_args(build_parser().parse_args([])).engine


def test_head_layouts() -> None:
    tiny = resolve_preset("tiny")  # 4 heads, 2 KV heads
    assert [head_layout(tiny, r, 2) for r in (0, 1)] == [
        HeadLayout(range(0, 2), range(0, 1)), HeadLayout(range(2, 4), range(1, 2))]
    assert [head_layout(tiny, r, 4).kv_heads for r in range(4)] == [range(0, 1), range(0, 1),
                                                                   range(1, 2), range(1, 2)]
    q32 = resolve_preset("qwen2.5-32b")
    local = local_config(q32, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size,
            local.vocab_size) == (20, 4, 13824, 76032)
    with pytest.raises(ShardingError, match="attention heads"):
        head_layout(tiny, 0, 3)
    with pytest.raises(ShardingError, match="KV heads"):
        head_layout(q32, 0, 20)  # 40 heads split, but 8 KV heads neither split nor replicate
