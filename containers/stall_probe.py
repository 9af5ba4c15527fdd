"""Owns the stall probe: a thread that notices when its process ran no Python for a while.

A container whose epochs stop for half a second shows it in the output's
timing, not in any log; what stopped it is what this probe is for. The
probe sleeps a few milliseconds in a loop and logs (``chronostream.stall``,
WARNING) every wake-up that came later than ``threshold_s``: another thread
held the GIL (a large copy inside one C call does), or the process was not
scheduled (CPU contention, a stalled VM). It cannot tell those apart; read
it beside the other processes' probes (the same stall in every process is
the machine's). Off unless asked for, as Dask's "event loop was
unresponsive" warning is always on: set ``CHRONOSTREAM_STALL_MS=80`` in the
driver's environment and every master and container process runs one.

    >>> probe = StallProbe("doc", threshold_s=10.0)
    >>> probe.stop(); probe.stalls
    []
"""

from __future__ import annotations

import logging
import os
import threading
import time

ENV = "CHRONOSTREAM_STALL_MS"

log = logging.getLogger("chronostream.stall")


class StallProbe:
    """A daemon thread recording wake-ups later than ``threshold_s``: ``stalls`` holds
    (wall-clock time the stall ended, its length in s) for each, oldest first."""

    def __init__(self, name: str, threshold_s: float, interval_s: float = 0.002) -> None:
        if threshold_s <= 0:
            raise ValueError(f"a stall threshold must be positive, got {threshold_s}")
        self.name = name
        self.threshold_s = threshold_s
        self.interval_s = interval_s
        self.stalls: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stall-probe-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(self.interval_s)
            late = time.perf_counter() - t - self.interval_s
            if late > self.threshold_s:
                end = time.time()
                self.stalls.append((end, late))
                log.warning("%s (pid %d): no Python ran in this process's probe for %.0f ms, until %s.%03d",
                            self.name, os.getpid(), late * 1000, time.strftime("%H:%M:%S", time.localtime(end)),
                            int(end * 1000) % 1000)

    def stop(self) -> None:
        """End the probe's thread (waits for its current sleep)."""
        self._stop.set()
        self._thread.join()


def start_from_env(name: str) -> StallProbe | None:
    """A probe named ``name`` with ``$CHRONOSTREAM_STALL_MS`` as its threshold, or None when the
    variable is unset or empty. A value that is not a positive number raises ``ValueError``."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r} is not a number of milliseconds") from None
    return StallProbe(name, threshold_s=ms / 1000)
