"""The connector's file-backed session store (no vLLM needed)."""

from __future__ import annotations

import shutil
from pathlib import Path

from edmm.integrations.vllm.store import SessionKVStore, chained_block_hashes, decode_block

BS = 4


def _kept_session(tmp_path: Path, n_blocks: int = 3, ttl: float = 60.0) -> SessionKVStore:
    store = SessionKVStore(tmp_path / "store")
    for i in range(n_blocks):
        assert store.save_pending("req-1", i, bytes([i]) * 64)
    tokens = list(range(n_blocks * BS + 2))
    assert store.commit("req-1", "sess/1", tokens, BS, ttl, now=1000.0) == n_blocks
    return store


def test_chained_hashes_cover_the_whole_prefix() -> None:
    a = chained_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    b = chained_block_hashes([0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert len(a) == 2 and len(b) == 2
    assert a[0] != b[0] and a[1] != b[1]  # a change in block 0 changes every later key


def test_commit_then_match_and_load(tmp_path: Path) -> None:
    store = _kept_session(tmp_path)
    tokens = list(range(3 * BS)) + [99] * 5  # the resume prompt: kept prefix + new tokens
    hashes = store.match("sess/1", tokens, BS, now=1001.0)
    assert len(hashes) == 3
    assert store.load("sess/1", hashes[1], 64) == bytes([1]) * 64
    assert store.load("sess/1", hashes[1], 65) is None  # another layout: a miss
    assert store.match("sess/1", [7, *tokens[1:]], BS, now=1001.0) == []
    assert store.match("other", tokens, BS, now=1001.0) == []
    assert not any((tmp_path / "store" / "pending").iterdir())


def test_corrupted_block_ends_the_match(tmp_path: Path) -> None:
    store = _kept_session(tmp_path)
    tokens = list(range(3 * BS))
    hashes = store.match("sess/1", tokens, BS, now=1001.0)
    (f,) = [p for p in (tmp_path / "store" / "sessions").rglob(f"{hashes[1]}.kvb")]
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    assert decode_block(bytes(data)) is None
    assert store.match("sess/1", tokens, BS, now=1001.0) == hashes[:1]
    assert store.load("sess/1", hashes[1], 64) is None
    f.write_bytes(bytes(data[:10]))  # truncated
    assert store.match("sess/1", tokens, BS, now=1001.0) == hashes[:1]


def test_expiry_drops_the_session(tmp_path: Path) -> None:
    store = _kept_session(tmp_path, ttl=5.0)
    tokens = list(range(3 * BS))
    assert store.drop_expired(now=1004.0) == 0
    assert store.drop_expired(now=1006.0, keep={"sess/1"}) == 0  # a running session stays
    assert store.match("sess/1", tokens, BS, now=1006.0) == []
    assert not any((tmp_path / "store" / "sessions").iterdir())


def test_full_store_keeps_what_fits(tmp_path: Path) -> None:
    store = SessionKVStore(tmp_path / "store", max_bytes=250, rescan_s=0.0)  # 2 blocks + headers
    assert store.save_pending("r", 0, b"x" * 64)
    assert store.save_pending("r", 1, b"x" * 64)
    assert not store.save_pending("r", 2, b"x" * 64)
    assert store.commit("r", "s", list(range(3 * BS)), BS, 60.0) == 2
    assert len(store.match("s", list(range(3 * BS)), BS)) == 2


def test_missing_store_is_a_miss(tmp_path: Path) -> None:
    store = _kept_session(tmp_path)
    shutil.rmtree(tmp_path / "store")
    assert store.match("sess/1", list(range(3 * BS)), BS, now=1001.0) == []
    assert store.drop_expired() == 0
    assert store.save_pending("req-2", 0, b"y" * 8)  # recreated on the next save


def test_size_written_by_another_process_counts_after_a_rescan(tmp_path: Path) -> None:
    store = SessionKVStore(tmp_path / "store", max_bytes=1000, rescan_s=3600.0)
    assert store.save_pending("r", 0, b"x" * 64)
    (tmp_path / "store" / "other.bin").write_bytes(bytes(900))  # another process's data
    assert store.save_pending("r", 1, b"x" * 64)  # not seen yet: a soft bound
    store.rescan_s = 0.0
    assert not store.save_pending("r", 2, b"x" * 64)
