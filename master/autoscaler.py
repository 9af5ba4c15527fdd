"""Owns turning container counters into a ``MetricsSnapshot``, and the autoscaler's record of decisions.

Pure functions over plain data (no Ray, no clock: times are arguments).
The master (``master.actor``) gathers every live container's statistics
and per-slice metrics, calls ``build_snapshot`` with what it kept from the
previous call, runs the policy, and keeps each ``Decision`` (snapshot and
actions) so ``chronostream.master.policies.simulate`` can replay the trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from chronostream.containers.metrics import LatencyHistogram, MetricsSnapshot, SliceMetrics, StageMetrics


@dataclass
class Counters:
    """Cumulative counters seen at one call (the base of the next call's rates)."""

    t: float = 0.0
    container: dict[int, tuple[int, float]] = field(default_factory=dict)  # container -> (events in, busy + send s)
    slice_in: dict[tuple[int, int], int] = field(default_factory=dict)  # (container, slice) -> events in
    host_cpu: dict[int, float] = field(default_factory=dict)  # host -> process CPU seconds
    latency: dict[int, np.ndarray] = field(default_factory=dict)  # container -> histogram counts
    source_in: int = 0
    backpressured: dict[int, float] = field(default_factory=dict)  # container -> seconds held back by receivers


def build_snapshot(t: float, plan: Any, placement: Any, host_of: dict[int, int], stats: dict[int, Any],
                   slices: dict[int, list[SliceMetrics]], prev: Counters | None) -> tuple[MetricsSnapshot, Counters]:
    """A snapshot at job time ``t`` from every live container's ``ContainerStatistics`` (``stats``)
    and per-slice metrics (``slices``); rates are over the interval since ``prev``.

    Counters of a container that appeared since ``prev`` count from 0 (a
    migration destination's catch-up shows as input): policies smooth this
    with hysteresis.
    """
    now = Counters(t)
    dt = max(t - prev.t, 1e-9) if prev is not None else 0.0
    base = prev or Counters()
    stages: dict[str, StageMetrics] = {}
    recent = LatencyHistogram()
    host_cpu: dict[int, float] = {}
    host_rss: dict[int, float] = {}
    for c, s in stats.items():
        now.container[c] = (s.events_in, s.busy_s + s.send_s)  # busy: processing and sending
        now.backpressured[c] = getattr(s, "backpressured_s", 0.0)
        h = host_of.get(c)
        if h is not None:
            now.host_cpu[h] = s.cpu_s
            host_rss[h] = round(s.rss_bytes / 1e6, 1)
        counts = LatencyHistogram.from_plain(s.latency).counts if s.latency else None
        if counts is not None:
            now.latency[c] = counts
            recent.counts += np.maximum(counts - base.latency.get(c, 0), 0)
            recent.max_ms = max(recent.max_ms, float(s.latency.get("max", 0.0)))
    if prev is not None:
        for h, cpu in now.host_cpu.items():
            if h in prev.host_cpu:
                host_cpu[h] = round(max(0.0, cpu - prev.host_cpu[h]) / dt, 3)
    lag = {st.stage_id: sum(stats[c].source_lag for c in placement.containers[st.stage_id] if c in stats)
           for st in plan.stages if st.kind == "source"}
    for st in plan.stages:
        ids = [c for c in placement.containers[st.stage_id] if c in stats]
        hosts = len({host_of[c] for c in ids}) or 1
        d_in = d_busy = d_held = 0.0
        for c in ids:
            e, b = now.container[c]
            e0, b0 = base.container.get(c, (0, 0.0))
            d_in += max(0, e - e0)
            d_busy += max(0.0, b - b0)
            d_held += max(0.0, now.backpressured[c] - base.backpressured.get(c, 0.0))
        per = []
        for c in ids:
            for m in slices.get(c, []):
                now.slice_in[(c, m.slice_id)] = m.events_in
                rate = max(0, m.events_in - base.slice_in.get((c, m.slice_id), 0)) / dt if prev else 0.0
                per.append(SliceMetrics(m.slice_id, c, m.events_in, m.busy_s, m.backlog_events, m.state_keys,
                                        m.state_bytes, round(rate, 1), m.state_cold_keys))
        if st.kind == "source":
            now.source_in += int(sum(now.container[c][0] for c in ids))
        stages[st.name] = StageMetrics(
            st.name, hosts, tuple(sorted(ids)), st.num_slices,
            input_rate=round(d_in / dt, 1) if prev else 0.0,
            processing_rate=round(d_in / d_busy, 1) if d_busy > 0 else 0.0,
            utilization=round(d_busy / dt / hosts, 3) if prev else 0.0,
            backlog_events=int(sum(stats[c].backlog_events for c in ids)),
            backlog_epochs=int(sum(stats[c].buffered_epochs for c in ids)),
            threads=int(sum(stats[c].threads for c in ids)),
            per_slice=tuple(sorted(per, key=lambda m: m.slice_id)),
            upstream_lag_events=int(sum(lag.get(a, 0) for a in _sources_of(plan, st.stage_id))),
            backpressured=round(min(d_held / dt / hosts, 1.0), 3) if prev else 0.0)
    throughput = round(max(0, now.source_in - base.source_in) / dt, 1) if prev else 0.0
    snap = MetricsSnapshot(round(t, 3), stages, recent.summary() if recent.count else {}, throughput,
                           host_cpu, host_rss)
    return snap, now


def _sources_of(plan: Any, stage_id: int) -> set[int]:
    """Source stages ``stage_id`` reads from, directly or through other stages (itself if a source)."""
    todo, seen = [stage_id], set()
    while todo:
        s = todo.pop()
        if s in seen:
            continue
        seen.add(s)
        todo.extend(plan.upstream_stages(s))
    return {s for s in seen if plan.stages[s].kind == "source"}
