"""An engine with an FP8 KV cache on the CPU (the SDPA reference stores real e4m3 bytes):
configuration and flags, pages sized by the dtype, logits of the embedded tool model within a
stated bound of FP32 KV, the README's and ``edmm demo``'s greedy tokens, an agent session's
FP8 KV through speculation branches, the zero-copy commit, offload and restore, and
tensor-parallel ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from kv_helpers import tiny_engine_config

from benchmarks.scripts.fp8_kv_accuracy import compare, step_logits
from edmm import LLM, SamplingParams
from edmm.agent import AgentConfig, AgentEngine, ToolCall, ToolResult, assistant_message
from edmm.engine import Engine, EngineConfig, EngineConfigError
from edmm.kernels._common import FP8_KV_DTYPE
from edmm.model import load_model, load_tokenizer
from edmm.model.kv_quant import calibrate_kv_scales, calibration_ids
from edmm.model.tiny import default_model
from edmm.server.tool_parser import parse_reply

# The embedded tool model, FP8 KV against FP32 KV over its chat prompts (a prefill of half the
# prompt, then one decode step per token; benchmarks/scripts/fp8_kv_accuracy.py prints the
# measured values, docs/benchmarks.md records them).
FP8_LOGIT_ERROR = 0.15  # max over positions
FP8_MEAN_LOGIT_ERROR = 0.04
FP8_ARGMAX_AGREEMENT = 0.95
FP8_MEAN_KL = 1e-2

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
BOOKING = [{"role": "user", "content": "Book a table for two at 8pm in Rome and tell me the "
                                       "price."}]


def test_kv_cache_dtype_is_checked_and_flagged(capsys: pytest.CaptureFixture[str]) -> None:
    from edmm.cli import main
    from edmm.server.cli import build_parser, config_from_args

    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(EngineConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp16")
    args = build_parser().parse_args(["--kv-cache-dtype", "fp8"])
    assert config_from_args(args).engine == {"kv_cache_dtype": "fp8"}
    assert config_from_args(build_parser().parse_args([])).engine == {}
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--kv-cache-dtype", "fp16"])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--kv-cache-dtype" in lines[0] and "'fp16'" in lines[0]


def test_the_pool_holds_the_dtype_s_tokens(tiny_dir: Path) -> None:
    """The same pool of pages: FP32 (the tiny model's weights), BF16 and FP8 KV take 2048,
    1024 and 512 bytes a token, and FP8's scales are calibrated at start-up. A pool too small
    for one BF16 sequence of ``max_model_len`` holds one in FP8."""
    spec = {}
    for name in ("auto", "bf16", "fp8"):
        engine = Engine(tiny_engine_config(tiny_dir, kv_cache_dtype=name, num_pages=40))
        try:
            spec[name] = engine.kv._arena.spec
            assert engine.stats().kv.pages_total == 40
            scales = engine.model.kv_scales
            if name != "fp8":
                assert scales is None
                continue
            cfg = engine.model.cfg
            assert scales is not None and scales.shape == (cfg.num_layers, 2, cfg.num_kv_heads)
            assert bool((scales > 0).all()) and bool(scales.isfinite().all())
            assert bool((scales != 1).all())  # calibrated, not vLLM's default of 1.0
        finally:
            engine.close()
    assert [spec[n].dtype for n in ("auto", "bf16", "fp8")] == [
        torch.float32, torch.bfloat16, FP8_KV_DTYPE]
    assert [spec[n].token_bytes for n in ("auto", "bf16", "fp8")] == [2048, 1024, 512]
    small = dict(max_model_len=256, num_pages=12)  # 16 KiB pages: BF16 needs 16, FP8 8
    with pytest.raises(EngineConfigError, match="cannot hold one sequence"):
        Engine(tiny_engine_config(tiny_dir, kv_cache_dtype="bf16", **small))
    Engine(tiny_engine_config(tiny_dir, kv_cache_dtype="fp8", **small)).close()


@torch.inference_mode()
def test_fp8_logits_of_the_tool_model_within_the_bound() -> None:
    folder = default_model()
    model, cfg = load_model(folder, "cpu")
    tok = load_tokenizer(folder)
    scales = calibrate_kv_scales(model, calibration_ids(tok, cfg.vocab_size))
    for conversation in (WEATHER, BOOKING):
        text = tok.apply_chat_template(conversation, tools=TOOLS, add_generation_prompt=True,
                                       tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        model.set_kv_scales(None)
        ref = step_logits(model, ids, torch.float32)
        model.set_kv_scales(scales)
        got = compare(ref, step_logits(model, ids, FP8_KV_DTYPE))
        summary = (f"rel max {got['rel_max']:.4f} mean {got['rel_mean']:.4f}, argmax "
                   f"{got['argmax']:.3f}, KL mean {got['kl_mean']:.2e}")
        assert got["rel_max"] <= FP8_LOGIT_ERROR, summary
        assert got["rel_mean"] <= FP8_MEAN_LOGIT_ERROR, summary
        assert got["argmax"] >= FP8_ARGMAX_AGREEMENT and got["kl_mean"] <= FP8_MEAN_KL, summary
        assert got["rel_mean"] > 1e-3, "no quantisation error at all: not FP8 storage?"


def test_readme_prompts_give_the_same_greedy_tokens_with_fp8() -> None:
    """The README's offline example (the embedded tool model, greedy, 32 tokens)."""
    prompts: list[Any] = ["The capital of France is", {"prompt_token_ids": [1, 2, 3]}]
    greedy = SamplingParams(temperature=0, max_tokens=32)
    tokens = {}
    for name in ("auto", "fp8"):
        with LLM(kv_cache_dtype=name) as llm:
            assert llm.llm_engine.kv._arena.spec.dtype == (
                FP8_KV_DTYPE if name == "fp8" else torch.float32)
            tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert tokens["fp8"] == tokens["auto"]


def _agent_turns(kv_cache_dtype: str, offload: bool) -> tuple[list[Any], AgentEngine]:
    """The README's agent loop (its weather call, a speculated resume) on the embedded tool
    model; with ``offload``, no speculation and the paused session pushed to host memory,
    restored at the resume. Returns ``[turn 0's tokens, the resume's tokens, the resume's
    cached tokens, the resume's prompt]`` and the agent engine (to close)."""
    config = EngineConfig(kv_cache_dtype=kv_cache_dtype, host_page_size=16384,
                          kv_offload_bytes=(1 << 20) if offload else 0)
    agent = AgentEngine(config, AgentConfig(speculation=()) if offload else None)
    tok = agent.tokenizer
    greedy = SamplingParams(temperature=0, max_tokens=48)

    def render(msgs: list[dict[str, Any]]) -> list[int]:
        text = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True,
                                       tokenize=False)
        return list(tok.encode(text, add_special_tokens=False))

    def run(request_id: str) -> Any:
        while True:
            for out in agent.step():
                if out.request_id == request_id and out.finished:
                    return out

    messages: list[dict[str, Any]] = list(WEATHER)
    agent.add_request("t0", render(messages), greedy, session_id="s1")
    first = run("t0").outputs[0]
    reply = parse_reply(first.text)
    call = ToolCall("call-1", reply.tool_calls[0].name, reply.tool_calls[0].arguments)
    messages.append(assistant_message(reply.content or "", [call]))
    agent.await_tools("s1", [call], messages=messages, tools=TOOLS,
                      predictions={"call-1": '{"temp": 21}'})
    while agent.has_speculation():
        agent.step()
    if offload:
        while agent.engine.stats().kv.offloads == 0:  # the retained session: to the host
            assert agent.engine.kv._index.evict_one()
    messages.append({"role": "tool", "tool_call_id": "call-1", "content": '{"temp": 21}'})
    prompt = render(messages)
    agent.resume("s1", "t1", [ToolResult("call-1", '{"temp": 21}')], greedy, prompt=prompt)
    second = run("t1")
    return [first.token_ids, second.outputs[0].token_ids, second.num_cached_tokens,
            prompt], agent


@pytest.fixture(scope="module")
def fp32_turns() -> list[Any]:
    """The README loop with FP32 KV (the embedded model's dtype)."""
    turns, agent = _agent_turns("auto", offload=False)
    agent.close()
    return turns


@pytest.mark.parametrize("offload", [False, True], ids=["speculated", "offloaded"])
def test_an_agent_session_keeps_its_fp8_kv(offload: bool, fp32_turns: list[Any]) -> None:
    """Speculated: the resume commits the branch that speculation prefilled over the
    session's FP8 pages (a hit); offloaded: the paused session's FP8 KV goes to the host and
    comes back at the resume. Both reuse the session's KV and answer as an FP8 engine that
    prefills the resume's whole prompt anew.

    Against FP32 KV the tool call is the same tokens; the answer after the result differs
    (the embedded model, greedy: FP32 "The weather in Madrid is cold, 12 C.", FP8 "It is
    cold, 12 C in Madrid right now."; the first token is a near tie)."""
    got, agent = _agent_turns("fp8", offload)
    try:
        assert got[0] == fp32_turns[0] and got[3] == fp32_turns[3]  # the same call, prompt
        fresh = Engine(EngineConfig(kv_cache_dtype="fp8", enable_prefix_caching=False))
        try:
            fresh.add_request("r", got[3], SamplingParams(temperature=0, max_tokens=48))
            done = [o for _ in range(100) for o in fresh.step() if o.finished]
            assert len(done) == 1 and done[0].num_cached_tokens == 0
            assert got[1] == done[0].outputs[0].token_ids and got[2] > 0
        finally:
            fresh.close()
        metrics = agent.session_metrics("s1")
        kv = agent.engine.stats().kv
        if offload:
            token_bytes = agent.engine.kv._arena.spec.token_bytes
            assert token_bytes == 512 and kv.offloads == kv.restores == 1
            assert kv.offloaded_bytes_total == kv.restored_bytes_total
            assert kv.offloaded_bytes_total % token_bytes == 0
            assert kv.offloaded_bytes_total // token_bytes >= got[2]
        else:
            assert metrics.spec_hits == 1
        stored = agent.engine.kv._arena.kv
        assert stored.dtype == FP8_KV_DTYPE
        agent.check_integrity()
    finally:
        agent.close()


@pytest.mark.slow  # a TP=2 process group (the fast tier runs one elsewhere)
def test_tensor_parallel_ranks_calibrate_their_own_heads(tiny_dir: Path) -> None:
    """TP=2 over gloo: each rank calibrates the scales of its KV head together with the other
    (the calibration pass runs the collectives), and generates what TP=1 does with FP8 KV."""
    small: dict[str, Any] = dict(kv_cache_dtype="fp8", dtype="float32", host_page_size=16384,
                                 max_model_len=256, num_slots=8, max_num_seqs=4, num_pages=60,
                                 max_num_batched_tokens=64)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 1000, (n,), generator=gen).tolist() for n in (150, 9)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(tiny_dir), **small) as one:
        want = [o.outputs[0].token_ids for o in one.generate(
            [{"prompt_token_ids": p} for p in prompts], greedy)]
        scales = one.llm_engine.model.kv_scales
    with LLM(str(tiny_dir), tensor_parallel_size=2, **small) as two:
        assert two.llm_engine.kv._arena.spec.dtype == FP8_KV_DTYPE
        local = two.llm_engine.model.kv_scales  # rank 0: KV head 0
        assert scales is not None and local is not None and local.shape[-1] == 1
        torch.testing.assert_close(local[..., 0], scales[..., 0], rtol=1e-5, atol=0)
        got = [o.outputs[0].token_ids for o in two.generate(
            [{"prompt_token_ids": p} for p in prompts], greedy)]
    assert got == want


@pytest.mark.slow  # a server, subprocess or seconds of waiting: the thorough tier
def test_the_demo_sessions_are_unchanged_with_fp8() -> None:
    """``edmm demo``'s three interleaved agent sessions (13 model turns: tool calls, streamed
    and predicted results, speculation, retention, zero-copy commits) give the same greedy
    outputs with FP8 KV as with FP32 KV, and with EDMM on as off."""
    from edmm.demo import run_agent_loop

    def outputs(kv_cache_dtype: str, edmm: bool) -> dict[str, list[list[int]]]:
        config = EngineConfig(dtype="float32", max_model_len=2048, host_page_size=16384,
                              num_slots=24, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype)
        with AgentEngine(config, AgentConfig() if edmm else AgentConfig.off()) as agent:
            return {sid: s.outputs for sid, s in run_agent_loop(agent, 3).items()}

    fp8 = outputs("fp8", edmm=True)
    assert sum(len(turns) for turns in fp8.values()) == 13
    assert fp8 == outputs("fp8", edmm=False)
    assert fp8 == outputs("auto", edmm=True)
