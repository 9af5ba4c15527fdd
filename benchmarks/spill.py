"""Memory and throughput of a large per-key map, all in memory or with a hot limit (the rest in lmdb).

A per-event operator keeps, per user, a map item -> visits
(``register_map("visits", hot_entries=H)``) and emits a row at every
repeated visit. Input: ``--events`` seeded uniform events over ``--users``
users and ``--items`` items (defaults: 1,000,000 events, 2,000 x 5,000
pairs, so about 95% of the events add a map entry). One container of 4
slices in one process (the in-process runtime, ``master.local``; the
host's spill store in a temporary directory, on the machine's disk);
with ``--checkpoint-every K``, checkpoints every K epochs (a full one,
then deltas, merged at the backup) to a backup on the source's host, in
the same process, so their bytes count in the memory too. Configurations: no limit, and
each of ``--limits`` (entries in memory per slice). Each run is a fresh
process (so one run's heap does not carry into the next), the
configurations interleaved run by run; reported per configuration: events/s
and the growth of the process's anonymous resident memory over the job,
read while the job's state is still alive (``RssAnon``, MB: the heap, not
the lmdb file pages mapped into the process, which are page cache the
kernel may drop), medians of ``--repeat`` runs. The process collects its
garbage as a Ray host does (``containers/gc_pacing.py``: what exists at the
start frozen, no automatic full collections, one every
``full_gc_interval_s``, 600 s by default: none in a run this short);
``--cpython-gc`` leaves CPython's own policy, whose full collections walk
every hot entry each time the heap grows by a quarter (at 100,000 hot
entries a slice they took half the map job's time).

    python -m benchmarks.spill --json
    python -m benchmarks.spill --json --checkpoint-every 4
    python -m benchmarks.spill --json --events 300000 --limits 10000 --repeat 1   # a quick look

``--window``: instead of the map, a sliding window per user
(``key_by("user").window(SlidingWindow(--window-size, time="ts"),
count=True, sum="item", hot_entries=H)``, ``ts`` the event's index):
many users each seen a few times, whose queues are too short to have
middle chunks to spill, so only the hot limit bounds them (each of the
window's states, its key values and its event queue, holds at most H
entries per slice).

    python -m benchmarks.spill --json --window --users 300000 --limits 10000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa

import chronostream as cs
from benchmarks.common import emit, median, parser
from chronostream.dag import compile_query
from chronostream.containers.options import JobOptions
from chronostream.containers.gc_pacing import CollectorPacing
from chronostream.master.local import LocalCluster
from chronostream.master.placement import containers_per_stage, initial_placement

SLICES = 4


class RepeatVisits(cs.Operator):
    """Per user, visits per item in a map (``hot_entries`` per slice, or all in memory); a row at
    every visit after the first."""

    HOT: int | None = None

    def setup(self) -> None:
        self.visits = self.register_map("visits", hot_entries=self.HOT)

    def consume(self, stream_id: str, event: dict) -> None:
        n = self.visits.increment(event["user"], event["item"])
        if n > 1:
            self.produce("out", {"user": event["user"], "item": event["item"], "visits": n})


def visit_events(n: int, users: int, items: int, seed: int = 11) -> pa.Table:
    """``n`` seeded events ``(user, item)``, both uniform."""
    rng = np.random.default_rng(seed)
    return pa.table({"user": rng.integers(0, users, n), "item": rng.integers(0, items, n)})


def one_run(events: int, users: int, items: int, hot: int | None, checkpoint_every: int = 0,
            window_size: int | None = None, host_gc: bool = True) -> dict:
    """One job in this process: events/s, anonymous-RSS growth (MB) and the output's row count.
    ``window_size``: the ``--window`` job (a sliding window per user) instead of the map;
    ``host_gc``: garbage collected as a Ray host does (``CollectorPacing``)."""
    table = visit_events(events, users, items)
    q = cs.Query(epoch_events=16_384)
    if window_size is None:
        op = type("Bounded", (RepeatVisits,), {"HOT": hot})
        q.source("visits", table).key_by("user").apply(op, slices=SLICES, name="visits").sink(name="repeats")
    else:
        table = table.append_column("ts", pa.array(np.arange(events, dtype=np.int64)))
        q.source("visits", table, order_by="ts").key_by("user").window(
            cs.SlidingWindow(window_size, time="ts"), count=True, sum="item", hot_entries=hot,
            slices=SLICES, name="visits").sink(name="repeats")
    plan, sources = compile_query(q)
    pacing = CollectorPacing(JobOptions().full_gc_interval_s if host_gc else 0)
    pacing.install()
    try:
        before = anonymous_rss_kib()
        t0 = time.perf_counter()
        cl = LocalCluster(plan, initial_placement(plan, containers_per_stage(plan, 1)), sources,
                          checkpoint_every=checkpoint_every).run()
        elapsed = time.perf_counter() - t0
        grown = anonymous_rss_kib() - before  # the job's state is still alive here
    finally:
        pacing.uninstall()  # (a caller importing one_run gets its process's policy back)
    return {"events_per_s": events / elapsed, "rss_growth_mb": grown / 1024,
            "repeats": cl.results("repeats").num_rows}


def anonymous_rss_kib() -> int:
    """The process's anonymous resident memory (``RssAnon``, KiB): its heap, not the spill
    store's file pages mapped into it (clean page cache the kernel may drop)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/self/status (this benchmark reads Linux's)")


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=1_000_000, help="events (default 1,000,000)")
    p.add_argument("--users", type=int, default=2_000)
    p.add_argument("--items", type=int, default=5_000)
    p.add_argument("--limits", default="100000,10000",
                   help="hot limits to run beside no limit: entries in memory per slice, comma-separated")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="checkpoint every K epochs (full, then deltas, to a backup on the source's host); "
                        "default 0: no checkpoints")
    p.add_argument("--window", action="store_true", help="a sliding window per user instead of the map")
    p.add_argument("--window-size", type=int, default=100_000,
                   help="with --window: the window's size in events (ts units; default 100,000)")
    p.add_argument("--cpython-gc", action="store_true",
                   help="CPython's own garbage collection policy instead of a Ray host's (containers/gc_pacing.py)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    events = 100_000 if args.quick else args.events
    if args.one is not None:  # a child run: one configuration, its JSON on stdout
        hot = None if args.one == "none" else int(args.one)
        print(json.dumps(one_run(events, args.users, args.items, hot, args.checkpoint_every,
                                 args.window_size if args.window else None, not args.cpython_gc)))
        return
    limits = [None] + [int(x) for x in args.limits.split(",") if x]
    if any(h is not None and h < 1 for h in limits):
        raise SystemExit("--limits: a hot limit must be at least 1")
    runs: dict[int | None, list[dict]] = {h: [] for h in limits}
    for r in range(1 if args.quick else args.repeat):
        for h in (limits if r % 2 == 0 else limits[::-1]):
            cmd = [sys.executable, "-m", "benchmarks.spill", "--one", "none" if h is None else str(h),
                   "--events", str(events), "--users", str(args.users), "--items", str(args.items),
                   "--checkpoint-every", str(args.checkpoint_every)] + (
                       ["--window", "--window-size", str(args.window_size)] if args.window else []) + (
                       ["--cpython-gc"] if args.cpython_gc else [])
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[h].append(json.loads(out.strip().splitlines()[-1]))
    repeats = {runs[h][0]["repeats"] for h in limits}
    if len(repeats) != 1:
        raise SystemExit(f"the configurations disagree on the output's row count: {repeats}")
    base = median([x["events_per_s"] for x in runs[None]])
    rows = [{"hot_entries_per_slice": h,
             "events_per_s": round(median([x["events_per_s"] for x in runs[h]])),
             "vs_in_memory": round(median([x["events_per_s"] for x in runs[h]]) / base, 3),
             "rss_growth_mb": round(median([x["rss_growth_mb"] for x in runs[h]]), 1),
             "runs_events_per_s": [round(x["events_per_s"]) for x in runs[h]],
             "runs_rss_growth_mb": [round(x["rss_growth_mb"], 1) for x in runs[h]]} for h in limits]
    emit({"events": events, "users": args.users, "items": args.items, "slices": SLICES,
          "checkpoint_every": args.checkpoint_every, "window_size": args.window_size if args.window else None,
          "gc": "cpython" if args.cpython_gc else "host",
          "output_rows": repeats.pop(), "rows": rows}, args.json)


if __name__ == "__main__":
    main()
