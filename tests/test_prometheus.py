"""A job's Prometheus endpoint: ``/metrics`` on loopback, scraped with Prometheus' own text
parser while the job runs and after it finished; its counters move with the job and end at the
input's row count, its latency histogram holds every row written; the endpoint goes with the
job's stop."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import chronostream as cs

ROWS = 6_000


def _scrape(url: str) -> dict[str, list]:
    """Metric family name -> its samples."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _total(families: dict[str, list], name: str, stage: str) -> float:
    return sum(s.value for s in families[name] if s.name == f"{name}_total" and s.labels["stage"] == stage)


def _state(families: dict[str, list]) -> str:
    (on,) = [s.labels["state"] for s in families["chronostream_job_state"] if s.value == 1.0]
    return on


def test_the_metrics_endpoint_counts_with_the_job_and_goes_with_it(ray_session):
    q = cs.Query(epoch_events=100)
    q.source("events", [{"k": i % 17, "v": i} for i in range(ROWS)]).key_by("k").count(slices=4, name="count") \
        .sink(name="c")
    job = cs.run(q, containers=2, source_pace_s=0.05)
    try:
        url = job.status().metrics_url
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        deadline = time.monotonic() + 60
        first = _scrape(url)
        while _total(first, "chronostream_events_in", "count") == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
            first = _scrape(url)
        time.sleep(0.8)  # (more than a heartbeat)
        second = _scrape(url)
        assert _state(first) == "running"
        assert 0 < _total(first, "chronostream_events_in", "count") < _total(second, "chronostream_events_in", "count")
        labels = {s.labels["container"] for s in second["chronostream_events_in"] if s.labels["stage"] == "count"}
        assert len(labels) == 2 and all(s.labels["job"] == job.key for s in second["chronostream_events_in"])
        assert {"chronostream_busy_seconds", "chronostream_checkpoints", "chronostream_backlog_events",
                "chronostream_rss_bytes", "chronostream_recoveries", "chronostream_gc_trimmed_entries"} <= set(second)
        job.wait(timeout_s=120)
        last = _scrape(url)
        deadline = time.monotonic() + 30
        while _total(last, "chronostream_events_out", "count") < ROWS and time.monotonic() < deadline:
            time.sleep(0.2)  # (the containers' last heartbeats)
            last = _scrape(url)
        assert _state(last) == "finished"
        assert _total(last, "chronostream_events_in", "count") == ROWS
        assert _total(last, "chronostream_events_out", "count") == ROWS
        # Every row the sink wrote is in the latency histogram once; its buckets are cumulative.
        latency = last["chronostream_latency_seconds"]
        (count,) = [s.value for s in latency if s.name == "chronostream_latency_seconds_count"]
        buckets = [s.value for s in latency if s.name == "chronostream_latency_seconds_bucket"]
        assert count == ROWS and buckets[-1] == ROWS and buckets == sorted(buckets) and buckets[0] < ROWS
    finally:
        job.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)
