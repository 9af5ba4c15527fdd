"""Owns a recovery as a sans-IO state machine: events in, commands out.

Which live host adopts each lost slice, from which backup, is
``master.recovery.plan_recovery``'s; this module owns the order of the
steps around it, what a host dying in the middle of one does, and what a
restarted master does with the saved record. It knows no Ray, no clock,
no container: the driver (``master.actor.JobMaster`` on Ray,
``master.local.LocalCluster`` in process) carries out the commands and
feeds their results back as events.

Steps (``RecoveryStep``; docs/design.md section 7d):

- DECLARING: the dead hosts are fenced and out of the live set, with any
  host found dead with them (a node takes all its hosts) -> ``Declared``;
- SURVEYING: their containers are the lost ones; the record (dead hosts not
  planned for yet, plans not finished) is saved -> ``Surveyed``;
- PLANNING: the live hosts' backup catalogs -> ``BackupsRead``; the plan is
  made and applied to the placement, and saved, before any host hears of
  it (``ApplyPlan``);
- ADOPTING: new hosts for stages with none left, then plan by plan:
  consumers accept the new containers as senders, each host restores its
  share -> ``Restored``;
- REROUTING: every new container starts, producers reroute and replay from
  the restored progress vectors, each recovered container replays its
  relogged outputs to the live consumers behind it (step 3b), backups are
  re-planned -> ``Retargeted``;
- DONE: the record is cleared, each plan reported.

A step that fails because a host died (``StepFailed``) declares the dead
and plans for their containers too; then every unfinished plan runs again,
without the adoptions on dead hosts (their containers are placed there: the
newer plan re-hosts them). Every step is idempotent, so a restarted master
runs the saved plans again from the start of ADOPTING (``resume``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from chronostream.master.recovery import Adoption, plan_recovery

Lost = dict[int, tuple[int, list[int]]]  # dead container -> (stage, slices)


class RecoveryStep(enum.Enum):
    """Where a recovery is (see the module docstring)."""

    DECLARING = "declaring"
    SURVEYING = "surveying"
    PLANNING = "planning"
    ADOPTING = "adopting"
    REROUTING = "rerouting"
    DONE = "done"


_S = RecoveryStep
#: Allowed steps, each with the event that triggers it.
TRANSITIONS: dict[tuple[RecoveryStep, RecoveryStep], str] = {
    (_S.DECLARING, _S.SURVEYING): "the dead hosts are fenced",
    (_S.SURVEYING, _S.PLANNING): "containers were lost",
    (_S.SURVEYING, _S.ADOPTING): "nothing more was lost; plans are left to run",
    (_S.SURVEYING, _S.DONE): "nothing was lost and no plan is left",
    (_S.PLANNING, _S.ADOPTING): "the plan is applied to the placement and saved",
    (_S.ADOPTING, _S.REROUTING): "every new container restored its slices",
    (_S.REROUTING, _S.DONE): "producers rerouted, backups re-planned",
}
for _s in (_S.DECLARING, _S.SURVEYING, _S.PLANNING, _S.ADOPTING, _S.REROUTING):
    TRANSITIONS[(_s, _S.DECLARING)] = "a host died during a step"


@dataclass
class PlanRecord:
    """One plan applied to the placement and not finished: what the catalog keeps of it."""

    dead: list[int]
    lost: Lost
    new_hosts: list[int]
    plan: list[Adoption]
    t0: float
    resumed: bool = False

    def to_plain(self) -> dict[str, Any]:
        """For the catalog (``JobMaster._save_layout``)."""
        return {"dead": list(self.dead), "lost": self.lost, "new_hosts": list(self.new_hosts),
                "plan": [a.to_plain() for a in self.plan], "t0": self.t0,
                **({"resumed": True} if self.resumed else {})}

    @staticmethod
    def from_plain(d: dict[str, Any]) -> "PlanRecord":
        """Inverse of ``to_plain``."""
        return PlanRecord(list(d["dead"]), {int(c): (st, list(sl)) for c, (st, sl) in d["lost"].items()},
                          list(d["new_hosts"]), [Adoption.from_plain(a) for a in d["plan"]], d["t0"],
                          bool(d.get("resumed", False)))


@dataclass(frozen=True)
class PlanInputs:
    """What ``plan_recovery`` needs besides the lost containers, as the driver read it."""

    backups: dict[tuple[int, int], list[tuple[int, int]]]
    live: dict[int, list[int]]
    next_id: int
    checkpointed: frozenset = frozenset()
    recompute_lost: bool = False
    stage_names: dict[int, str] = field(default_factory=dict)
    chain: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    damaged: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    floor: dict[int, int] | None = None
    slack: int = 0
    rebuildable: frozenset = frozenset()


@dataclass(frozen=True)
class Restore:
    """What one new container restored: per slice its progress vector and first epoch to run."""

    progress: dict[int, Any]
    resume: dict[int, int]


# -- events ------------------------------------------------------------------------


@dataclass(frozen=True)
class HostsDied:
    """Start: ``dead`` hosts (none: only run the saved plans a restarted master found)."""

    dead: frozenset[int]


@dataclass(frozen=True)
class Declared:
    """``DeclareDead``'s result: every host now declared dead (the asked ones and any found with them)."""

    dead: frozenset[int]


@dataclass(frozen=True)
class Surveyed:
    """``Survey``'s result: the containers those hosts ran, and the driver's time."""

    lost: Lost
    now: float = 0.0


@dataclass(frozen=True)
class BackupsRead:
    """``ReadBackups``'s result."""

    inputs: PlanInputs


@dataclass(frozen=True)
class HostMade:
    """``MakeHost``'s result."""

    host: int


@dataclass(frozen=True)
class Restored:
    """``RestoreSlices``'s result for plan ``plan_index``: new container -> what it restored."""

    plan_index: int
    restores: dict[int, Restore]


@dataclass(frozen=True)
class Rerouted:
    """``Reroute``'s result: the epochs producers replayed to ``new_id``."""

    new_id: int
    epochs: int


@dataclass(frozen=True)
class Retargeted:
    """``RetargetBackups`` is done: the last step."""


@dataclass(frozen=True)
class StepFailed:
    """A step raised and ``dead`` hosts were found dead (a driver re-raises when none was)."""

    dead: frozenset[int]
    error: str = ""


Event = HostsDied | Declared | Surveyed | BackupsRead | HostMade | Restored | Rerouted | Retargeted | StepFailed


# -- commands ----------------------------------------------------------------------


@dataclass(frozen=True)
class DeclareDead:
    """Fence ``dead`` (and any host found dead with them) and take them out of the live set -> ``Declared``."""

    dead: frozenset[int]


@dataclass(frozen=True)
class Survey:
    """The containers ``dead`` ran; save the record (``record``: dead hosts to plan for, plans) -> ``Surveyed``."""

    dead: frozenset[int]
    plans: tuple[PlanRecord, ...]


@dataclass(frozen=True)
class AtStep:
    """Failure injection's hook: the recovery reached ``step`` (``master.recovery.RECOVERY_STEPS``)."""

    step: str
    lost: Lost
    plan: tuple[Adoption, ...] | None = None


@dataclass(frozen=True)
class ReadBackups:
    """Read every live host's backup catalog and what else the planner needs -> ``BackupsRead``."""

    lost: Lost


@dataclass(frozen=True)
class ApplyPlan:
    """``made`` joins the placement (new containers on their hosts, the lost slices re-hosted),
    saved with the ``plans`` not finished before any host hears of it; ids from ``next_id`` on are free."""

    made: PlanRecord
    plans: tuple[PlanRecord, ...]
    next_id: int


@dataclass(frozen=True)
class MakeHost:
    """Start host ``host`` (or find it by name) -> ``HostMade``."""

    host: int


@dataclass(frozen=True)
class AcceptSenders:
    """Consumers of each adoption's stage accept its new container as a sender (those in
    ``not_made`` get theirs from the placement when they are made)."""

    plan: tuple[Adoption, ...]
    not_made: frozenset[int]


@dataclass(frozen=True)
class RestoreSlices:
    """Each adoption's host makes its new container and restores its slices (newest verified
    backup among the holders, its own first) -> ``Restored``."""

    plan_index: int
    plan: tuple[Adoption, ...]


@dataclass(frozen=True)
class StartContainers:
    """The new containers start running."""

    adoptions: tuple[Adoption, ...]


@dataclass(frozen=True)
class Reroute:
    """Every live producer of the adoption's stage sends its slices to the new container,
    replaying from the progress vectors -> ``Rerouted``."""

    adoption: Adoption
    restore: Restore


@dataclass(frozen=True)
class ReplayToConsumers:
    """The new container replays its relogged outputs before epoch ``upto`` to every live consumer
    behind it (``adopted``: new containers, rerouted to already)."""

    adoption: Adoption
    upto: int
    adopted: frozenset[int]


@dataclass(frozen=True)
class RetargetBackups:
    """Re-plan the backup chains of ``stages`` (and of the stages backed up off their hosts) -> ``Retargeted``."""

    stages: frozenset[int]


@dataclass(frozen=True)
class Finish:
    """Clear the record; report each plan (``epochs``: new container -> epochs replayed to it)."""

    plans: tuple[PlanRecord, ...]
    ran: tuple[tuple[Adoption, ...], ...]
    epochs: dict[int, int]


Command = DeclareDead | Survey | AtStep | ReadBackups | ApplyPlan | MakeHost | AcceptSenders | RestoreSlices | \
    StartContainers | Reroute | ReplayToConsumers | RetargetBackups | Finish


class RecoveryProtocol:
    """One recovery, possibly of several plans, as a state machine: ``handle(event) -> commands``.

    >>> from chronostream.master.protocols.recovery import *
    >>> r = RecoveryProtocol()
    >>> r.handle(HostsDied(frozenset({2})))
    [DeclareDead(dead=frozenset({2}))]
    >>> [type(c).__name__ for c in r.handle(Declared(frozenset({2})))]
    ['Survey']
    >>> [type(c).__name__ for c in r.handle(Surveyed({5: (1, [0, 3])}, now=1.0))]
    ['AtStep', 'ReadBackups']
    >>> out = r.handle(BackupsRead(PlanInputs({(1, 0): [(1, 4)], (1, 3): [(3, 4)]}, {1: [1, 3]}, next_id=9)))
    >>> [type(c).__name__ for c in out], [(a.new_id, a.host, a.slices) for a in out[0].made.plan]
    (['ApplyPlan', 'AtStep', 'AcceptSenders', 'RestoreSlices'], [(9, 1, [0]), (10, 3, [3])])
    """

    def __init__(self, plans: list[PlanRecord] | None = None, gone: set[int] | frozenset = frozenset()) -> None:
        """``plans``, ``gone``: a restarted master's saved plans and the hosts they were made for."""
        self.step = RecoveryStep.DECLARING
        self.plans: list[PlanRecord] = list(plans or [])
        self.gone: set[int] = set(gone)
        self.story: list[tuple[str, str, str]] = []  # (event, step after it, commands)
        self._dead: frozenset[int] = frozenset()  # declared, not planned for yet
        self._lost: Lost = {}
        self._now = 0.0
        self._runs: list[list[Adoption]] = []
        self._restores: dict[int, Restore] = {}
        self._waiting: set[Any] = set()
        self._epochs: dict[int, int] = {}
        self._applied = len(self.plans)  # plans saved before any host heard of them (invariant)

    # -- reading ---------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """The recovery ended (every plan ran)."""
        return self.step is RecoveryStep.DONE

    def record(self) -> dict[str, Any] | None:
        """What the catalog keeps of this recovery now (``JobMaster._save_layout``): dead hosts
        not planned for yet and the plans not finished."""
        if not self._dead and not self.plans:
            return None
        return {"dead": sorted(self._dead), "plans": [p.to_plain() for p in self.plans]}

    def timeline(self) -> str:
        """The story as lines: each event, the step after it, and the commands it gave."""
        return "\n".join(f"{e} -> {s}: {c}" for e, s, c in self.story)

    # -- the one entry point ---------------------------------------------------

    def handle(self, event: Event) -> list[Command]:
        """Take one event; return what the driver must do next."""
        out = _HANDLERS[type(event)](self, event)
        self.story.append((type(event).__name__, self.step.value, ", ".join(type(c).__name__ for c in out) or "-"))
        self._check(out)
        return out

    def _to(self, step: RecoveryStep) -> None:
        assert (self.step, step) in TRANSITIONS, f"recovery: no step {self.step.value} -> {step.value}"
        self.step = step

    # -- handlers --------------------------------------------------------------

    def _hosts_died(self, e: HostsDied) -> list[Command]:
        if e.dead:
            return [DeclareDead(e.dead)]
        self.step = RecoveryStep.SURVEYING  # (nothing to declare: a restarted master's plans)
        return self._run() if self.plans else self._done_nothing()

    def _declared(self, e: Declared) -> list[Command]:
        self._to(RecoveryStep.SURVEYING)
        self._dead = self._dead | e.dead  # (with those declared before a step failed, not planned for yet)
        self.gone |= set(e.dead)
        return [Survey(self._dead, tuple(self.plans))]

    def _surveyed(self, e: Surveyed) -> list[Command]:
        self._now = e.now
        if not e.lost:
            self._dead = frozenset()
            return self._run() if self.plans else self._done_nothing()
        self._to(RecoveryStep.PLANNING)
        self._lost = e.lost
        return [AtStep("detected", e.lost), ReadBackups(e.lost)]

    def _backups_read(self, e: BackupsRead) -> list[Command]:
        i = e.inputs
        plan = plan_recovery(self._lost, i.backups, i.live, i.next_id, i.checkpointed, i.recompute_lost,
                             i.stage_names, i.chain, i.damaged, i.floor, i.slack, i.rebuildable)
        next_id = max([i.next_id] + [a.new_id + 1 for a in plan])
        new_hosts = []
        for a in plan:
            if a.host is None:  # every host of the stage died: a new one
                a.host = next_id
                next_id += 1
                new_hosts.append(a.host)
        made = PlanRecord(sorted(self._dead), self._lost, new_hosts, plan, self._now)
        self.plans.append(made)
        self._dead = frozenset()
        self._applied = len(self.plans)
        return [ApplyPlan(made, tuple(self.plans), next_id), AtStep("planned", self._lost, tuple(plan))] + self._run()

    def _run(self) -> list[Command]:
        """ADOPTING for every unfinished plan, without the adoptions on dead hosts."""
        self._to(RecoveryStep.ADOPTING)
        self._runs = [[a for a in p.plan if a.host not in self.gone] for p in self.plans]
        self._restores = {}
        self._epochs = {}
        out: list[Command] = []
        hosts = [h for p in self.plans for h in p.new_hosts if h not in self.gone]
        out += [MakeHost(h) for h in hosts]
        self._waiting = {("host", h) for h in hosts} | {("restore", i) for i in range(len(self._runs))}
        for i, run in enumerate(self._runs):
            # (containers of this plan and later ones are made with the senders the placement names)
            not_made = frozenset(a.new_id for later in self._runs[i:] for a in later)
            out += [AcceptSenders(tuple(run), not_made), RestoreSlices(i, tuple(run))]
        return out

    def _host_made(self, e: HostMade) -> list[Command]:
        self._waiting.discard(("host", e.host))
        return self._rerouting_if_ready()

    def _restored(self, e: Restored) -> list[Command]:
        self._waiting.discard(("restore", e.plan_index))
        self._restores.update(e.restores)
        return self._rerouting_if_ready()

    def _rerouting_if_ready(self) -> list[Command]:
        if self.step is not RecoveryStep.ADOPTING or self._waiting:
            return []
        self._to(RecoveryStep.REROUTING)
        every = [a for run in self._runs for a in run]
        lost = {c: v for p in self.plans for c, v in p.lost.items()}
        adopted = frozenset(a.new_id for a in every)
        self._waiting = {("reroute", a.new_id) for a in every} | {("retarget",)}
        # Every plan's containers are made and started before any producer reroutes: a producer of
        # one plan's containers may be another plan's, and a reroute waits for its target.
        return ([AtStep("restored", lost, tuple(every)), StartContainers(tuple(every))]
                + [Reroute(a, self._restores[a.new_id]) for a in every]
                + [ReplayToConsumers(a, min(self._restores[a.new_id].resume.values(), default=0), adopted)
                   for a in every]
                + [AtStep("rerouted", lost, tuple(every)),
                   RetargetBackups(frozenset(a.stage_id for a in every))])

    def _rerouted(self, e: Rerouted) -> list[Command]:
        self._waiting.discard(("reroute", e.new_id))
        self._epochs[e.new_id] = e.epochs
        return self._finish_if_ready()

    def _retargeted(self, _e: Retargeted) -> list[Command]:
        self._waiting.discard(("retarget",))
        return self._finish_if_ready()

    def _finish_if_ready(self) -> list[Command]:
        if self.step is not RecoveryStep.REROUTING or self._waiting:
            return []
        self._to(RecoveryStep.DONE)
        plans, runs = tuple(self.plans), tuple(tuple(r) for r in self._runs)
        self.plans = []
        return [Finish(plans, runs, dict(self._epochs))]

    def _step_failed(self, e: StepFailed) -> list[Command]:
        """A host died during a step: declare it, plan for its containers, run every plan again."""
        self._to(RecoveryStep.DECLARING)
        self._waiting = set()
        return [DeclareDead(e.dead)]

    def _done_nothing(self) -> list[Command]:
        self._to(RecoveryStep.DONE)
        return [Finish((), (), {})]

    # -- invariants ------------------------------------------------------------

    def _check(self, out: list[Command]) -> None:
        """Invariants after every event (docs/design.md section 7d)."""
        for p in self.plans:
            # a plan adopts every lost slice exactly once
            got = sorted((a.replaces, a.stage_id, s) for a in p.plan for s in a.slices)
            want = sorted((c, st, s) for c, (st, sl) in p.lost.items() for s in sl)
            assert got == want, f"plan for {p.dead} adopts {got}, lost {want}"
            assert all(a.host is not None for a in p.plan), "an adoption without a host"
        # no host hears of a plan before it is saved, and none of a dead host
        for c in out:
            if isinstance(c, (AcceptSenders, RestoreSlices)):
                assert self._applied >= len(self.plans) or not self.plans, "a plan ran before it was saved"
                assert all(a.host not in self.gone for a in c.plan), "an adoption on a dead host ran"


_HANDLERS = {HostsDied: RecoveryProtocol._hosts_died, Declared: RecoveryProtocol._declared,
             Surveyed: RecoveryProtocol._surveyed, BackupsRead: RecoveryProtocol._backups_read,
             HostMade: RecoveryProtocol._host_made, Restored: RecoveryProtocol._restored,
             Rerouted: RecoveryProtocol._rerouted, Retargeted: RecoveryProtocol._retargeted,
             StepFailed: RecoveryProtocol._step_failed}
