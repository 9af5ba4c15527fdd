"""Owns autoscaling policies: metrics snapshot in, scaling actions (with a reason) out; and their simulator.

A policy is plain Python over ``chronostream.containers.metrics.MetricsSnapshot``: it
reads no clock but ``snapshot.t`` and keeps only state it derives from the
snapshots it saw, so the same trace of snapshots gives the same decisions
live (the master runs the policy every ``autoscale_interval_s``) and
offline (``simulate``, and ``chronostream autoscale-sim``). Every decision
carries the figures it was taken on in its ``reason``.

Built-ins:

- ``UtilizationPolicy``: busy time per host above ``high`` (below ``low``)
  for ``sustain`` snapshots in a row scales out (in) by one host, then
  waits ``cooldown_s`` (hysteresis: the band between low and high does
  nothing);
- ``RatePolicy``: target rate = input rate + backlog / ``catch_up_s``
  (backlog: the stage's own, plus the events waiting in its sources when
  it is busy, since backpressure parks a slow stage's excess there);
  hosts = ceil(target x ``headroom`` / per-host processing rate (events per
  busy second)); scales out at once, scales in lazily (only once the lower
  count was wanted for ``lazy_in`` snapshots in a row);
- ``LatencyPolicy``: p99 end-to-end latency above ``high_ms`` scales out
  the busiest stage, below ``low_ms`` (for ``sustain`` snapshots) scales
  in the least busy;
- ``ScheduledPolicy``: given actions at given job times (manual schedules);
- ``HotSliceRule``: a slice with ``ratio`` times the mean input rate of
  its stage, on a host busier than the others, moves to the least loaded
  container of the stage;
- ``CompactionRule``: a stage running ``extra`` or more containers beyond
  one per host (recoveries and scale-ins leave them) is compacted
  (``Job.compact``: each host's containers merged into one). Combine
  with ``Policies(a, b, ...)``.

>>> from chronostream.containers.metrics import MetricsSnapshot, StageMetrics
>>> snap = MetricsSnapshot(5.0, {"count": StageMetrics("count", 1, (1,), 8, input_rate=9000,
...     processing_rate=4000, utilization=1.0, backlog_events=20000, backlog_epochs=3, threads=1)})
>>> [a.describe() for a in RatePolicy(stages=["count"], catch_up_s=10).decide(snap)]
['scale_out count by 2: target 11000 ev/s (input 9000 + backlog 20000 / 10s) x 1.2 over 4000 ev/s per host -> 4 hosts, have 1 (capped at 3)']
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Protocol

from chronostream.containers.metrics import MetricsSnapshot, StageMetrics

ACTION_KINDS = ("scale_out", "scale_in", "migrate", "set_threads", "compact")


@dataclass(frozen=True)
class ScalingAction:
    """One decision: ``kind`` on ``stage`` (``n`` hosts, or ``slice`` to ``to_container``, or
    ``container`` to ``threads`` threads), and why."""

    kind: str
    stage: str
    n: int = 1
    reason: str = ""
    slice: int | None = None
    to_container: int | None = None
    container: int | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"unknown action {self.kind!r}; kinds: {ACTION_KINDS}")

    def describe(self) -> str:
        """``scale_out count by 2: <reason>``."""
        what = {"scale_out": f"by {self.n}", "scale_in": f"by {self.n}",
                "migrate": f"slice {self.slice} to container {self.to_container}",
                "set_threads": f"container {self.container} to {self.threads} threads",
                "compact": "(one container a host)"}[self.kind]
        return f"{self.kind} {self.stage} {what}: {self.reason}"

    def to_plain(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


class Policy(Protocol):
    """What the master's autoscaler loop calls: decide from one snapshot (and what the policy saw before)."""

    def decide(self, snapshot: MetricsSnapshot) -> list[ScalingAction]:
        """Actions to take now (empty: nothing)."""
        ...


def _streak(streak: int, up: bool, down: bool) -> int:
    """Snapshots in a row above (> 0) or below (< 0) a band; 0 inside it."""
    return (max(streak, 0) + 1) if up else (min(streak, 0) - 1) if down else 0


def _stages(snapshot: MetricsSnapshot, names: list[str] | None) -> list[StageMetrics]:
    return [s for n, s in sorted(snapshot.stages.items()) if names is None or n in names]


@dataclass
class UtilizationPolicy:
    """Scale out above ``high`` busy fraction, in below ``low``, after ``sustain`` snapshots; cooldown between."""

    high: float = 0.8
    low: float = 0.3
    sustain: int = 2
    cooldown_s: float = 10.0
    min_hosts: int = 1
    max_hosts: int = 8
    stages: list[str] | None = None
    _streak: dict[str, int] = field(default_factory=dict)
    _last_action_t: dict[str, float] = field(default_factory=dict)

    def decide(self, snapshot: MetricsSnapshot) -> list[ScalingAction]:
        out = []
        for st in _stages(snapshot, self.stages):
            if snapshot.t - self._last_action_t.get(st.name, -math.inf) < self.cooldown_s:
                continue
            streak = _streak(self._streak.get(st.name, 0), st.utilization > self.high, st.utilization < self.low)
            self._streak[st.name] = streak
            fig = f"utilization {st.utilization:.2f} over {st.hosts} host(s)"
            if streak >= self.sustain and st.hosts < min(self.max_hosts, st.slices):
                out.append(ScalingAction("scale_out", st.name, 1, f"{fig} > {self.high} for {streak} snapshots"))
            elif -streak >= self.sustain and st.hosts > self.min_hosts:
                out.append(ScalingAction("scale_in", st.name, 1, f"{fig} < {self.low} for {-streak} snapshots"))
            else:
                continue
            self._streak[st.name] = 0
            self._last_action_t[st.name] = snapshot.t
        return out


@dataclass
class RatePolicy:
    """Hosts = ceil((input rate + backlog / catch_up_s) x headroom / per-host processing rate)."""

    catch_up_s: float = 30.0
    headroom: float = 1.2
    busy: float = 0.5  # utilization from which upstream lag counts as the stage's backlog
    lazy_in: int = 3
    min_hosts: int = 1
    max_hosts: int = 8
    max_step: int = 2
    cooldown_s: float = 0.0
    stages: list[str] | None = None
    _lower: dict[str, int] = field(default_factory=dict)
    _last_action_t: dict[str, float] = field(default_factory=dict)

    def decide(self, snapshot: MetricsSnapshot) -> list[ScalingAction]:
        out = []
        for st in _stages(snapshot, self.stages):
            if st.processing_rate <= 0 or snapshot.t - self._last_action_t.get(st.name, -math.inf) < self.cooldown_s:
                continue  # no busy time measured yet: no capacity estimate
            # A busy stage holds its sources back: their lag is its backlog too.
            backlog = st.backlog_events + (st.upstream_lag_events if st.utilization >= self.busy else 0)
            target = st.input_rate + backlog / self.catch_up_s
            want = math.ceil(target * self.headroom / st.processing_rate) if target > 0 else self.min_hosts
            want = max(self.min_hosts, min(want, self.max_hosts, st.slices))
            why = (f"target {target:.0f} ev/s (input {st.input_rate:.0f} + backlog {backlog} / "
                   f"{self.catch_up_s:g}s) x {self.headroom:g} over {st.processing_rate:.0f} ev/s per host "
                   f"-> {want} hosts, have {st.hosts}")
            if want > st.hosts:
                n = min(want - st.hosts, self.max_step)
                self._lower[st.name] = 0
                out.append(ScalingAction("scale_out", st.name, n, why + (f" (capped at {st.hosts + n})"
                                                                          if n < want - st.hosts else "")))
                self._last_action_t[st.name] = snapshot.t
            elif want < st.hosts:
                self._lower[st.name] = self._lower.get(st.name, 0) + 1
                if self._lower[st.name] >= self.lazy_in:
                    self._lower[st.name] = 0
                    out.append(ScalingAction("scale_in", st.name, 1, why + f" for {self.lazy_in} snapshots"))
                    self._last_action_t[st.name] = snapshot.t
            else:
                self._lower[st.name] = 0
        return out


@dataclass
class LatencyPolicy:
    """Keep p99 end-to-end latency between ``low_ms`` and ``high_ms`` by adding or removing hosts."""

    high_ms: float = 500.0
    low_ms: float = 50.0
    sustain: int = 2
    cooldown_s: float = 10.0
    min_hosts: int = 1
    max_hosts: int = 8
    stages: list[str] | None = None
    _streak: int = 0
    _last_action_t: float = -math.inf

    def decide(self, snapshot: MetricsSnapshot) -> list[ScalingAction]:
        p99 = snapshot.latency.get("p99_ms", 0.0)
        stages = _stages(snapshot, self.stages)
        if not stages or not snapshot.latency.get("count") or snapshot.t - self._last_action_t < self.cooldown_s:
            return []
        self._streak = _streak(self._streak, p99 > self.high_ms, p99 < self.low_ms)
        if self._streak >= self.sustain:
            st = max(stages, key=lambda s: (s.utilization, s.name))
            if st.hosts < min(self.max_hosts, st.slices):
                self._streak, self._last_action_t = 0, snapshot.t
                return [ScalingAction("scale_out", st.name, 1, f"p99 {p99:.0f} ms > {self.high_ms:g} ms; "
                                                               f"busiest stage at {st.utilization:.2f}")]
        if -self._streak >= self.sustain:
            st = min(stages, key=lambda s: (s.utilization, s.name))
            if st.hosts > self.min_hosts:
                self._streak, self._last_action_t = 0, snapshot.t
                return [ScalingAction("scale_in", st.name, 1, f"p99 {p99:.0f} ms < {self.low_ms:g} ms; "
                                                              f"least busy stage at {st.utilization:.2f}")]
        return []


@dataclass
class ScheduledPolicy:
    """Fixed actions at job times: ``[(t_seconds, ScalingAction), ...]``, each taken once."""

    schedule: list[tuple[float, ScalingAction]]
    _done: int = 0

    def decide(self, snapshot: MetricsSnapshot) -> list[ScalingAction]:
        due = sorted(self.schedule, key=lambda x: x[0])
        out = []
        while self._done < len(due) and due[self._done][0] <= snapshot.t:
            out.append(due[self._done][1])
            self._done += 1
        return out


@dataclass
class HotSliceRule:
    """Move a slice whose input rate is ``ratio`` x its stage's mean to the least loaded container."""

    ratio: float = 3.0
    min_rate: float = 100.0
    cooldown_s: float = 10.0
    stages: list[str] | None = None
    _last_action_t: dict[str, float] = field(default_factory=dict)

    def decide(self, snapshot: MetricsSnapshot) -> list[ScalingAction]:
        out = []
        for st in _stages(snapshot, self.stages):
            per = st.per_slice
            if len(per) < 2 or len(st.containers) < 2 \
                    or snapshot.t - self._last_action_t.get(st.name, -math.inf) < self.cooldown_s:
                continue
            mean = sum(x.input_rate for x in per) / len(per)
            hot = max(per, key=lambda x: (x.input_rate, -x.slice_id))
            if hot.input_rate < max(self.min_rate, self.ratio * mean):
                continue
            load: dict[int, float] = {c: 0.0 for c in st.containers}
            for x in per:
                load[x.container] = load.get(x.container, 0.0) + x.input_rate
            target = min((c for c in load if c != hot.container), key=lambda c: (load[c], c))
            if load[target] + hot.input_rate >= load[hot.container]:
                continue  # moving it would not lower the hottest container's load
            self._last_action_t[st.name] = snapshot.t
            out.append(ScalingAction("migrate", st.name, 1, f"slice {hot.slice_id} at {hot.input_rate:.0f} ev/s "
                                     f"is {hot.input_rate / max(mean, 1e-9):.1f}x the mean {mean:.0f}; container "
                                     f"{hot.container} carries {load[hot.container]:.0f}, {target} {load[target]:.0f}",
                                     slice=hot.slice_id, to_container=target))
        return out


@dataclass
class CompactionRule:
    """Compact a stage (``Job.compact``) that runs ``extra`` or more containers beyond one per host.

    Every recovery and scale-in leaves a new container beside the old ones on
    the hosts that take slices: each is one more epoch loop, one more message
    from every producer each epoch. A compaction hands the merged slices over
    in process (no copy: its cost does not grow with their state,
    ``benchmarks.compaction``); it waits ``cooldown_s`` after the stage's last
    compaction and ``quiet_s`` after the stage's host count last changed (a
    scale-out right after would undo it). ``max_state_mb`` (None: no limit)
    leaves a stage whose slices hold more than that alone.

    >>> from chronostream.containers.metrics import StageMetrics
    >>> st = StageMetrics("count", 2, (3, 4, 7, 8), 16, 0.0, 0.0, 0.0, 0, 0, 1)
    >>> r = CompactionRule(quiet_s=0)
    >>> [a.describe() for a in r.decide(MetricsSnapshot(1.0, {"count": st}))]
    ['compact count (one container a host): 4 containers on 2 hosts']
    >>> r.decide(MetricsSnapshot(2.0, {"count": st}))  # cooling down
    []
    """

    extra: int = 1
    cooldown_s: float = 60.0
    quiet_s: float = 10.0
    max_state_mb: float | None = None
    stages: list[str] | None = None
    _last_action_t: dict[str, float] = field(default_factory=dict)
    _hosts: dict[str, tuple[int, float]] = field(default_factory=dict)  # stage -> (hosts, since when)

    def decide(self, snapshot: MetricsSnapshot) -> list[ScalingAction]:
        out = []
        for st in _stages(snapshot, self.stages):
            hosts, since = self._hosts.get(st.name, (st.hosts, snapshot.t))
            if hosts != st.hosts:
                since = snapshot.t
            self._hosts[st.name] = (st.hosts, since)
            state_mb = sum(x.state_bytes for x in st.per_slice) / 1e6
            if len(st.containers) - st.hosts < self.extra or snapshot.t - since < self.quiet_s \
                    or snapshot.t - self._last_action_t.get(st.name, -math.inf) < self.cooldown_s \
                    or (self.max_state_mb is not None and state_mb > self.max_state_mb):
                continue
            self._last_action_t[st.name] = snapshot.t
            out.append(ScalingAction("compact", st.name, 0,
                                     f"{len(st.containers)} containers on {st.hosts} hosts"))
        return out


class Policies:
    """Several policies in one: each decides on every snapshot; actions in the given order."""

    def __init__(self, *policies: Policy) -> None:
        self.policies = list(policies)

    def decide(self, snapshot: MetricsSnapshot) -> list[ScalingAction]:
        """Every policy's actions, in order."""
        return [a for p in self.policies for a in p.decide(snapshot)]


# -- traces and the simulator ---------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """One autoscaler tick: the snapshot it read and the actions it took."""

    snapshot: MetricsSnapshot
    actions: tuple[ScalingAction, ...]

    def to_plain(self) -> dict[str, Any]:
        """JSON-ready form (one line of a trace file)."""
        return {"snapshot": self.snapshot.to_plain(), "actions": [a.to_plain() for a in self.actions]}

    @staticmethod
    def from_plain(d: dict[str, Any]) -> "Decision":
        """Inverse of ``to_plain``."""
        return Decision(MetricsSnapshot.from_plain(d["snapshot"]), tuple(ScalingAction(**a) for a in d["actions"]))


def simulate(policy: Policy, snapshots: Iterable[MetricsSnapshot]) -> list[Decision]:
    """Replay ``snapshots`` through ``policy``: the decisions it would take, tick by tick.

    With a fresh policy and the snapshots a live run recorded, this gives
    the live run's decisions (policies read nothing but the snapshots).
    """
    return [Decision(s, tuple(policy.decide(s))) for s in snapshots]


def write_trace(decisions: Iterable[Decision], path: str) -> None:
    """One JSON object per line."""
    with open(path, "w") as f:
        for d in decisions:
            f.write(json.dumps(d.to_plain()) + "\n")


def read_trace(path: str) -> list[Decision]:
    """A trace written by ``write_trace`` (or ``Job.autoscale_trace``)."""
    with open(path) as f:
        return [Decision.from_plain(json.loads(line)) for line in f if line.strip()]


BUILTIN = {"utilization": UtilizationPolicy, "rate": RatePolicy, "latency": LatencyPolicy}
