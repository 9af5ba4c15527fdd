"""Keeps Python's full (generation 2) garbage collections off a container host's epoch path.

Owns: the cyclic collector's settings in a host process, and when its full
collections run. Must not touch state or messages; it only decides when the
interpreter walks its objects.

Why: a slice's state is long-lived Python containers (a dict per key, a
list per window chunk), a million or more per host. CPython starts a full
collection whenever the objects promoted to the oldest generation grow by a
quarter, and a full collection walks every tracked object (about 55-110 ms
per host in ``benchmarks.latency``'s 5-minute window, more with more
state), in the middle of whatever epoch is running. Those pauses were the
whole p99.9 tail of end-to-end latency.

Policy, per host process:

- at start, ``gc.freeze()`` moves what the imports and warm-up made (Ray,
  Arrow, numpy: about 100,000 objects) to the permanent generation, which no
  collection walks;
- automatic full collections are off; young collections (generations 0 and
  1, a few ms each) still run as usual and free short-lived cycles;
- every ``full_every_s`` seconds (``JobOptions.full_gc_interval_s``) the
  host runs one full collection itself, which bounds what cyclic garbage
  that outlived the young generations can hold. That pause is paid once per
  interval instead of every time state grows by a quarter. ``0`` leaves
  CPython's own policy in place.

Acyclic garbage (almost all of it: expired window entries, consumed
messages) is freed by reference counting either way, at once.

>>> import gc
>>> pacing = CollectorPacing(full_every_s=600.0, clock=lambda: 0.0)
>>> pacing.install(); gc.get_threshold()[2] == CollectorPacing.NEVER
True
>>> pacing.full_collection_due()
False
>>> pacing.uninstall(); gc.get_threshold()[2] == CollectorPacing.NEVER
False
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Callable

log = logging.getLogger("chronostream.gc")


class CollectorPacing:
    """Full collections on the host's schedule instead of the allocator's (see the module docstring)."""

    #: A generation-2 threshold no run reaches (full collections only when asked for).
    NEVER = 1 << 30

    def __init__(self, full_every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if full_every_s < 0:
            raise ValueError(f"full_every_s must be >= 0, got {full_every_s}")
        self.full_every_s = full_every_s
        self.clock = clock
        self.installed = False
        self.last_full = clock()
        self.full_collections = 0
        self.full_pause_s = 0.0  # total time spent in the host's own full collections
        self._saved: tuple[int, int, int] | None = None

    def install(self) -> None:
        """Freeze what exists now and stop automatic full collections (no-op when ``full_every_s`` is 0)."""
        if self.full_every_s == 0 or self.installed:
            return
        self._saved = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(self._saved[0], self._saved[1], self.NEVER)
        self.installed = True
        self.last_full = self.clock()

    def uninstall(self) -> None:
        """Give the process CPython's own policy back (the frozen objects become collectable again)."""
        if not self.installed:
            return
        assert self._saved is not None
        gc.set_threshold(*self._saved)
        gc.unfreeze()
        self.installed = False

    def full_collection_due(self) -> bool:
        """True when ``full_every_s`` passed since the last full collection (and pacing is on)."""
        return self.installed and self.clock() - self.last_full >= self.full_every_s

    def collect_if_due(self) -> int | None:
        """Run the periodic full collection if it is due; returns the objects it freed (None: not due)."""
        if not self.full_collection_due():
            return None
        t0 = time.perf_counter()
        freed = gc.collect()
        pause = time.perf_counter() - t0
        self.full_collections += 1
        self.full_pause_s += pause
        self.last_full = self.clock()
        log.info("full collection %d: freed %d objects in %.1f ms", self.full_collections, freed, pause * 1000)
        return freed
