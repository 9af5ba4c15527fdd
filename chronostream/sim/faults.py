"""Owns the simulator's faults: their kinds, a seeded schedule, and how each is injected and judged.

A fault fires once the job's sources have produced ``at_epoch`` epochs (so it
lands while the job runs, whatever the job's length), picks its target among
the candidates of that moment with its own seeded ``pick``, and is judged at
the end: it *landed* when it happened and did what its kind says (a dead host's
containers were rebuilt, a duplicate was refused, a delayed message arrived
late, a damaged backup was refused, a migration finished or was aborted by
the crash it was meant to meet). A fault that did not land fails its run: a
schedule that proves nothing must not pass.

Faults reach the job only through the in-process driver's hooks
(``master.local.Network``, ``LocalCluster.step_every``, ``run``'s
``on_round``, ``kill``, ``migrate``/``scale_out``/``scale_in``), never through
the cores.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from chronostream.master.local import Flight, LocalCluster, Network
from chronostream.master.migration import MigrationError, MigrationPhase
from chronostream.master.protocols.recovery import AtStep
from chronostream.master.recovery import RECOVERY_ROLES, RECOVERY_STEPS, restore_floor

#: Every kind of fault, and what landing means for it.
FAULT_KINDS: dict[str, str] = {
    "host_crash": "a host with containers dies; every one of them is rebuilt elsewhere",
    "crash_in_migration": "a host of a migrating slice dies while its transfer is in a chosen phase",
    "crash_in_recovery": "a host dies, then another with a chosen role while the recovery is at a chosen step; "
                         "the recovery plans for it too and every slice ends on a live container",
    "master_crash": "the master dies while a transfer is in a chosen phase or a recovery at a chosen step; the "
                    "new master, from its catalog alone, settles the migration or finishes the recovery",
    "damaged_backup": "a slice's backup copy is damaged or truncated, then its host dies; recovery refuses that copy",
    "duplicate": "a message arrives a second time, later; the receiver drops it",
    "delay": "messages are held back for rounds; they arrive late and out of order",
    "slow_host": "a host steps only every k-th round for a while, with work ready",
    "migrate": "slices move to another host; the transfer finishes",
    "scale_out": "a stage gets one more host; its transfers finish",
    "scale_in": "a stage loses one host; its transfers finish",
}

#: A source near the end of its input steps every this many rounds while a fault waits to fire
#: (prime to every slow host's period, 2-4: a slowed host downstream then meets work on rounds
#: it skips, whatever its distance from the sources).
THROTTLE = 7
#: A crash that missed its transfer's phase (another fault ended the transfer) tries again this often.
REARMS = 3
#: Phases a transfer passes through that a crash can meet (``MigrationPhase``).
CRASH_PHASES = (MigrationPhase.PREPARING, MigrationPhase.WARMING, MigrationPhase.REBUILDING,
                MigrationPhase.DUAL, MigrationPhase.RELEASING)
#: Where a master crash meets the job: a transfer's phase (the fault starts a migration) or a
#: recovery's step (the fault kills a host first).
MASTER_CRASH_POINTS = tuple(p.value for p in CRASH_PHASES) + RECOVERY_STEPS
#: Kinds that start a migration (the master runs one at a time), and kinds that kill a host.
MOVES = ("migrate", "scale_out", "scale_in", "crash_in_migration", "master_crash")
KILLS = ("host_crash", "damaged_backup", "crash_in_recovery")
#: Moves a schedule draws at most.
MOVES_MAX = 3


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: its kind, when it fires (sources' epochs), and its seeded choices."""

    kind: str
    at_epoch: int
    pick: int  # which candidate of the moment it hits (modulo their number)
    param: int = 0  # kind-specific: rounds held, slowdown factor, phase index, truncate or not

    def describe(self) -> str:
        """The fault in one line, e.g. ``host_crash@3 pick=7``."""
        return f"{self.kind}@{self.at_epoch} pick={self.pick} param={self.param}"


@dataclass
class Landing:
    """What became of one fault: fired (at which round, on what) and whether it landed."""

    fault: Fault
    fired_round: int | None = None
    target: str = ""
    landed: bool = False
    effect: str = "never fired"
    # Kind-specific record filled while the job runs.
    data: dict[str, Any] = field(default_factory=dict)


def random_schedule(rng: random.Random, num_epochs: int, n: int, kinds: list[str]) -> list[Fault]:
    """``n`` faults of ``kinds``, each firing at a random epoch in ``[1, num_epochs - 2]``, at
    most ``MOVES_MAX`` of them moves; a move (a migration, with or without a crash in it) or a kill (which may first need a move to
    widen the job: ``Injector._widen``) in the first two thirds: moves run one at a time and
    take several epochs each, so one late in the input may meet no epoch left.

    >>> [f.kind for f in random_schedule(random.Random(1), 40, 3, ["host_crash", "delay"])]
    ['delay', 'host_crash', 'host_crash']
    """
    last = max(1, num_epochs - 2)
    last_move = max(1, 2 * num_epochs // 3)
    out = []
    for _ in range(n):
        kind = rng.choice(kinds)
        others = [k for k in kinds if k not in MOVES]
        if kind in MOVES and sum(f.kind in MOVES for f in out) >= MOVES_MAX and others:
            kind = rng.choice(others)  # (moves queue one after another: a fourth meets no input left)
        param = {"delay": rng.randint(1, 4), "duplicate": rng.randint(1, 6), "slow_host": rng.randint(2, 4),
                 "crash_in_migration": rng.randrange(len(CRASH_PHASES) * 2),
                 "crash_in_recovery": rng.randrange(len(RECOVERY_STEPS) * len(RECOVERY_ROLES)),
                 "damaged_backup": rng.randint(0, 1)}.get(kind, 0)
        if kind == "master_crash":  # (drawn apart: a schedule without one draws what it always drew)
            param = rng.randrange(len(MASTER_CRASH_POINTS))
        at = rng.randint(1, last_move if kind in MOVES or kind in KILLS else last)
        out.append(Fault(kind, at, rng.randrange(1 << 30), param))
    return sorted(out, key=lambda f: f.at_epoch)


def _moving(cl: LocalCluster) -> set[tuple[int, int]]:
    """(source container, slice) of every transfer in progress."""
    return {(t.source, s) for t in cl.migrations
            if t.phase not in (MigrationPhase.DONE, MigrationPhase.ABORTED) for s in t.slices}


def _refresh(cl: LocalCluster, landing: Landing) -> None:
    """A fault's transfers as the master knows them now: a restarted master settles the ones
    its predecessor left as new objects (from its catalog)."""
    if "transfers" in landing.data:
        known = {(t.stage_id, t.source, t.new_id): t for t in cl.migrated + cl.migrations}  # (the newest wins)
        landing.data["transfers"] = [known.get((t.stage_id, t.source, t.new_id), t)
                                     for t in landing.data["transfers"]]


def _abort_reason(t: Any) -> str:
    """Why a transfer was aborted (its story's last ``reason``), or ``""``."""
    return next((info.get("reason", "") for _, phase, _, info in reversed(t.story) if phase == "aborted"), "")


class SimNetwork(Network):
    """The simulator's network: every round's arrivals shuffled by the seed, plus the delays and
    duplicates the faults ask for (``hold``, ``duplicate``), each tracked to its arrival."""

    def __init__(self) -> None:
        super().__init__()
        self.round = 0
        self.held: list[tuple[int, Flight, Landing]] = []  # (round it arrives, message, fault)
        self.to_hold: list[tuple[int, Landing]] = []  # (rounds, fault): the next messages sent are held
        self.to_copy: list[tuple[int, Landing]] = []  # (rounds later, fault): the next messages are copied
        self.tracked: dict[int, tuple[Landing, str]] = {}  # id(flight) -> (fault, "held" | "copy")

    def arrivals(self, rng: random.Random, in_flight: list[Flight]) -> tuple[list[Flight], list[Flight]]:
        held = {id(h) for _, h, _ in self.held}  # (by identity: a copy equals its original)
        fresh = [f for f in in_flight if id(f) not in held]
        for f in fresh:
            if f[3].end is not None and not f[3].parts:
                continue  # an end-of-input notice is sent once, outside the epochs' flow
            if self.to_hold:
                # (the fault that holds fewest so far first: two delays fired together both land soon)
                i = min(range(len(self.to_hold)), key=lambda j: self.to_hold[j][1].data.get("held", 0))
                rounds, landing = self.to_hold.pop(i)
                self.held.append((self.round + rounds, f, landing))
                self.tracked[id(f)] = (landing, "held")
                landing.data["held"] = landing.data.get("held", 0) + 1
            elif self.to_copy:
                i = min(range(len(self.to_copy)), key=lambda j: self.to_copy[j][1].data.get("copied", 0))
                rounds, landing = self.to_copy.pop(i)
                copy = (f[0], f[1], f[2], f[3])  # the same message, a second time
                self.held.append((self.round + rounds, copy, landing))
                self.tracked[id(copy)] = (landing, "copy")
                landing.data["copied"] = landing.data.get("copied", 0) + 1
        due = [f for r, f, _ in self.held if r <= self.round]
        self.held = [(r, f, fl) for r, f, fl in self.held if r > self.round]
        waiting = [f for _, f, _ in self.held]
        apart = {id(f) for f in waiting} | {id(f) for f in due}
        now = [f for f in in_flight if id(f) not in apart] + due
        rng.shuffle(now)
        self.round += 1
        # Held messages stay in flight (a dead sender's are dropped with the rest by ``kill``).
        return now, waiting

    def delivered(self, flight: Flight, accepted: bool | None) -> None:
        tracked = self.tracked.pop(id(flight), None)
        if tracked is None:
            return
        landing, how = tracked
        if accepted is None and landing.data.get("resent", 0) < 3:
            # (the receiver was gone: no one to hold it for or refuse it; the next message then)
            landing.data["resent"] = landing.data.get("resent", 0) + 1
            (self.to_hold if how == "held" else self.to_copy).append((1, landing))
            return
        if how == "held":
            landing.data["arrived_late"] = landing.data.get("arrived_late", 0) + 1
        elif accepted is False:
            landing.data["refused"] = landing.data.get("refused", 0) + 1
        elif accepted is True:
            landing.data["accepted_copy"] = landing.data.get("accepted_copy", 0) + 1


class Injector:
    """Fires a schedule's faults from ``LocalCluster.run``'s ``on_round`` and judges them at the end."""

    def __init__(self, schedule: list[Fault], network: SimNetwork, story: list[tuple[int, str, str]]) -> None:
        self.landings = [Landing(f) for f in schedule]
        self.network = network
        self.story = story
        self.slow: list[tuple[int, int, Landing]] = []  # (host, until round, fault)
        self.watch: list[Landing] = []  # crash_in_migration faults waiting for their phase
        self.holding: set[int] = set()  # source hosts slowed near the end of the input
        # (stage, slice, host) -> the damaged checkpoint: the copy counts as none while its chain
        # holds it (a full checkpoint replaces the chain)
        self.damaged: dict[tuple[int, int, int], bytes] = {}

    def __call__(self, cl: LocalCluster) -> None:
        if not cl.deployed:
            return  # (faults meet a running job: the Ray master rescales or recovers none before)
        # (a source feeding no stage sets no pace: its epochs send no message to copy or hold)
        sources = [c for c in cl.cores.values() if c.reader is not None and c.slices and c.destinations] or \
            [c for c in cl.cores.values() if c.reader is not None and c.slices]
        produced = min((c.next_epoch for c in sources), default=1 << 30)
        for landing in self.landings:
            if landing.fired_round is None and produced >= landing.fault.at_epoch:
                self._fire(cl, landing)
        for landing in list(self.watch):
            self._crash_when_in_phase(cl, landing)
        for host, until, landing in list(self.slow):
            landing.data["skipped"] = cl.skipped_steps.get(host, 0) - landing.data["skipped_before"]
            if host not in cl.alive or not any(cl.hosts[c] == host and not core.done for c, core in cl.cores.items()):
                cl.step_every.pop(host, None)
                self.slow.remove((host, until, landing))
                if not landing.data["skipped"]:  # the host died or finished first: slow another one
                    landing.fired_round = None
                    landing.data = {}
            elif cl.round >= until and landing.data["skipped"]:
                cl.step_every.pop(host, None)
                self.slow.remove((host, until, landing))
        self._hold_the_end(cl)

    def _hold_the_end(self, cl: LocalCluster) -> None:
        """Slow the sources while a fault is overdue (a move waits for the one in progress), a
        crash waits for its transfer's phase, or the input nears its end with a fault to fire:
        every scheduled fault then meets a running job, and whatever is in progress (a
        migration's phases) still advances. A fault that cannot fire before the input ends does
        not land."""
        unfired = [x for x in self.landings if x.fired_round is None]
        # A fault fired but not applied yet: messages still to hold or copy, a slowdown that has
        # not yet skipped a ready step.
        applying = bool(self.network.to_hold or self.network.to_copy) or any(
            x.fault.kind == "slow_host" and x.fired_round is not None and not x.data.get("skipped")
            for x in self.landings)
        near_end = (cl.plan.num_epochs or 1) - 3
        for cid, core in cl.cores.items():
            host = cl.hosts[cid]
            if core.reader is None or not core.slices:
                continue
            overdue = any(core.next_epoch > x.fault.at_epoch for x in unfired)
            if overdue or applying or self.watch or (unfired and core.next_epoch >= near_end):
                if host not in cl.step_every:
                    cl.step_every[host] = THROTTLE
                    self.holding.add(host)
            elif host in self.holding:
                cl.step_every.pop(host, None)
                self.holding.discard(host)

    def _say(self, cl: LocalCluster, landing: Landing, what: str) -> None:
        self.story.append((cl.round, "inject", f"{landing.fault.describe()}: {what}"))

    def _busy_hosts(self, cl: LocalCluster) -> list[int]:
        """Live hosts with a container that owns slices not moving away (a migration settled by
        the host's death would take them off it: nothing to rebuild) and has work left."""
        moving = _moving(cl)
        return sorted({cl.hosts[c] for c, core in cl.cores.items()
                       if cl.hosts[c] in cl.alive and c in cl.placement.stage_of and not core.done
                       and any((c, s) not in moving for s in cl.placement.slices_of(c))})

    def _survivable(self, cl: LocalCluster, host: int, damaged: tuple[int, int, int] | None = None) -> bool:
        """True when the job survives ``host``'s death by design: every slice of its containers
        was never checkpointed (it is rebuilt from the start) or has a usable copy on another live
        host: undamaged, and no older than where its producers' output logs now begin (a copy
        left off the slice's chain by a migration or recovery ages while GC trims the logs past
        it). A job whose last usable copy of a slice dies fails with ``BackupsLost`` as it
        should; the simulator checks what the runtime promises to survive."""
        if len(cl.alive) < 2:
            return False
        floor = restore_floor(cl.plan, cl.gc.marks) or {}
        # (the containers of a recovery's plan are placed before they exist: their slices count too)
        placed = {c for ids in cl.placement.containers.values() for c in ids}
        for c in sorted(set(cl.cores) | placed):
            # (and a recovery's lost containers, still placed on a dead host: their copies count too)
            if c not in cl.placement.stage_of or (cl.hosts.get(c) != host and cl.hosts.get(c) in cl.alive):
                continue
            st = cl.placement.stage_of[c]
            slices = cl.cores[c].slices if c in cl.cores else cl.placement.slices_of(c)
            for s in slices:
                if (st, s) in cl.checkpointed and not any(
                        h != host and h in cl.alive and cl.stores[h].epochs().get((st, s), -1) >= floor.get(st, -1)
                        and (st, s) in cl.stores[h].holds() and (st, s, h) != damaged
                        and not self._is_damaged(cl, st, s, h) for h in cl.stores):
                    return False
        return True

    def _is_damaged(self, cl: LocalCluster, stage: int, slice_id: int, host: int) -> bool:
        """True while the copy of a slice on ``host`` is one a fault damaged (no later full one)."""
        bad = self.damaged.get((stage, slice_id, host))
        return bad is not None and host in cl.stores and any(
            blob is bad for blob in cl.stores[host].chains.get((stage, slice_id), []))

    def _widen(self, cl: LocalCluster, landing: Landing, why: str) -> bool:
        """Give a stage one more host (a scale-out the story names), so a fault that needs more
        room (another copy, another host) can fire once it is done; one at a time. False when no
        stage can take one (every container holds one slice)."""
        stages = [st.stage_id for st in cl.plan.stages
                  if 0 < len([c for c in cl.placement.containers[st.stage_id] if c in cl.cores]) < st.num_slices]
        if landing.data.get("widened", 0) >= 3 or not stages:
            landing.data["no_room"] = True  # (judged inapplicable if it never fires)
        if cl.migrations or landing.data.get("widened", 0) >= 3 or not stages:
            return bool(stages)
        st = stages[landing.fault.pick % len(stages)]
        landing.data["widened"] = landing.data.get("widened", 0) + 1
        self._say(cl, landing, f"first scale out stage {st}: {why}")
        cl.scale_out(st)
        return True

    def _kill(self, cl: LocalCluster, landing: Landing, host: int, hook: Any = None) -> None:
        """Kill ``host``; record the containers whose recovery that started (``rebuilt`` is checked
        against them at the end). ``hook(cl, cmd, landing)``: at each step of that recovery."""
        before = sum(1 for e in cl.timeline if e[1] == "recovery_start")
        landing.data["killed"] = host
        landing.data["host_containers"] = sorted(c for c in cl.cores if cl.hosts[c] == host)
        if hook is not None:
            cl.recovery_hook = lambda cl_, cmd: hook(cl_, cmd, landing)
        try:
            cl.kill([host])
        finally:
            cl.recovery_hook = None
        started = [e for e in cl.timeline if e[1] == "recovery_start"][before:]
        landing.data["lost"] = sorted(e[2]["container"] for e in started)

    def _kill_in_recovery(self, cl: LocalCluster, cmd: AtStep, landing: Landing) -> None:
        """The recovery hook of a ``crash_in_recovery``: at its step, kill the lowest host with its
        role that the job survives (once)."""
        d = landing.data
        if cmd.step != d["step"] or "second" in d:
            return
        stages = {st for st, _ in cmd.lost.values()}
        if d["role"] == "adopter":
            hosts = {a.host for a in cmd.plan} if cmd.plan is not None else \
                {cl.hosts[c] for st in stages for c in cl.placement.containers[st]}
        else:
            near = cl.plan.upstream_stages if d["role"] == "producer" else cl.plan.downstream_stages
            hosts = {cl.hosts[c] for st in stages for n in near(st) for c in cl.placement.containers[n]}
        hosts = {h for h in hosts if h in cl.alive and self._survivable(cl, h)}
        if not hosts:  # (no host has the role now: any other the job survives, the step is the point)
            hosts = {h for h in cl.alive if self._survivable(cl, h)}
            if not hosts:
                return
            d["role"] = f"any host (no {d['role']} could die)"
        d["second"] = victim = min(hosts)
        d["second_round"] = cl.round
        self._say(cl, landing, f"kill host {victim} ({d['role']}) at recovery step {cmd.step}")
        cl.kill([victim])

    def _fire(self, cl: LocalCluster, landing: Landing) -> None:
        f = landing.fault
        kind = f.kind
        if kind == "host_crash":
            hosts = [h for h in self._busy_hosts(cl) if self._survivable(cl, h)]
            if not hosts:
                self._widen(cl, landing, "every busy host holds the only copy of some slice")
                return
            h = hosts[f.pick % len(hosts)]
            landing.target = f"host {h}"
            landing.fired_round = cl.round
            self._say(cl, landing, f"kill host {h}")
            self._kill(cl, landing, h)
        elif kind == "crash_in_recovery":
            hosts = [h for h in self._busy_hosts(cl) if self._survivable(cl, h)]
            if len(cl.alive) < 3 or not hosts:
                if not self._widen(cl, landing, "two hosts must be able to die"):
                    landing.fired_round = cl.round
                    landing.effect = "inapplicable: no stage can take another host for a second death"
                return
            h = hosts[f.pick % len(hosts)]
            step = RECOVERY_STEPS[f.param % len(RECOVERY_STEPS)]
            role = RECOVERY_ROLES[f.param // len(RECOVERY_STEPS)]
            landing.data.update(step=step, role=role)
            landing.target = f"host {h}, then a host ({role}) at recovery step {step}"
            landing.fired_round = cl.round
            self._say(cl, landing, f"kill host {h}; a {role} dies at recovery step {step}")
            self._kill(cl, landing, h, hook=self._kill_in_recovery)
        elif kind == "master_crash" and MASTER_CRASH_POINTS[f.param] in RECOVERY_STEPS:
            hosts = [h for h in self._busy_hosts(cl) if self._survivable(cl, h)]
            if not hosts:
                self._widen(cl, landing, "every busy host holds the only copy of some slice")
                return
            h = hosts[f.pick % len(hosts)]
            step = landing.data["point"] = MASTER_CRASH_POINTS[f.param]
            landing.target = f"host {h}, then the master at recovery step {step}"
            landing.fired_round = cl.round
            self._say(cl, landing, f"kill host {h}; the master dies at recovery step {step}")
            self._kill(cl, landing, h, hook=self._crash_master_at)
        elif kind == "damaged_backup":
            candidates = sorted({(st, sl) for h in sorted(cl.stores) if h in cl.alive
                                 for st, sl in cl.stores[h].holds()})
            held_by = {k: [h for h in sorted(cl.stores) if h in cl.alive and k in cl.stores[h].holds()
                           and not self._is_damaged(cl, *k, h)] for k in candidates}
            # A copy on a host other than the slice's own, with another live copy left to restore from.
            # (not a slice moving away: the victim's death would settle its move, nothing rebuilt)
            moving = _moving(cl)
            owner = {(cl.placement.stage_of[c], s): cl.hosts[c] for c in cl.cores if c in cl.placement.stage_of
                     for s in cl.placement.slices_of(c) if (c, s) not in moving}
            # Off the victim (the slice's host) two copies: one to damage, one to restore from.
            usable = [(k, [h for h in hs if h != owner[k]]) for k, hs in held_by.items()
                      if k in owner and len([h for h in hs if h != owner[k]]) >= 2]
            if not usable:
                self._widen(cl, landing, "no slice has two copies off its own host")
                return  # fires later, once some slice has two copies
            usable = [(k, hs) for k, hs in usable for h in [hs[(f.pick // 7) % len(hs)]]
                      if self._survivable(cl, owner[k], damaged=(k[0], k[1], h))]
            if not usable:
                self._widen(cl, landing, "no slice's host could die with a copy damaged")
                return
            (st, sl), holders = usable[f.pick % len(usable)]
            h = holders[(f.pick // 7) % len(holders)]
            cl.stores[h].corrupt(st, sl, truncate=bool(f.param))
            self.damaged[(st, sl, h)] = cl.stores[h].chains[(st, sl)][-1]
            victim = owner[(st, sl)]
            landing.data.update(stage=st, slice=sl, holder=h)
            landing.target = f"stage {st} slice {sl} copy on host {h}, then host {victim}"
            landing.fired_round = cl.round
            self._say(cl, landing, f"{'truncate' if f.param else 'damage'} the copy of {st}/{sl} on host {h}, "
                                   f"kill host {victim}")
            self._kill(cl, landing, victim)
        elif kind == "duplicate":
            landing.fired_round = cl.round
            landing.target = "the next messages sent"
            self.network.to_copy += [(1 + (f.pick + i) % 3, landing) for i in range(f.param or 1)]
            self._say(cl, landing, f"copy the next {f.param or 1} messages")
        elif kind == "delay":
            landing.fired_round = cl.round
            landing.target = "the next messages sent"
            self.network.to_hold += [(f.param, landing) for _ in range(1 + f.pick % 4)]
            self._say(cl, landing, f"hold the next {1 + f.pick % 4} messages for {f.param} rounds")
        elif kind == "slow_host":
            hosts = [h for h in self._busy_hosts(cl) if h not in {x for x, _, _ in self.slow}]
            if not hosts:
                return
            h = hosts[f.pick % len(hosts)]
            cl.step_every[h] = max(f.param, cl.step_every.get(h, 1))
            self.holding.discard(h)  # (a throttled source: this slowdown replaces the throttle)
            landing.data["skipped_before"] = cl.skipped_steps.get(h, 0)
            self.slow.append((h, cl.round + 6 * f.param, landing))
            landing.fired_round = cl.round
            landing.target = f"host {h}"
            self._say(cl, landing, f"host {h} steps every {f.param} rounds for {6 * f.param} rounds")
        elif kind in MOVES:
            self._start_move(cl, landing)

    def _start_move(self, cl: LocalCluster, landing: Landing) -> None:
        f = landing.fault
        if cl.migrations:
            return  # one move at a time, as the master runs them; fires later
        stages = [st.stage_id for st in cl.plan.stages if any(cl.placement.stage_of.get(c) == st.stage_id
                                                                 for c in cl.cores)]
        try:
            if f.kind == "scale_in":
                wide = [s for s in stages
                        if len({cl.hosts[c] for c in cl.placement.containers[s] if c in cl.cores}) >= 2]
                if not wide:
                    if not self._widen(cl, landing, "every stage runs on one host"):
                        landing.fired_round = cl.round
                        landing.effect = "inapplicable: every stage runs on one host and holds one slice"
                    return
                stages = wide
                st = stages[f.pick % len(stages)]
                transfers = cl.scale_in(st)
            elif f.kind == "scale_out":
                stages = [s for s in stages if len([c for c in cl.placement.containers[s] if c in cl.cores])
                          < cl.plan.stages[s].num_slices]
                if not stages:
                    landing.fired_round = cl.round
                    landing.effect = "inapplicable: every container holds one slice"
                    return
                st = stages[f.pick % len(stages)]
                transfers = cl.scale_out(st)
            else:
                st = stages[f.pick % len(stages)]
                owned = sorted(s for c in cl.placement.containers[st] if c in cl.cores for s in cl.cores[c].slices)
                if not owned:
                    return
                n = 1 + (f.pick // 3) % min(2, len(owned))
                start = (f.pick // 5) % len(owned)
                slices = [owned[(start + i) % len(owned)] for i in range(n)]
                transfers = cl.migrate(st, slices)
        except MigrationError as exc:
            landing.fired_round = cl.round
            landing.effect = f"refused: {exc}"
            return
        if not transfers:
            return
        landing.fired_round = cl.round
        landing.data["transfers"] = transfers
        landing.target = f"stage {st}: " + ", ".join(t.describe() for t in transfers)
        self._say(cl, landing, f"{f.kind} {landing.target}")
        if f.kind == "crash_in_migration":
            landing.data["phase"] = CRASH_PHASES[f.param % len(CRASH_PHASES)]
            landing.data["kill_source"] = f.param // len(CRASH_PHASES) == 0
        elif f.kind == "master_crash":
            landing.data["phase"] = MigrationPhase(MASTER_CRASH_POINTS[f.param])
            landing.data["point"] = landing.data["phase"].value
        if f.kind in ("crash_in_migration", "master_crash"):
            self.watch.append(landing)
            self._crash_when_in_phase(cl, landing)

    def _crash_master_at(self, cl: LocalCluster, cmd: AtStep, landing: Landing) -> None:
        """The recovery hook of a ``master_crash`` at a recovery step: the master dies there (once)."""
        d = landing.data
        if cmd.step != d["point"] or "crashed" in d:
            return
        d["crashed"] = cl.round
        d["restarts_before"] = cl.master_restarts
        d["resumed_before"] = cl.timeline.count("recovery_resumed")
        self._say(cl, landing, f"the master dies at recovery step {cmd.step}")
        cl.crash_master()

    def _crash_when_in_phase(self, cl: LocalCluster, landing: Landing) -> None:
        phase = landing.data["phase"]
        _refresh(cl, landing)
        for t in landing.data["transfers"]:
            if t.phase is phase and landing.fault.kind == "master_crash":
                landing.data["crashed"] = cl.round
                landing.data["restarts_before"] = cl.master_restarts
                landing.data["resumed_before"] = cl.timeline.count("migration_resumed")
                self.watch.remove(landing)
                self._say(cl, landing, f"the master dies while {t.describe()} is {phase.value}")
                cl.crash_master()
                return
            if t.phase is phase:
                ends = [cl.hosts.get(t.source), cl.hosts.get(t.new_id)]
                if not landing.data["kill_source"]:
                    ends.reverse()
                # (an end whose death would take a slice's last copy waits: the phase may come again)
                host = next((h for h in ends if h is not None and h in cl.alive and self._survivable(cl, h)), None)
                if host is None:
                    continue
                landing.data["killed_in"] = phase
                self.watch.remove(landing)
                self._say(cl, landing, f"kill host {host} while {t.describe()} is {phase.value}")
                self._kill(cl, landing, host)
                return
        if all(t.phase in (MigrationPhase.DONE, MigrationPhase.ABORTED) for t in landing.data["transfers"]):
            # The transfers ended before the phase (another fault's crash aborted them, or the
            # phase passed within one round): start another move later, a few times at most.
            self.watch.remove(landing)
            rearms = landing.data.get("rearms", 0)
            if rearms < REARMS:
                self._say(cl, landing, f"missed phase {phase.value} ({[t.phase.value for t in landing.data['transfers']]}); again later")
                landing.fired_round = None
                landing.data = {"rearms": rearms + 1}

    def judge(self, cl: LocalCluster) -> list[Landing]:
        """Decide, for every fault, whether it landed and what it did."""
        ended = {e[2].get("container") for e in cl.timeline if e[1] == "recovery_end"}
        rejected = [(e[2].get("stage"), e[2].get("slice"), e[2].get("host"))
                    for e in cl.timeline if e[1] == "backup_rejected"]
        for landing in self.landings:
            k, d = landing.fault.kind, landing.data
            _refresh(cl, landing)
            if landing.fired_round is None:
                landing.effect = "never fired: no candidate while the job ran"
                if (k in KILLS or k == "master_crash") and d.get("no_room"):
                    # Earlier deaths left no host the job survives losing, and no stage can take
                    # another: the runtime promises nothing here.
                    landing.effect = "inapplicable: no host the job survives losing was left, and no room to add one"
                elif (k in KILLS or k == "master_crash") and d.get("widened"):
                    landing.effect = (f"inapplicable: no host the job survives losing was left, and the input "
                                      f"ended while stages were widened for one ({d['widened']} scale-outs)")
                continue
            if landing.effect.startswith(("refused", "inapplicable")):
                continue
            if k in ("host_crash", "damaged_backup") or (k == "crash_in_migration" and "killed" in d):
                lost = d.get("lost", [])
                rebuilt = [c for c in lost if c in ended]
                # A host crash must cost the job a container to rebuild; a crash in a migration
                # may meet a host whose containers had just let go of their slices.
                landing.landed = len(rebuilt) == len(lost) and (bool(lost) or k == "crash_in_migration")
                landing.effect = (f"host {d['killed']} died with containers {d['host_containers']}; "
                                  f"recovery rebuilt {rebuilt} of {lost}")
                if k == "damaged_backup":
                    refused = (d["stage"], d["slice"], d["holder"]) in rejected
                    landing.landed = landing.landed and refused
                    landing.effect += "; the damaged copy was " + ("refused" if refused else "NOT refused")
                if k == "crash_in_migration":
                    phases = [t.phase.value for t in d["transfers"]]
                    landing.effect += f" in phase {d['killed_in'].value}; transfers ended {phases}"
                    landing.landed = landing.landed and all(
                        t.phase in (MigrationPhase.DONE, MigrationPhase.ABORTED) for t in d["transfers"])
            elif k == "crash_in_recovery":
                if "second" not in d:
                    landing.effect = (f"inapplicable: no host of role {d['role']} could die at recovery step "
                                      f"{d['step']}")
                    continue
                failed = [e for e in cl.timeline if e[1] == "recovery_step_failed" and d["second"] in e[2]["hosts"]]
                unplaced = sorted((st, s) for st, c_of in cl.placement.slice_to_container.items()
                                  for s, c in enumerate(c_of.tolist()) if int(c) not in cl.cores)
                landing.landed = bool(failed) and not unplaced
                landing.effect = (f"host {d['killed']} died; host {d['second']} ({d['role']}) died at recovery "
                                  f"step {d['step']}; the step failed and was planned for: {bool(failed)}; "
                                  f"slices on no live container: {unplaced[:5]}")
            elif k == "master_crash":
                self._judge_master_crash(cl, landing)
            elif k == "crash_in_migration":
                landing.effect = (f"the transfers ended {[t.phase.value for t in d['transfers']]} before "
                                  f"phase {d['phase'].value}")
            elif k in ("migrate", "scale_out", "scale_in"):
                # Done, or aborted because a host died mid-way (what the protocol does then).
                ends = [(t.phase, _abort_reason(t)) for t in d["transfers"]]
                landing.landed = all(p is MigrationPhase.DONE or (p is MigrationPhase.ABORTED and "died" in why)
                                     for p, why in ends)
                landing.effect = "transfers ended " + ", ".join(p.value + (f" ({why})" if why else "")
                                                                for p, why in ends)
            elif k in ("duplicate", "delay") and not d.get("copied" if k == "duplicate" else "held", 0):
                # (fired after the last message of the job was sent: the rest of the run only
                # processes what arrived and writes to sinks)
                landing.effect = "inapplicable: no message was sent after it fired"
            elif k == "duplicate":
                landing.landed = d.get("refused", 0) >= 1 and not d.get("accepted_copy", 0)
                landing.effect = (f"{d.get('copied', 0)} copies sent, {d.get('refused', 0)} refused, "
                                  f"{d.get('accepted_copy', 0)} accepted")
            elif k == "delay":
                landing.landed = d.get("arrived_late", 0) >= 1
                landing.effect = f"{d.get('held', 0)} messages held, {d.get('arrived_late', 0)} arrived late"
            elif k == "slow_host":
                landing.landed = d.get("skipped", 0) >= 1
                landing.effect = f"{d.get('skipped', 0)} rounds skipped with work ready"
        return self.landings

    def _judge_master_crash(self, cl: LocalCluster, landing: Landing) -> None:
        """Landed: the master died at its point and a new one started from the catalog; a
        migration it left ended (done or undone), a recovery it left rebuilt every lost container,
        and every slice is on a live container."""
        d = landing.data
        if "crashed" not in d:
            where = f"phase {d['phase'].value}" if "phase" in d else f"recovery step {d.get('point')}"
            landing.effect = f"the master never met {where}"
            if "transfers" in d:
                landing.effect += f": the transfers ended {[t.phase.value for t in d['transfers']]} first"
            return
        restarted = cl.master_restarts > d["restarts_before"]
        unplaced = sorted((st, s) for st, c_of in cl.placement.slice_to_container.items()
                          for s, c in enumerate(c_of.tolist()) if int(c) not in cl.cores)
        if "transfers" in d:
            phases = [t.phase.value for t in d["transfers"]]
            # (this restart resumed it: a resumption counted after the crash)
            resumed = cl.timeline.count("migration_resumed") > d["resumed_before"]
            settled = resumed and all(p in ("done", "aborted") for p in phases)
            landing.landed = restarted and settled and not unplaced
            landing.effect = (f"the master died in phase {d['phase'].value}; restarted: {restarted}; the new "
                              f"master settled the transfers: {phases}")
        else:
            ended = {e[2].get("container") for e in cl.timeline if e[1] == "recovery_end"}
            lost = d.get("lost", [])
            rebuilt = sorted({c for c in lost if c in ended})
            resumed = cl.timeline.count("recovery_resumed") > d["resumed_before"]
            landing.landed = (restarted and resumed and bool(lost)
                              and len(rebuilt) == len(set(lost)) and not unplaced)
            landing.effect = (f"host {d['killed']} died, the master at recovery step {d['point']}; restarted: "
                              f"{restarted}; the new master rebuilt {rebuilt} of {sorted(set(lost))}")
        landing.effect += f"; slices on no live container: {unplaced[:5]}"
