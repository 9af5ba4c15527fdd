"""Owns the master's timeline: what happened to a job (faults, recoveries, migrations, state
changes, autoscaler actions), in order, within a fixed bound.

An event is ``(time, kind, info)``. A long job makes some kinds without end (an autoscaler
action every few seconds, a fault a day), so each kind keeps its latest ``per_kind`` events
(``TIMELINE_PER_KIND``) and counts every event it ever had (``count``). Kinds are names the
master uses (a few dozen), so the timeline holds at most that many times ``per_kind``
events, and a rare kind (the job's state changes ``job_running``, ``job_failed``, ...) is
never pushed out by a frequent one. Each event has a sequence number (its key in the
master's catalog, ``master.catalog``); ``add`` says which event it pushed out, so the
catalog's copy keeps the same bound; ``listeners`` see every event added (the job's metrics
count from them past the bound). Knows no Ray.

>>> t = Timeline(per_kind=2)
>>> for i in range(3):
...     _ = t.add((float(i), "tick", {"i": i}))
>>> _ = t.add((9.0, "job_running", {}))
>>> [(k, i) for _, k, i in t], t.count("tick")
([('tick', {'i': 1}), ('tick', {'i': 2}), ('job_running', {})], 3)
"""

from __future__ import annotations

import collections
import heapq
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

Event = tuple[float, str, dict[str, Any]]

log = logging.getLogger("chronostream.master")

#: Events kept per kind (the latest): with a few dozen kinds, a timeline holds tens of
#: thousands of events at most, whatever the job's length.
TIMELINE_PER_KIND = 1000


class Timeline:
    """The job's events, in order, at most ``per_kind`` of each kind (the latest)."""

    def __init__(self, per_kind: int = TIMELINE_PER_KIND) -> None:
        if per_kind < 1:
            raise ValueError(f"per_kind must be >= 1, got {per_kind}")
        self.per_kind = per_kind
        self._by_kind: dict[str, collections.deque[tuple[int, Event]]] = {}
        self._counts: collections.Counter[str] = collections.Counter()
        self.next_seq = 1
        self.listeners: list[Callable[[Event], None]] = []  # called with each event added

    def add(self, event: Event, seq: int | None = None) -> tuple[int, int | None]:
        """Keep ``event`` (numbered ``seq``, default the next number). Returns its number and
        the number of the event of its kind it pushed out (None when none)."""
        seq = self.next_seq if seq is None else seq
        self.next_seq = max(self.next_seq, seq + 1)
        kept = self._by_kind.setdefault(event[1], collections.deque())
        dropped = kept.popleft()[0] if len(kept) == self.per_kind else None
        kept.append((seq, event))
        self._counts[event[1]] += 1
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - a listener (metrics) must never fail the master
                log.exception("timeline listener %r failed on %s", listener, event[1])
        return seq, dropped

    def extend(self, numbered: Iterable[tuple[int, Event]]) -> list[int]:
        """Keep events read back in order (``(number, event)``, a restarted master's catalog);
        returns the numbers of those pushed out."""
        return [d for seq, event in numbered if (d := self.add(event, seq)[1]) is not None]

    def count(self, kind: str) -> int:
        """How many ``kind`` events there were, including those pushed out (since this master
        process started or read the timeline back)."""
        return self._counts[kind]

    def __iter__(self) -> Iterator[Event]:
        for _, event in heapq.merge(*self._by_kind.values(), key=lambda e: e[0]):
            yield event

    def __len__(self) -> int:
        return sum(len(k) for k in self._by_kind.values())
