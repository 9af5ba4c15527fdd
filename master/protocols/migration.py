"""Owns one live migration as a sans-IO state machine: events in, commands out.

The phases, their legal order and the plans are ``master.migration``'s
(``MigrationPhase``, ``TRANSITIONS``, ``Transfer``); this module decides
*when* each transfer moves on and *what* the driver must do for it. It
knows no Ray, no clock, no container: the driver answers ``Observe`` with a
``View`` (container progress, backup epochs held per live host, handover
states, the driver's time) and carries out the other commands, feeding
their results back as events. Both masters drive the same machine:
``master.local.LocalCluster`` answers an ``Observe`` at its next round (one
phase a round: the simulator's crashes meet every phase), the Ray
``JobMaster`` at once or after a short poll.

Rules (docs/design.md section 7f):

- A phase's work starts on an observation; its results move the transfers on
  (``Transfer.advance``, which refuses a transition outside ``TRANSITIONS``).
- Transfers to one new container (a *group*) move together up to
  RELEASING; each then completes on its own when its source released.
- DUAL -> RELEASING only when the destination caught up with every source
  of the group (or one of them is done) and, with backups, every moved
  slice has a backup at least as new as its restore point on a host other
  than its new one (``backed_up_off_host``; after ``off_host_timeout_s`` it
  goes on, with a ``Warn``).
- ``Interrupted`` (hosts died, a phase got stuck, a master restarted)
  settles every live group at once by ``settled_by_finishing``: finished
  (producers release to the new container, a source still alive lets go)
  or aborted (dual copies stop, the new container goes). The placement
  moves (``Rehost``) before the handling of the event returns commands
  that a driver might defer: a recovery planned next sees it.

Commands of one kind in a batch are independent (a driver may run them
concurrently); kinds run in the order given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chronostream.master.migration import (MigrationPhase, Transfer, backed_up_off_host, by_destination,
                                           migration_pauses, settled_by_finishing, slices_of, warm_up_goals)

P = MigrationPhase
_ENDED = (P.DONE, P.ABORTED)


# -- what a driver observes --------------------------------------------------------


@dataclass(frozen=True)
class ContainerView:
    """One container as the driver saw it: next epoch, done, released slices (slice -> epoch)
    and, when asked, when its recent epochs finished (epoch -> time: the pause measurement)."""

    next_epoch: int
    done: bool
    released: dict[int, int] = field(default_factory=dict)
    epoch_done_at: dict[int, float] = field(default_factory=dict)

    @staticmethod
    def of(state: dict[str, Any]) -> "ContainerView":
        """From a ``ResourceContainer.migration_state`` entry."""
        return ContainerView(state["next_epoch"], state["done"], dict(state["released"]),
                             dict(state.get("epoch_done_at") or {}))


@dataclass(frozen=True)
class View:
    """A driver's answer to ``Observe``: ``containers`` holds the live ones asked for (a missing
    one is gone), ``held`` every live host's backup epochs ((stage, slice) -> epoch) when asked,
    ``handovers`` new container -> ``pending``/``done``/``cancelled``, ``now`` the driver's time
    in seconds (virtual in the simulator)."""

    now: float
    containers: dict[int, ContainerView] = field(default_factory=dict)
    held: dict[int, dict[tuple[int, int], int]] = field(default_factory=dict)
    handovers: dict[int, str] = field(default_factory=dict)


# -- events (driver -> machine) ----------------------------------------------------


@dataclass(frozen=True)
class Begin:
    """Start the migration."""


@dataclass(frozen=True)
class HostMade:
    """``MakeHost``'s result: placeholder ``target`` is host ``host`` now."""

    target: int
    host: int


@dataclass(frozen=True)
class Observed:
    """``Observe``'s result."""

    view: View


@dataclass(frozen=True)
class Snapshotted:
    """``Snapshot``'s result: transfer ``index``'s source shipped its snapshot of ``epoch``."""

    index: int
    epoch: int | None
    bytes: int = 0


@dataclass(frozen=True)
class Started:
    """``StartContainer``'s result: the new container restored its slices (their progress vectors
    and first epochs to run; empty for a handover)."""

    new_id: int
    progress: dict[int, Any] = field(default_factory=dict)
    resume: dict[int, int] = field(default_factory=dict)
    restore_ms: float = 0.0


@dataclass(frozen=True)
class RestoreFailed:
    """``StartContainer``'s other result: the destination's copies of ``slices`` did not verify (a
    damaged backup); the new container was not made. Their sources snapshot them again."""

    new_id: int
    slices: tuple[int, ...]
    error: str = ""


@dataclass(frozen=True)
class Rerouted:
    """``Reroute``'s result: producer -> what it replayed (``Transfer.catch_up``)."""

    new_id: int
    catch_up: dict[int, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DualBegun:
    """``BeginDual``'s result: the producers' first epochs sending to both."""

    new_id: int
    epochs: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class HandoverFixed:
    """``FixHandover``'s result: the epoch the new container takes the slices over at."""

    new_id: int
    epoch: int


@dataclass(frozen=True)
class SourceReleased:
    """``ReleaseSource``'s result: the transfer's source (None: gone) and destination after it."""

    index: int
    source: ContainerView | None
    dest: ContainerView | None


@dataclass(frozen=True)
class Interrupted:
    """Hosts died, a phase got stuck or a master restarted: settle every live transfer now.
    ``handed_over``: new container -> whether a compaction's handover happened (asked of its
    host, atomically cancelling one still pending)."""

    dead: frozenset[int] = frozenset()
    reason: str = ""
    handed_over: dict[int, bool] = field(default_factory=dict)


Event = Begin | HostMade | Observed | Snapshotted | Started | RestoreFailed | Rerouted | DualBegun | \
    HandoverFixed | SourceReleased | Interrupted


# -- commands (machine -> driver) --------------------------------------------------


@dataclass(frozen=True)
class Observe:
    """Report a ``View``: the ``containers`` (with ``times``), every live host's backup epochs
    (``held``), the ``handovers``' states. ``wait``: nothing moved since the last one (a
    driver polls after a pause)."""

    containers: tuple[int, ...] = ()
    held: bool = False
    handovers: tuple[int, ...] = ()
    times: bool = False
    wait: bool = False


@dataclass(frozen=True)
class MakeHost:
    """A new host for placeholder ``target`` -> ``HostMade``."""

    target: int


@dataclass(frozen=True)
class Freeze:
    """Pause (``on``) or resume the ``sources`` (the stop-copy baseline only)."""

    sources: tuple[int, ...]
    on: bool


@dataclass(frozen=True)
class Snapshot:
    """Transfer ``index``'s source ships full checkpoints of ``slices`` (sink parts up to them go
    to the master first) to ``host``'s backup store -> ``Snapshotted``."""

    index: int
    source: int
    slices: tuple[int, ...]
    host: int


@dataclass(frozen=True)
class AcceptSenders:
    """The placement learns container ``new_id`` on ``host``; every consumer of the stage accepts
    it as a sender covering ``slices``."""

    new_id: int
    stage_id: int
    slices: tuple[int, ...]
    host: int


@dataclass(frozen=True)
class StartContainer:
    """Make container ``new_id`` on ``host``: restored from ``host``'s store (a migration), or
    empty, waiting for ``hand_over_from`` to hand their slices over (a compaction) -> ``Started``."""

    new_id: int
    stage_id: int
    slices: tuple[int, ...]
    host: int
    hand_over_from: tuple[int, ...] = ()


@dataclass(frozen=True)
class Reroute:
    """Every producer of the stage sends ``slices`` to ``new_id`` too (dual), replaying from the
    progress vectors -> ``Rerouted``."""

    new_id: int
    stage_id: int
    slices: tuple[int, ...]
    progress: dict[int, Any]
    resume: dict[int, int]


@dataclass(frozen=True)
class BeginDual:
    """Every producer sends ``slices`` to ``new_id`` too, from its next epoch, no replay -> ``DualBegun``."""

    new_id: int
    stage_id: int
    slices: tuple[int, ...]


@dataclass(frozen=True)
class FixHandover:
    """``new_id``'s host fixes the handover epoch (the first at or after ``not_before`` no source
    reached) and stops the ``sources`` before it -> ``HandoverFixed``."""

    new_id: int
    sources: tuple[int, ...]
    not_before: int


@dataclass(frozen=True)
class ReleaseRoutes:
    """Every producer switches ``slices`` to ``new_id`` only, in one call (their sources see one
    marked epoch); ``release``: source -> slices it lets go of by itself (a source stage, with
    no producer to mark it)."""

    new_id: int
    stage_id: int
    slices: tuple[int, ...]
    release: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class ReleaseSource:
    """Transfer ``index``'s source, if alive and not done, lets go of ``slices`` if it has not (a
    producer that would mark them may have died) -> ``SourceReleased``."""

    index: int
    source: int
    dest: int
    slices: tuple[int, ...]


@dataclass(frozen=True)
class ForgetReleased:
    """Producers stop marking ``slices`` in their messages to ``source`` (released, or gone)."""

    stage_id: int
    source: int
    slices: tuple[int, ...]


@dataclass(frozen=True)
class Rehost:
    """Transfer ``index`` is done: the placement moves its slices to ``new_id`` (and its run-ahead
    allowance ends)."""

    index: int
    source: int
    new_id: int
    slices: tuple[int, ...]


@dataclass(frozen=True)
class DropDual:
    """Producers stop sending ``slices`` to a second copy."""

    stage_id: int
    slices: tuple[int, ...]


@dataclass(frozen=True)
class RemoveContainer:
    """The new container ``new_id`` goes (``host``: None when dead); a compaction's ``sources`` go
    on past the handover epoch."""

    new_id: int
    host: int | None
    sources: tuple[int, ...] = ()


@dataclass(frozen=True)
class Abandon:
    """A phase got stuck (``reason``): the driver interrupts the migration (``Interrupted``)."""

    reason: str


@dataclass(frozen=True)
class Warn:
    """Something a person should read (``message``); the migration goes on."""

    message: str


Command = Observe | MakeHost | Freeze | Snapshot | AcceptSenders | StartContainer | Reroute | BeginDual | \
    FixHandover | ReleaseRoutes | ReleaseSource | ForgetReleased | Rehost | DropDual | RemoveContainer | \
    Abandon | Warn


@dataclass(frozen=True)
class MigrationOptions:
    """How a driver runs the protocol. ``warm_up_s``: how long WARMING waits for the chained
    backups at the destinations to reach the sources' epoch (0: not at all); ``off_host``:
    wait for a backup of each moved slice off its new host before releasing, at most
    ``off_host_timeout_s``; ``phase_timeout_s``: a phase waiting longer is abandoned (None:
    never); ``pause_wait_s``: how long DONE waits for the destination to finish the release
    epochs (to measure the pause); ``stop_copy``: the baseline that freezes the sources while
    their state is copied; ``source_stage``: the stage reads input (its sources release by
    themselves)."""

    warm_up_s: float = 0.0
    off_host: bool = False
    off_host_timeout_s: float | None = None
    phase_timeout_s: float | None = None
    pause_wait_s: float = 0.0
    stop_copy: bool = False
    source_stage: bool = False


class MigrationProtocol:
    """One migration (all its transfers) as a state machine: ``handle(event) -> commands``.

    >>> t = Transfer(9, 1, 0, None, [3], target=-1)
    >>> m = MigrationProtocol(0, [t])
    >>> m.handle(Begin())
    [MakeHost(target=-1)]
    >>> m.handle(HostMade(-1, 5))
    [Observe(containers=(1,), held=True, handovers=(), times=False, wait=False)]
    >>> t.phase.value, t.host
    ('warming', 5)
    >>> m.handle(Observed(View(0.0, {1: ContainerView(4, False)}, {5: {}})))
    [Snapshot(index=0, source=1, slices=(3,), host=5)]
    >>> m.handle(Snapshotted(0, 3, 100))[0].containers, t.phase.value
    ((1, 9), 'rebuilding')
    """

    def __init__(self, stage_id: int, transfers: list[Transfer], options: MigrationOptions = MigrationOptions(),
                 chain: dict[int, dict[int, list[int]]] | None = None) -> None:
        """``chain``: the stage's backup peers now (source container -> slice -> hosts; warm-up)."""
        self.stage_id = stage_id
        self.transfers = transfers
        self.options = options
        self.chain = chain or {}
        self.groups = by_destination(transfers)
        self.story: list[tuple[str, str]] = []  # (event, what it did): ``timeline``
        self._goals: dict[int, tuple[list[int], int]] | None = None
        self._since: dict[Any, float] = {}  # (group or "warm", phase) -> first time observed in it
        self._asked: set[Any] = set()  # work asked of the driver, not answered yet
        self._started: dict[int, Started] = {}
        self._completing: dict[int, SourceReleased] = {}  # index -> waiting for the pause to show
        self._snapped: dict[int, tuple[int | None, int]] = {}  # index -> snapshot's (epoch, bytes)
        self._index = {id(t): i for i, t in enumerate(transfers)}
        self._settling = False  # an ``Interrupted`` came: every live group is being settled
        self._warm_wait = 0.0  # how long WARMING waited for the chained backups (seconds)

    # -- reading ---------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Every transfer is DONE or ABORTED."""
        return all(t.phase in _ENDED for t in self.transfers)

    def live(self) -> list[Transfer]:
        """The transfers not ended."""
        return [t for t in self.transfers if t.phase not in _ENDED]

    def timeline(self) -> str:
        """The story as lines: each event and what the machine did about it."""
        return "\n".join(f"{e}: {did}" for e, did in self.story)

    # -- the one entry point ---------------------------------------------------

    def handle(self, event: Event) -> list[Command]:
        """Take one event; return what the driver must do next."""
        handler = _HANDLERS[type(event)]
        out = handler(self, event)
        if self.finished:
            out = [c for c in out if not isinstance(c, Observe)]
        self.story.append((type(event).__name__, ", ".join(type(c).__name__ for c in out) or "-"))
        self._check()
        return out

    # -- handlers --------------------------------------------------------------

    def _begin(self, _e: Begin) -> list[Command]:
        if self.transfers and self.transfers[0].handover:
            for t in self.transfers:
                t.advance(P.WARMING, host=t.host, handover=True)
            return [self._observe()]
        targets = sorted({t.target for t in self.transfers if t.host is None})
        if not targets:
            return self._warm()
        self._asked |= {("host", x) for x in targets}
        return [MakeHost(x) for x in targets]

    def _host_made(self, e: HostMade) -> list[Command]:
        self._asked.discard(("host", e.target))
        for t in self.transfers:
            if t.host is None and t.target == e.target:
                t.host = e.host
        return [] if any(t.host is None for t in self.live()) else self._warm()

    def _warm(self) -> list[Command]:
        for t in self.live():
            t.advance(P.WARMING, host=t.host)
        return [Observe(tuple(sorted({t.source for t in self.transfers})), held=True)]

    def _snapshotted(self, e: Snapshotted) -> list[Command]:
        self._asked.discard(("snapshot", e.index))
        self._snapped[e.index] = (e.epoch, e.bytes)
        t = self.transfers[e.index]
        if t.phase is P.REBUILDING:  # a snapshot again after a damaged copy: start once all are in
            if any(k[0] == "snapshot" and self.transfers[k[1]].new_id == t.new_id for k in self._asked):
                return []
            group = self._live_group(t.new_id)
            self._asked.add(("start", t.new_id))
            return [StartContainer(t.new_id, self.stage_id, tuple(slices_of(group)), t.host)]  # type: ignore[arg-type]
        if any(k[0] == "snapshot" for k in self._asked):
            return []
        self._rebuilding()
        return [self._observe()]

    def _rebuilding(self) -> None:
        """WARMING -> REBUILDING for every transfer, once every snapshot asked for arrived."""
        for i, t in enumerate(self.transfers):
            if t.phase is P.WARMING:
                epoch, size = self._snapped.get(i, (None, 0))
                t.advance(P.REBUILDING, epoch, snapshot=t.snapshot, mb=round(size / 1e6, 3),
                          warm_wait_s=self._warm_wait, local=sorted(set(t.slices) - set(t.snapshot)))

    def _started_(self, e: Started) -> list[Command]:
        self._asked.discard(("start", e.new_id))
        group = self._live_group(e.new_id)
        if not group:
            return []
        self._started[e.new_id] = e
        t0 = group[0]
        if t0.handover:
            self._asked.add(("dual", e.new_id))
            return [BeginDual(e.new_id, self.stage_id, tuple(slices_of(group)))]
        for t in group:
            t.resume = {s: e.resume[s] for s in t.slices}
        self._asked.add(("reroute", e.new_id))
        return [Reroute(e.new_id, self.stage_id, tuple(slices_of(group)), dict(e.progress), dict(e.resume))]

    def _restore_failed(self, e: RestoreFailed) -> list[Command]:
        """The destination's own copy of some slices is damaged: their sources snapshot them to it
        again (a fresh full checkpoint replaces the chain there), then the container starts."""
        self._asked.discard(("start", e.new_id))
        out: list[Command] = []
        for t in self._live_group(e.new_id):
            bad = [s for s in t.slices if s in e.slices]
            if bad and t.phase is P.REBUILDING:
                i = self._index[id(t)]
                t.snapshot = sorted(set(t.snapshot) | set(bad))
                self._asked.add(("snapshot", i))
                out.append(Snapshot(i, t.source, tuple(bad), t.host))  # type: ignore[arg-type]
        return out or [Abandon(f"container {e.new_id} could not restore {list(e.slices)}: {e.error}")]

    def _rerouted(self, e: Rerouted) -> list[Command]:
        self._asked.discard(("reroute", e.new_id))
        group = self._live_group(e.new_id)
        if not group or group[0].phase is not P.REBUILDING:
            return []
        started = self._started[e.new_id]
        for t in group:
            t.catch_up.update(e.catch_up)
            t.advance(P.DUAL, min(t.resume.values(), default=None), resume=t.resume,
                      restore_ms=started.restore_ms)
        return [self._observe()]

    def _dual_begun(self, e: DualBegun) -> list[Command]:
        self._asked.discard(("dual", e.new_id))
        group = self._live_group(e.new_id)
        if not group:
            return []
        self._asked.add(("fix", e.new_id))
        return [FixHandover(e.new_id, tuple(t.source for t in group), max(e.epochs, default=0))]

    def _handover_fixed(self, e: HandoverFixed) -> list[Command]:
        self._asked.discard(("fix", e.new_id))
        group = self._live_group(e.new_id)
        if not group or group[0].phase is not P.REBUILDING:
            return []
        for t in group:
            t.hand_over_epoch = e.epoch
            t.advance(P.DUAL, e.epoch, hand_over_epoch=e.epoch)
        return [self._observe()]

    def _source_released(self, e: SourceReleased) -> list[Command]:
        self._asked.discard(("release", e.index))
        t = self.transfers[e.index]
        if t.phase is not P.RELEASING:
            return []
        out: list[Command] = []
        if e.source is not None:
            t.released_at = {s: r for s, r in e.source.released.items() if s in t.slices}
        # Producers stop marking the slices for the source once it let them go, or once settling
        # asked it to (``ReleaseSource``: it lets them go at its next epoch, marker or not); a
        # producer left marking them would send every epoch to the source for good.
        if e.source is None or set(t.slices) <= set(e.source.released) or self._settling:
            out.append(ForgetReleased(self.stage_id, t.source, tuple(t.slices)))
        if (e.source is not None and e.dest is not None and not e.dest.done and self.options.pause_wait_s > 0
                and not self._settling and any(r not in e.dest.epoch_done_at for r in t.released_at.values())):
            self._completing[e.index] = e  # the destination is still on a release epoch: see it finish
            return out + [self._observe()]
        return out + self._done(e.index, e.source, e.dest)

    def _done(self, index: int, src: ContainerView | None, dst: ContainerView | None) -> list[Command]:
        t = self.transfers[index]
        self._completing.pop(index, None)
        if src is not None and dst is not None:
            t.pause_ms = migration_pauses(t.released_at, src.epoch_done_at, dst.epoch_done_at)
        t.advance(P.DONE, None if dst is None else dst.next_epoch, released_at=t.released_at, pause_ms=t.pause_ms)
        return [Rehost(index, t.source, t.new_id, tuple(t.slices))]

    def _observed(self, e: Observed) -> list[Command]:
        v = e.view
        out: list[Command] = []
        waiting = False
        before = [t.phase for t in self.transfers]
        for index, done in list(self._completing.items()):
            dst = v.containers.get(self.transfers[index].new_id)
            if dst is None or dst.done or v.now - self._since.setdefault(("pause", index), v.now) \
                    >= self.options.pause_wait_s or all(r in dst.epoch_done_at
                                                        for r in self.transfers[index].released_at.values()):
                out += self._done(index, done.source, dst if dst is not None else done.dest)
            else:
                waiting = True
        live = self.live()
        if live and all(t.phase is P.WARMING for t in live) and not self._asked:
            moved = self._warming(v)
            if moved is None:
                waiting = True
            else:
                out += moved
        for new_id, group in self.groups.items():
            group = [t for t in group if t.phase not in _ENDED]
            # (one step a group per observation: a phase entered just now waits for the next)
            if not group or self._busy(new_id) or any(t.phase is not before[self._index[id(t)]] for t in group):
                continue
            phase = min((t.phase for t in group), key=list(P).index)
            key = (new_id, phase)
            since = self._since.setdefault(key, v.now)
            if phase is P.REBUILDING:
                out += self._rebuild(new_id, group)
            elif phase is P.DUAL:
                step = self._handover_dual(new_id, group, v) if group[0].handover else self._dual(new_id, group, v)
                if step is None:
                    waiting = True
                    if self._timed_out(v.now, since):
                        return [Abandon(f"migration stuck in {phase.value} for "
                                        f"{v.now - since:.0f} s: " + "; ".join(t.describe() for t in group))]
                else:
                    out += step
            elif phase is P.RELEASING:
                step = self._releasing(group, v)
                if step is None:
                    waiting = True
                    if self._timed_out(v.now, since):
                        return [Abandon("migration stuck releasing: " + "; ".join(t.describe() for t in group))]
                else:
                    out += step
        abandon = [c for c in out if isinstance(c, Abandon)]
        if abandon:
            return abandon[:1]
        if not self.finished and not any(isinstance(c, Observe) for c in out) and not self._asked_besides_release():
            out.append(self._observe(wait=waiting and not any(not isinstance(c, Warn) for c in out)))
        return out

    def _warming(self, v: View) -> list[Command] | None:
        """WARMING's work once the hosts are up: wait for fresh backups (``warm_up_s``), then ask the
        sources for a snapshot of each slice their destination lacks the newest backup of."""
        since = self._since.setdefault(("warm", P.WARMING), v.now)
        self._warm_wait = round(v.now - since, 3)
        live = self.live()
        if live[0].handover:  # nothing to copy: the slices stay in their process
            for t in live:
                t.advance(P.REBUILDING, None, snapshot=[], handover=True)
            return []
        if self.options.warm_up_s > 0 and not self.options.stop_copy:
            sources = {c: {"done": cv.done, "next_epoch": cv.next_epoch} for c, cv in v.containers.items()}
            if self._goals is None:  # the epochs to reach: each source's last when the warm-up began
                self._goals = warm_up_goals(self.stage_id, self.transfers, self.chain, v.held, sources)
            self._goals = {i: (slices, epoch) for i, (slices, epoch) in self._goals.items()
                           if not sources.get(self.transfers[i].source, {"done": True})["done"]
                           and not all(v.held.get(self.transfers[i].host, {}).get((self.stage_id, s), -1) >= epoch
                                       for s in slices)}
            if self._goals and v.now - since < self.options.warm_up_s:
                return None
        out: list[Command] = []
        if self.options.stop_copy:
            out.append(Freeze(tuple(t.source for t in live), True))
        for t in live:
            newest = {s: max([e.get((self.stage_id, s), -1) for e in v.held.values()], default=-1) for s in t.slices}
            own = v.held.get(t.host, {})  # type: ignore[arg-type]
            t.snapshot = [s for s in t.slices
                          if newest[s] < 0 or own.get((self.stage_id, s), -1) < newest[s] or self.options.stop_copy]
        for t in live:
            if t.snapshot:
                i = self._index[id(t)]
                self._asked.add(("snapshot", i))
                out.append(Snapshot(i, t.source, tuple(t.snapshot), t.host))  # type: ignore[arg-type]
        if not any(k[0] == "snapshot" for k in self._asked):
            self._rebuilding()
        return out

    def _rebuild(self, new_id: int, group: list[Transfer]) -> list[Command]:
        """REBUILDING's work: consumers accept the new container, which then starts (restored, or
        empty for a handover)."""
        t0, slices = group[0], tuple(slices_of(group))
        self._asked.add(("start", new_id))
        return [AcceptSenders(new_id, self.stage_id, slices, t0.host),  # type: ignore[arg-type]
                StartContainer(new_id, self.stage_id, () if t0.handover else slices, t0.host,  # type: ignore[arg-type]
                               tuple(t.source for t in group) if t0.handover else ())]

    def _dual(self, new_id: int, group: list[Transfer], v: View) -> list[Command] | None:
        """DUAL: wait until the destination caught up with every source and the moved slices are
        backed up off their new host; then release (``None``: still waiting)."""
        dst = v.containers.get(new_id)
        gone = [c for c in [new_id] + [t.source for t in group] if c not in v.containers]
        if gone:
            return [Abandon(f"containers {gone} are gone while catching up")]
        srcs = [v.containers[t.source] for t in group]
        assert dst is not None
        if not self.options.stop_copy and not all(dst.next_epoch >= s.next_epoch - 1 or s.done or dst.done
                                                  for s in srcs):
            return None
        out: list[Command] = []
        if self.options.off_host and not dst.done and not all(backed_up_off_host(t, v.held) for t in group):
            since = self._since.setdefault(("off_host", new_id), v.now)
            limit = self.options.off_host_timeout_s
            if limit is None or v.now - since < limit:
                return None
            out.append(Warn(f"migration: the moved slices have no backup off their new host after {limit:.0f} s; "
                            "releasing anyway: " + "; ".join(t.describe() for t in group)))
        out += self._release(group, dst.next_epoch)
        if self.options.stop_copy:
            out.append(Freeze(tuple(t.source for t in group), False))
        return out

    def _release(self, group: list[Transfer], epoch: int | None, **info: Any) -> list[Command]:
        """DUAL -> RELEASING for ``group``: producers switch its slices in one call."""
        release = {t.source: tuple(t.slices) for t in group} if self.options.source_stage else {}
        cmd = ReleaseRoutes(group[0].new_id, self.stage_id, tuple(slices_of(group)), release)
        for t in group:
            t.advance(P.RELEASING, epoch, **info)
        return [cmd]

    def _handover_dual(self, new_id: int, group: list[Transfer], v: View) -> list[Command] | None:
        """A compaction in DUAL: wait for its host to hand the slices over at the fixed epoch."""
        state = v.handovers.get(new_id, "pending")
        if state == "pending":
            return None
        if state == "done":
            return self._release(group, group[0].hand_over_epoch, handed_over=[s for t in group for s in t.slices])
        return self._abort(group, "the input ended before the handover epoch")

    def _releasing(self, group: list[Transfer], v: View) -> list[Command] | None:
        """RELEASING: each transfer completes once its source released its slices (or is done or gone)."""
        out: list[Command] = []
        for t in group:
            i = self._index[id(t)]
            if t.phase is not P.RELEASING or ("release", i) in self._asked or i in self._completing:
                continue
            src = v.containers.get(t.source)
            if src is None or src.done or set(t.slices) <= set(src.released):
                self._asked.add(("release", i))
                out.append(ReleaseSource(i, t.source, t.new_id, tuple(t.slices)))
        return out or None

    def _abort(self, group: list[Transfer], reason: str, dst_alive: bool = True) -> list[Command]:
        t0 = group[0]
        out: list[Command] = [DropDual(self.stage_id, tuple(slices_of(group))),
                              RemoveContainer(t0.new_id, t0.host if dst_alive else None,
                                              tuple(t.source for t in group) if t0.handover else ())]
        for t in group:
            t.advance(P.ABORTED, reason=reason)
        return out

    def _interrupted(self, e: Interrupted) -> list[Command]:
        """Settle every live group at once (``settled_by_finishing``)."""
        self._settling = True
        self._asked.clear()
        out: list[Command] = []
        releases: list[Command] = []
        for new_id, group in self.groups.items():
            live = [t for t in group if t.phase not in _ENDED]
            if not live:
                continue
            t0 = live[0]  # (transfers to one new container are in one phase up to RELEASING)
            dst_ok = t0.host is not None and t0.host not in e.dead
            if settled_by_finishing(t0.phase, t0.handover, dst_ok, e.handed_over.get(new_id, False)):
                for t in live:  # (a handover the machine had not seen reach DUAL yet)
                    if t.phase is P.REBUILDING:
                        t.advance(P.DUAL, reason="handed over before the interruption")
                dual = [t for t in live if t.phase is P.DUAL]
                if dual:
                    out += self._release(dual, None)
                for t in live:
                    i = self._index[id(t)]
                    if i in self._completing:
                        releases += self._done(i, self._completing[i].source, self._completing[i].dest)
                    else:
                        self._asked.add(("release", i))
                        releases.append(ReleaseSource(i, t.source, t.new_id, tuple(t.slices)))
            else:
                out += self._abort(live, e.reason, dst_ok)
        # every source runs on (a stop-copy baseline paused them; a restarted master cannot know)
        out.append(Freeze(tuple(sorted({t.source for t in self.transfers})), False))
        return out + releases

    # -- helpers ---------------------------------------------------------------

    def _observe(self, wait: bool = False) -> Observe:
        """What the next observation must hold for every live transfer's phase."""
        live = self.live()
        ids = sorted({c for t in live for c in (t.source, t.new_id)})
        handovers = tuple(sorted({t.new_id for t in live if t.handover and t.phase is P.DUAL}))
        held = any(t.phase is P.WARMING for t in live) or (
            self.options.off_host and any(t.phase is P.DUAL for t in live))
        return Observe(tuple(ids), held=held, handovers=handovers, times=bool(self._completing), wait=wait)

    def _busy(self, new_id: int) -> bool:
        """Whether the driver owes a result for the group's new container (or any snapshot)."""
        return any(k[0] == "snapshot" or (k[0] in ("start", "reroute", "dual", "fix") and k[1] == new_id)
                   for k in self._asked)

    def _asked_besides_release(self) -> bool:
        return any(k[0] != "release" for k in self._asked)

    def _live_group(self, new_id: int) -> list[Transfer]:
        return [t for t in self.groups.get(new_id, []) if t.phase not in _ENDED]

    def _timed_out(self, now: float, since: float) -> bool:
        limit = self.options.phase_timeout_s
        return limit is not None and now - since > limit

    def _check(self) -> None:
        """Invariants after every event (docs/design.md section 7f)."""
        order = list(P)
        for group in self.groups.values():
            live = [t for t in group if t.phase not in _ENDED]
            # transfers to one new container move together up to RELEASING
            pre = {t.phase for t in live if order.index(t.phase) < order.index(P.RELEASING)}
            assert len(pre) <= 1, f"group {group[0].new_id} split across phases {pre}"
            # a group that released never goes back; one that aborted released nothing
            assert not (any(t.phase is P.ABORTED for t in group) and any(t.phase is P.DONE for t in group)), \
                f"group {group[0].new_id} both done and aborted"
        for t in self.transfers:
            # every phase past PREPARING has a destination host
            assert t.phase in (P.PREPARING, P.ABORTED) or t.host is not None, f"{t.describe()} has no host"
            # a finished transfer moved every slice through RELEASING (or was read back from the
            # catalog at RELEASING or DONE by a restarted master)
            if t.phase is P.DONE:
                assert any(p == P.RELEASING.value or (p == P.DONE.value and info.get("from_catalog"))
                           for _, p, _, info in t.story), f"{t.describe()} skipped RELEASING"


_HANDLERS = {Begin: MigrationProtocol._begin, HostMade: MigrationProtocol._host_made,
             Observed: MigrationProtocol._observed, Snapshotted: MigrationProtocol._snapshotted,
             Started: MigrationProtocol._started_, RestoreFailed: MigrationProtocol._restore_failed,
             Rerouted: MigrationProtocol._rerouted,
             DualBegun: MigrationProtocol._dual_begun, HandoverFixed: MigrationProtocol._handover_fixed,
             SourceReleased: MigrationProtocol._source_released, Interrupted: MigrationProtocol._interrupted}
