"""A file-backed KV block store shared by vLLM's scheduler and worker processes.

Layout under ``root``::

    pending/<request id>/<block index>.kvb   blocks saved while a tagged request runs
    sessions/<session id>/<prefix hash>.kvb  blocks of a paused session, keyed by the chained
                                             hash of every token up to the block's end
    sessions/<session id>/meta.json          {"expires_at": unix time, "block_size": n}

A block file is a header (magic, payload length, blake2b digest of the payload) then the
payload: the block's KV in every layer, raw bytes in the worker's own layout. A block that is
missing, truncated, of another size or whose digest does not match is a miss: the caller
recomputes it. Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

MAGIC = b"EDMMKV01"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload bytes, blake2b-256 of the payload
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_name(name: str) -> str:
    """A file-system-safe, collision-resistant form of a session or request id."""
    clean = _SAFE.sub("_", name)[:64]
    return f"{clean}-{hashlib.blake2b(name.encode(), digest_size=6).hexdigest()}"


def chained_block_hashes(token_ids: Sequence[int], block_size: int) -> list[str]:
    """One hex hash per full block; each covers all tokens from the start to the block's end."""
    out: list[str] = []
    prev = b""
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(struct.pack(f"<{block_size}q", *block))
        prev = h.digest()
        out.append(prev.hex())
    return out


def encode_block(payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, len(payload), hashlib.blake2b(payload, digest_size=32).digest()) + (
        payload
    )


def decode_block(data: bytes, expected_len: int | None = None) -> bytes | None:
    """The payload, or None if the file is not an intact block (of ``expected_len`` bytes)."""
    if len(data) < _HEADER.size:
        return None
    magic, n, digest = _HEADER.unpack_from(data)
    payload = data[_HEADER.size :]
    if magic != MAGIC or n != len(payload) or (expected_len is not None and n != expected_len):
        return None
    if hashlib.blake2b(payload, digest_size=32).digest() != digest:
        return None
    return payload


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class SessionKVStore:
    """Paused agent sessions' KV blocks on a file system shared by processes.

    ``max_bytes`` bounds the store: a save that would pass it (after dropping expired
    sessions) is skipped, so the session simply recomputes at resume.
    """

    def __init__(self, root: str | Path, max_bytes: int = 1 << 30, rescan_s: float = 1.0) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.rescan_s = rescan_s
        self._used: int | None = None
        self._used_at = 0.0
        (self.root / "pending").mkdir(parents=True, exist_ok=True)
        (self.root / "sessions").mkdir(parents=True, exist_ok=True)

    # -- paths ------------------------------------------------------------------------------
    def _pending_dir(self, req_id: str) -> Path:
        return self.root / "pending" / safe_name(req_id)

    def _session_dir(self, session: str) -> Path:
        return self.root / "sessions" / safe_name(session)

    # -- worker side ------------------------------------------------------------------------
    def used_bytes(self) -> int:
        """Bytes under the store (all processes' files), rescanned at most every
        ``rescan_s`` seconds; this process's own writes are added in between."""
        now = time.monotonic()
        if self._used is None or now - self._used_at > self.rescan_s:
            self._used, self._used_at = self._scan_bytes(), now
        return self._used

    def _scan_bytes(self) -> int:
        total = 0
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                with contextlib.suppress(OSError):
                    total += os.stat(os.path.join(dirpath, f)).st_size
        return total

    def save_pending(self, req_id: str, index: int, payload: bytes) -> bool:
        """Save block ``index`` of a running request; False (nothing written) if full."""
        data = encode_block(payload)
        if self.used_bytes() + len(data) > self.max_bytes:
            self.drop_expired()
            self._used = None
            if self.used_bytes() + len(data) > self.max_bytes:
                return False
        _atomic_write(self._pending_dir(req_id) / f"{index}.kvb", data)
        if self._used is not None:
            self._used += len(data)
        return True

    def load(self, session: str, block_hash: str, expected_len: int) -> bytes | None:
        """The payload of a session block, or None (missing, corrupted, other size)."""
        try:
            data = (self._session_dir(session) / f"{block_hash}.kvb").read_bytes()
        except OSError:
            return None
        return decode_block(data, expected_len)

    # -- scheduler side ---------------------------------------------------------------------
    def commit(
        self,
        req_id: str,
        session: str,
        token_ids: Sequence[int],
        block_size: int,
        ttl_s: float,
        now: float | None = None,
    ) -> int:
        """Move a finished request's pending blocks into its session, keyed by prefix hash,
        valid for ``ttl_s`` seconds. Returns how many blocks the session now holds for it."""
        pend = self._pending_dir(req_id)
        sdir = self._session_dir(session)
        sdir.mkdir(parents=True, exist_ok=True)
        hashes = chained_block_hashes(token_ids, block_size)
        kept = 0
        for i, h in enumerate(hashes):
            src = pend / f"{i}.kvb"
            dst = sdir / f"{h}.kvb"
            if src.exists():
                os.replace(src, dst)
            if dst.exists():
                kept += 1
            else:
                break  # the chain is broken: later blocks can never match
        shutil.rmtree(pend, ignore_errors=True)
        now = time.time() if now is None else now
        meta = {"expires_at": now + ttl_s, "block_size": block_size, "session": session}
        _atomic_write(sdir / "meta.json", json.dumps(meta).encode())
        return kept

    def discard_pending(self, req_id: str) -> None:
        shutil.rmtree(self._pending_dir(req_id), ignore_errors=True)

    def expires_at(self, session: str) -> float | None:
        try:
            meta = json.loads((self._session_dir(session) / "meta.json").read_text())
            return float(meta["expires_at"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def match(
        self,
        session: str,
        token_ids: Sequence[int],
        block_size: int,
        expected_len: int | None = None,
        now: float | None = None,
    ) -> list[str]:
        """Hashes of the leading blocks of ``token_ids`` the session holds intact (checksums
        verified), stopping at the first miss. Empty if the session is unknown or expired."""
        exp = self.expires_at(session)
        now = time.time() if now is None else now
        if exp is None:
            return []
        if exp < now:
            self.drop_session(session)
            return []
        out: list[str] = []
        sdir = self._session_dir(session)
        for h in chained_block_hashes(token_ids, block_size):
            try:
                data = (sdir / f"{h}.kvb").read_bytes()
            except OSError:
                break
            if decode_block(data, expected_len) is None:
                break
            out.append(h)
        return out

    def drop_session(self, session: str) -> None:
        shutil.rmtree(self._session_dir(session), ignore_errors=True)

    def drop_expired(
        self, now: float | None = None, keep: set[str] | frozenset[str] = frozenset()
    ) -> int:
        """Drop sessions whose expiry passed (except those named in ``keep``). Returns count."""
        now = time.time() if now is None else now
        dropped = 0
        try:
            sdirs = list((self.root / "sessions").iterdir())
        except OSError:
            return 0  # no store (yet): nothing to drop
        for sdir in sdirs:
            try:
                meta = json.loads((sdir / "meta.json").read_text())
            except (OSError, ValueError):
                continue
            if meta.get("session") in keep or float(meta.get("expires_at", 0)) >= now:
                continue
            shutil.rmtree(sdir, ignore_errors=True)
            dropped += 1
        return dropped
