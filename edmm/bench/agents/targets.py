"""The agent-workload targets, checked on the summary rows of `edmm bench agents` (one run or
merged).

- **Knees.** Per policy (long tools, main oversubscription), walking the loads upwards: the
  first load whose p90 TTFT exceeds 1 s is the knee (of resumes, ``RESUME_P90``, or of every
  turn, ``ALL_TURN_P90``: first turns, tool resumes and user turns, the headline); the
  sustainable load is the load where p90 crosses 1 s, interpolated linearly between the last
  load under it and the knee (the last load under it when the curve is not monotone there).
  A policy with no load over 1 s has not reached its knee: its sustainable load is only known
  to be >= the highest load run, and a ratio built on it is a bound.
- **Targets** (PASS / MISS with the margin, or NOT MEASURED saying what is missing):
  sustainable load ``edmm`` >= 1.5x ``lru`` and >= 1.2x the best of ``ttl`` / ``offload`` /
  ``rewarm``; at all-turn p90, ``edmm`` >= 1.3x ``offload`` (as against vLLM with its
  offloading connector) and >= 1.8x ``lru`` (as against vLLM's prefix caching), and over HTTP
  the same against the real peers (`peer_checks`: ``vllm-offload``, ``vllm``); at the highest
  load ``lru`` sustains, mean engine-wait ``lru`` / ``edmm`` >=
  1.5x and ``edmm``'s p90 resume TTFT at the main oversubscription <= 1.3x its own at the
  check one (1x); at 1x and in the short-tool mix, ``edmm`` no worse than the best baseline by
  more than 3% on any of `COMPARED`; offload restore >= 40 GiB/s beside decode steps and a
  decode step beside a restore <= 1.1x alone (the micro-bench
  ``python -m benchmarks.scripts.restore_overlap`` writes ``restore-overlap.json``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edmm.bench.agents.policies import BASELINES

SUSTAIN_TTFT_MS = 1000.0
RESUME_P90 = "resume_ttft_p90_ms"  # the knee of resumes (every turn after a job's first)
ALL_TURN_P90 = "ttft_p90_ms"  # the knee of every turn (the headline)
OTHERS = ("ttl", "offload", "rewarm")  # the "best of" baselines of the sustainable-load target
# Metrics of the no-worse-than-3% target: (column, True when higher is better).
COMPARED = (("jct_mean_s", False), ("jct_p50_s", False), ("jct_p90_s", False),
            ("wait_mean_s", False), ("wait_p90_s", False), ("resume_ttft_p50_ms", False),
            ("resume_ttft_p90_ms", False), ("resume_ttft_p99_ms", False),
            ("jobs_per_min", True), ("out_tok_per_s", True))

Row = Mapping[str, Any]
MARGIN_NOTE = ("target margins are relative to the target: positive = room to spare, "
               "negative = short of it (e.g. -12%: the ratio is 12% under what the target asks)")


@dataclass(frozen=True)
class Knee:
    """Where one policy stops sustaining p90 resume TTFT <= 1 s."""

    policy: str
    loads: tuple[float, ...]  # measured, ascending
    sustained: float | None  # highest measured load under 1 s below the knee
    knee: float | None  # first measured load over 1 s (None: not reached)
    sustainable: float | None  # interpolated crossing; None when the first load is over

    @property
    def reached(self) -> bool:
        """True when some measured load is over 1 s."""
        return self.knee is not None

    def describe(self) -> str:
        """One line for a person."""
        if not self.loads:
            return f"{self.policy}: not run"
        if not self.reached:
            return f"{self.policy}: >= {self.loads[-1]:g} (knee not reached)"
        if self.sustainable is None:
            return f"{self.policy}: < {self.loads[0]:g} (over 1 s at the lowest load)"
        return (f"{self.policy}: {self.sustainable:.1f} (under 1 s at {self.sustained:g}, "
                f"over at {self.knee:g})")


@dataclass(frozen=True)
class TargetCheck:
    """One target: what was measured against it and the verdict."""

    name: str
    target: str
    measured: str
    status: str  # PASS, MISS or NOT MEASURED
    margin: str = ""

    def line(self) -> str:
        """``status: name: measured (target; margin)``."""
        tail = f"; {self.margin}" if self.margin else ""
        return f"{self.status}: {self.name}: {self.measured} (target {self.target}{tail})"


def knees(rows: Sequence[Row], oversub: float, tools: str = "long",
          metric: str = RESUME_P90) -> dict[str, Knee]:
    """The knee of every policy with rows at ``oversub`` in the ``tools`` mix, on the p90
    TTFT column ``metric`` (rows without it are left out)."""
    curves: dict[str, dict[float, float]] = {}
    for r in rows:
        if r["tools"] == tools and r["oversub"] == oversub and r.get(metric) is not None:
            curves.setdefault(r["policy"], {})[float(r["load"])] = float(r[metric])
    return {p: _knee(p, curve) for p, curve in curves.items()}


def knee_line(rows: Sequence[Row], oversub: float, metric: str = RESUME_P90) -> str:
    """One line: each policy's sustainable load on ``metric`` (long tools, ``oversub``)."""
    what = "every turn" if metric == ALL_TURN_P90 else "resumes"
    kn = knees(rows, oversub, metric=metric)
    return (f"sustainable load (p90 TTFT of {what} <= {SUSTAIN_TTFT_MS / 1e3:g} s, long tools, "
            f"x{oversub:g}): " + ("; ".join(k.describe() for k in kn.values()) or "none run"))


def _knee(policy: str, curve: Mapping[float, float]) -> Knee:
    loads = tuple(sorted(curve))
    prev: float | None = None
    for load in loads:
        if curve[load] > SUSTAIN_TTFT_MS:
            if prev is None:
                return Knee(policy, loads, None, load, None)
            p0, p1 = curve[prev], curve[load]
            cross = prev + (SUSTAIN_TTFT_MS - p0) / (p1 - p0) * (load - prev) if p1 > p0 else prev
            return Knee(policy, loads, prev, load, cross)
        prev = load
    return Knee(policy, loads, prev, None, prev)


def _ratio_check(name: str, target: float, num: Knee | None, den: Knee | None) -> TargetCheck:
    want = f">= {target:g}x"
    if num is None or den is None or den.sustainable is None or not den.reached:
        missing = "no run" if num is None or den is None else f"{den.describe()}"
        return TargetCheck(name, want, missing, "NOT MEASURED")
    if num.sustainable is None:
        return TargetCheck(name, want, f"{num.describe()}", "MISS")
    ratio = num.sustainable / den.sustainable
    measured = f"{ratio:.2f}x ({num.describe()}; {den.describe()})"
    if not num.reached:  # a lower bound
        if ratio >= target:
            return TargetCheck(name, want, measured + ", a lower bound", "PASS",
                               f"at least {ratio / target - 1:+.0%}")
        return TargetCheck(name, want, measured + ", a lower bound", "NOT MEASURED",
                           "run higher loads of edmm")
    return _verdict(name, want, measured, ratio >= target, ratio / target - 1)


def _verdict(name: str, want: str, measured: str, ok: bool, margin: float) -> TargetCheck:
    return TargetCheck(name, want, measured, "PASS" if ok else "MISS", f"{margin:+.0%}")


def check_targets(rows: Sequence[Row], oversub: float, check_oversub: float | None,
                  restore: Mapping[str, Any] | None = None) -> list[TargetCheck]:
    """Every target of the module docstring that ``rows`` (and ``restore``, the micro-bench's
    result) can speak to."""
    kn = knees(rows, oversub)
    out = [_ratio_check(f"sustainable load edmm / lru (x{oversub:g})", 1.5, kn.get("edmm"),
                        kn.get("lru"))]
    others = [kn[p] for p in OTHERS if p in kn and kn[p].sustainable is not None]
    best = max(others, key=lambda k: k.sustainable or 0.0, default=None)
    out.append(_ratio_check(f"sustainable load edmm / best of ttl, offload, rewarm "
                            f"({best.policy if best else 'none run'})", 1.2, kn.get("edmm"), best))
    every = knees(rows, oversub, metric=ALL_TURN_P90)
    out.append(_ratio_check(f"sustainable load, all-turn p90, edmm / offload (x{oversub:g})",
                            1.3, every.get("edmm"), every.get("offload")))
    out.append(_ratio_check(f"sustainable load, all-turn p90, edmm / lru (x{oversub:g})", 1.8,
                            every.get("edmm"), every.get("lru")))
    by = {(r["policy"], r["tools"], r["oversub"], float(r["load"])): r for r in rows}
    lru = kn.get("lru")
    out += _load_checks(by, lru.sustained if lru is not None else None, oversub, check_oversub)
    out += _no_worse_checks(rows, check_oversub, oversub)
    out += _restore_checks(restore)
    return out


PEER_TARGETS = (("vllm-offload", 1.3), ("vllm", 1.8))  # peer name, edmm's ratio at least


def peer_checks(rows: Sequence[Row], oversub: float) -> list[TargetCheck]:
    """Sustainable load at all-turn p90 TTFT, ``edmm`` over each vLLM peer (`PEER_TARGETS`:
    its offloading connector, its prefix caching), where the rows have both."""
    every = knees(rows, oversub, metric=ALL_TURN_P90)
    return [_ratio_check(f"sustainable load, all-turn p90, edmm / {peer} (x{oversub:g})",
                         target, every.get("edmm"), every.get(peer))
            for peer, target in PEER_TARGETS if peer in every]


def _at_or_below(by: Mapping[tuple[Any, ...], Row], limit: float | None,
                 needs: Sequence[tuple[str, float | None]]) -> float | None:
    """The highest load <= ``limit`` (any load when None: the lowest then) at which every
    ``(policy, oversub)`` of ``needs`` has a long-tool row."""
    loads = sorted({k[3] for k in by if all((p, "long", o, k[3]) in by for p, o in needs)})
    if limit is None:
        return loads[0] if loads else None
    under = [ld for ld in loads if ld <= limit]
    return under[-1] if under else None


def _load_checks(by: Mapping[tuple[Any, ...], Row], sustained: float | None, oversub: float,
                 check_oversub: float | None) -> list[TargetCheck]:
    """At the highest load ``lru`` sustains (``sustained``; the highest measured load at or
    under it where the rows exist): engine-wait lru / edmm, and edmm's p90 TTFT x2 / x1."""
    where = f"lru sustains {sustained:g}" if sustained is not None else "lru sustains none"
    check = f"x{check_oversub:g}" if check_oversub is not None else "no check oversubscription"
    load = _at_or_below(by, sustained, [("lru", oversub), ("edmm", oversub)])
    name = f"mean engine-wait lru / edmm at load {_load(load)} ({where}, x{oversub:g})"
    if load is None:
        out = [TargetCheck(name, ">= 1.5x", "edmm and lru not both run there", "NOT MEASURED")]
    else:
        edmm, lru = by[("edmm", "long", oversub, load)], by[("lru", "long", oversub, load)]
        ratio = lru["wait_mean_s"] / edmm["wait_mean_s"]
        measured = f"{ratio:.2f}x ({lru['wait_mean_s']:.3g} / {edmm['wait_mean_s']:.3g} s)"
        whole = by.get(("edmm", "long", check_oversub, load))
        if whole is not None:  # the pool holds every session: no policy waits less
            measured += (f"; the most any policy reaches here, lru / edmm at "
                         f"x{check_oversub:g}: {lru['wait_mean_s'] / whole['wait_mean_s']:.2f}x")
        out = [_verdict(name, ">= 1.5x", measured, ratio >= 1.5, ratio / 1.5 - 1)]
    load = _at_or_below(by, sustained, [("edmm", oversub), ("edmm", check_oversub)])
    name = f"edmm p90 resume TTFT x{oversub:g} / {check} at load {_load(load)} ({where})"
    if load is None:
        out.append(TargetCheck(name, "<= 1.3", "edmm not run at both oversubscriptions",
                               "NOT MEASURED"))
    else:
        two, one = by[("edmm", "long", oversub, load)], by[("edmm", "long", check_oversub, load)]
        ratio = two["resume_ttft_p90_ms"] / one["resume_ttft_p90_ms"]
        measured = f"{ratio:.2f} ({two['resume_ttft_p90_ms']:.0f} / " \
                   f"{one['resume_ttft_p90_ms']:.0f} ms)"
        share = two.get("mem_wait_running_share")
        if share is not None:
            measured += (f"; at x{oversub:g} turns waited for memory in "
                         f"{two['mem_wait_steps']} steps, running turns holding "
                         f"{share:.0%} of the pool then")
        out.append(_verdict(name, "<= 1.3", measured, ratio <= 1.3, 1 - ratio / 1.3))
    return out


def _load(load: float | None) -> str:
    return "(none)" if load is None else f"{load:g}"


def worst_metric(edmm: Row, baselines: Sequence[Row]) -> tuple[str, float] | None:
    """The metric of `COMPARED` on which ``edmm`` trails the best baseline most, and by how
    much (relative: 0.05 = 5% worse; <= 0 means edmm is at least as good on every one)."""
    worst: tuple[str, float] | None = None
    for col, higher in COMPARED:
        vals = [b[col] for b in baselines if b.get(col) is not None]
        mine = edmm.get(col)
        if not vals or mine is None:
            continue
        best = max(vals) if higher else min(vals)
        if best == 0:
            continue
        rel = (best - mine) / best if higher else (mine - best) / best
        if worst is None or rel > worst[1]:
            worst = (col, rel)
    return worst


def _no_worse_checks(rows: Sequence[Row], check_oversub: float | None,
                     oversub: float) -> list[TargetCheck]:
    out = []
    for label, tools, over in (("x1 (check oversubscription)", "long", check_oversub),
                               ("short-tool mix", "short", oversub)):
        name = f"edmm no worse than the best baseline, {label}"
        groups: dict[float, list[Row]] = {}
        for r in rows:
            if r["tools"] == tools and r["oversub"] == over:
                groups.setdefault(float(r["load"]), []).append(r)
        done = False
        for load, group in sorted(groups.items()):
            edmm = next((r for r in group if r["policy"] == "edmm"), None)
            bases = [r for r in group if r["policy"] in BASELINES]
            if edmm is None or not bases:
                continue
            found = worst_metric(edmm, bases)
            if found is None:
                continue
            col, rel = found
            done = True
            out.append(_verdict(f"{name}, load {load:g}", "<= 3% worse on every metric",
                                f"edmm's worst metric: {col}, {abs(rel):.1%} "
                                f"{'worse' if rel > 0 else 'better'} than the best of "
                                f"{', '.join(sorted(r['policy'] for r in bases))}",
                                rel <= 0.03, 0.03 - rel))
        if not done:
            out.append(TargetCheck(name, "<= 3% worse on every metric",
                                   "edmm and a baseline not both run", "NOT MEASURED"))
    return out


def _restore_checks(restore: Mapping[str, Any] | None) -> list[TargetCheck]:
    if restore is None:
        return [TargetCheck("offload restore overlapped", ">= 40 GiB/s, step ratio <= 1.1",
                            "restore_overlap not run", "NOT MEASURED")]
    gib, ratio = restore["restore_gib_s_beside_steps"], restore["ratio"]
    return [_verdict("restore GiB/s beside decode steps", ">= 40 GiB/s", f"{gib:.1f} GiB/s",
                     gib >= 40, gib / 40 - 1),
            _verdict("decode step beside a restore / alone", "<= 1.1", f"{ratio:.3f}",
                     ratio <= 1.1, 1 - ratio / 1.1)]
