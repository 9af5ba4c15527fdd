"""Owns the OS scheduling priority of a host's background threads (Linux per-thread niceness).

A host process runs its epoch loops on the event-loop thread and its
bulk work on worker threads: the backup store (verify, merge, lmdb
flushes), checkpoint encoding, restores, replays and shipments. With GB
states the bulk work takes whole seconds of CPU, largely in C with the
GIL released, so it competes with every host's epoch loop for the
machine's cores, and on a saturated machine the loops get their CPU late:
every slice's output stalls (docs/design.md section 8). With the job option
``background_niceness`` (default 0: off; no gain shown yet) background
threads run that many nice levels below the process (Ray runs its workers
at nice 15; with 4 the background threads run at 19): the kernel gives a
runnable epoch loop the CPU first, and bulk work the rest. No lock or
scheduling of our own; work on a background thread still runs at full
speed when a core is free.

Linux only (elsewhere ``os.setpriority`` on a thread id would name a
process); raising niceness needs no privilege, and a thread never lowers
it again. Owns only the priority: which work is background is decided
where the pools are made (``background_pool``).

    >>> set_background_niceness(2)
    >>> pool = background_pool(1, "example")
    >>> pool.submit(lambda: thread_niceness() >= process_niceness()).result()
    True
    >>> pool.shutdown(); set_background_niceness(0)
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from chronostream.containers.options import JobOptions

log = logging.getLogger("chronostream.container")

#: The highest niceness the kernel allows (the lowest priority).
MAX_NICENESS = 19

_SUPPORTED = sys.platform.startswith("linux") and hasattr(os, "setpriority")
_increment = JobOptions.background_niceness  # per process: ``set_background_niceness`` (the job's option)


def set_background_niceness(increment: int) -> None:
    """How many nice levels below the process new background threads run (0: the same priority).

    Threads a ``background_pool`` starts after this call get it; pools
    start their threads on first use, so a host sets it before any work.
    """
    global _increment
    if increment < 0:
        raise ValueError(f"background_niceness must be >= 0, got {increment}")
    _increment = increment


def process_niceness() -> int:
    """The process's niceness (its main thread's, on Linux)."""
    return os.getpriority(os.PRIO_PROCESS, 0) if _SUPPORTED else 0


def thread_niceness() -> int:
    """The calling thread's niceness (the process's where threads have none of their own)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if _SUPPORTED else 0


def lower_this_thread(increment: int | None = None) -> int:
    """Raise the calling thread's niceness by ``increment`` (default: the configured one), capped
    at ``MAX_NICENESS``; return the niceness it runs at. Failures are logged, never raised: a
    thread that keeps the process's priority still does its work."""
    inc = _increment if increment is None else increment
    if not _SUPPORTED or inc <= 0:
        return thread_niceness()
    tid = threading.get_native_id()
    try:
        target = min(MAX_NICENESS, os.getpriority(os.PRIO_PROCESS, tid) + inc)
        os.setpriority(os.PRIO_PROCESS, tid, target)
        return target
    except OSError as exc:  # a sandbox without setpriority: run at the process's priority
        log.warning("could not lower the priority of background thread %s: %s", threading.current_thread().name, exc)
        return thread_niceness()


def background_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run at the background priority (``lower_this_thread``)."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=lower_this_thread)
