"""The batch limits an `EngineConfig` takes by default, and the decode graphs captured for them."""

from __future__ import annotations

import pytest

from edmm.engine import config as config_module
from edmm.engine.config import EngineConfig, EngineConfigError
from edmm.engine.cuda_graph import decode_graph_sizes


def test_cpu_keeps_a_small_batch() -> None:
    cfg = EngineConfig()
    assert (cfg.max_num_seqs, cfg.num_slots) == (16, 32)


@pytest.mark.parametrize(("device_class", "seqs"), [("cuda-large", 256), ("cuda", 128)])
def test_gpu_batch_is_sized_by_its_memory(monkeypatch: pytest.MonkeyPatch, device_class: str,
                                          seqs: int) -> None:
    monkeypatch.setattr(config_module, "_device_class", lambda device: device_class)
    cfg = EngineConfig(device="cuda")
    assert (cfg.max_num_seqs, cfg.num_slots) == (seqs, 2 * seqs)


def test_explicit_limits_win_and_bound_each_other() -> None:
    assert EngineConfig(num_slots=8).max_num_seqs == 8  # the default capped by the slots
    assert EngineConfig(max_num_seqs=300).num_slots == 600
    assert (EngineConfig(max_num_seqs=3, num_slots=5).max_num_seqs,
            EngineConfig(max_num_seqs=3, num_slots=5).num_slots) == (3, 5)
    with pytest.raises(EngineConfigError, match="max_num_seqs=9 exceeds num_slots=4"):
        EngineConfig(max_num_seqs=9, num_slots=4)
    with pytest.raises(EngineConfigError, match="max_num_seqs must be >= 1, got -2"):
        EngineConfig(max_num_seqs=-2)


def test_decode_graphs_cover_every_batch_with_at_most_seven_padding_rows() -> None:
    assert decode_graph_sizes(1) == (1,)
    assert decode_graph_sizes(6) == (1, 2, 4, 6)
    assert decode_graph_sizes(16) == (1, 2, 4, 8, 16)
    sizes = decode_graph_sizes(256)
    assert sizes[:6] == (1, 2, 4, 8, 16, 24) and sizes[-1] == 256 and len(sizes) == 35
    for batch in range(1, 257):
        padded = next(s for s in sizes if s >= batch)
        assert padded - batch <= 7
    assert decode_graph_sizes(100)[-2:] == (96, 100)
