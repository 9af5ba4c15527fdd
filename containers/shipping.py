"""Owns the checkpoint shipping rule of one container as a sans-IO state machine.

A checkpoint round (``ContainerCore.take_backups`` with the memory-sink rows
taken with it) of epoch C ships only after every push of epochs <= C was
settled downstream (accepted, or its receiver is dead: a replay from the
output logs covers a dead one), and after the memory-sink rows up to C
reached the master; the rounds of one container end in the order they were
taken, so deltas reach every peer in order. A recovered slice therefore
never has to re-produce an epoch at or before its checkpoint for anyone
(docs/design.md section 7c).

A round's phases::

    WAITING --(every earlier round ended, every await settled)--> STORING (rows to the master)
    STORING --PartsStored--> SHIPPING (one Ship per peer, concurrently)
    STORING --PartsFailed--> ABANDONED (nothing ships: the next delta is refused, a full one follows)
    SHIPPING --(every peer answered)--> DONE

A round with no rows skips STORING; one with no peers skips SHIPPING. A peer
that refuses a delta (a gap in its chain) or fails to take it makes the
round's slices' next checkpoint a full one (``ForceFull``); a dead peer's chain is
re-planned by the recovery, and a retargeted chain starts with a full one. It knows no Ray,
no clock, no host: the drivers (``containers.ray_shipping`` on Ray,
``master.local.LocalCluster`` in process) turn pushes and other containers'
shipments into await tokens, carry out the commands and feed the results
back.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum


class RoundPhase(Enum):
    WAITING = "waiting"  # for the rounds before it and for its awaits
    STORING = "storing"  # its memory-sink rows are on their way to the master
    SHIPPING = "shipping"  # its frames are on their way to the peers
    DONE = "done"
    ABANDONED = "abandoned"  # the rows did not reach the master: nothing of it ships

    @property
    def ended(self) -> bool:
        return self in (RoundPhase.DONE, RoundPhase.ABANDONED)


#: Each phase and the phases it may go to.
TRANSITIONS: dict[RoundPhase, frozenset[RoundPhase]] = {
    RoundPhase.WAITING: frozenset({RoundPhase.STORING, RoundPhase.SHIPPING, RoundPhase.DONE}),
    RoundPhase.STORING: frozenset({RoundPhase.SHIPPING, RoundPhase.DONE, RoundPhase.ABANDONED}),
    RoundPhase.SHIPPING: frozenset({RoundPhase.DONE}),
    RoundPhase.DONE: frozenset(),
    RoundPhase.ABANDONED: frozenset(),
}

#: Transitions the story keeps per container.
STORY_KEPT = 256


# -- events ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RoundTaken:
    """A round was taken after epoch ``epoch``: ``awaits`` must settle first (the pushes of its
    epochs still unacknowledged, or other containers' shipments), ``rows``: it carries
    memory-sink rows for the master, ``peers``: the hosts its frames go to, ``slices``: the
    slices whose checkpoints it carries (made full again when a peer refuses or misses them)."""

    epoch: int
    awaits: frozenset[Hashable] = frozenset()
    rows: bool = False
    peers: tuple[int, ...] = ()
    slices: tuple[int, ...] = ()


@dataclass(frozen=True)
class Settled:
    """An await token settled (a push acknowledged or failed, a shipment drained)."""

    token: Hashable


@dataclass(frozen=True)
class PartsStored:
    round: int


@dataclass(frozen=True)
class PartsFailed:
    round: int
    error: str


@dataclass(frozen=True)
class PeerShipped:
    """``peer`` took round ``round``'s frames; ``refused``: slices whose delta it refused."""

    round: int
    peer: int
    refused: tuple[int, ...] = ()


@dataclass(frozen=True)
class PeerFailed:
    """``peer`` did not take round ``round``'s frames (``dead``: it is gone; recovery re-plans
    the chain and the next checkpoint is full anyway)."""

    round: int
    peer: int
    dead: bool
    error: str = ""


Event = RoundTaken | Settled | PartsStored | PartsFailed | PeerShipped | PeerFailed


# -- commands --------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreRows:
    """Hand round ``round``'s memory-sink rows to the master; answer ``PartsStored``/``PartsFailed``."""

    round: int


@dataclass(frozen=True)
class Ship:
    """Send round ``round``'s frames for ``peer``; answer ``PeerShipped``/``PeerFailed``."""

    round: int
    peer: int


@dataclass(frozen=True)
class ForceFull:
    """The next checkpoint of these slices is a full one."""

    slices: tuple[int, ...]


@dataclass(frozen=True)
class RoundEnded:
    """Round ``round`` ended (``shipped``: its frames went out); the driver drops its payload."""

    round: int
    shipped: bool


Command = StoreRows | Ship | ForceFull | RoundEnded


@dataclass
class _Round:
    number: int
    taken: RoundTaken
    waiting_on: set = field(default_factory=set)
    unanswered: set = field(default_factory=set)
    phase: RoundPhase = RoundPhase.WAITING


class ShippingProtocol:
    """The shipping rounds of one container: ``handle(event) -> commands``.

    >>> p = ShippingProtocol(container=3)
    >>> p.handle(RoundTaken(4, awaits=frozenset({"push e4"}), rows=True, peers=(1, 2), slices=(0,)))
    []
    >>> p.handle(Settled("push e4"))
    [StoreRows(round=0)]
    >>> p.handle(PartsStored(0))
    [Ship(round=0, peer=1), Ship(round=0, peer=2)]
    >>> p.handle(PeerShipped(0, 1))
    []
    >>> p.handle(PeerShipped(0, 2, refused=(0,)))
    [ForceFull(slices=(0,)), RoundEnded(round=0, shipped=True)]
    >>> p.idle
    True
    """

    def __init__(self, container: int) -> None:
        self.container = container
        self.rounds: collections.OrderedDict[int, _Round] = collections.OrderedDict()  # open rounds, in order
        self.next_round = 0
        self.last_ended = -1
        self.story: collections.deque[tuple[int, int, str, str, str]] = collections.deque(maxlen=STORY_KEPT)

    @property
    def idle(self) -> bool:
        """No round open: everything taken has ended."""
        return not self.rounds

    def handle(self, event: Event) -> list[Command]:
        """Take one event; return what the driver must do, in order."""
        out: list[Command] = []
        if isinstance(event, RoundTaken):
            r = _Round(self.next_round, event, waiting_on=set(event.awaits))
            self.next_round += 1
            self.rounds[r.number] = r
            self.story.append((r.number, event.epoch, "", r.phase.value, "taken"))
        elif isinstance(event, Settled):
            for r in self.rounds.values():
                r.waiting_on.discard(event.token)
        elif isinstance(event, (PartsStored, PartsFailed)):
            r = self._open(event.round, RoundPhase.STORING)
            if isinstance(event, PartsStored):
                out += self._ship(r)
            else:
                self._move(r, RoundPhase.ABANDONED, f"rows not stored: {event.error}")
        elif isinstance(event, (PeerShipped, PeerFailed)):
            r = self._open(event.round, RoundPhase.SHIPPING)
            assert event.peer in r.unanswered, f"round {r.number}: peer {event.peer} answered twice or unasked"
            r.unanswered.discard(event.peer)
            # (a dead peer: the recovery re-plans its chain, and a retargeted chain starts full)
            refused = event.refused if isinstance(event, PeerShipped) else (() if event.dead else r.taken.slices)
            if refused:
                out.append(ForceFull(tuple(sorted(set(refused)))))
            if not r.unanswered:
                self._move(r, RoundPhase.DONE, "every peer answered")
        else:
            raise TypeError(f"shipping: unknown event {event!r}")
        out += self._advance()
        out += self._end_ended()
        self._check()
        return out

    # -- steps ---------------------------------------------------------------------

    def _open(self, number: int, phase: RoundPhase) -> _Round:
        r = self.rounds.get(number)
        assert r is not None and r.phase is phase, \
            f"container {self.container}: round {number} is {r.phase if r else 'not open'}, not {phase}"
        return r

    def _advance(self) -> list[Command]:
        """Start the oldest open round once its awaits settled (only the oldest: in order)."""
        if not self.rounds:
            return []
        r = next(iter(self.rounds.values()))
        if r.phase is not RoundPhase.WAITING or r.waiting_on:
            return []
        if r.taken.rows:
            self._move(r, RoundPhase.STORING, "earlier rounds ended, awaits settled")
            return [StoreRows(r.number)]
        return self._ship(r)

    def _ship(self, r: _Round) -> list[Command]:
        if not r.taken.peers:
            self._move(r, RoundPhase.DONE, "no peer to ship to")
            return []
        r.unanswered = set(r.taken.peers)
        self._move(r, RoundPhase.SHIPPING, "rows with the master" if r.taken.rows else "awaits settled")
        return [Ship(r.number, p) for p in r.taken.peers]

    def _end_ended(self) -> list[Command]:
        """Report the ended rounds at the head, in order (a later one cannot end first: only the
        oldest round ever leaves WAITING)."""
        out: list[Command] = []
        while self.rounds:
            r = next(iter(self.rounds.values()))
            if not r.phase.ended:
                break
            del self.rounds[r.number]
            assert r.number == self.last_ended + 1, f"round {r.number} ended after round {self.last_ended}"
            self.last_ended = r.number
            out.append(RoundEnded(r.number, r.phase is RoundPhase.DONE))
            out += self._advance()
        return out

    def _move(self, r: _Round, to: RoundPhase, cause: str) -> None:
        assert to in TRANSITIONS[r.phase], f"round {r.number}: {r.phase.value} -> {to.value} is no transition"
        self.story.append((r.number, r.taken.epoch, r.phase.value, to.value, cause))
        r.phase = to

    def _check(self) -> None:
        """Invariants: at most one round past WAITING, and it is the oldest open one; a round
        past WAITING has no await left; open rounds are numbered in order after the last ended."""
        numbers = list(self.rounds)
        assert numbers == sorted(numbers) and (not numbers or numbers[0] > self.last_ended)
        active = [r for r in self.rounds.values() if r.phase is not RoundPhase.WAITING]
        assert len(active) <= 1, f"rounds {[r.number for r in active]} are past waiting together"
        assert not active or active[0].number == numbers[0], "a round started before an earlier one ended"
        assert all(not r.waiting_on for r in active), "a round started with awaits unsettled"

    def timeline(self) -> str:
        """The story, one transition a line."""
        return "\n".join(f"round {n} (epoch {e}): {a or '-'} -> {b} ({why})" for n, e, a, b, why in self.story)
