"""Owns a job's Prometheus metrics: what ``/metrics`` of the job's HTTP server says.

The server (``master.ray_http``) asks ``JobCollector`` at each scrape; it reads
the master's books as they are (the containers' counters from their last
heartbeat, every ``heartbeat_s``) and never waits on a host.

Names follow Prometheus' conventions (``chronostream_`` prefix, ``_total`` for
counters, base units): per container, labelled ``job``, ``stage`` and
``container`` (a container's counters start at its birth: a recovery's or a
migration's new container starts from zero, as a restarted process would):
events in and out, busy, backpressured and CPU seconds, checkpoints, duplicates
dropped; its backlog, buffered bytes and resident memory as gauges. Per slice
(``slice`` for ``container``): events in, state keys and bytes. Per job: its
state, the recoveries ended, the output-log entries GC trimmed; histograms of
the end-to-end latency of the rows its sinks wrote, of its checkpoint rounds'
durations and sizes (the live containers'), of each migrated slice's pause and
of each recovery's duration (``EventHistograms``, fed by the timeline); and the
whole run's latency quantiles as gauges. Knows nothing of the hosts' calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from chronostream.containers.metrics import (CHECKPOINT_BYTES_BOUNDS, CHECKPOINT_SECONDS_BOUNDS, BoundedHistogram,
                                             LatencyHistogram)
from chronostream.master.job_state import JobState

#: Per-container counters: (metric name, ``ContainerStatistics`` field, help).
COUNTERS = (("chronostream_events_in", "events_in", "Events a container consumed"),
            ("chronostream_events_out", "events_out", "Events a container produced"),
            ("chronostream_busy_seconds", "busy_s", "Seconds a container spent processing epochs"),
            ("chronostream_backpressured_seconds", "backpressured_s",
             "Seconds a container waited for its receivers to take its epochs"),
            ("chronostream_cpu_seconds", "cpu_s", "CPU seconds of a container's epochs"),
            ("chronostream_checkpoints", "checkpoints", "Slice checkpoints a container took"),
            ("chronostream_duplicates_dropped", "duplicates_dropped", "Replayed events a container dropped"))
#: Per-container gauges: (metric name, field, help).
GAUGES = (("chronostream_backlog_events", "backlog_events", "Input events received and not yet processed"),
          ("chronostream_buffered_bytes", "buffered_bytes", "Bytes of epoch messages buffered for a container"),
          ("chronostream_rss_bytes", "rss_bytes", "Resident memory of the container's process"))
#: The job's states, as the ``chronostream_job_state`` gauge's label values.
STATES = tuple(s.value for s in JobState)


#: Buckets of a migrated slice's pause and of a recovery's duration, in seconds.
PAUSE_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RECOVERY_BOUNDS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class EventHistograms:
    """Histograms of what the timeline tells: each migrated slice's pause (``migration_end``'s
    transfers: slice -> ms) and each recovery's duration (``recovery_end``). Fed every event once
    (``observe``: the timeline's listener), so they count past the timeline's bound.

    >>> h = EventHistograms()
    >>> h.observe((0.0, "migration_end", {"transfers": [{"pause_ms": {3: 30.0, 4: 700.0}}]}))
    >>> h.observe((1.0, "recovery_end", {"seconds": 2.0}))
    >>> h.pause.to_plain()["counts"][:9], h.recovery.to_plain()["sum"]
    ([0, 0, 0, 1, 0, 0, 0, 1, 0], 2.0)
    """

    def __init__(self) -> None:
        self.pause = BoundedHistogram(PAUSE_BOUNDS)
        self.recovery = BoundedHistogram(RECOVERY_BOUNDS)

    def observe(self, event: tuple[float, str, dict[str, Any]]) -> None:
        """Count one timeline event (other kinds: nothing)."""
        _, kind, info = event
        if kind == "migration_end":
            for t in info.get("transfers", []):
                for ms in (t.get("pause_ms") or {}).values() if isinstance(t, dict) else ():
                    self.pause.observe(float(ms) / 1000)
        elif kind == "recovery_end" and info.get("seconds") is not None:
            self.recovery.observe(float(info["seconds"]))


class JobCollector(Collector):
    """The metrics of one ``JobMaster`` (``master``), made at each scrape from its books."""

    def __init__(self, master: Any, events: EventHistograms) -> None:
        self.m = master
        self.events = events

    def collect(self) -> Iterable[Any]:
        m = self.m
        stats = dict(m.stats)  # (one copy: the heartbeats replace entries while this runs)
        labels = ["job", "stage", "container"]
        for name, field, text in COUNTERS:
            family = CounterMetricFamily(name, text, labels=labels)
            for c, st in sorted(stats.items()):
                family.add_metric([m.job_key, st.stage, str(c)], float(getattr(st, field)))
            yield family
        for name, field, text in GAUGES:
            family = GaugeMetricFamily(name, text, labels=labels)
            for c, st in sorted(stats.items()):
                family.add_metric([m.job_key, st.stage, str(c)], float(getattr(st, field)))
            yield family
        live = {c for ids in m.placement.containers.values() for c in ids}
        yield from slice_families(m.job_key, {c: st for c, st in stats.items() if c in live})
        state = GaugeMetricFamily("chronostream_job_state", "1 for the job's current state", labels=["job", "state"])
        for s in STATES:
            state.add_metric([m.job_key, s], 1.0 if m.state.value == s else 0.0)
        yield state
        recoveries = CounterMetricFamily("chronostream_recoveries", "Recoveries ended", labels=["job"])
        recoveries.add_metric([m.job_key], float(m.timeline.count("recovery_end")))
        yield recoveries
        trimmed = CounterMetricFamily("chronostream_gc_trimmed_entries", "Output-log entries the GC trimmed",
                                      labels=["job"])
        trimmed.add_metric([m.job_key], float(m.gc_dropped))
        yield trimmed
        latency = merged_latency([st.latency for st in stats.values() if st.latency])
        yield latency_family(m.job_key, latency)
        yield quantiles_family(m.job_key, latency)
        yield bounded_family("chronostream_checkpoint_seconds", "Durations of checkpoint rounds (capture and "
                             "encoding)", m.job_key, CHECKPOINT_SECONDS_BOUNDS,
                             [st.checkpoint_seconds for st in stats.values() if st.checkpoint_seconds])
        yield bounded_family("chronostream_checkpoint_bytes", "Encoded sizes of checkpoint rounds", m.job_key,
                             CHECKPOINT_BYTES_BOUNDS, [st.checkpoint_bytes for st in stats.values() if st.checkpoint_bytes])
        yield bounded_family("chronostream_migration_pause_seconds", "Pause of each migrated slice",
                             m.job_key, PAUSE_BOUNDS, [self.events.pause.to_plain()])
        yield bounded_family("chronostream_recovery_seconds", "Duration of each recovery", m.job_key,
                             RECOVERY_BOUNDS, [self.events.recovery.to_plain()])


#: The latency histogram's buckets, in seconds (``le``); ``+Inf`` follows.
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def merged_latency(histograms: list[dict]) -> LatencyHistogram:
    """The containers' ``LatencyHistogram``s (plain) as one."""
    merged = LatencyHistogram()
    for plain in histograms:
        merged = merged.merge(LatencyHistogram.from_plain(plain))
    return merged


def latency_family(job: str, merged: LatencyHistogram) -> HistogramMetricFamily:
    """``chronostream_latency_seconds``: the end-to-end latency of every row the job's sinks wrote,
    from its epoch's ingest (the containers' histograms merged; their 5%-wide buckets counted
    under ``LATENCY_BUCKETS_S``).

    >>> h = LatencyHistogram(); h.add(3.0, 2); h.add(40.0)
    >>> fam = latency_family("j", merged_latency([h.to_plain()]))
    >>> [(s.labels["le"], s.value) for s in fam.samples if s.name.endswith("_bucket")][:4]
    [('0.001', 0.0), ('0.005', 2.0), ('0.01', 2.0), ('0.025', 2.0)]
    """
    counts = merged.counts_at_or_below([b * 1000 for b in LATENCY_BUCKETS_S])
    family = HistogramMetricFamily("chronostream_latency_seconds", "End-to-end latency of the rows sinks wrote",
                                   labels=["job"])
    family.add_metric([job], [(str(b), float(c)) for b, c in zip(LATENCY_BUCKETS_S, counts)]
                      + [("+Inf", float(merged.count))], sum_value=merged.approximate_sum_ms() / 1000)
    return family


def quantiles_family(job: str, merged: LatencyHistogram) -> GaugeMetricFamily:
    """``chronostream_latency_quantile_seconds``: p50, p99 and p99.9 of the whole run's end-to-end
    latency (from the containers' fine histograms, merged; ``histogram_quantile`` over the coarser
    buckets of ``chronostream_latency_seconds`` gives any quantile over any window)."""
    family = GaugeMetricFamily("chronostream_latency_quantile_seconds", "End-to-end latency quantiles of the run",
                               labels=["job", "quantile"])
    if merged.count:
        for q in (0.5, 0.99, 0.999):
            family.add_metric([job, str(q)], merged.percentile(q * 100) / 1000)
    return family


def bounded_family(name: str, text: str, job: str, bounds: tuple[float, ...],
                   plains: list[dict]) -> HistogramMetricFamily:
    """A Prometheus histogram of ``BoundedHistogram``s' plain forms (one bounds), merged.

    >>> h = BoundedHistogram((1.0,)); h.observe(0.5); h.observe(3.0)
    >>> [(s.name, s.labels.get("le"), s.value) for s in bounded_family("x", "", "j", (1.0,), [h.to_plain()]).samples]
    [('x_bucket', '1.0', 1.0), ('x_bucket', '+Inf', 2.0), ('x_count', None, 2.0), ('x_sum', None, 3.5)]
    """
    cumulative, total = BoundedHistogram.cumulative(plains)
    if not cumulative:
        cumulative = [0] * (len(bounds) + 1)
    family = HistogramMetricFamily(name, text, labels=["job"])
    family.add_metric([job], [(str(b), float(c)) for b, c in zip(bounds, cumulative)]
                      + [("+Inf", float(cumulative[-1]))], sum_value=total)
    return family


def slice_families(job: str, stats: dict[int, Any]) -> Iterable[Any]:
    """Per slice, labelled ``job``, ``stage`` and ``slice``: events in (a counter; it starts again
    where a slice moved), state keys and approximate state bytes (gauges), from the heartbeats."""
    labels = ["job", "stage", "slice"]
    events = CounterMetricFamily("chronostream_slice_events_in", "Events a slice consumed", labels=labels)
    keys = GaugeMetricFamily("chronostream_slice_state_keys", "Keys in a slice's state", labels=labels)
    size = GaugeMetricFamily("chronostream_slice_state_bytes", "Approximate bytes of a slice's state", labels=labels)
    for st in stats.values():
        for s, n_in, n_keys, n_bytes in st.slice_figures:
            at = [job, st.stage, str(s)]
            events.add_metric(at, float(n_in))
            keys.add_metric(at, float(n_keys))
            size.add_metric(at, float(n_bytes))
    return events, keys, size
