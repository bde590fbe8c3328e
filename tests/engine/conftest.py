"""Fixtures of the engine tests: tiny random HF checkpoints, the tiny model, small engines."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import HOST_PAGE, HFCase, MakeEngine, build_case

from edmm.engine import Engine, EngineConfig


@pytest.fixture(scope="session")
def hf_cases(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], HFCase]:
    """``hf_cases(arch)``: the tiny random checkpoint of ``arch``, built once per session."""
    root = tmp_path_factory.mktemp("hf")
    cases: dict[str, HFCase] = {}

    def get(arch: str) -> HFCase:
        if arch not in cases:
            cases[arch] = build_case(root, arch)
        return cases[arch]

    return get


@pytest.fixture(params=["qwen2", "llama"])
def hf_case(request: pytest.FixtureRequest, hf_cases: Callable[[str], HFCase]) -> HFCase:
    """A tiny random Qwen2 or Llama checkpoint (transformers' save_pretrained)."""
    return hf_cases(request.param)


@pytest.fixture
def qwen2_case(hf_cases: Callable[[str], HFCase]) -> HFCase:
    """The tiny random Qwen2 checkpoint."""
    return hf_cases("qwen2")



@pytest.fixture
def make_engine() -> Iterator[MakeEngine]:
    """``make_engine(folder, **config)``: a small float32 engine on 4 KiB host pages; every
    engine made is integrity-checked and closed at teardown."""
    engines: list[Engine] = []

    def make(folder: Path | str, **overrides: Any) -> Engine:
        kwargs: dict[str, Any] = dict(
            model=str(folder), dtype="float32", host_page_size=HOST_PAGE, max_model_len=256,
            num_slots=8, max_num_seqs=8, num_pages=256, max_num_batched_tokens=4096)
        engine = Engine(EngineConfig(**{**kwargs, **overrides}))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.check_integrity()
        engine.close()
