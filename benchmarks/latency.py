"""End-to-end latency of the Railgun fraud metric at half the maximum throughput, by window size.

Per card, the count and sum of amounts over the last 5 minutes, 1 hour or
7 days, evaluated exactly at every payment (a real sliding window,
``chronostream.SlidingWindow``), on Ray (one source container, two for the
windows, 8 slices). Payments: ``chronostream.datasets.payments`` (seeded;
Zipf 0.8 over 100,000 cards, Poisson times over 7 days, card-testing
bursts).

For each window size:

1. the maximum throughput: the whole input in a source log, read as fast
   as the job goes (events / processing time, deploy excluded);
2. the latency run: a writer thread appends the same payments to a
   followed source log at 50% of that rate (a chunk every 50 ms, the time
   of each chunk recorded), and the job tails it. Every output row's
   latency is the time its (slice, epoch) part reached the sink minus the
   time its payment was appended: from source append to sink write,
   including the wait for its epoch to fill (``--epoch`` events).
   With ``--same-rate`` every window is offered the same rate, half the
   smallest maximum measured over the windows: the wait for an epoch to fill
   depends on the rate, so this compares window lengths at equal load
   (the maxima of separate runs differ by up to 30% on a noisy machine).
   Reported: p50, p99, p99.9 and max over all rows; the runtime's own
   histogram (from the epoch's ingest by the source container to the sink
   write: ``job.metrics()["latency_total"]``); and the largest RSS of the
   window containers' hosts seen during the run.

    python -m benchmarks.latency --json                  # 200,000 payments
    python -m benchmarks.latency --json --same-rate      # every window at one offered rate
    python -m benchmarks.latency --json --rows 50000 --epoch 250
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

import chronostream as cs
from benchmarks.common import (
    append_to_sink_ms,
    emit,
    paced_run,
    parser,
    with_order,
    write_all,
)
from chronostream.datasets import payments
from chronostream.slices.sourcelog import SourceLogWriter

WINDOWS = {"5m": 300, "1h": 3600, "7d": 7 * 86_400}


def build(log_dir: str, window_s: int, epoch: int, follow: bool) -> cs.Query:
    q = cs.Query(epoch_events=epoch)
    q.source_log(log_dir, "payments", follow=follow, slices=1).key_by("card") \
        .window(cs.SlidingWindow(window_s, time="ts"), count=True, sum="amount", slices=8, name="profiles") \
        .sink(name="profiles")
    return q


def max_throughput(table: pa.Table, window_s: int, epoch: int, root: Path) -> float:
    log_dir = str(root / f"bounded-{window_s}")
    write_all(log_dir, "payments", table)
    job = cs.run(build(log_dir, window_s, epoch, False), containers={"payments": 1, "profiles": 2},
                 checkpoint_interval_s=0)
    try:
        st = job.wait(timeout_s=3600)
        return table.num_rows / st.elapsed_s
    finally:
        job.stop()


def latency_run(table: pa.Table, window_s: int, epoch: int, rate: float, root: Path) -> dict:
    log_dir = str(root / f"followed-{window_s}")
    w = SourceLogWriter(log_dir)
    first = min(epoch, table.num_rows)
    w.append({"payments": with_order(table, 0, first)}, high_water=first)
    appended: list[tuple[int, float]] = [(first - 1, time.time())]  # the first chunk counts from the start
    job = cs.run(build(log_dir, window_s, epoch, True), containers={"payments": 1, "profiles": 2},
                 checkpoint_interval_s=0)
    rss = 0.0

    def sample() -> None:
        nonlocal rss
        snap = job.metrics()["snapshot"]
        hosts = {job.placement().hosts[c] for c in snap["stages"]["profiles"]["containers"]}
        rss = max([rss] + [snap["host_rss_mb"].get(str(h), snap["host_rss_mb"].get(h, 0.0)) for h in hosts])

    rows, written, runtime = paced_run(job, w, "payments", table, first, rate, "profiles", appended,
                                       sample=sample, period_s=1.0)
    lat_ms = append_to_sink_ms(rows, written, appended, epoch)
    return {"p50_ms": round(float(np.percentile(lat_ms, 50)), 1), "p99_ms": round(float(np.percentile(lat_ms, 99)), 1),
            "p999_ms": round(float(np.percentile(lat_ms, 99.9)), 1), "max_ms": round(float(lat_ms.max()), 1),
            "runtime_p99_ms": runtime["p99_ms"], "runtime_p999_ms": runtime["p999_ms"], "rss_mb": round(rss, 1),
            "outputs": len(lat_ms)}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--epoch", type=int, default=500, help="events per epoch (default 500)")
    p.add_argument("--windows", default="5m,1h,7d")
    p.add_argument("--same-rate", action="store_true",
                   help="offer every window half the smallest maximum throughput (equal load)")
    args = p.parse_args()
    n = 20_000 if args.quick else args.rows
    table = payments(n, cards=100_000, s=0.8, seed=42)
    cs.ensure_ray(num_cpus=2)
    rows = []
    root = Path(tempfile.mkdtemp(prefix="chronostream-latency-"))
    try:
        names = args.windows.split(",")
        tops = {name: max_throughput(table, WINDOWS[name], args.epoch, root) for name in names}
        for name in names:
            rate = (min(tops.values()) if args.same_rate else tops[name]) / 2
            res = latency_run(table, WINDOWS[name], args.epoch, rate, root)
            rows.append({"window": name, "max_events_per_s": round(tops[name]), "offered_events_per_s": round(rate),
                         **res})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    emit({"payments": n, "epoch_events": args.epoch, "same_rate": args.same_rate, "containers": {"payments": 1, "profiles": 2}, "rows": rows},
         args.json)


if __name__ == "__main__":
    main()
