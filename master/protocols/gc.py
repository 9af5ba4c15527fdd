"""Owns garbage collection of output logs and backups as a sans-IO state machine.

What a round may drop is ``master.recovery.gc_marks_and_source_floors`` and
``master.backups.stale_backups``'s (pure); this module owns the order around
them and what it must never do: the marks and floors only rise, and the
marks are saved before any host trims to them (a restarted master must never
plan a recovery below a trimmed log). It knows no Ray, no clock, no host:
the driver (``master.actor.JobMaster`` on Ray, ``master.local.LocalCluster``
in process) reads what the hosts hold, feeds it in, and carries out the
commands.

A round (docs/design.md section 7j):

- ``HeldRead(held)``: the epochs each live host holds a backup of, per slice
  -> ``SaveMarks(marks)`` when they rose, then ``Trim(marks)`` (every host
  drops logged outputs and carried outputs of each producer stage below its
  mark) when any mark is set;
- ``ChainsRead(chains, held)``: the hosts each slice's checkpoints go to now
  -> ``DropStale(host, keys)`` for the copies no recovery can take any more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chronostream.master.backups import stale_backups
from chronostream.master.recovery import gc_marks_and_source_floors, raised

SliceKey = tuple[int, int]  # (stage, slice)


@dataclass(frozen=True)
class HeldRead:
    """What each live host holds: host's backup epochs, (stage, slice) -> newest epoch."""

    held: tuple[dict[SliceKey, int], ...]


@dataclass(frozen=True)
class ChainsRead:
    """The chains now (slice -> hosts its checkpoints go to) and what each host holds."""

    chains: dict[SliceKey, list[int]]
    held: dict[int, dict[SliceKey, int]]


Event = HeldRead | ChainsRead


@dataclass(frozen=True)
class SaveMarks:
    """Make the marks durable (the catalog) before any host trims to them."""

    marks: dict[int, int]


@dataclass(frozen=True)
class Trim:
    """Every host drops what lies below ``marks`` (producer stage -> last epoch no one needs)."""

    marks: dict[int, int]


@dataclass(frozen=True)
class DropStale:
    """``host`` forgets its copies of ``keys`` (off their slices' chains, older than the chain's)."""

    host: int
    keys: tuple[SliceKey, ...]


Command = SaveMarks | Trim | DropStale


class GcProtocol:
    """Garbage collection across rounds: ``handle(event) -> commands``.

    >>> import chronostream as cs
    >>> from chronostream.dag import compile_query
    >>> q = cs.Query(epoch_events=2)
    >>> _ = q.source("w", [{"w": x} for x in "abab"]).key_by("w").count(slices=2).sink(name="c")
    >>> plan, _ = compile_query(q)
    >>> gc = GcProtocol(plan, slack=2)
    >>> gc.handle(HeldRead(({(1, 0): 6, (1, 1): 7},)))  # (one host holds both slices' copies)
    [SaveMarks(marks={0: 6}), Trim(marks={0: 6})]
    >>> gc.handle(HeldRead(({(1, 0): 3, (1, 1): 7},)))  # (the saved mark does not fall)
    [Trim(marks={0: 3})]
    >>> gc.marks
    {0: 6}
    """

    def __init__(self, plan: Any, slack: int, marks: dict[int, int] | None = None) -> None:
        """``marks``: a restarted master's saved marks."""
        self.plan = plan
        self.slack = slack
        self.marks: dict[int, int] = dict(marks or {})  # highest mark saved per producer stage
        self.source_floors: dict[str, int] = {}  # source stage -> first order a restore may read
        self._saved = dict(self.marks)

    def handle(self, event: Event) -> list[Command]:
        """Take one event; return what the driver must do, in order."""
        if isinstance(event, HeldRead):
            marks, floors = gc_marks_and_source_floors(self.plan, list(event.held), self.slack)
            self.source_floors = raised(self.source_floors, floors, 0)
            out: list[Command] = []
            risen = raised(self.marks, marks, -1)
            if risen != self.marks:
                self.marks = risen
                out.append(SaveMarks(dict(risen)))
                self._saved = dict(risen)
            if any(v >= 0 for v in marks.values()):
                out.append(Trim(marks))
        elif isinstance(event, ChainsRead):
            stale = stale_backups(event.chains, event.held, self.slack)
            out = [DropStale(h, tuple(stale[h])) for h in sorted(stale) if stale[h]]
        else:
            raise TypeError(f"gc: unknown event {event!r}")
        self._check(out)
        return out

    def _check(self, out: list[Command]) -> None:
        """Invariants after every event (docs/design.md section 7j)."""
        for cmd in out:
            if isinstance(cmd, Trim):
                # no host trims above what the catalog holds
                assert all(v <= self._saved.get(st, -1) for st, v in cmd.marks.items()), \
                    f"trim to {cmd.marks} above the saved marks {self._saved}"
        # the marks only rise, and are saved as they rise
        assert all(self._saved.get(st, -1) >= v for st, v in self.marks.items()), "a mark rose unsaved"
