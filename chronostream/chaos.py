"""Failure injection against a running job, and the check that its output is still exact.

Owns: the user-facing fault schedule (``Fault``), applying it to a running
``Job`` (``inject``), seeded random campaigns (``random_faults``), the
merged timeline (fault, detection, recovery start/end per slice, first
output after recovery), the judgement of whether each fault landed
(``judge_landing``: it did what its kind says) and ``run_with_faults``,
which runs a query with a schedule, hands back every sink's rows and
compares each with the serial executor row for row.
Talks to the job only through its master and its hosts' failure-injection
calls; never touches the runtime's internals.

>>> Fault("kill", at_epoch=5, stage="count").describe()
"kill a container of stage 'count' at epoch 5"
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import ray
from chronostream.client import run
from chronostream.master.job_state import JobState
from chronostream.master.recovery import RECOVERY_ROLES, RECOVERY_STEPS

#: Kinds the schedule waits on: a recovery, the master's restart, or a rescaling's call.
SETTLING_KINDS = ("kill", "kill_two", "kill_master", "kill_master_in_recovery", "kill_in_recovery", "scale_out",
                  "scale_in", "migrate", "compact")
KINDS = ("kill", "kill_two", "kill_master", "kill_master_in_recovery", "kill_in_recovery", "kill_spare", "delay",
         "corrupt_backup", "truncate_backup", "scale_out", "scale_in", "migrate", "compact")


#: ``Fault.parse``'s options: the fields a fault takes besides kind, epoch and stage.
_FAULT_OPTIONS: dict[str, Any] = {"index": int, "seconds": float, "n": int, "step": str, "role": str}


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` applied once the job has passed ``at_epoch`` (every container).

    Kinds: ``kill`` (one container's host dies: ``ray.kill``), ``kill_two``
    (two hosts of the stage at once), ``kill_master`` (the job master's
    process dies; Ray restarts it and it resumes from its catalog),
    ``kill_master_in_recovery`` (a ``kill``, and the master's process dies
    at recovery step ``step`` of it, one of ``master.recovery.RECOVERY_STEPS``:
    the restarted master finishes that recovery from its catalog),
    ``kill_in_recovery`` (a ``kill``, and at recovery step ``step`` the
    master kills a second host with ``role`` in that recovery, one of
    ``master.recovery.RECOVERY_ROLES``: a host adopting lost slices, a
    producer told to reroute, a consumer told of new senders; the plan goes
    on without it and its own recovery follows), ``kill_spare`` (the next
    warm spare host the master takes from the pool, ``master.host_pool``,
    for a scale-out's or a recovery's new host, dies before the master
    adopts it, as when its process or node dies between the pool's lease
    and the adoption: the master starts that host itself), ``delay`` (the host spends
    ``seconds`` more per epoch from then on), ``corrupt_backup`` /
    ``truncate_backup`` (one backup replica of the stage's slices held by a
    peer is damaged; a ``kill`` of the same stage and ``index`` at the same
    epoch kills the slice's owner, whose recovery must reject the damaged
    copy and use the other replica: without it the damage does not land).
    ``stage`` picks the stage (any stateful one when None); ``index`` which
    of its containers (by sorted id).
    Not faults but scheduled the same way: ``scale_out`` / ``scale_in``
    (``n`` hosts), ``migrate`` (the first slice of container ``index``
    to a new host) and ``compact`` (``Job.compact``), so a campaign can mix
    rescaling with failures.
    """

    kind: str
    at_epoch: int
    stage: str | None = None
    index: int = 0
    seconds: float = 0.0
    n: int = 1
    step: str = "restored"
    role: str = "adopter"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; kinds: {KINDS}")
        if self.kind in ("kill_master_in_recovery", "kill_in_recovery"):

            if self.step not in RECOVERY_STEPS:
                raise ValueError(f"unknown recovery step {self.step!r}; steps: {RECOVERY_STEPS}")
            if self.role not in RECOVERY_ROLES:
                raise ValueError(f"unknown role {self.role!r}; roles: {RECOVERY_ROLES}")

    @classmethod
    def parse(cls, spec: str) -> "Fault":
        """A fault written ``KIND@EPOCH[:STAGE][,NAME=VALUE...]`` (the ``chronostream chaos
        --fault`` option), NAME one of ``index``, ``seconds``, ``n``, ``step``, ``role``.

        >>> Fault.parse("kill_in_recovery@12:running_sum,step=planned,role=producer")
        Fault(kind='kill_in_recovery', at_epoch=12, stage='running_sum', index=0, seconds=0.0, n=1, step='planned', role='producer')
        >>> Fault.parse("scale_out@20:stats,n=2").describe()
        "add 2 host(s) of stage 'stats' at epoch 20"
        >>> Fault.parse("kill_master@10").kind
        'kill_master'
        """
        head, *options = spec.split(",")
        kind_epoch, _, stage = head.partition(":")
        kind, _, epoch = kind_epoch.partition("@")
        if not kind or not epoch.isdigit():
            raise ValueError(f"a fault is KIND@EPOCH[:STAGE][,NAME=VALUE...] (e.g. kill@10:count or "
                             f"scale_out@20:count,n=2), got {spec!r}")
        values: dict[str, Any] = {}
        for option in options:
            name, eq, value = option.partition("=")
            convert = _FAULT_OPTIONS.get(name)
            if convert is None or not eq:
                raise ValueError(f"fault {spec!r}: {option!r} is not NAME=VALUE with NAME one of "
                                 f"{sorted(_FAULT_OPTIONS)}")
            try:
                values[name] = convert(value)
            except ValueError:
                raise ValueError(f"fault {spec!r}: {name} must be {convert.__name__}, got {value!r}") from None
        return cls(kind, int(epoch), stage or None, **values)

    def describe(self) -> str:
        """``kill a container of stage 'count' at epoch 5``."""
        if self.kind == "kill_master":
            return f"kill the job master at epoch {self.at_epoch}"
        if self.kind == "kill_spare":
            return f"kill the next warm spare the master takes, before its adoption (armed at epoch {self.at_epoch})"
        what = {"kill": "kill a container", "kill_master_in_recovery": "kill the job master at recovery step "
                f"{self.step!r} after killing a container", "kill_in_recovery": f"kill a host ({self.role}) at "
                f"recovery step {self.step!r} after killing a container", "kill_two": "kill two containers", "delay": f"delay a container by "
                f"{self.seconds}s per epoch", "corrupt_backup": "corrupt a backup", "truncate_backup":
                "truncate a backup", "scale_out": f"add {self.n} host(s)", "scale_in": f"remove {self.n} host(s)",
                "migrate": "migrate a slice", "compact": "merge the containers on each host"}[self.kind]
        return f"{what} of stage {self.stage!r} at epoch {self.at_epoch}"


@dataclass(frozen=True)
class Landing:
    """Whether one scheduled fault landed: it was applied and did what its kind says (``judge_landing``)."""

    fault: Fault
    landed: bool
    did: str  # what it did, or why it did not land

    def describe(self) -> str:
        return f"{'landed' if self.landed else 'NOT LANDED'}: {self.fault.describe()}: {self.did}"


@dataclass
class ChaosReport:
    """What ``run_with_faults`` saw: the faults scheduled and applied, the timeline, each sink's
    output, and the comparison with the serial executor."""

    applied: list[tuple[float, Fault, dict[str, Any]]] = field(default_factory=list)
    timeline: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)
    mismatches: dict[str, str] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)  # the schedule, in the order it is applied
    outputs: dict[str, pa.Table] = field(default_factory=dict)  # sink name -> its rows

    @property
    def ok(self) -> bool:
        """True when every sink equals the serial executor's."""
        return not self.mismatches

    def landings(self) -> list[Landing]:
        """Every scheduled fault, judged on the timeline: applied faults by ``judge_landing``, the
        rest not landed (the job ended before the schedule reached them)."""
        out = [judge_landing(f, at, hit, self.timeline) for at, f, hit in self.applied]
        return out + [Landing(f, False, "never applied: the job ended before its epoch")
                      for f in self.faults[len(self.applied):]]

    def not_landed(self) -> list[Landing]:
        """The scheduled faults that did not land."""
        return [x for x in self.landings() if not x.landed]

    def format_landings(self) -> str:
        """One line a scheduled fault: landed or not, and what it did."""
        return "\n".join(x.describe() for x in self.landings()) or "(no faults)"

    def format_timeline(self) -> str:
        """The timeline as text, times relative to the first event."""
        if not self.timeline:
            return "(no events)"
        t0 = self.timeline[0][0]
        lines = []
        for t, kind, info in self.timeline:
            details = ", ".join(f"{k}={v}" for k, v in info.items())
            lines.append(f"{t - t0:8.3f}s  {kind:<18} {details}")
        return "\n".join(lines)


Event = tuple[float, str, dict[str, Any]]


def _recovery_of(container: int, timeline: list[Event]) -> tuple[float, dict[str, Any]] | None:
    """The ``recovery_end`` that re-hosted ``container``'s slices (container ids are never reused)."""
    return next(((t, i) for t, k, i in timeline
                 if k == "recovery_end" and container in {int(c) for c in i.get("containers", [])}), None)


def _after(kind: str, at: float, timeline: list[Event]) -> tuple[float, dict[str, Any]] | None:
    return next(((t, i) for t, k, i in timeline if k == kind and t >= at), None)


def _judge_kill(containers: list[int], timeline: list[Event]) -> tuple[bool, str]:
    done = []
    for c in containers:
        rec = _recovery_of(c, timeline)
        if rec is None:
            return False, f"no recovery re-hosted container {c}'s slices"
        done.append(f"container {c} died and was recovered as {rec[1].get('new')}")
    return True, "; ".join(done)


def _judge_damage(hit: dict[str, Any], at: float, timeline: list[Event]) -> tuple[bool, str]:
    """A damaged backup landed when its holder had the copy and a later restore of that slice
    rejected the copy and restored another replica."""
    holder, st, sl = hit.get("holder_host"), hit.get("stage_id"), hit.get("slice")
    if holder is None:
        return False, f"no holder of slice {sl} had a backup of it (chain {hit.get('chain')}): nothing was damaged"
    restores = [i for t, k, i in timeline if k == "slices_restored" and t >= at and i.get("stage") == st
                and sl in i.get("slices", [])]
    if not restores:
        return False, f"slice {sl}'s copy on host {holder} was damaged, and no restore of the slice followed"
    rejected = any(k == "backup_rejected" and t >= at and i.get("stage") == st and i.get("slice") == sl
                   and i.get("host") == holder for t, k, i in timeline)
    if not rejected:
        return False, f"slice {sl}'s copy on host {holder} was damaged, and no restore rejected it"
    for i in restores:
        used = dict(zip(i["slices"], i.get("restored_from") or []))
        if used.get(sl) is not None and used[sl] != holder:
            return True, (f"slice {sl}'s copy on host {holder} was damaged, rejected, and the replica on host "
                          f"{used[sl]} restored")
    used = [dict(zip(i["slices"], i.get("restored_from") or [])).get(sl) for i in restores]
    return False, f"slice {sl}'s copy on host {holder} was damaged; its restores used {used}, not another replica"


def judge_landing(fault: Fault, at: float, hit: dict[str, Any], timeline: list[Event]) -> Landing:
    """Whether ``fault``, applied at wall time ``at`` with ``hit`` (``inject``'s answer), did what its
    kind says, from the job's ``timeline``.

    - ``kill``: the container died and a recovery re-hosted its slices (``recovery_end``);
      ``kill_two``: both; ``kill_master_in_recovery``: that, and the master died in the recovery
      and restarted; ``kill_in_recovery``: that, and a second host was killed in the recovery and
      a recovery of that host followed.
    - ``kill_master``: the master restarted. ``kill_spare``: a spare was killed before its adoption.
    - ``migrate``: the slice moved to a new container; ``scale_out`` / ``scale_in`` /
      ``compact``: slices moved.
    - ``corrupt_backup`` / ``truncate_backup``: the damaged holder had the copy, and a later restore
      of the slice rejected it and restored another replica.
    - ``delay``: the host took the delay.
    """
    k = fault.kind
    ok, did = False, "no check"
    if k in ("kill", "kill_master_in_recovery", "kill_in_recovery"):
        ok, did = _judge_kill([hit["container"]], timeline)
        if ok and k == "kill_master_in_recovery":
            crash, restart = _after("master_crash_injected", at, timeline), _after("master_restarted", at, timeline)
            if crash is None or restart is None:
                ok, did = False, did + f"; but the master did not die at recovery step {fault.step!r} and restart"
            else:
                did += f"; the master died at step {crash[1].get('step')!r} and restarted"
        if ok and k == "kill_in_recovery":
            second = _after("host_kill_injected", at, timeline)
            if second is None:
                skipped = _after("host_kill_skipped", at, timeline)
                ok, did = False, did + "; but no second host was killed in the recovery" + \
                    (f" ({skipped[1].get('why')})" if skipped else "")
            else:
                h = second[1]["host"]
                planned = next((t for t, kind, i in timeline if kind == "recovery_planning" and t >= second[0]
                                and h in i.get("hosts", [])), None)
                if planned is None or _after("recovery_end", planned, timeline) is None:
                    ok, did = False, did + f"; host {h} ({second[1].get('role')}) was killed, and no recovery " \
                        "of it followed"
                else:
                    did += f"; host {h} ({second[1].get('role')}) was killed at step {fault.step!r} and recovered"
    elif k == "kill_two":
        ok, did = _judge_kill(list(hit["containers"]), timeline)
    elif k == "kill_master":
        restart = _after("master_restarted", at, timeline)
        ok, did = restart is not None, "the master died and restarted" if restart else "the master never restarted"
    elif k == "kill_spare":
        killed = _after("spare_kill_injected", at, timeline)
        ok = killed is not None
        did = (f"spare {killed[1].get('spare')} died before its adoption as host {killed[1].get('host')}" if killed
               else "the master took no spare afterwards: no spare was killed")
    elif k == "migrate":
        ok = hit.get("slice") in hit.get("moved", [])
        did = (f"slice {hit.get('slice')} moved off container {hit.get('container')}" if ok
               else f"slice {hit.get('slice')} did not move (moved: {hit.get('moved')})")
    elif k in ("scale_out", "scale_in", "compact"):
        ok = bool(hit.get("moved"))
        did = f"moved slices {hit.get('moved')}" if ok else "moved no slice"
    elif k in ("corrupt_backup", "truncate_backup"):
        ok, did = _judge_damage(hit, at, timeline)
    elif k == "delay":
        ok = hit.get("seconds") == fault.seconds
        did = f"container {hit.get('container')}'s host takes {hit.get('seconds')} s more an epoch"
    return Landing(fault, ok, did)


def _stateful_stages(job: Any) -> list[str]:
    return [s.name for s in job.plan.stages if s.kind == "operator"]


def _containers_of(job: Any, stage: str) -> list[int]:
    return job.placement().containers_of(stage)


def inject(job: Any, fault: Fault) -> dict[str, Any]:
    """Apply one fault now; return what was hit (container, host, slices)."""

    if fault.kind == "kill_master":
        ray.kill(job.master, no_restart=False)
        return {"master": True}
    if fault.kind == "kill_spare":
        ray.get(job.master.kill_next_spare.remote())
        return {"armed": True}
    stage = fault.stage or _stateful_stages(job)[0]
    if fault.kind in ("scale_out", "scale_in", "compact"):
        done = job.compact(stage) if fault.kind == "compact" else \
            (job.scale_out if fault.kind == "scale_out" else job.scale_in)(stage, fault.n)
        return {"stage": stage, "moved": _moved(done), "seconds": done.get("seconds")}
    ids = _containers_of(job, stage)
    handles = ray.get(job.master.container_handles.remote())
    hosts = job.placement().hosts
    victim = ids[fault.index % len(ids)]
    if fault.kind in ("kill", "kill_master_in_recovery", "kill_in_recovery"):
        if fault.kind == "kill_master_in_recovery":
            ray.get(job.master.crash_in_recovery.remote(fault.step))
        if fault.kind == "kill_in_recovery":
            ray.get(job.master.kill_in_recovery.remote(fault.step, fault.role))
        ray.kill(handles[victim], no_restart=True)
        return {"stage": stage, "container": victim, "host": hosts[victim]}
    if fault.kind == "kill_two":
        if len(ids) < 2:
            raise ValueError(f"stage {stage!r} has {len(ids)} container(s); kill_two needs 2")
        second = ids[(fault.index + 1) % len(ids)]
        for c in (victim, second):
            ray.kill(handles[c], no_restart=True)
        return {"stage": stage, "containers": [victim, second], "hosts": [hosts[victim], hosts[second]]}
    if fault.kind == "delay":
        ray.get(handles[victim].inject_delay.remote(fault.seconds))
        return {"stage": stage, "container": victim, "seconds": fault.seconds}
    if fault.kind == "migrate":
        slice_ = job.placement().stages[stage][victim][0]
        done = job.migrate(stage, slice_)
        return {"stage": stage, "slice": slice_, "container": victim, "moved": _moved(done),
                "seconds": done.get("seconds")}
    # corrupt/truncate: damage the replica of the victim's first slice that a
    # recovery would try first (the first holder in its backup chain).
    sid = job.plan.stage(stage).stage_id
    slice_ = job.placement().stages[stage][victim][0]
    chain = ray.get(job.master.backup_plan.remote())[sid][slice_]
    host_handles = ray.get(job.master.host_handles.remote())
    hit = {"stage": stage, "stage_id": sid, "slice": slice_, "container": victim, "host": hosts[victim]}
    for h in chain:
        if ray.get(host_handles[h].corrupt_backup.remote(sid, slice_, fault.kind == "truncate_backup")):
            return {**hit, "holder_host": h}
    return {**hit, "holder_host": None, "chain": list(chain)}  # (no holder had the backup: nothing damaged)


def _moved(done: dict[str, Any]) -> list[int]:
    """The slices a rescaling's transfers moved to their new containers (phase ``done``)."""
    return sorted(s for t in done.get("transfers", []) if t.get("phase", "done") == "done" for s in t["slices"])


#: Kills a kind costs against a stage's cap (a kill in a recovery may take a second host of the
#: stage; a damaged backup is followed by a kill of the slice's host, which reads it).
_KILL_COST = {"kill": 1, "kill_master_in_recovery": 1, "kill_two": 2, "kill_in_recovery": 2, "corrupt_backup": 1,
              "truncate_backup": 1}
#: Hosts a kind adds to its stage (a kill takes its cost; ``kill_spare`` comes with a scale-out).
_HOSTS_ADDED = {"scale_out": 1, "migrate": 1, "scale_in": -1, "kill_spare": 1}


def random_faults(seed: int, n: int, stages: list[str], max_epoch: int, containers: int = 3,
                  kinds: tuple[str, ...] = ("kill",), min_gap: int = 4,
                  roles: dict[str, tuple[str, ...]] | None = None, backups_from: int = 1) -> list[Fault]:
    """A seeded random schedule of ``n`` faults at epochs in [1, max_epoch), at least ``min_gap`` apart.

    Kills are capped so every stage keeps 2 containers (``containers`` per
    stage at the start): with backup factor 2 a copy of each slice then
    survives. A ``scale_in`` must leave a stage on 2 hosts or more (counted
    from ``containers``: a scale-out or a migration to a new host adds one,
    a kill or a scale-in takes one; the master refuses to remove a stage's
    last host). A ``compact`` needs a host with two containers of the stage
    to merge: a kill (its recovery adopts slices onto the stage's other
    hosts) or a scale-in since the stage's last compaction, scale-out or
    migration (either may move the adopted slices away). ``roles``
    (stage -> the ``master.recovery.RECOVERY_ROLES`` it has: a stage with
    no stage downstream has no consumer) limits the roles a
    ``kill_in_recovery`` draws, so the second host it kills exists. A
    damaged backup needs a backup to damage: it is drawn at epochs from
    ``backups_from`` on (when the job's first checkpoints have reached
    their holders). A kind
    drawn that does not fit is drawn again among the ``kinds`` that do;
    when none fits, ``ValueError`` says so: the schedule returned is the
    one asked for, never a fault turned into another kind.

    Faults whose effect only shows with a second one come with it, at the
    same epoch, so that each can land: a damaged backup (``corrupt_backup``,
    ``truncate_backup``) with a ``kill`` of the same container (its
    recovery reads the damaged copy and must use the other replica), and
    ``kill_spare`` with a ``scale_out`` of the stage (it takes a spare).
    The schedule then holds more than ``n`` faults.

    >>> [(f.kind, f.at_epoch) for f in random_faults(0, 3, ["count"], 40, 5, ("kill", "corrupt_backup"))]
    [('corrupt_backup', 1), ('kill', 1), ('kill', 13), ('corrupt_backup', 38), ('kill', 38)]
    """
    rng = random.Random(seed)
    epochs: list[int] = []
    candidates = list(range(1, max(2, max_epoch)))
    rng.shuffle(candidates)
    for e in candidates:
        if len(epochs) == n:
            break
        if all(abs(e - x) >= min_gap for x in epochs):
            epochs.append(e)
    kills: dict[str, int] = {}
    hosts = {st: containers for st in stages}
    mergeable: set[str] = set()  # stages with a host holding two of their containers

    def fits(stage: str, kind: str, epoch: int) -> bool:
        if kind in ("corrupt_backup", "truncate_backup") and epoch < backups_from:
            return False
        cost = _KILL_COST.get(kind, 0)
        if cost and kills.get(stage, 0) + cost > containers - 2:
            return False
        if kind == "compact" and stage not in mergeable:
            return False
        return not (kind == "scale_in" and hosts[stage] - 1 < 2)

    faults = []
    for e in sorted(epochs):
        stage, kind = rng.choice(stages), rng.choice(kinds)
        if not fits(stage, kind, e):
            allowed = [k for k in kinds if fits(stage, k, e)]
            if not allowed:
                raise ValueError(
                    f"fault {len(faults) + 1} at epoch {e} on stage {stage!r}: none of {sorted(set(kinds))} fits "
                    f"(kills so far {kills.get(stage, 0)}, at most {containers - 2} a stage of {containers} "
                    f"hosts; {hosts[stage]} hosts now; backups to damage from epoch {backups_from}); ask for "
                    "fewer faults, more containers or other kinds")
            kind = rng.choice(allowed)
        cost = _KILL_COST.get(kind, 0)
        kills[stage] = kills.get(stage, 0) + cost
        hosts[stage] += _HOSTS_ADDED.get(kind, -cost)
        if cost or kind == "scale_in":
            mergeable.add(stage)
        if kind in ("compact", "scale_out", "migrate"):
            # (a scale-out or a migration may move the adopted slices off the host that held two
            # containers: only a later kill or scale-in surely makes one again)
            mergeable.discard(stage)
        index = rng.randrange(containers)
        if kind == "kill_master_in_recovery":  # (drawn only for this kind: other schedules stay as they were)

            faults.append(Fault(kind, e, stage, index, step=rng.choice(RECOVERY_STEPS)))
            continue
        if kind == "kill_in_recovery":  # (drawn only for this kind, as above)

            faults.append(Fault(kind, e, stage, index, step=rng.choice(RECOVERY_STEPS),
                                role=rng.choice((roles or {}).get(stage, RECOVERY_ROLES))))
            continue
        faults.append(Fault(kind, e, stage, index, 0.01 if kind == "delay" else 0.0))
        if kind in ("corrupt_backup", "truncate_backup"):
            faults.append(Fault("kill", e, stage, index))
        if kind == "kill_spare":
            faults.append(Fault("scale_out", e, stage, index))
    return faults


def _slow_sources(job: Any, pace_s: float) -> list[tuple[Any, float]]:
    """Slow every source host to at least ``pace_s`` per epoch; return (handle, delay it had).
    (A host the delay is set on slows all its containers: a source restored onto another
    stage's host by a recovery slows that stage's container there too.)"""

    handles = ray.get(job.master.container_handles.remote())
    sources = {c for s in job.plan.stages if s.kind == "source" for c in _containers_of(job, s.name)}
    hosts = {id(handles[c]): handles[c] for c in sources if c in handles}.values()
    before = ray.get([h.inject_delay.remote(pace_s) for h in hosts])
    slowed = []
    for h, was in zip(hosts, before):
        if was > pace_s:  # (already slower: keep that pace)
            ray.get(h.inject_delay.remote(was))
        else:
            slowed.append((h, was))
    return slowed


def _restore_sources(slowed: list[tuple[Any, float]], pace_s: float) -> None:

    for h, was in slowed:
        try:
            now = ray.get(h.inject_delay.remote(was))
            if now != pace_s:  # (the fault itself set a delay there: that one stays)
                ray.get(h.inject_delay.remote(now))
        except ray.exceptions.RayActorError:
            pass  # the fault took that host: its successor runs at the job's own pace


def apply_schedule(job: Any, faults: list[Fault], poll_s: float = 0.05, timeout_s: float = 600.0,
                   settle: bool = True, settle_pace_s: float = 0.0) -> list[tuple[float, Fault, dict[str, Any]]]:
    """Apply ``faults`` in epoch order as the job passes each ``at_epoch``; return what was applied.

    With ``settle``, each kill waits for its recovery to end (a master kill
    for the master's restart) before the next fault is considered (faults
    one at a time, as in a campaign). ``settle_pace_s``: while a fault is
    applied and settles, the job's sources spend at least this long per
    epoch, then go back to their pace; the input keeps flowing, but a slow
    recovery on a loaded machine cannot let the job run out of input before
    the later faults land. A ``delay`` on a source stage is its pace for
    the rest of the schedule: a source host a fault replaced (a producer
    killed in a recovery) gets it again once the fault settled, or its
    successor would replay the input at full speed and end the job before
    the later faults land.
    """
    applied = []
    paces: dict[str, float] = {}  # source stage -> the delay the schedule gave it
    sources = {s.name for s in job.plan.stages if s.kind == "source"}
    deadline = time.monotonic() + timeout_s
    for fault in sorted(faults, key=lambda f: f.at_epoch):
        while True:
            p = job.progress()
            if p["state"] is not JobState.RUNNING:
                return applied
            if p["min_epoch"] >= fault.at_epoch:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"job never reached epoch {fault.at_epoch}")
            time.sleep(poll_s)
        before = (job.progress().get("recoveries", 0),
                  sum(1 for _, k, _ in job.timeline() if k == "master_restarted") if fault.kind == "kill_master" else 0)
        slowed = _slow_sources(job, settle_pace_s) if settle_pace_s > 0 and fault.kind in SETTLING_KINDS else []
        try:
            at = time.time()  # (before the fault: every event it causes comes after)
            try:
                hit = inject(job, fault)
            except Exception:
                if job.progress()["state"] is not JobState.RUNNING:
                    return applied  # the job finished between the check and the fault (a rescale refuses then)
                raise
            applied.append((at, fault, hit))
            if fault.kind == "delay" and hit.get("stage") in sources:
                paces[hit["stage"]] = fault.seconds
            if settle:
                _settle(job, fault, before, deadline, poll_s)
        finally:
            _restore_sources(slowed, settle_pace_s)
        if paces and fault.kind in SETTLING_KINDS and job.progress()["state"] is JobState.RUNNING:
            _keep_pace(job, paces)
    return applied


def _keep_pace(job: Any, paces: dict[str, float]) -> None:
    """Every host of a paced source stage spends at least its pace an epoch (a host that is
    slower already keeps its delay)."""

    handles = ray.get(job.master.container_handles.remote())
    for stage, pace in paces.items():
        hosts = {id(handles[c]): handles[c] for c in _containers_of(job, stage) if c in handles}.values()
        for h in hosts:
            try:
                was = ray.get(h.inject_delay.remote(pace))
                if was > pace:
                    ray.get(h.inject_delay.remote(was))
            except ray.exceptions.RayActorError:
                pass  # (died meanwhile: its recovery follows, and the next fault's settling paces it)


def _settle(job: Any, fault: Fault, before: tuple[int, int], deadline: float, poll_s: float) -> None:
    """Wait for ``fault``'s recovery to end, or for the master's restart after a master kill
    (``before``: the recoveries ended and the master restarts seen before the fault)."""
    recoveries_before, restarts_before = before
    if fault.kind == "kill_master":
        while sum(1 for _, k, _ in job.timeline() if k == "master_restarted") <= restarts_before:
            if time.monotonic() > deadline:
                raise TimeoutError("the master did not restart")
            time.sleep(poll_s)
    if fault.kind in ("kill", "kill_two", "kill_master_in_recovery", "kill_in_recovery"):
        while job.progress().get("recoveries", 0) <= recoveries_before and job.progress()["state"] is JobState.RUNNING:
            if time.monotonic() > deadline:
                raise TimeoutError("recovery did not end")
            time.sleep(poll_s)


def compare_with_serial(job: Any, query: Any) -> tuple[dict[str, str], dict[str, int]]:
    """Each sink's rows vs the serial executor's: (mismatch descriptions, row counts)."""
    return compare_outputs({sink.name: job.results(sink.name) for sink in job.plan.sinks}, query)


def compare_outputs(outputs: dict[str, pa.Table], query: Any) -> tuple[dict[str, str], dict[str, int]]:
    """Each sink's rows (``outputs``: sink name -> table) vs the serial executor's: (mismatch
    descriptions, row counts)."""

    expected = run(query, executor="serial")
    return compare_tables(outputs, {name: expected.results(name) for name in outputs}), \
        {name: got.num_rows for name, got in outputs.items()}


def compare_tables(outputs: dict[str, pa.Table], expected: dict[str, pa.Table]) -> dict[str, str]:
    """Each sink's rows (``outputs``: sink name -> table, in identity order as ``job.results``
    gives them) vs ``expected`` (the serial executor's, by sink name), row for row, values and
    system columns alike: a description of how each sink that differs does.

    >>> t = pa.table({"_slice": [0, 0], "_seq": [0, 1], "x": [1, 2]})
    >>> compare_tables({"o": t}, {"o": t})
    {}
    >>> compare_tables({"o": t.slice(0, 1)}, {"o": t})["o"]
    '1 rows vs 2: 1 missing (first [(0, 1)]), 0 extra (first []), 0 differ (first [])'
    """
    mismatches = {}
    for name, got in outputs.items():
        want = expected[name]
        if got.to_pylist() != want.to_pylist():
            mismatches[name] = _describe_difference(got, want)
    return mismatches


def _describe_difference(got: pa.Table, want: pa.Table) -> str:
    g = {(r["_slice"], r["_seq"]): r for r in got.to_pylist()}
    w = {(r["_slice"], r["_seq"]): r for r in want.to_pylist()}
    missing = sorted(set(w) - set(g))
    extra = sorted(set(g) - set(w))
    differ = sorted(k for k in set(g) & set(w) if g[k] != w[k])
    return (f"{got.num_rows} rows vs {want.num_rows}: {len(missing)} missing (first {missing[:3]}), "
            f"{len(extra)} extra (first {extra[:3]}), {len(differ)} differ (first {differ[:3]})")


def run_with_faults(query: Any, faults: list[Fault], *, timeout_s: float = 600.0, settle_pace_s: float = 0.0,
                    **run_kw: Any) -> ChaosReport:
    """Run ``query`` on Ray, apply ``faults``, wait, read every sink, compare each with the serial
    executor, then stop the job.

    ``settle_pace_s`` slows the sources while each fault settles (``apply_schedule``);
    ``run_kw`` goes to ``chronostream.run`` (``containers``, ``checkpoint_every``...). The report
    holds each sink's rows (``outputs``) and judges every fault (``landings``)::

        report = run_with_faults(q, [Fault("kill", at_epoch=10, stage="count")],
                                 containers=3, checkpoint_every=2)
        assert report.ok, report.mismatches
        assert not report.not_landed(), report.format_landings()
        print(report.format_timeline())
    """

    job = run(query, **run_kw)
    report = ChaosReport(faults=sorted(faults, key=lambda f: f.at_epoch))
    try:
        report.applied = apply_schedule(job, faults, timeout_s=timeout_s, settle_pace_s=settle_pace_s)
        job.wait(timeout_s=timeout_s)
        report.outputs = {sink.name: job.results(sink.name) for sink in job.plan.sinks}
        report.mismatches, report.rows = compare_outputs(report.outputs, query)
        events = [(t, "fault_injected", {"fault": f.describe(), **hit}) for t, f, hit in report.applied]
        report.timeline = sorted(events + job.timeline(), key=lambda e: e[0])
    finally:
        job.stop()
    return report
