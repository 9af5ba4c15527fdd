"""Helpers shared by the benchmarks: argument parsing, medians, JSON output."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa

from chronostream.sourcelog import SourceLogWriter


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


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Print a human summary, then (with --json) the JSON object as the last line."""
    for k, v in result.items():
        if k != "rows":
            print(f"{k}: {v}", file=sys.stderr if as_json else sys.stdout)
    for row in result.get("rows", []):
        print("  " + ", ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr if as_json else sys.stdout)
    if as_json:
        print(json.dumps(result))


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
