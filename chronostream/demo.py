"""The demo job: running delay statistics per route over the 2013 NYC flights.

Owns: the demo's steps and its summary table. Spark (local[2]) feeds the
flights into a sequence-numbered source log; the job runs on Ray (started
in this process) reading that log; Spark validates the job's Parquet
output: exactly-once identities, and equality, row for row, with the same
running statistics computed by Spark SQL window functions. A third of the
way through, the failure harness (``chronostream.chaos``) kills one of the
route-statistics containers; its slices are rebuilt from their chained
backups by the two other containers. Half way through, the stage scales
out by one host, and at two thirds back in by one (live slice migration:
only the moving slices notice). The output must still validate.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pyarrow.compute as pc

import chronostream as cs
from chronostream.datasets import flights
from chronostream.chaos import Fault, apply_schedule
from chronostream.spark import feed, spark_session, validate, with_order


def build_query(log_dir: Path, out_dir: Path, slices: int = 32, name: str = "route_delays",
                epoch_events: int = 8192) -> cs.Query:
    """Per (origin, dest): running count, mean and max of the departure delay, in event-time order."""
    q = cs.Query(epoch_events=epoch_events)
    src = q.source_log(str(log_dir), "flights")
    departed = src.filter_batches(lambda t: pc.is_valid(t["dep_delay"]))
    departed.key_by(["origin", "dest"]).aggregate(count=True, mean=["dep_delay"], max=["dep_delay"],
                                                  slices=slices, name=name) \
        .sink(cs.ParquetSink(str(out_dir), name=name))
    return q


def expected_route_delays(flights_df):
    """The same running statistics computed in batch by Spark SQL (window functions)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F


    ordered = with_order(flights_df, ["sched_ts"]).where(F.col("dep_delay").isNotNull())
    w = Window.partitionBy("origin", "dest").orderBy("_order").rowsBetween(Window.unboundedPreceding, 0)
    return ordered.select("origin", "dest", "_order",
                          F.count(F.lit(1)).over(w).alias("count"),
                          F.avg("dep_delay").over(w).alias("mean_dep_delay"),
                          F.max("dep_delay").over(w).alias("max_dep_delay"))


def _recovery_lines(timeline: list, applied: list) -> list[tuple[str, str]]:
    """Summary lines for the fault and the recovery, times relative to the kill."""
    if not applied:
        return [("fault", "none injected: the job finished before the kill point")]
    t_kill, fault, hit = applied[0]
    rel = lambda t: f"+{(t - t_kill) * 1000:,.0f} ms"  # noqa: E731
    lines = [("fault", f"killed container {hit['container']} of stage {hit['stage']!r} at epoch {fault.at_epoch}")]
    for t, kind, info in timeline:
        if t < t_kill:
            continue
        if kind == "fault_detected":
            lines.append(("  detected", f"{rel(t)} by {info['by']}"))
        elif kind == "slices_restored":
            lines.append(("  restored", f"{rel(t)} slices {info['slices']} on host {info['host']} "
                                        f"(from epoch {min(info['resume'].values())})"))
        elif kind == "recovery_end":
            lines.append(("  recovered", f"{rel(t)} ({info['epochs_replayed']} epoch messages replayed "
                                         "from upstream output logs)"))
    firsts = [t for t, kind, _ in timeline if kind == "first_output" and t >= t_kill]
    if firsts:
        lines.append(("  first output", f"{rel(min(firsts))} (first recovered slice), {rel(max(firsts))} (last)"))
    return lines


def _migration_lines(timeline: list) -> list[tuple[str, str]]:
    """Summary lines for each migration: what moved where, how long, and each slice's output pause."""
    lines = []
    for t, kind, info in timeline:
        if kind != "migration_end":
            continue
        moved = sorted(s for tr in info["transfers"] for s in tr["slices"])
        pauses = [p for tr in info["transfers"] for p in tr.get("pause_ms", {}).values()]
        hosts = sorted({tr["host"] for tr in info["transfers"]})
        what = info["reason"].split(":")[0]
        released = f", released hosts {info['released_hosts']}" if info.get("released_hosts") else ""
        which = f"slices {moved}" if len(moved) <= 12 else f"{len(moved)} slices"
        lines.append((what, f"{which} -> host(s) {hosts} in {info['seconds']:.1f} s{released}"))
        if pauses:
            # (a compaction moves every slice of the hosts it merges: no others to speak of)
            others = "" if what == "compact" else " (others kept running)"
            lines.append(("  pause per slice", f"median {sorted(pauses)[len(pauses) // 2]:.0f} ms, "
                                               f"max {max(pauses):.0f} ms{others}"))
    return lines or [("scaling", "none applied: the job finished first")]


def run_demo(containers: int = 2, rows: int = 0, out: Path = Path("out/demo"), kill: bool = True,
             scale: bool = True, pace_s: float = 0.12) -> int:
    """Run the demo; print progress and a summary table; return the exit code (1 = invalid)."""

    print("ChronoStream demo: running departure-delay statistics per route, 2013 NYC flights")
    if kill:
        print("  (a route-statistics container is killed a third of the way through)")
    if scale:
        print("  (the route-statistics stage scales out by one host half way, back in at two thirds,")
        print("   and its containers on each host are merged into one at five sixths)")
    if out.exists():
        shutil.rmtree(out)
    log_dir, out_dir = out / "source-log", out / "route_delays"
    table = flights().select(["origin", "dest", "dep_delay", "sched_ts", "carrier", "flight"])
    if rows:
        table = table.slice(0, rows)
    print("  1/3 Spark feeds the flights into the source log ...", flush=True)
    t_feed = time.perf_counter()
    spark = spark_session("local[2]")
    df = spark.createDataFrame(table.to_pandas())
    fed = feed(df, log_dir, stream="flights", order_by=["sched_ts"])
    feed_s = time.perf_counter() - t_feed
    print("  2/3 the job runs on Ray ...", flush=True)
    cs.ensure_ray()
    t0 = time.perf_counter()
    query = build_query(log_dir, out_dir, epoch_events=4096)
    stats_containers = max(3, containers) if kill else containers
    # Paced from the first epoch, so the fault and the rescaling land mid-stream (a delay
    # injected after the start let the sources run ahead of the schedule).
    job = cs.run(query, containers={"flights": containers, "route_delays": stats_containers},
                 checkpoint_every=4 if kill or scale else 0, source_pace_s=pace_s if kill or scale else 0.0)
    applied: list = []
    try:
        epochs = job.plan.num_epochs or 1
        schedule = []
        if kill:
            schedule.append(Fault("kill", at_epoch=max(1, epochs // 3), stage="route_delays"))
        if scale:
            schedule += [Fault("scale_out", at_epoch=max(2, epochs // 2), stage="route_delays"),
                         Fault("scale_in", at_epoch=max(3, 2 * epochs // 3), stage="route_delays"),
                         Fault("compact", at_epoch=max(4, 5 * epochs // 6), stage="route_delays")]
        print(f"      dashboard: {job.status().dashboard_url}", flush=True)
        applied = [a for a in apply_schedule(job, schedule) if a[1].kind == "kill"]
        job.wait()  # (a bar of its epochs on a terminal)
        elapsed = time.perf_counter() - t0
        placement = job.placement()
        timeline = job.timeline()
    finally:
        job.stop()
    outputs = cs.read_parquet_sink(out_dir).num_rows
    print("  3/3 Spark validates the output ...", flush=True)
    t_val = time.perf_counter()
    report = validate(out_dir, expected_route_delays(df), key=["_order"], spark=spark, show=False)
    val_s = time.perf_counter() - t_val
    verdict = "PASS" if report.ok else "FAIL"
    lines = [
        ("events in", f"{fed.total_rows:,} flights (fed by Spark in {feed_s:.1f} s)"),
        ("outputs", f"{outputs:,} route updates (one per departed flight)"),
        ("containers", ", ".join(f"{k}: {len(v)}" for k, v in placement.stages.items())
         + " (at the end)"),
        ("job time", f"{elapsed:.1f} s (deploy + run + recovery + rescaling; the source is paced)"
                     if kill or scale else f"{elapsed:.1f} s (deploy + run)"),
        ("throughput", f"{fed.total_rows / elapsed:,.0f} events/s"
                       + (f" (source paced at {pace_s} s per epoch)" if kill or scale else "")),
        *(_recovery_lines(timeline, applied) if kill else [("faults", "none (--no-kill)")]),
        *(_migration_lines(timeline) if scale else [("scaling", "none (--no-scale)")]),
        ("output", str(out_dir)),
        ("validation", f"{verdict} (Spark, {val_s:.1f} s): {report.n_duplicates} duplicated, "
                       f"{report.n_missing_identities} missing identities, {report.n_unexpected} wrong rows"),
    ]
    width = max(len(k) for k, _ in lines)
    print("-" * 76)
    for k, v in lines:
        print(f"  {k:<{width}}  {v}")
    print("-" * 76)
    if not report.ok:
        print(report.summary())
    return 0 if report.ok else 1
