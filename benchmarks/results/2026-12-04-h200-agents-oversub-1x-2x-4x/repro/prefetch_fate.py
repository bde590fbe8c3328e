"""What becomes of prefetches in one `edmm bench agents` run, and which entries are evicted
to the host: counts only (functions wrapped; nothing else changes). From the repository root:

    python benchmarks/results/2026-12-04-h200-agents-pinned-host/prefetch_fate.py \
        bench agents --clock model ... --policies edmm --out /tmp/fate-edmm

Fates: a prefetch restores the session's KV (ok) or finds no room (failed); a restored session
is then used by its resume or evicted to the host again first.
"""
import collections
import json
import sys

from edmm.engine import kv_manager, prefix_cache

victims: collections.Counter = collections.Counter()  # (tag kind, rank) -> evictions
fate: collections.Counter = collections.Counter()
prefetched: set[str] = set()  # tags restored by a prefetch, not yet used or evicted

_offload = prefix_cache.PrefixCache._offload
_restore = kv_manager.KVCacheManager.restore
_restore_claimed = kv_manager.KVCacheManager.restore_claimed


def offload(self, slot):
    entry = self._lru[slot]
    victims[(json.loads(entry.tag)[0] if entry.tag else "untagged", entry.rank.name)] += 1
    if entry.tag in prefetched:
        fate["prefetched, then evicted"] += 1
        prefetched.discard(entry.tag)
    return _offload(self, slot)


def restore(self, tag):
    ok = _restore(self, tag)
    fate["prefetch ok" if ok else "prefetch failed (no room)"] += 1
    if ok:
        prefetched.add(tag)
    return ok


def restore_claimed(self, tags):
    for tag in tags:
        if tag in prefetched:
            fate["prefetched, then used"] += 1
            prefetched.discard(tag)
    return _restore_claimed(self, tags)


prefix_cache.PrefixCache._offload = offload
kv_manager.KVCacheManager.restore = restore
kv_manager.KVCacheManager.restore_claimed = restore_claimed

if __name__ == "__main__":
    from edmm.cli import main

    rc = main(sys.argv[1:])
    print("evicted entries (tag kind, rank):", dict(victims.most_common()))
    print("prefetches:", dict(fate), "| still prefetched at the end:", len(prefetched))
    sys.exit(rc)
