"""Helpers shared by the benchmarks: argument parsing, medians, JSON output."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa

from chronostream.slices.sourcelog import SourceLogWriter

#: State bytes per key of the built-in aggregate over one int column, as the benchmarks that size
#: state in MB count it: count and int sum/min/max (8 bytes each; an int column has no float
#: variants) plus the key index's share (approx.).
AGGREGATE_BYTES_PER_KEY = 8 * 4 + 16


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line (last line)")
    p.add_argument("--repeat", type=int, default=3, help="runs per configuration (the median is reported)")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    return p


def median(xs: list[float]) -> float:
    """Median of a non-empty list."""
    return float(statistics.median(xs))


def run_identity() -> dict[str, str]:
    """Which run a result comes from: the benchmark's name, its command line, the date (UTC).

    ``benchmarks.readme_table`` puts the command and the date beside each figure."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    module = getattr(spec, "name", None) or ""
    if not module.startswith("benchmarks."):  # (a benchmark's main() called from elsewhere)
        module = f"benchmarks.{os.path.splitext(os.path.basename(sys.argv[0]))[0]}"
    return {"benchmark": module.rsplit(".", 1)[-1], "command": shlex.join(["python", "-m", module, *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat()}


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Print a human summary, then (with --json) the JSON object as the last line: the result
    with ``run_identity()``'s ``benchmark``, ``command`` and ``date`` first."""
    result = {**run_identity(), **result}
    for k, v in result.items():
        if k != "rows":
            print(f"{k}: {v}", file=sys.stderr if as_json else sys.stdout)
    for row in result.get("rows", []):
        print("  " + ", ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr if as_json else sys.stdout)
    if as_json:
        print(json.dumps(result))


def last_json_line(text: str) -> dict[str, Any]:
    """The JSON object on the last line of ``text`` (what a benchmark's child process printed).

    >>> last_json_line('starting\\n{"x": 1}\\n')
    {'x': 1}
    """
    return json.loads(text.strip().splitlines()[-1])


def with_order(table: pa.Table, lo: int, hi: int) -> pa.Table:
    """Rows ``lo:hi`` of ``table`` numbered for a source log (``_order`` = ``_stream_seq`` = row index)."""
    idx = np.arange(lo, hi, dtype=np.int64)
    return table.slice(lo, hi - lo).append_column("_order", pa.array(idx)).append_column("_stream_seq", pa.array(idx))


def write_all(log_dir: str, stream: str, table: pa.Table) -> None:
    """The whole table into a sealed source log (a bounded input read as fast as the job goes)."""
    w = SourceLogWriter(log_dir)
    w.append({stream: with_order(table, 0, table.num_rows)})
    w.seal()


def write_paced(w: SourceLogWriter, stream: str, table: pa.Table, start: int, rate: float, appended: list,
                stop: threading.Event) -> None:
    """Append ``table`` from row ``start`` at ``rate`` rows/s in 50 ms chunks, then seal.

    Notes ``(last order, wall time)`` of each chunk in ``appended``, so a
    benchmark can tell each output row's append time.
    """
    n, t0, i = table.num_rows, time.monotonic(), start
    while i < n and not stop.is_set():
        due = start + int((time.monotonic() - t0) * rate)
        hi = min(n, max(due, i + 1))
        if hi > i:
            w.append({stream: with_order(table, i, hi)}, high_water=hi)
            appended.append((hi - 1, time.time()))
            i = hi
        time.sleep(0.05)
    w.seal()


def append_to_sink_ms(rows: pa.Table, written: dict, appended: list, epoch: int) -> np.ndarray:
    """Per output row, ms from its source row's append (``write_paced``) to its (slice, epoch) part's sink write.

    ``written`` is ``job.sink_write_times(sink)``; ``epoch`` the query's
    events per epoch (a row's epoch is its ``_order // epoch``).
    """
    last_order = np.array([o for o, _ in appended])
    at = np.array([t for _, t in appended])
    order = np.asarray(rows.column("_order"))
    slices = np.asarray(rows.column("_slice"))
    append_t = at[np.searchsorted(last_order, order)]
    write_t = np.array([written[k] for k in zip(slices.tolist(), (order // epoch).tolist())])
    return (write_t - append_t) * 1000


def paced_run(job: Any, w: SourceLogWriter, stream: str, table: pa.Table, start: int, rate: float, sink: str,
              appended: list, *, ready: Any = None, sample: Any = None, period_s: float = 0.25
              ) -> tuple[pa.Table, dict, dict]:
    """Feed a running job (tailing ``w``'s log) at ``rate`` rows/s with ``write_paced`` and wait for it.

    The writer starts once ``ready()`` holds (default: at once); ``appended[0]``
    is then re-stamped, so rows already in the log count from the writer's
    start. ``sample()`` is called every ``period_s`` while the job runs.
    Returns the sink's rows, its ``sink_write_times`` and the runtime's
    latency summary; the job is stopped.
    """
    stop = threading.Event()
    writer = threading.Thread(target=write_paced, args=(w, stream, table, start, rate, appended, stop))
    try:
        while ready is not None and not ready():
            time.sleep(period_s)
        appended[0] = (appended[0][0], time.time())
        writer.start()
        while job.status().state == "running":
            if sample is not None:
                sample()
            time.sleep(period_s)
        job.wait(timeout_s=3600)
        return job.results(sink), job.sink_write_times(sink), job.metrics()["latency_total"]
    finally:
        stop.set()
        if writer.ident is not None:
            writer.join()
        job.stop()


def unaccounted_s(wall_s: float, ticks: int, cpus: int, hz: int = 100) -> float:
    """Seconds of an interval in which the machine did not run at all: its wall time minus the
    time the kernel accounted per CPU (``ticks`` of every state in /proc/stat, idle included).

    On a virtual machine whose vCPUs the hypervisor stops (while it serves the host's page
    faults, say), wall time goes on and no state is accounted.

    >>> unaccounted_s(0.5, 100, 2), unaccounted_s(0.5, 4, 2)
    (0.0, 0.48)
    """
    return round(max(0.0, wall_s - ticks / (hz * cpus)), 6)


#: The CPU states of /proc/stat's ``cpu`` line, in order (the first eight fields).
CPU_STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_seconds_in(samples: list[tuple[float, list[int]]], a: float, b: float,
                   hz: int = 100) -> dict[str, float]:
    """CPU time per state (``CPU_STATES``, summed over CPUs, in s) within wall-clock [a, b],
    from successive /proc/stat samples (wall time, the ``cpu`` line's first eight tick
    counters); an interval partly inside counts pro rata.

    >>> cpu_seconds_in([(0.0, [0] * 8), (1.0, [50, 0, 100, 50, 0, 0, 0, 0])], 0.5, 2.0)["system"]
    0.5
    """
    total = dict.fromkeys(CPU_STATES, 0.0)
    for (t, ticks), (u, later) in zip(samples, samples[1:]):
        overlap = min(b, u) - max(a, t)
        if overlap <= 0 or u <= t:
            continue
        share = overlap / (u - t)
        for state, x, y in zip(CPU_STATES, ticks, later):
            total[state] += (y - x) / hz * share
    return total


class FreezeMeter:
    """Notes when the whole machine stopped running (a VM's vCPUs held by the hypervisor),
    and what the CPUs spent their time on.

    A thread reads the CPU line of /proc/stat every 10 ms; an interval that
    lasted over ``min_ms`` and of which more than half is unaccounted
    (``unaccounted_s``) is a freeze. No process of the machine ran then, so a
    gap in a job's output that overlaps a freeze is not the runtime's alone.
    ``frozen_ms(a, b)``: the freeze time within wall-clock times [a, b].
    ``cpu_shares(a, b)``: the machine's CPU time in [a, b] by state, as
    shares: ``idle`` near 0 says the CPUs were saturated, ``steal`` is time
    the hypervisor gave this VM's running vCPUs to someone else (accounted,
    so not a freeze, but no more ours).
    Reads nothing (and reports 0) where /proc/stat is missing.
    """

    def __init__(self, min_ms: float = 50.0) -> None:
        self.min_s = min_ms / 1000
        self.cpus = os.cpu_count() or 1
        self.freezes: list[tuple[float, float, float]] = []  # (wall start, wall end, unaccounted s)
        self.samples: list[tuple[float, list[int]]] = []  # (wall time, /proc/stat cpu ticks by state)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="freeze-meter", daemon=True)

    @staticmethod
    def _ticks() -> list[int]:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]  # user .. steal

    def start(self) -> "FreezeMeter":
        """Begin sampling (a daemon thread)."""
        try:
            self._ticks()
        except OSError:
            return self
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        self.samples.append((time.time(), self._ticks()))
        while not self._stop.wait(0.01):
            (t, ticks), (now, now_ticks) = self.samples[-1], (time.time(), self._ticks())
            self.samples.append((now, now_ticks))
            lost = unaccounted_s(now - t, sum(now_ticks) - sum(ticks), self.cpus)
            if now - t > self.min_s and lost > (now - t) / 2:
                self.freezes.append((t, now, lost))

    def frozen_ms(self, a: float, b: float) -> float:
        """Freeze time within [a, b] (wall clock), in ms; a freeze partly inside counts pro rata."""
        total = 0.0
        for s, e, lost in self.freezes:
            overlap = min(b, e) - max(a, s)
            if overlap > 0:
                total += lost * overlap / (e - s)
        return round(total * 1000, 1)

    def cpu_seconds(self, a: float, b: float) -> dict[str, float]:
        """The machine's CPU time in [a, b] per ``CPU_STATES`` state, in s summed over CPUs."""
        return cpu_seconds_in(self.samples, a, b)

    def cpu_shares(self, a: float, b: float) -> dict[str, float]:
        """Share (0-1) of the machine's CPU time in [a, b] per ``CPU_STATES`` state; empty when
        nothing was sampled there."""
        spent = self.cpu_seconds(a, b)
        whole = (b - a) * self.cpus
        if whole <= 0 or not any(spent.values()):
            return {}
        return {state: round(x / whole, 3) for state, x in spent.items()}
