"""What a compaction costs the running job (``Job.compact``), on Ray, by slice state size.

The migration benchmark's job (``benchmarks.migration``: 2 containers of 2
aggregate slices, a checkpoint every 2 epochs to one chained backup,
steady updates after the state load). Slice 0 first moves to the other
host, which then runs two containers of the stage: its own and the one the
move made. Once that move has settled, ``job.compact("agg")`` merges them:
one new container on that host takes their 3 slices, rebuilt from
snapshots the old containers take in-process (a copy of their state),
while the old ones run them in dual mode until the release.

Reported per size (medians of ``--repeat`` jobs): the call's duration
(``compact_s``); the delay of the merged slices, the largest gap between
two consecutive epochs of a slice at the sink, from the call until 3 s
after it returned, minus that slice's median gap before the call, for
the worst of the 3 (``merged_delay_ms``); the same for the slice on the
other host, which does not move (``unmoved_delay_ms``: a gap everybody
saw); and the merged slices' pause (their last epoch in the old
container to their first in the new one, the master's measure). The
control (``control_*``): the same job at the same point, no call (as long
a wait as the call took): the gaps those slices show anyway, at 1 GB a
slice mostly the backups of the migration before (folds and flushes of
its chains).

    python -m benchmarks.compaction --json                    # 10 and 100 MB per slice
    python -m benchmarks.compaction --json --sizes 100 --repeat 5
"""

from __future__ import annotations

import time

import chronostream as cs
from benchmarks.common import AGGREGATE_BYTES_PER_KEY, emit, median, parser
from benchmarks.migration import EPOCH, RATE, SETTLE_S, SLICES, make_query, output_gap_ms
from chronostream.chaos import Fault, apply_schedule


def one_run(state_mb: int, rate: int = RATE, compact: bool = True) -> dict:
    """One job: load, move slice 0 to the other host, let it settle, then compact the stage there
    (``compact=False``: the control, no call; the window is as long as a small one's)."""
    n_keys = state_mb * 1_000_000 * SLICES // AGGREGATE_BYTES_PER_KEY
    load_epochs = -(-n_keys // EPOCH)
    job = cs.run(make_query(n_keys), containers={"events": 1, "agg": 2}, checkpoint_every=2, backup_factor=1)
    try:
        apply_schedule(job, [Fault("delay", load_epochs, "events", seconds=EPOCH / rate)])
        apply_schedule(job, [Fault("delay", load_epochs + 30, "events", seconds=EPOCH / rate)])
        before = job.placement().stages["agg"]
        src = next(c for c, sl in before.items() if 0 in sl)
        dst = next(c for c in before if c != src)
        job.migrate("agg", 0, to_container=dst)
        time.sleep(SETTLE_S + 1.0)
        after = job.placement().stages["agg"]
        merged = sorted(s for c, sl in after.items() if c != src for s in sl)  # the other host's slices
        unmoved = next(s for s in after[src])
        t0 = time.time()
        if compact:
            summary = job.compact("agg")
        else:  # the control: as long a window as a compaction's call, no call
            time.sleep(0.3)
            summary = {"transfers": []}
        t1 = time.time()
        time.sleep(SETTLE_S + 1.0)
        if job.progress()["state"] != "running":
            raise RuntimeError("the job ended before the measurement: raise benchmarks.migration.UPDATE_EPOCHS")
        times = job.sink_write_times("sample")

        def delay_ms(slice_id: int) -> float:
            gap, normal, _at = output_gap_ms(times, slice_id, t0, t1)
            return round(max(0.0, gap - normal), 1)
        pauses = [ms for tr in summary["transfers"] for ms in tr["pause_ms"].values()]
        return {"compact_s": round(t1 - t0, 3), "merged": merged,
                "merged_delay_ms": max(delay_ms(s) for s in merged), "unmoved_delay_ms": delay_ms(unmoved),
                "pause_ms": round(median(pauses), 1) if pauses else None,
                "containers_after": len(job.placement().stages["agg"]) if compact else None}
    finally:
        job.stop()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10,100", help="slice state sizes in MB, comma-separated")
    p.add_argument("--no-control", action="store_true", help="skip the control runs (no compaction)")
    args = p.parse_args()
    sizes = [5] if args.quick else [int(x) for x in args.sizes.split(",")]
    cs.ensure_ray(num_cpus=2)
    rows = []
    for mb in sizes:
        repeat = 1 if args.quick else args.repeat
        runs, control = [], []
        for _ in range(repeat):  # (interleaved: drift hits both alike)
            runs.append(one_run(mb))
            if not args.no_control:
                control.append(one_run(mb, compact=False))
        rows.append({
            "state_mb": mb,
            "compact_s": round(median([r["compact_s"] for r in runs]), 3),
            "merged_delay_ms": round(median([r["merged_delay_ms"] for r in runs]), 1),
            "merged_runs_ms": [r["merged_delay_ms"] for r in runs],
            "unmoved_delay_ms": round(median([r["unmoved_delay_ms"] for r in runs]), 1),
            "unmoved_runs_ms": [r["unmoved_delay_ms"] for r in runs],
            "pause_ms": round(median([r["pause_ms"] for r in runs if r["pause_ms"] is not None] or [0.0]), 1),
            "control_merged_delay_ms": round(median([r["merged_delay_ms"] for r in control]), 1) if control else None,
            "control_merged_runs_ms": [r["merged_delay_ms"] for r in control],
            "control_unmoved_delay_ms": round(median([r["unmoved_delay_ms"] for r in control]), 1) if control else None,
            "merged_slices": runs[0]["merged"],
            "containers_after": runs[0]["containers_after"],
        })
    emit({"slices": SLICES, "epoch_events": EPOCH, "rate": RATE, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
