"""Owns a job's Prometheus endpoint: ``/metrics`` served by its master on loopback.

The master starts one HTTP server (``prometheus_client.start_http_server``, a
thread of its process) when the job runs, on ``JobOptions.metrics_port`` (0: a
free port; -1: none), bound to 127.0.0.1 like every port the project opens; its
address is in ``Job.status()`` (``metrics_url``) and ``chronostream status``. A
scrape reads the master's books as they are (the containers' counters from
their last heartbeat, every ``heartbeat_s``); it never waits on a host.

Names follow Prometheus' conventions (``chronostream_`` prefix, ``_total`` for
counters, base units): per container, labelled ``job``, ``stage`` and
``container`` (a container's counters start at its birth: a recovery's or a
migration's new container starts from zero, as a restarted process would):
events in and out, busy and CPU seconds, checkpoints, duplicates dropped; its
backlog, buffered bytes and resident memory as gauges. Per job: its state, the
recoveries ended, the output-log entries GC trimmed, and the end-to-end latency
of the rows its sinks wrote as a histogram (``histogram_quantile`` gives its
percentiles). The server stops with the job. Knows nothing of the hosts' calls.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from chronostream.containers.metrics import LatencyHistogram
from chronostream.master.job_state import JobState

log = logging.getLogger("chronostream.master")

#: Per-container counters: (metric name, ``ContainerStatistics`` field, help).
COUNTERS = (("chronostream_events_in", "events_in", "Events a container consumed"),
            ("chronostream_events_out", "events_out", "Events a container produced"),
            ("chronostream_busy_seconds", "busy_s", "Seconds a container spent processing epochs"),
            ("chronostream_cpu_seconds", "cpu_s", "CPU seconds of a container's epochs"),
            ("chronostream_checkpoints", "checkpoints", "Slice checkpoints a container took"),
            ("chronostream_duplicates_dropped", "duplicates_dropped", "Replayed events a container dropped"))
#: Per-container gauges: (metric name, field, help).
GAUGES = (("chronostream_backlog_events", "backlog_events", "Input events received and not yet processed"),
          ("chronostream_buffered_bytes", "buffered_bytes", "Bytes of epoch messages buffered for a container"),
          ("chronostream_rss_bytes", "rss_bytes", "Resident memory of the container's process"))
#: The job's states, as the ``chronostream_job_state`` gauge's label values.
STATES = tuple(s.value for s in JobState)


class JobCollector(Collector):
    """The metrics of one ``JobMaster`` (``master``), made at each scrape from its books."""

    def __init__(self, master: Any) -> None:
        self.m = master

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
        yield latency_family(m.job_key, [st.latency for st in stats.values() if st.latency])


#: The latency histogram's buckets, in seconds (``le``); ``+Inf`` follows.
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def latency_family(job: str, histograms: list[dict]) -> HistogramMetricFamily:
    """``chronostream_latency_seconds``: the end-to-end latency of every row the job's sinks wrote,
    from its epoch's ingest (the containers' ``LatencyHistogram``s, plain, merged; their 5%-wide
    buckets counted under ``LATENCY_BUCKETS_S``).

    >>> h = LatencyHistogram(); h.add(3.0, 2); h.add(40.0)
    >>> fam = latency_family("j", [h.to_plain()])
    >>> [(s.labels["le"], s.value) for s in fam.samples if s.name.endswith("_bucket")][:4]
    [('0.001', 0.0), ('0.005', 2.0), ('0.01', 2.0), ('0.025', 2.0)]
    """
    merged = LatencyHistogram()
    for plain in histograms:
        merged = merged.merge(LatencyHistogram.from_plain(plain))
    counts = merged.counts_at_or_below([b * 1000 for b in LATENCY_BUCKETS_S])
    family = HistogramMetricFamily("chronostream_latency_seconds", "End-to-end latency of the rows sinks wrote",
                                   labels=["job"])
    family.add_metric([job], [(str(b), float(c)) for b, c in zip(LATENCY_BUCKETS_S, counts)]
                      + [("+Inf", float(merged.count))], sum_value=merged.approximate_sum_ms() / 1000)
    return family


class MetricsEndpoint:
    """The ``/metrics`` server of one ``JobMaster`` (``master``)."""

    def __init__(self, master: Any) -> None:
        self.m = master
        self.server: Any = None
        self.url = ""

    def start(self) -> None:
        """Serve the job's metrics (once; nothing when ``metrics_port`` is -1). A port that cannot
        be bound is logged: the job runs without the endpoint."""
        m = self.m
        if self.server is not None or m.opts.metrics_port < 0:
            return
        registry = CollectorRegistry(auto_describe=False)
        registry.register(JobCollector(m))
        try:
            self.server, _thread = start_http_server(m.opts.metrics_port, addr="127.0.0.1", registry=registry)
        except OSError as exc:
            log.warning("job %s: no Prometheus endpoint on port %s: %s", m.job_key, m.opts.metrics_port, exc)
            return
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"
        m._event("metrics_endpoint", url=self.url)

    def stop(self) -> None:
        """The job stops: so does the server."""
        server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()
