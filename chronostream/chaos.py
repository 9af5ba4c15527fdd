"""Failure injection against a running job, and the check that its output is still exact.

Owns: the user-facing fault schedule (``Fault``), applying it to a running
``Job`` (``inject``), seeded random campaigns (``random_faults``), the
merged timeline (fault, detection, recovery start/end per slice, first
output after recovery) and ``run_with_faults``, which runs a query with a
schedule and compares every sink with the serial executor row for row.
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
    peer is damaged; combine with a later ``kill`` of the slice's owner to
    see the other replica used). ``stage`` picks the stage (any stateful
    one when None); ``index`` which of its containers (by sorted id).
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
            from master.recovery import RECOVERY_ROLES, RECOVERY_STEPS

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


@dataclass
class ChaosReport:
    """What ``run_with_faults`` saw: the faults applied, the timeline, and the comparison."""

    applied: list[tuple[float, Fault, dict[str, Any]]] = field(default_factory=list)
    timeline: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)
    mismatches: dict[str, str] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when every sink equals the serial executor's."""
        return not self.mismatches

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


def _stateful_stages(job: Any) -> list[str]:
    return [s.name for s in job.plan.stages if s.kind == "operator"]


def _containers_of(job: Any, stage: str) -> list[int]:
    return sorted(int(c) for c in job.placement()["stages"][stage])


def inject(job: Any, fault: Fault) -> dict[str, Any]:
    """Apply one fault now; return what was hit (container, host, slices)."""
    import ray

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
        return {"stage": stage, "moved": sorted(s for t in done["transfers"] for s in t["slices"]),
                "seconds": done.get("seconds")}
    ids = _containers_of(job, stage)
    handles = ray.get(job.master.container_handles.remote())
    hosts = job.placement()["hosts"]
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
        slice_ = job.placement()["stages"][stage][victim][0]
        done = job.migrate(stage, slice_)
        return {"stage": stage, "slice": slice_, "seconds": done.get("seconds")}
    # corrupt/truncate: damage the replica of the victim's first slice that a
    # recovery would try first (the first holder in its backup chain).
    sid = job.plan.stage(stage).stage_id
    slice_ = job.placement()["stages"][stage][victim][0]
    chain = ray.get(job.master.backup_plan.remote())[sid][slice_]
    host_handles = ray.get(job.master.host_handles.remote())
    for h in chain:
        if ray.get(host_handles[h].corrupt_backup.remote(sid, slice_, fault.kind == "truncate_backup")):
            return {"stage": stage, "slice": slice_, "holder_host": h}
    return {"stage": stage, "slice": slice_, "holder_host": None}


def random_faults(seed: int, n: int, stages: list[str], max_epoch: int, containers: int = 3,
                  kinds: tuple[str, ...] = ("kill",), min_gap: int = 4) -> list[Fault]:
    """A seeded random schedule of ``n`` faults at epochs in [1, max_epoch), at least ``min_gap`` apart.

    Kills are capped so every stage keeps 2 containers (``containers`` per
    stage at the start): with backup factor 2 a copy of each slice then
    survives; a kind that would exceed the cap becomes a ``delay``. So does
    a ``scale_in`` that would leave a stage on fewer than 2 hosts (counted
    from ``containers``: a scale-out or a migration to a new host adds one,
    a kill or a scale-in takes one; the master refuses to remove a stage's
    last host).

    >>> [(f.kind, f.at_epoch) for f in random_faults(0, 3, ["count"], 40, 4, ("kill", "corrupt_backup"))]
    [('corrupt_backup', 1), ('kill', 13), ('corrupt_backup', 38)]
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
    faults = []
    for e in sorted(epochs):
        stage, kind = rng.choice(stages), rng.choice(kinds)
        # (a kill in a recovery may take a second host of the stage: counted as two)
        cost = {"kill": 1, "kill_master_in_recovery": 1, "kill_two": 2, "kill_in_recovery": 2}.get(kind, 0)
        if cost and kills.get(stage, 0) + cost > containers - 2:
            kind = "delay"
        if kind == "scale_in" and hosts[stage] - 1 < 2:
            kind = "delay"
        kills[stage] = kills.get(stage, 0) + cost * (kind != "delay")
        hosts[stage] += {"scale_out": 1, "migrate": 1, "scale_in": -1}.get(kind, -cost)
        index = rng.randrange(containers)
        if kind == "kill_master_in_recovery":  # (drawn only for this kind: other schedules stay as they were)
            from master.recovery import RECOVERY_STEPS

            faults.append(Fault(kind, e, stage, index, step=rng.choice(RECOVERY_STEPS)))
            continue
        if kind == "kill_in_recovery":  # (drawn only for this kind, as above)
            from master.recovery import RECOVERY_ROLES, RECOVERY_STEPS

            faults.append(Fault(kind, e, stage, index, step=rng.choice(RECOVERY_STEPS),
                                role=rng.choice(RECOVERY_ROLES)))
            continue
        faults.append(Fault(kind, e, stage, index, 0.01 if kind == "delay" else 0.0))
    return faults


def _slow_sources(job: Any, pace_s: float) -> list[tuple[Any, float]]:
    """Slow every source host to at least ``pace_s`` per epoch; return (handle, delay it had).
    (A host the delay is set on slows all its containers: a source restored onto another
    stage's host by a recovery slows that stage's container there too.)"""
    import ray

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
    import ray

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
    the later faults land.
    """
    applied = []
    deadline = time.monotonic() + timeout_s
    for fault in sorted(faults, key=lambda f: f.at_epoch):
        while True:
            p = job.progress()
            if p["state"] != "running":
                return applied
            if p["min_epoch"] >= fault.at_epoch:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"job never reached epoch {fault.at_epoch}")
            time.sleep(poll_s)
        before = job.progress().get("recoveries", 0)
        slowed = _slow_sources(job, settle_pace_s) if settle_pace_s > 0 and fault.kind in SETTLING_KINDS else []
        try:
            try:
                hit = inject(job, fault)
            except Exception:
                if job.progress()["state"] != "running":
                    return applied  # the job finished between the check and the fault (a rescale refuses then)
                raise
            applied.append((time.time(), fault, hit))
            if settle:
                _settle(job, fault, before, deadline, poll_s)
        finally:
            _restore_sources(slowed, settle_pace_s)
    return applied


def _settle(job: Any, fault: Fault, recoveries_before: int, deadline: float, poll_s: float) -> None:
    """Wait for ``fault``'s recovery to end, or for the master's restart after a master kill."""
    if fault.kind == "kill_master":
        while not any(k == "master_restarted" for _, k, _ in job.timeline()):
            if time.monotonic() > deadline:
                raise TimeoutError("the master did not restart")
            time.sleep(poll_s)
    if fault.kind in ("kill", "kill_two", "kill_master_in_recovery", "kill_in_recovery"):
        while job.progress().get("recoveries", 0) <= recoveries_before and job.progress()["state"] == "running":
            if time.monotonic() > deadline:
                raise TimeoutError("recovery did not end")
            time.sleep(poll_s)


def compare_with_serial(job: Any, query: Any) -> tuple[dict[str, str], dict[str, int]]:
    """Each sink's rows vs the serial executor's: (mismatch descriptions, row counts)."""
    from chronostream.client import run

    expected = run(query, executor="serial")
    mismatches, rows = {}, {}
    for sink in job.plan.sinks:
        got = job.results(sink.name)
        want = expected.results(sink.name)
        rows[sink.name] = got.num_rows
        if got.to_pylist() != want.to_pylist():
            mismatches[sink.name] = _describe_difference(got, want)
    return mismatches, rows


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
    """Run ``query`` on Ray, apply ``faults``, wait, and compare every sink with the serial executor.

    ``settle_pace_s`` slows the sources while each fault settles (``apply_schedule``);
    ``run_kw`` goes to ``chronostream.run`` (``containers``, ``checkpoint_every``...)::

        report = run_with_faults(q, [Fault("kill", at_epoch=10, stage="count")],
                                 containers=3, checkpoint_every=2)
        assert report.ok, report.mismatches
        print(report.format_timeline())
    """
    from chronostream.client import run

    job = run(query, **run_kw)
    report = ChaosReport()
    try:
        report.applied = apply_schedule(job, faults, timeout_s=timeout_s, settle_pace_s=settle_pace_s)
        job.wait(timeout_s=timeout_s)
        report.mismatches, report.rows = compare_with_serial(job, query)
        events = [(t, "fault_injected", {"fault": f.describe(), **hit}) for t, f, hit in report.applied]
        report.timeline = sorted(events + job.timeline(), key=lambda e: e[0])
    finally:
        job.stop()
    return report
