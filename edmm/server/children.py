"""The server's worker processes: they die with it, and what they leave is cleaned.

A worker process (the grammar probe, the client-template renderer) runs `worker_init` first:
Linux's parent-death signal kills it when the server dies, however it dies, so the
multiprocessing resource tracker, whose pipe the workers held open, sees the server gone,
removes the named semaphores it tracked (``/dev/shm/sem.mp-*``) and exits: no process is left.
Should the tracker be killed too (a whole process group killed), those semaphores are removed
at the next start of a server (`clean_stale_semaphores`), from the ledger each server keeps in
/dev/shm of the semaphores its process pools made (`record_semaphores`).

Light to import (the standard library only): workers import it before anything else.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.synchronize import SemLock
from pathlib import Path

SHM = Path("/dev/shm")
LEDGER_PREFIX = "edmm-sems-"
_PR_SET_PDEATHSIG = 1


def worker_init(niceness: int = 0) -> None:
    """A worker process's first step: `die_with_parent`, then lower its CPU priority by
    ``niceness``."""
    die_with_parent()
    if niceness:
        os.nice(niceness)


def die_with_parent() -> None:
    """In a child process: be killed when the process that started it dies (Linux's
    ``PR_SET_PDEATHSIG``; elsewhere nothing), and exit at once if it died already."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent == 1 or os.getppid() != parent:
        os._exit(1)


def _start_time(pid: int) -> str | None:
    """A process's start time in clock ticks (field 22 of ``/proc/PID/stat``), None if it is
    gone: with its PID it names one process, even after the PID is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def pool_semaphores(pool: ProcessPoolExecutor) -> set[str]:
    """Names (``sem.mp-...``, as in /dev/shm) of the named semaphores of a process pool's
    queues (the standard library keeps them as ``SemLock`` attributes of the queues)."""
    names: set[str] = set()
    for queue in (getattr(pool, "_call_queue", None), getattr(pool, "_result_queue", None)):
        for value in vars(queue).values() if queue is not None else ():
            name = getattr(getattr(value, "_semlock", None), "name", None)
            if isinstance(value, SemLock) and isinstance(name, str):
                names.add("sem." + name.lstrip("/"))
    return names


def ledger_path(pid: int | None = None) -> Path:
    """This process's ledger of its semaphores (`record_semaphores`)."""
    return SHM / f"{LEDGER_PREFIX}{os.getpid() if pid is None else pid}"


def record_semaphores(pool: ProcessPoolExecutor) -> Path | None:
    """Add the semaphores of ``pool`` (`pool_semaphores`) to this process's ledger, with the
    process's start time (called as each process pool is made); the ledger, or None where
    there is no /dev/shm."""
    if not SHM.is_dir():
        return None
    path = ledger_path()
    known = set(path.read_text().split()[1:]) if path.exists() else set()
    names = sorted(known | pool_semaphores(pool))
    path.write_text(" ".join([_start_time(os.getpid()) or "?", *names]))
    return path


def forget_semaphores() -> None:
    """Remove this process's ledger (a clean exit: its pools released their semaphores)."""
    with contextlib.suppress(OSError):
        ledger_path().unlink()


def clean_stale_semaphores() -> int:
    """Remove the semaphores listed by the ledgers of EDMM servers that are gone (a PID that
    is dead, or reused by a process started at another time), and those ledgers; return how
    many semaphores were removed. The names are random and were made by those servers' pools,
    whose workers died with them: nothing alive uses them."""
    if not SHM.is_dir():
        return 0
    removed = 0
    for ledger in SHM.glob(LEDGER_PREFIX + "*"):
        try:
            pid = int(ledger.name[len(LEDGER_PREFIX):])
            started, *names = ledger.read_text().split()
        except (OSError, ValueError):
            continue
        if _start_time(pid) == started:
            continue  # that server still runs
        for name in names:
            if name.startswith("sem.mp-") and "/" not in name:
                with contextlib.suppress(FileNotFoundError):
                    (SHM / name).unlink()
                    removed += 1
        with contextlib.suppress(OSError):
            ledger.unlink()
    return removed
