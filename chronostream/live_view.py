"""Owns what a person watches in a terminal: a job's progress bar, ``chronostream top``'s live
tables and the readable summary of ``Job.metrics()``.

Reads a job only through its handle (``status``, ``progress``, ``metrics``); draws with
``tqdm`` (the bar) and ``rich`` (the tables). The browser's view of the same job is its
dashboard (``master.ray_http``).

>>> m = {"snapshot": {"t": 4.0, "throughput": 1200.0, "latency": {"p50_ms": 8.0, "p99_ms": 20.0},
...      "host_cpu": {"0": 0.5}, "host_rss_mb": {"0": 120.0},
...      "stages": {"count": {"containers": [0], "slices": 4, "input_rate": 1200.0, "utilization": 0.25,
...                           "backpressured": 0.0, "backlog_events": 10, "threads": 1, "per_slice": []}}},
...      "latency_total": {"count": 9000, "p50_ms": 7.5, "p99_ms": 30.0, "p999_ms": 41.0, "max_ms": 50.0}}
>>> print(metrics_summary(m, width=100))  # doctest: +NORMALIZE_WHITESPACE
 t 4.0 s · 1200 source events/s · latency p50 8.0 ms, p99 20.0 ms (run: p50 7.5 ms, p99 30.0 ms, max 50.0 ms)
 stage   containers  slices  events/s  busy  backpressured  backlog  threads
 count            1       4      1200   25%             0%       10        1
 host  CPU  RSS MB
 0     50%     120
"""

from __future__ import annotations

import io
import sys
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text
from tqdm import tqdm

from chronostream.master.job_state import JobState


class EpochBar:
    """A progress bar of a bounded job's epochs (the lowest epoch every container has passed);
    an unbounded job's bar counts them. ``show``: None draws it only on a terminal."""

    def __init__(self, name: str, show: bool | None = None) -> None:
        self.bar = tqdm(desc=name, unit="epoch", disable=None if show is None else not show, file=sys.stderr,
                        dynamic_ncols=True, leave=True)

    def update(self, progress: dict[str, Any]) -> None:
        """Move the bar to ``Job.progress()``'s figures."""
        if self.bar.disable:
            return
        if progress.get("epochs") and self.bar.total != progress["epochs"]:
            self.bar.total = progress["epochs"]
        self.bar.n = progress.get("min_epoch", 0)
        recoveries = progress.get("recoveries", 0)
        self.bar.set_postfix_str(f"{progress['state']}" + (f", {recoveries} recoveries" if recoveries else ""),
                                 refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        """The job ended: the bar stays on the screen as it last was."""
        self.bar.close()


def _percent(x: float) -> str:
    return f"{100 * x:.0f}%"


def metrics_tables(metrics: dict[str, Any]) -> Group:
    """``Job.metrics()`` as a headline and two tables (stages, hosts)."""
    snap = metrics.get("snapshot", {})
    lat, total = snap.get("latency") or {}, metrics.get("latency_total") or {}
    headline = (f"t {snap.get('t', 0.0):.1f} s · {snap.get('throughput', 0.0):.0f} source events/s · latency "
                f"p50 {lat.get('p50_ms', 0.0)} ms, p99 {lat.get('p99_ms', 0.0)} ms")
    if total.get("count"):
        headline += (f" (run: p50 {total['p50_ms']} ms, p99 {total['p99_ms']} ms, max {total['max_ms']} ms)")
    stages = Table(box=None, header_style="bold")
    for col in ("stage", "containers", "slices", "events/s", "busy", "backpressured", "backlog", "threads"):
        stages.add_column(col, justify="left" if col == "stage" else "right")
    for name, st in snap.get("stages", {}).items():
        stages.add_row(name, str(len(st.get("containers", []))), str(st.get("slices", 0)),
                       f"{st.get('input_rate', 0.0):.0f}", _percent(st.get("utilization", 0.0)),
                       _percent(st.get("backpressured", 0.0)), str(st.get("backlog_events", 0)),
                       str(st.get("threads", 0)))
    hosts = Table(box=None, header_style="bold")
    for col in ("host", "CPU", "RSS MB"):
        hosts.add_column(col, justify="left" if col == "host" else "right")
    rss = snap.get("host_rss_mb", {})
    for h, cpu in sorted(snap.get("host_cpu", {}).items(), key=lambda kv: int(kv[0])):
        hosts.add_row(str(h), _percent(cpu), f"{rss.get(h, 0.0):.0f}")
    return Group(Text(headline), stages, hosts)


def metrics_summary(metrics: dict[str, Any], width: int = 120) -> str:
    """``Job.metrics()`` as text a person reads (``Job.metrics_summary()``)."""
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, legacy_windows=False).print(metrics_tables(metrics))
    return out.getvalue().rstrip("\n")


def top(job: Any, interval_s: float = 1.0, iterations: int | None = None, console: Console | None = None) -> JobState:
    """``chronostream top NAME``: the job's stages and hosts, redrawn every ``interval_s`` until it
    ends (or ``iterations`` times); returns its last state. Ctrl-C leaves it running."""
    console = console or Console()
    n = 0
    with Live(console=console, auto_refresh=False) as live:
        while True:
            progress = job.progress()
            head = Text(f"{job.key}: {progress['state']}, epoch {progress['min_epoch']} of {progress['epochs']}, "
                        f"{progress['done']}/{progress['containers']} containers done, "
                        f"{progress['recoveries']} recoveries", style="bold")
            live.update(Group(head, metrics_tables(job.metrics())), refresh=True)
            n += 1
            if progress["state"].terminal or (iterations is not None and n >= iterations):
                return progress["state"]
            time.sleep(interval_s)
