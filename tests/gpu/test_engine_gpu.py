"""The engine on CUDA: Triton attention + CUDA-graph decode against the eager reference and HF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edmm import LLM, SamplingParams
from edmm.engine import Engine, EngineConfig
from edmm.engine.cuda_graph import CudaGraphRunner

pytestmark = pytest.mark.gpu


def _folder(tmp_path: Path, kv_heads: int = 2) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=2048, hidden_size=256, intermediate_size=768,
                      num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=kv_heads,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(1)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    return tmp_path


def test_graphs_and_triton_match_eager_and_hf_in_float32(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = _folder(tmp_path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 2048, (n,), generator=g).tolist() for n in (5, 77, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    kw = {"device": "cuda", "dtype": "float32", "num_pages": 64, "num_slots": 8,
          "max_num_seqs": 4}
    fast = LLM(str(folder), **kw)
    assert isinstance(fast.llm_engine._runner, CudaGraphRunner)
    got = [o.outputs[0].token_ids for o in fast.generate(inputs, params)]
    fast.llm_engine.check_integrity()
    replays = fast.llm_engine._runner.replays
    assert replays["mixed"] >= 1 and replays["decode"] >= 30 and replays["eager"] == 0
    fast.close()
    eager = LLM(str(folder), enforce_eager=True, **kw)
    want = [o.outputs[0].token_ids for o in eager.generate(inputs, params)]
    eager.close()
    assert got == want
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    for p, toks in zip(prompts, got, strict=True):
        out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=40, do_sample=False,
                          min_new_tokens=40)
        assert out[0, len(p):].tolist() == toks


def _staggered(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Requests arriving while others decode, a prefix shared with a running request, a
    prompt longer than the step budget (chunked), then a resume on a finished one's prefix."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    done: dict[str, list[int]] = {}

    def steps(n: int) -> None:
        for _ in range(n):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids

    engine.add_request("a", prompts[0], params)
    steps(2)
    engine.add_request("b", prompts[0][:100] + prompts[1][:30], params)
    steps(3)
    engine.add_request("c", prompts[2], params)
    while engine.has_unfinished():
        steps(1)
    engine.add_request("d", prompts[0] + done["a"] + prompts[1][30:50], params)
    while engine.has_unfinished():
        steps(1)
    return done


@pytest.mark.parametrize("small", [False, True], ids=["default-sizes", "graphs-of-few-tokens"])
def test_mixed_graphs_match_eager_with_staggered_requests(tmp_path: Path, small: bool) -> None:
    """With ``small``, mixed graphs of 3-16 tokens take fewer sequences than the engine
    runs (``T - 1``): a step of decodes beside a short prefill replays one of them."""
    folder = _folder(tmp_path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 2048, (n,), generator=g).tolist() for n in (150, 60, 600)]
    kw = {"model": str(folder), "device": "cuda", "dtype": "float32", "num_pages": 64,
          "num_slots": 8, "max_num_seqs": 4, "max_num_batched_tokens": 256}
    if small:
        kw["cuda_graph_token_sizes"] = (3, 4, 6, 8, 16, 32, 64, 128, 256)
    fast = Engine(EngineConfig(**kw))
    runner = fast._runner
    assert isinstance(runner, CudaGraphRunner)
    sizes = (3, 4, 6, 8, 16, 32, 64, 128, 256) if small else (
        32, 64, 96, 128, 160, 192, 224, 256)  # the config's, up to the token budget
    assert runner.token_sizes == sizes
    # the 7 usable slots (one is the pad slot) bound a graph's sequences
    assert [runner.mixed_seqs(t) for t in sizes[:4]] == ([2, 3, 5, 7] if small else [7] * 4)
    assert runner.graph_for(1) is runner._decode[min(runner.sizes)].graph
    assert runner.mixed_buckets(128) == (7,)  # 16 and 64 exceed the 7 sequences
    assert runner.graph_for(100) is runner._mixed[(128, 7)].graph
    assert runner.graph_for(257) is None  # past the largest mixed graph: eager
    got = _staggered(fast, prompts)
    fast.check_integrity()
    assert runner.replays["mixed"] >= 5 and runner.replays["eager"] == 0
    fast.close()
    eager = Engine(EngineConfig(enforce_eager=True, **kw))
    want = _staggered(eager, prompts)
    eager.close()
    assert got == want


def test_prefix_spares_on_cuda_change_no_output(tmp_path: Path) -> None:
    """Requests on one shared 1,200-token prefix (3.5 2 MiB pages of this model's KV: 6 KiB a
    token), two at a time with CUDA graphs and async scheduling: spares are made while steps
    compute and adopted by later requests, and the greedy tokens equal a run without spares."""
    folder = _folder(tmp_path, kv_heads=8)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 2048, (1200,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 2048, (40,), generator=g).tolist() for _ in range(10)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = {}
    for spares in (True, False):
        engine = Engine(EngineConfig(model=str(folder), device="cuda", dtype="float32",
                                     num_pages=256, num_slots=16, prefix_spares=spares))
        done: dict[str, list[int]] = {}
        for i in range(0, len(prompts), 2):
            for j in (i, i + 1):
                engine.add_request(f"r{j}", prompts[j], params)
            while engine.has_unfinished():
                done.update({o.request_id: o.outputs[0].token_ids
                             for o in engine.step() if o.finished})
        engine.check_integrity()
        stats = engine.kv.stats()
        if spares:
            assert stats.spares_made >= 2 and stats.spares_used >= 2
        runs[spares] = done
        engine.close()
    assert runs[True] == runs[False]
