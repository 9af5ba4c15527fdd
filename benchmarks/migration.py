"""Execution delay of a live slice migration (paper Fig. 14), on Ray, by slice state size.

A keyed aggregation (count, sum, min, max, mean per key) runs with two
containers of two slices each; the input first touches every key (loading the
state) and then updates random keys at a steady pace (the source is
slowed a little). Chained backups (factor 1, a checkpoint every 2 epochs)
put each slice's backup on the other container's host. Then slice 0
moves to that host, two ways:

- ``reconstruct`` (ChronoStream): rebuilt from the destination's own
  backup while the source keeps running it (dual mode), released once
  the copy caught up;
- ``stop_copy`` (the baseline, implemented only for this comparison): the
  source container pauses, a fresh full snapshot is copied to the
  destination and restored there, then the slice restarts there.

The delay is what the slice's output sees: the largest gap between two
consecutive epochs of slice 0 reaching the sink from the call until
``SETTLE_S`` after it returned (the backup re-planning that follows a move
is part of it), minus the median gap before the call (the sink's write
times). The same measure
for a slice of the source container that does not move
(``unmoved_slice_delay_ms``) tells a gap of the move from one everybody
saw; ``reconstruct_gap_at_s`` says when the largest gap ended,
``reconstruct_gap_phase`` in which protocol phase it began (``before``:
before the call; ``done``: once the call was over, while backups are
re-planned), and
``*_gap_frozen_ms`` how much of that gap the whole machine did not run at
all (``benchmarks.common.FreezeMeter``: on the 2-vCPU VM the figures come
from, the hypervisor stops both vCPUs for 100-500 ms several times a
minute while GB states are loaded, merged and copied; ``*_window_frozen_ms``: over the
whole measured window). The delay is reported as measured, freezes
included. What the CPUs did over the window (``*_window_idle_pct``,
``*_window_system_pct``, ``*_window_steal_pct``; ``*_gap_steal_ms``: CPU time the hypervisor took
from the running vCPUs during the gap) says whether the machine was
saturated. The control (``no_migration_*``): the same job at the same point,
as long a window (the median call), no call at all: the gaps a job of that
state shows anyway. Also reported:
the call's duration (``migrate_s``) and the restore time at the
destination. Sizes are the slice's numpy state (``state_mb``).

By default the call comes 30 epochs after the state load, while the
backup holders still merge and persist the load's checkpoints;
``--steady-s S`` waits S seconds of steady updates more, to measure a
migration in steady state.

    python -m benchmarks.migration --json                    # 10 and 100 MB per slice
    python -m benchmarks.migration --json --sizes 10,100,500,1000
    python -m benchmarks.migration --json --sizes 1000 --steady-s 40
    python -m benchmarks.migration --json --sizes 1000 --rate 100000 --no-stop-copy   # more CPU headroom
    python -m benchmarks.migration --json --sizes 100 --no-stop-copy --no-shm   # messages through Ray only
"""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import chronostream as cs
from benchmarks.common import AGGREGATE_BYTES_PER_KEY, FreezeMeter, emit, median, parser
from chronostream.chaos import Fault, apply_schedule

SLICES = 4
EPOCH = 10_000
UPDATE_EPOCHS = 2000  # the job outlives any migration: it is stopped once measured
RATE = 200_000  # updates/s (``--rate``): the 2-core machine keeps headroom for the migration itself
SETTLE_S = 3.0  # gaps ending this long after the call returned still count (the re-planned backups' full checkpoints)


def make_query(n_keys: int, seed: int = 5) -> cs.Query:
    rng = np.random.default_rng(seed)
    updates = rng.integers(0, n_keys, UPDATE_EPOCHS * EPOCH)
    keys = np.concatenate([np.arange(n_keys), updates])
    table = pa.table({"k": pa.array(keys, pa.int64()), "v": pa.array(rng.integers(0, 1000, len(keys)), pa.int64())})
    q = cs.Query(epoch_events=EPOCH)
    q.source("events", table, slices=1).key_by("k") \
        .aggregate(count=True, sum=["v"], min=["v"], max=["v"], mean=["v"], slices=SLICES, name="agg") \
        .filter_batches(lambda t: pc.equal(pc.bit_wise_and(t["k"], 255), 0)).sink(name="sample")
    return q


def output_gap_ms(times: dict[tuple[int, int], float], slice_id: int, t0: float,
                  t1: float) -> tuple[float, float, float]:
    """(largest gap between consecutive epochs of ``slice_id`` reaching the sink within [t0, t1 + SETTLE_S],
    median gap before t0, in ms; when that gap ended, s after t0). An epoch counts when its first
    copy reached the sink."""
    ts = sorted(t for (s, _e), t in times.items() if s == slice_id)
    gaps = np.diff(ts) * 1000
    mids = np.array(ts[1:])
    before = gaps[mids < t0]
    window = (mids >= t0) & (mids <= t1 + SETTLE_S)
    during, ends = gaps[window], mids[window]
    normal = float(np.median(before[-30:])) if len(before) else 0.0
    if not len(during):
        return 0.0, normal, 0.0
    return float(during.max()), normal, float(ends[int(np.argmax(during))] - t0)


def one_run(state_mb: int, mode: str, steady_s: float = 0.0, window_s: float = 10.0, rate: int = RATE,
            **run_options) -> dict:
    """One job, one measurement: ``mode`` is ``reconstruct``, ``stop_copy`` or ``none`` (the
    control: the same job at the same point, no call, ``window_s`` of waiting instead); the
    updates come at ``rate`` a second (one epoch every ``EPOCH / rate`` s); ``run_options`` go to
    ``cs.run``."""
    pace_s = EPOCH / rate
    n_keys = state_mb * 1_000_000 * SLICES // AGGREGATE_BYTES_PER_KEY
    load_epochs = -(-n_keys // EPOCH)
    job = cs.run(make_query(n_keys), containers={"events": 1, "agg": 2}, checkpoint_every=2, backup_factor=1,
                 **run_options)
    try:
        apply_schedule(job, [Fault("delay", load_epochs, "events", seconds=pace_s)])
        apply_schedule(job, [Fault("delay", load_epochs + 30, "events", seconds=pace_s)])
        time.sleep(steady_s)
        placement = job.placement().stages["agg"]
        src = next(c for c, sl in placement.items() if 0 in sl)
        dst = next(c for c in placement if c != src)
        meter = FreezeMeter().start()
        t0 = time.time()
        if mode == "none":
            time.sleep(window_s)
            summary = None
        else:
            summary = job.migrate("agg", 0, to_container=dst, baseline=None if mode == "reconstruct" else "stop_copy")
        t1 = time.time()
        time.sleep(SETTLE_S + 1.0)  # epochs after the measured window
        meter.stop()
        if job.progress()["state"] != "running":
            raise RuntimeError("the job ended before the measurement: raise UPDATE_EPOCHS")
        times = job.sink_write_times("sample")
        gap, normal, gap_at = output_gap_ms(times, 0, t0, t1)
        # A slice that stays put, over the same window: is the gap the move's, or everyone's?
        stays = next(s for s in placement[src] if s != 0)  # on the source container, like slice 0
        still_gap, still_normal, _ = output_gap_ms(times, stays, t0, t1)
        tr = summary["transfers"][0] if summary is not None else {"phase": "none", "pause_ms": {}}
        gap_end = t0 + gap_at
        # The protocol phase the largest gap began in (phases_s: when each began, s after the call).
        began = gap_at - gap / 1000
        entered = [p for p, at in sorted(tr.get("phases_s", {}).items(), key=lambda kv: kv[1]) if at <= began]
        gap_phase = entered[-1] if entered else ("before" if summary is not None else "none")
        window = meter.cpu_shares(t0, t1 + SETTLE_S)
        return {"delay_ms": round(max(0.0, gap - normal), 1), "gap_ms": round(gap, 1), "normal_gap_ms": round(normal, 1),
                "gap_at_s": round(gap_at, 3), "gap_phase": gap_phase, "gap_frozen_ms": meter.frozen_ms(gap_end - gap / 1000, gap_end),
                "window_frozen_ms": meter.frozen_ms(t0, t1 + SETTLE_S),
                "window_idle_pct": round(100 * window.get("idle", 0.0), 1),
                "window_system_pct": round(100 * window.get("system", 0.0), 1),
                "window_steal_pct": round(100 * window.get("steal", 0.0), 1),
                "gap_steal_ms": round(1000 * meter.cpu_seconds(gap_end - gap / 1000, gap_end)["steal"], 1),
                "still_delay_ms": round(max(0.0, still_gap - still_normal), 1),
                "migrate_s": round(t1 - t0, 3), "phase": tr["phase"], "pause_ms": tr["pause_ms"].get(0),
                "phases_s": tr.get("phases_s", {})}
    finally:
        job.stop()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10,100", help="slice state sizes in MB, comma-separated")
    p.add_argument("--steady-s", type=float, default=0.0,
                   help="seconds of steady updates between the state load and the call (default 0)")
    p.add_argument("--rate", type=int, default=RATE,
                   help=f"updates a second after the load (default {RATE:,}; the source waits EPOCH / rate per epoch)")
    p.add_argument("--no-stop-copy", action="store_true",
                   help="skip the stop-copy baseline (its fields are null): the reconstruction and the control only")
    p.add_argument("--no-shm", action="store_true",
                   help="every epoch message through Ray's object store, none as shared-memory files "
                        "(cs.run(shm_transport=False))")
    p.add_argument("--alone", action="store_true",
                   help="run the aggregate's slices each alone, not as one slice group "
                        "(CHRONOSTREAM_GROUP_SLICES=0 in the containers' environment)")
    args = p.parse_args()
    if args.alone:
        os.environ["CHRONOSTREAM_GROUP_SLICES"] = "0"  # before Ray starts: its workers inherit it
    sizes = [5] if args.quick else [int(x) for x in args.sizes.split(",")]
    cs.ensure_ray(num_cpus=2)
    rows = []
    for mb in sizes:
        repeat = 1 if args.quick else args.repeat
        modes = ("reconstruct",) if args.no_stop_copy else ("reconstruct", "stop_copy")
        shm = {"shm_transport": not args.no_shm}
        runs = {m: [one_run(mb, m, args.steady_s, rate=args.rate, **shm) for _ in range(repeat)] for m in modes}
        # The control: as long a window at the same point of the same job, with no migration.
        window_s = median([r["migrate_s"] for r in runs["reconstruct"]])
        runs["none"] = [one_run(mb, "none", args.steady_s, window_s, rate=args.rate, **shm) for _ in range(repeat)]
        stop_copy = runs.get("stop_copy")

        def of_stop_copy(figure):  # the baseline's figures, null when it was skipped (--no-stop-copy)
            return figure(stop_copy) if stop_copy else None
        rows.append({
            "state_mb": mb,
            "reconstruct_delay_ms": round(median([r["delay_ms"] for r in runs["reconstruct"]]), 1),
            "stop_copy_delay_ms": of_stop_copy(lambda rs: round(median([r["delay_ms"] for r in rs]), 1)),
            "reconstruct_runs_ms": [r["delay_ms"] for r in runs["reconstruct"]],
            "stop_copy_runs_ms": of_stop_copy(lambda rs: [r["delay_ms"] for r in rs]),
            "normal_gap_ms": round(median([r["normal_gap_ms"] for r in runs["reconstruct"]]), 1),
            "reconstruct_migrate_s": round(median([r["migrate_s"] for r in runs["reconstruct"]]), 3),
            "reconstruct_phases_s": runs["reconstruct"][0]["phases_s"],
            "reconstruct_gap_at_s": [r["gap_at_s"] for r in runs["reconstruct"]],
            "reconstruct_gap_phase": [r["gap_phase"] for r in runs["reconstruct"]],
            "reconstruct_gap_frozen_ms": [r["gap_frozen_ms"] for r in runs["reconstruct"]],
            "reconstruct_window_frozen_ms": [r["window_frozen_ms"] for r in runs["reconstruct"]],
            "stop_copy_gap_frozen_ms": of_stop_copy(lambda rs: [r["gap_frozen_ms"] for r in rs]),
            "unmoved_slice_delay_ms": round(median([r["still_delay_ms"] for r in runs["reconstruct"]]), 1),
            "no_migration_delay_ms": round(median([r["delay_ms"] for r in runs["none"]]), 1),
            "no_migration_runs_ms": [r["delay_ms"] for r in runs["none"]],
            "reconstruct_window_idle_pct": [r["window_idle_pct"] for r in runs["reconstruct"]],
            "reconstruct_window_system_pct": [r["window_system_pct"] for r in runs["reconstruct"]],
            "reconstruct_window_steal_pct": [r["window_steal_pct"] for r in runs["reconstruct"]],
            "reconstruct_gap_steal_ms": [r["gap_steal_ms"] for r in runs["reconstruct"]],
            "no_migration_window_idle_pct": [r["window_idle_pct"] for r in runs["none"]],
            "no_migration_window_system_pct": [r["window_system_pct"] for r in runs["none"]],
            "no_migration_window_steal_pct": [r["window_steal_pct"] for r in runs["none"]],
            "no_migration_gap_steal_ms": [r["gap_steal_ms"] for r in runs["none"]],
            "reconstruct_pause_ms": round(median([r["pause_ms"] or 0.0 for r in runs["reconstruct"]]), 1),
            "stop_copy_migrate_s": of_stop_copy(lambda rs: round(median([r["migrate_s"] for r in rs]), 3)),
        })
    emit({"slices": SLICES, "epoch_events": EPOCH, "steady_s": args.steady_s, "rate": args.rate,
          "grouped": not args.alone, "shm_transport": not args.no_shm, "rows": rows},
         args.json)


if __name__ == "__main__":
    main()
