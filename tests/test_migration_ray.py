"""Live scaling on Ray: real actors, real lmdb, slices migrating while the job runs.

Method: a two-stateful-stage query runs with many small epochs and a slowed
source (a ``delay`` fault), so rescaling lands mid-stream; the scaling
calls are scheduled with the failure harness (``chronostream.chaos``). Each
sink must equal the serial executor's row for row, and the master's
timeline must show every migration finishing.
"""

from __future__ import annotations

import pytest

import chronostream as cs
from chronostream.chaos import Fault, apply_schedule, compare_with_serial, run_with_faults
from chronostream.dag import compile_query
from chronostream.slices.errors import QueryError
from chronostream.master.migration import MigrationError
from queries import running_sum

EPOCH = 40
SLOW_SOURCE = Fault("delay", at_epoch=0, stage="payments", seconds=0.05)


def query(n: int = 8000) -> cs.Query:
    q = running_sum(6, n=n)
    q.epoch_events = EPOCH  # 200 epochs
    return q


def migrations(report) -> list[dict]:
    return [info for _, k, info in report.timeline if k == "migration_end"]


def hosts_of(report_or_job, stage: str) -> int:
    return len({report_or_job.placement().hosts[c] for c in report_or_job.placement().stages[stage]})


def test_scale_out_one_to_two_to_four_then_in_to_one_gives_the_serial_output(ray_session):
    faults = [SLOW_SOURCE, Fault("scale_out", 10, "running_sum", n=1), Fault("scale_out", 40, "running_sum", n=2),
              Fault("scale_in", 80, "running_sum", n=3)]
    report = run_with_faults(query(), faults, containers={"payments": 1, "running_sum": 1, "stats": 1},
                             checkpoint_every=4, settle_pace_s=0.25)
    assert report.ok, report.mismatches
    assert len(report.applied) == 4, "every rescale landed mid-stream"
    done = migrations(report)
    assert [len({t["host"] for t in m["transfers"]}) for m in done] == [1, 2, 1]
    assert [len({t["to"] for t in m["transfers"]}) for m in done] == [1, 2, 1], "one new container a host"
    assert len(done[2]["transfers"]) == 3, "the scale-in drained three containers into one"
    assert all(t["phase"] == "done" for m in done for t in m["transfers"])
    assert len(done[2]["released_hosts"]) == 3, "scale-in released the drained hosts"
    print(report.format_timeline())


def test_a_stage_without_checkpoints_scales_out_from_snapshots(ray_session):
    """No chained backups: the destination is warmed up with snapshots shipped by the source."""
    report = run_with_faults(query(4000), [SLOW_SOURCE, Fault("scale_out", 10, "stats", n=1)],
                             containers={"payments": 1, "running_sum": 1, "stats": 1})
    assert report.ok, report.mismatches
    (m,) = migrations(report)
    warm = [i for _, k, i in report.timeline if k == "migration_start"]
    assert warm and m["transfers"][0]["phase"] == "done"


def test_slices_that_are_not_moving_keep_producing_output_during_a_migration(ray_session):
    """Output timestamps: while one slice moves, the sink keeps receiving other slices' epochs."""
    job = cs.run(query(), containers={"payments": 1, "running_sum": 2, "stats": 1}, checkpoint_every=4)
    try:
        apply_schedule(job, [SLOW_SOURCE])
        moving = job.placement().stages["running_sum"]
        first = sorted(moving)[0]
        s = moving[first][0]
        apply_schedule(job, [Fault("delay", 20, "payments", seconds=0.05)])
        summary = job.migrate("running_sum", s)
        job.wait(timeout_s=300)
        events = {k: t for t, k, _ in job.timeline() if k in ("migration_start", "migration_end")}
        writes = job.sink_write_times("sums")
        during = {sl for (sl, _e), t in writes.items() if events["migration_start"] <= t <= events["migration_end"]}
        assert during - {s}, "other slices wrote output while the slice moved"
        (t,) = summary["transfers"]
        assert t["phase"] == "done" and t["slices"] == [s]
        mismatches, _ = compare_with_serial(job, query())
        assert not mismatches, mismatches
    finally:
        job.stop()


def test_a_copy_rebuilt_far_behind_catches_up_by_replay_before_it_joins_the_live_route(ray_session):
    """The destination restores a backup ~10 epochs old: the producer replays it up in rounds (reading
    its output log off its event loop) and routes live epochs to it only once it is within a window."""
    job = cs.run(query(), containers={"payments": 1, "running_sum": 2, "stats": 1}, checkpoint_every=40,
                 migration_warm_up_s=0)  # no warm-up: start from the old backup
    try:
        apply_schedule(job, [SLOW_SOURCE])
        placement = job.placement().stages["running_sum"]
        src, dst = sorted(placement)
        # Checkpoints at ~39 and ~79: move at ~50 with the source slowed to 0.15 s an epoch, so the
        # epoch-79 checkpoint is ~3.5 s away: a loaded machine's rebuild (a CI run once took long
        # enough at 20-epoch checkpoints for the next one to land first) still starts ~11 behind.
        apply_schedule(job, [Fault("delay", 50, "payments", seconds=0.15)])
        summary = job.migrate("running_sum", placement[src][0], to_container=dst)
        apply_schedule(job, [SLOW_SOURCE])
        (t,) = summary["transfers"]
        assert t["phase"] == "done"
        (caught_up,) = t["catch_up"].values()  # one producer: the payments container
        assert caught_up["rounds"] >= 2 and caught_up["epochs"] > 4, caught_up
        job.wait(timeout_s=300)
        mismatches, _ = compare_with_serial(job, query())
        assert not mismatches, mismatches
    finally:
        job.stop()


def test_a_migration_waits_for_a_fresh_backup_so_the_copy_starts_at_the_sources_epoch(ray_session):
    """Warm-up: the destination's chained backup is up to 20 epochs old when the call comes; the
    master waits (pausing nothing) for the next checkpoint round, so the copy resumes at or after
    the epoch the job had reached and has only the epochs of its rebuild to catch up."""
    job = cs.run(query(), containers={"payments": 1, "running_sum": 2, "stats": 1}, checkpoint_every=20)
    try:
        apply_schedule(job, [SLOW_SOURCE])
        placement = job.placement().stages["running_sum"]
        src, dst = sorted(placement)
        apply_schedule(job, [Fault("delay", 45, "payments", seconds=0.05)])  # newest backups: epoch 39
        reached = job.progress()["min_epoch"]
        summary = job.migrate("running_sum", placement[src][0], to_container=dst)
        (t,) = summary["transfers"]
        assert t["phase"] == "done" and t["warm_wait_s"] > 0
        assert min(t["resume"].values()) >= reached > 40, (t["resume"], reached)
        (caught_up,) = t["catch_up"].values()
        assert caught_up["epochs"] < 20, caught_up  # not the 20+ epochs since the old backup
        job.wait(timeout_s=300)
        mismatches, _ = compare_with_serial(job, query())
        assert not mismatches, mismatches
    finally:
        job.stop()


def test_a_scale_in_right_after_a_scale_out_does_not_wait_for_a_chain_no_round_extends(ray_session):
    """The scale-out moves slice 4 to a new host and re-plans its backups; the scale-in sends it
    back to a host that still holds its chain from the old placement, which no round extends any
    more. The warm-up does not wait for that chain (it waited the whole migration_warm_up_s): the
    slice is rebuilt at once from the newest backup there is (that chain, or a snapshot when the
    new chain is newer), and the output is exact."""
    slow = Fault("delay", at_epoch=0, stage="payments", seconds=0.15)  # 60 epochs: both land mid-stream
    faults = [slow, Fault("scale_out", 4, "running_sum", n=1), Fault("scale_in", 12, "running_sum", n=1)]
    report = run_with_faults(query(2400), faults, containers={"payments": 1, "running_sum": 4, "stats": 4},
                             checkpoint_every=2, migration_warm_up_s=20.0)
    assert report.ok, report.mismatches
    assert len(migrations(report)) == 2, report.format_timeline()
    _out, back = migrations(report)
    (t,) = back["transfers"]
    assert t["slices"] == [4] and t["phase"] == "done"
    assert t["warm_wait_s"] < 20.0, t  # not timed out


def move_one_slice_to_the_other_host(job) -> tuple[dict, int, int]:
    """Two containers of ``running_sum`` on two hosts: move the first one's first slice to the
    second one's host, mid-stream. Returns (the transfer, the moved slice, the source's host)."""
    apply_schedule(job, [SLOW_SOURCE])
    placement = job.placement().stages["running_sum"]
    src, dst = sorted(placement)
    moved = placement[src][0]
    apply_schedule(job, [Fault("delay", 20, "payments", seconds=0.05)])
    (t,) = job.migrate("running_sum", moved, to_container=dst)["transfers"]
    return t, moved, job.placement().hosts[src]


def backup_epochs_held(job, host: int, slice_id: int) -> list[int]:
    """Epochs of the backups of ``running_sum``'s slice ``slice_id`` that ``host`` holds."""
    import ray

    sid = next(st.stage_id for st in compile_query(query())[0].stages if st.name == "running_sum")
    held = ray.get(job.master.backup_catalog.remote()).get(host, [])
    return [e for st, sl, e in held if (st, sl) == (sid, slice_id)]


def kill_the_new_host_and_expect_the_serial_output(job, t: dict) -> None:
    import ray

    handles = ray.get(job.master.container_handles.remote())
    ray.kill(handles[t["to"]], no_restart=True)
    job.wait(timeout_s=300)
    assert "recovery_end" in [k for _, k, _ in job.timeline()]
    mismatches, _ = compare_with_serial(job, query())
    assert not mismatches, mismatches


def test_a_moved_slices_seeded_backup_chain_recovers_it_when_its_new_host_dies(ray_session):
    """After the move, the destination backs the slice up as the chain it restored from plus
    deltas (no full checkpoint) on the old source's host, the only other host of the stage;
    killing the destination then restores the slice from that seeded chain, exactly."""
    import time

    job = cs.run(query(), containers={"payments": 1, "running_sum": 2, "stats": 1}, checkpoint_every=2)
    try:
        t, moved, src_host = move_one_slice_to_the_other_host(job)
        restored_at = t["resume"][moved] - 1
        deadline = time.monotonic() + 60
        while True:  # the seed and a delta reached the old host: its chain ends after the restore point
            epochs = backup_epochs_held(job, src_host, moved)
            if job.statistics()[t["to"]].checkpoints_seeded >= 1 and epochs and max(epochs) > restored_at:
                break
            assert time.monotonic() < deadline, (epochs, restored_at)
            time.sleep(0.1)
        kill_the_new_host_and_expect_the_serial_output(job, t)
    finally:
        job.stop()


def test_ray_started_for_jobs_allocates_from_the_filesystem_at_once_when_the_object_store_is_full(ray_session):
    """``ensure_ray`` starts Ray without the 2 s wait before a filesystem allocation, which
    stalled every container of a job when a seed did not fit the store (``RAY_SYSTEM_CONFIG``).
    Read from the node the test run's Ray started (a private Ray attribute: no public API exposes it)."""
    node = ray_session._private.worker._global_node
    assert node._ray_params._system_config["oom_grace_period_s"] == 0


def test_a_migration_returns_only_once_the_moved_slice_is_backed_up_off_its_new_host(ray_session):
    """Two hosts: the sources release a moved slice only once a backup of it at least as new as
    its restore point sits on the other host (the machine's DUAL wait: ``backed_up_off_host``), so when the call
    returns that backup is in the master's catalog, and killing the new host at once (no wait)
    recovers the slice from it, exactly. Before (backup peers given at DONE), the other host held
    no backup of the slice when the call returned. (With the early peers but no wait, the
    backup arrives in time here by timing alone; the wait is what guarantees it.)"""
    job = cs.run(query(), containers={"payments": 1, "running_sum": 2, "stats": 1}, checkpoint_every=2)
    try:
        t, moved, src_host = move_one_slice_to_the_other_host(job)
        epochs = backup_epochs_held(job, src_host, moved)
        assert epochs and max(epochs) >= t["resume"][moved] - 1, (epochs, t["resume"])
        kill_the_new_host_and_expect_the_serial_output(job, t)
    finally:
        job.stop()


def test_compaction_after_a_recovery_leaves_one_container_a_host_and_its_backups_recover_it(ray_session):
    """A kill leaves the dead container's slices in new containers beside the survivors'
    (two on each host); ``compact`` merges them into one per host while the job runs, keeping
    a scaled-up container's threads; a later kill of one merged container is recovered from
    the backups it made. Output exact."""
    import time

    job = cs.run(query(12000), containers={"payments": 1, "running_sum": 3, "stats": 1}, checkpoint_every=2)
    try:
        apply_schedule(job, [SLOW_SOURCE, Fault("kill", 10, "running_sum")])

        def per_host() -> list[int]:
            view = job.placement()
            hosts = [view.hosts[c] for c in view.stages["running_sum"]]
            return sorted(hosts.count(h) for h in set(hosts))

        assert per_host() == [2, 2], "the recovery put a new container beside each survivor"
        scaled_up = min(job.placement().stages["running_sum"])
        job.scale_up(scaled_up, threads=1)  # (compact may come before it takes effect: it is asked for)
        done = job.compact("running_sum")
        assert {t["phase"] for t in done["transfers"]} == {"done"} and len(done["transfers"]) == 4
        for t in done["transfers"]:  # handed over in process at one epoch: no replay, no copy
            assert t["catch_up"] == {} and set(t["released_at"].values()) == {t["hand_over_epoch"]}, t
        assert per_host() == [1, 1]
        heir = next(t["to"] for t in done["transfers"] if t["from"] == scaled_up)
        deadline = time.monotonic() + 10  # (a thread table takes effect at the next epoch barrier)
        while job.statistics()[heir].threads != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert job.statistics()[heir].threads == 2, "the merged container keeps the scaled-up threads"
        assert job.compact("running_sum")["transfers"] == [], "nothing left to merge"
        apply_schedule(job, [Fault("kill", job.progress()["min_epoch"] + 10, "running_sum")])
        job.wait(timeout_s=300)
        assert [k for _, k, _ in job.timeline()].count("recovery_end") == 2
        mismatches, _ = compare_with_serial(job, query(12000))
        assert not mismatches, mismatches
    finally:
        job.stop()


def test_the_compaction_rule_compacts_after_a_recovery_in_the_autoscaler_loop(ray_session):
    """With ``autoscale=CompactionRule()``, the master's loop compacts the stage once a kill left
    two containers on each host; the decision is in the timeline and the output is exact."""
    from chronostream.master.policies import CompactionRule

    job = cs.run(query(), containers={"payments": 1, "running_sum": 3, "stats": 1}, checkpoint_every=2,
                 autoscale=CompactionRule(quiet_s=0, cooldown_s=1000), autoscale_interval_s=0.3)
    try:
        apply_schedule(job, [SLOW_SOURCE, Fault("kill", 10, "running_sum")])
        job.wait(timeout_s=300)
        decisions = [i["action"] for _, k, i in job.timeline() if k == "autoscale_decision"]
        assert any(d.startswith("compact running_sum") for d in decisions), decisions
        view = job.placement()
        hosts = [view.hosts[c] for c in view.stages["running_sum"]]
        assert len(hosts) == len(set(hosts)) == 2, view
        mismatches, _ = compare_with_serial(job, query())
        assert not mismatches, mismatches
    finally:
        job.stop()


def test_scaling_requested_while_a_container_dies_still_gives_the_serial_output(ray_session):
    """A kill and a scale-out at once: the master runs one after the other (one control
    operation at a time); whichever comes first, the output is exact."""
    faults = [SLOW_SOURCE, Fault("kill", 15, "stats", index=0), Fault("scale_out", 15, "stats", n=1)]
    job = cs.run(query(), containers={"payments": 1, "running_sum": 1, "stats": 2}, checkpoint_every=2)
    try:
        apply_schedule(job, faults, settle=False)
        job.wait(timeout_s=300)
        kinds = [k for _, k, _ in job.timeline()]
        assert "recovery_end" in kinds and "migration_end" in kinds
        mismatches, _ = compare_with_serial(job, query())
        assert not mismatches, mismatches
    finally:
        job.stop()


def test_a_stage_scaled_in_to_one_host_is_backed_up_off_it_and_its_death_restores_it_there(ray_session):
    """After the scale-in the stage has no peer of its own: its chain moves to the job's other
    hosts (re-planned once the drained host is released). Its host then dies: those hosts restore
    every slice from a checkpoint taken after the scale-in, and the output is exact."""
    faults = [SLOW_SOURCE, Fault("scale_in", 10, "running_sum", n=1), Fault("kill", 40, "running_sum")]
    report = run_with_faults(query(), faults, containers={"payments": 1, "running_sum": 2, "stats": 2},
                             checkpoint_every=2)
    assert report.ok, report.mismatches
    assert len(report.applied) == 3, report.format_timeline()
    (scaled_in,) = migrations(report)
    assert len(scaled_in["released_hosts"]) == 1
    starts = [i for _, k, i in report.timeline if k == "recovery_start"]
    assert sorted(s for i in starts for s in i["slices"]) == list(range(6)), report.format_timeline()
    assert len({i["host"] for i in starts}) > 1, "the other stages' hosts rebuild a share each (no new host)"
    assert all(e > 10 for i in starts for e in i["backup_epochs"].values()), report.format_timeline()


def test_copies_a_scale_out_left_off_the_chain_are_dropped_while_the_job_runs(ray_session):
    """The scale-out re-plans the stage's backup chain over three hosts: the copies the old
    chain left on hosts no longer in it are dropped by GC once the new chain holds newer ones,
    and the output is still the serial one."""
    q = query(2400)
    q.epoch_events = 20  # 120 epochs
    job = cs.run(q, containers={"payments": 1, "running_sum": 2, "stats": 1}, checkpoint_every=2,
                 gc_interval_s=0.25)
    try:
        apply_schedule(job, [Fault("delay", 0, "payments", seconds=0.04), Fault("scale_out", 20, "running_sum", n=1)])
        job.wait(timeout_s=180)
        import ray
        status = ray.get(job.master.status.remote())
        mismatches, _ = compare_with_serial(job, query(2400))
        assert not mismatches, mismatches
        sid = next(st.stage_id for st in job.plan.stages if st.name == "running_sum")
        dropped = [i for _, k, i in job.timeline() if k == "stale_backups_dropped"]
        chain = ray.get(job.master.backup_plan.remote())[sid]
        held = ray.get(job.master.backup_catalog.remote())
    finally:
        job.stop()
    assert status.stale_backups_dropped > 0 and any(st == sid for i in dropped for st, _ in i["slices"])
    for i in dropped:  # the host dropped copies of slices whose chain it is not in, and holds them no more
        gone = [s for st, s in i["slices"] if st == sid]
        assert all(i["host"] not in chain[s] for s in gone)
        assert not {(sid, s) for s in gone} & {(st, s) for st, s, _e in held.get(i["host"], [])}


def test_bad_scaling_requests_are_refused_with_a_clear_error(ray_session):
    job = cs.run(query(2000), containers={"payments": 1, "running_sum": 1, "stats": 1})
    try:
        with pytest.raises(QueryError, match="no stage 'nope'; its stages are"):
            job.scale_out("nope")
        with pytest.raises(MigrationError, match="cannot remove 1"):
            job.scale_in("stats", 1)
        with pytest.raises(MigrationError, match="no slices \\[99\\]"):
            job.migrate("stats", 99)
        job.wait(timeout_s=120)
        with pytest.raises(MigrationError, match="finished"):
            job.scale_out("stats")
    finally:
        job.stop()


def test_threads_scaled_up_and_down_mid_stream_give_the_serial_output(ray_session):
    """Vertical scaling: a container's slices move onto 3 threads and back to 1 while it runs."""
    job = cs.run(query(4000), containers={"payments": 1, "running_sum": 1, "stats": 1})
    try:
        apply_schedule(job, [SLOW_SOURCE, Fault("delay", 10, "payments", seconds=0.05)])
        (c,) = job.placement().stages["stats"]
        up = job.scale_up(c, 2)
        assert up["threads"] == 3
        apply_schedule(job, [Fault("delay", 40, "payments", seconds=0.05)])
        assert job.statistics()[c].threads == 3, "in effect from the next epoch"
        down = job.scale_down(c, 2)
        assert down["threads"] == 1 and down["from_epoch"] > up["from_epoch"]
        with pytest.raises(MigrationError, match="no live container 999"):
            job.scale_up(999)
        job.wait(timeout_s=300)
        mismatches, _ = compare_with_serial(job, query(4000))
        assert not mismatches, mismatches
    finally:
        job.stop()


def run_cli(*args: str) -> "subprocess.CompletedProcess[str]":
    """``chronostream ARGS`` in a new process (as a user's shell runs it), its output captured;
    a control command is given the test run's Ray cluster by address (``auto`` would refuse to
    choose when another Ray cluster runs on the machine)."""
    import subprocess
    import sys

    import ray

    control = args[0] in ("jobs", "status", "attach", "stop", "placement", "metrics", "log-floor", "scale-out", "scale-in", "migrate", "compact",
                          "scale-up", "scale-down", "warm-hosts")
    address = ["--address", ray.get_runtime_context().gcs_address] if control else []
    return subprocess.run([sys.executable, "-m", "chronostream", *args, *address], capture_output=True, text=True,
                          timeout=120)


def test_the_cli_lists_a_running_job_and_scales_it_out(ray_session):
    """``chronostream jobs`` / ``scale-out`` / ``placement`` / ``compact`` from another process, against a
    running job."""
    import json

    # 300 epochs of at least 50 ms: four CLI processes (each starts Python and connects to Ray)
    # and a scale-out that waits for an off-host backup fit before the job ends (at 100 epochs
    # the compaction call once came after the job's end and failed).
    job = cs.run(query(12000), containers={"payments": 1, "running_sum": 1, "stats": 1})
    try:
        apply_schedule(job, [SLOW_SOURCE, Fault("delay", 5, "payments", seconds=0.05)])

        def cli(*args: str) -> object:
            run = run_cli(*args)
            assert run.returncode == 0, (args, run.stderr[-2000:])
            return json.loads(run.stdout.strip().splitlines()[-1])

        assert {"name": job.key, "state": "running", "address": ray_session.get_runtime_context().gcs_address,
                "workdir": job.workdir, "submitted": False} in cli("jobs")
        moved = cli("scale-out", job.key, "stats", "-n", "1")
        assert moved["transfers"] and all(t["phase"] == "done" for t in moved["transfers"])
        assert len(set(cli("placement", job.key)["hosts"].values())) >= 4
        assert cli("compact", job.key, "stats")["transfers"] == [], "one container a host: nothing to merge"
        job.wait(timeout_s=300)
        mismatches, _ = compare_with_serial(job, query(12000))
        assert not mismatches, mismatches
    finally:
        job.stop()


def test_the_cli_refuses_to_rescale_a_finished_or_unknown_job_in_one_line_naming_why(ray_session):
    """A control command against a job that has ended (or never ran) exits 1 with
    ``chronostream COMMAND: why`` on stderr, not a traceback."""
    job = cs.run(query(400), containers={"payments": 1, "running_sum": 1, "stats": 1})
    try:
        job.wait(timeout_s=120)
        ended = run_cli("compact", job.key, "stats")
        assert ended.returncode == 1, ended.stderr[-2000:]
        assert ended.stderr.strip().splitlines()[-1] == \
            "chronostream compact: the job is finished: nothing to rescale", ended.stderr[-2000:]
        assert "Traceback" not in ended.stderr
        no_log = run_cli("log-floor", job.key)
        assert no_log.returncode == 1 and "Traceback" not in no_log.stderr
        assert no_log.stderr.strip().splitlines()[-1] == \
            "chronostream log-floor: the job reads no source log (its sources are in-memory tables)", no_log.stderr
    finally:
        job.stop()
    unknown = run_cli("placement", "no-such-job")
    assert unknown.returncode == 1 and "Traceback" not in unknown.stderr
    assert unknown.stderr.strip().splitlines()[-1].startswith("chronostream placement: no job 'no-such-job' runs on "
                                                              "the Ray cluster at ")


def test_job_metrics_report_rates_backlog_state_and_latency_percentiles(ray_session):
    job = cs.run(query(4000), containers={"payments": 1, "running_sum": 2, "stats": 1})
    try:
        apply_schedule(job, [SLOW_SOURCE, Fault("delay", 10, "payments", seconds=0.05)])
        job.metrics()
        apply_schedule(job, [Fault("delay", 30, "payments", seconds=0.05)])
        m = job.metrics()
        stage = m["snapshot"]["stages"]["running_sum"]
        assert stage["hosts"] == 2 and stage["input_rate"] > 0 and 0 < stage["utilization"] <= 2
        assert stage["processing_rate"] > stage["input_rate"], "a slowed source leaves the stage idle part of the time"
        assert len(stage["per_slice"]) == 6 and sum(x["state_keys"] for x in stage["per_slice"]) > 0
        lat = m["latency_total"]
        assert lat["count"] > 0 and 0 < lat["p50_ms"] <= lat["p99_ms"] <= lat["p999_ms"] <= lat["max_ms"]
        assert m["snapshot"]["host_rss_mb"] and m["snapshot"]["throughput"] > 0
        job.wait(timeout_s=300)
    finally:
        job.stop()


def test_a_master_killed_in_the_middle_of_a_scale_out_settles_it_once_restarted(ray_session):
    """The master dies while a scale-out runs; Ray restarts it and retries the call, which the
    restarted master answers once (settling the migration it finds in its catalog, never running
    it twice); the output is the serial executor's."""
    import threading
    import time

    import ray

    job = cs.run(query(), containers={"payments": 1, "running_sum": 1, "stats": 1}, checkpoint_every=4)
    result: list = []
    try:
        apply_schedule(job, [SLOW_SOURCE, Fault("delay", 10, "payments", seconds=0.05)])
        caller = threading.Thread(target=lambda: result.append(job.scale_out("running_sum", 1)))
        caller.start()
        time.sleep(1.5)  # the new host is starting: the migration is in progress
        ray.kill(job.master, no_restart=False)
        caller.join(timeout=240)
        job.wait(timeout_s=300)
        kinds = [k for _, k, _ in job.timeline()]
        assert "master_restarted" in kinds
        assert result and result[0]["transfers"], "the retried call got an answer"
        assert kinds.count("migration_start") == 1, "the retried call did not start a second migration"
        hosts = {job.placement().hosts[c] for c in job.placement().stages["running_sum"]}
        assert len(hosts) in (1, 2), hosts
        mismatches, _ = compare_with_serial(job, query())
        assert not mismatches, mismatches
    finally:
        job.stop()


def test_a_master_killed_while_a_compaction_waits_for_its_handover_undoes_it_once_restarted(ray_session):
    """One of the merged containers is paused (the stop-copy baseline's ``freeze``), so the
    compaction waits for its handover epoch; the master dies meanwhile. The restarted master
    finds the compaction in its catalog and, the handover not having happened, undoes it
    (cancelled atomically on the host, the sources go on with their slices); the retried call
    is answered once; a second compaction then merges the host; the output is exact."""
    import threading
    import time

    import ray

    job = cs.run(query(), containers={"payments": 1, "running_sum": 2, "stats": 1}, checkpoint_every=4)
    result: list = []
    try:
        apply_schedule(job, [SLOW_SOURCE, Fault("delay", 10, "payments", seconds=0.05)])
        view = job.placement()
        first, second = sorted(view.stages["running_sum"])
        job.migrate("running_sum", view.stages["running_sum"][first][0], to_container=second)
        handle = ray.get(job.master.host_handles.remote())[job.placement().hosts[second]]
        ray.get(handle.freeze.remote(second, True))
        caller = threading.Thread(target=lambda: result.append(job.compact("running_sum")))
        caller.start()
        time.sleep(1.5)
        ray.kill(job.master, no_restart=False)
        caller.join(timeout=240)
        kinds = [k for _, k, _ in job.timeline()]
        assert "master_restarted" in kinds and "migration_resumed" in kinds, kinds
        assert result and {t["phase"] for t in result[0]["transfers"]} == {"aborted"}, result
        assert kinds.count("migration_start") == 2, "the migration and one compaction, not two"
        again = job.compact("running_sum")
        assert again["transfers"] and {t["phase"] for t in again["transfers"]} == {"done"}, again
        job.wait(timeout_s=300)
        mismatches, _ = compare_with_serial(job, query())
        assert not mismatches, mismatches
    finally:
        job.stop()


def test_a_producer_dying_while_a_compaction_waits_undoes_it_and_recovery_gives_the_serial_output(ray_session):
    """The compaction waits for its handover epoch (one merged container paused) when the host
    of the stage feeding it dies: the master sees the death, undoes the compaction (the sources
    keep their slices, the new container goes), recovers the producer, and the output is exact."""
    import threading
    import time

    import ray

    job = cs.run(query(), containers={"payments": 1, "running_sum": 2, "stats": 1}, checkpoint_every=4)
    result: list = []
    try:
        apply_schedule(job, [SLOW_SOURCE, Fault("delay", 10, "payments", seconds=0.05)])
        view = job.placement()
        first, second = sorted(view.stages["running_sum"])
        job.migrate("running_sum", view.stages["running_sum"][first][0], to_container=second)
        view = job.placement()
        handles = ray.get(job.master.host_handles.remote())
        ray.get(handles[view.hosts[second]].freeze.remote(second, True))
        caller = threading.Thread(target=lambda: result.append(job.compact("running_sum")))
        caller.start()
        time.sleep(1.0)
        (producer,) = view.stages["payments"]
        ray.kill(handles[view.hosts[producer]])
        caller.join(timeout=240)
        assert result and {t["phase"] for t in result[0]["transfers"]} == {"aborted"}, result
        job.wait(timeout_s=300)
        assert "recovery_end" in [k for _, k, _ in job.timeline()]
        mismatches, _ = compare_with_serial(job, query())
        assert not mismatches, mismatches
    finally:
        job.stop()


def test_a_source_stage_migrated_onto_a_host_with_its_sibling_is_compacted_and_exact(ray_session):
    """A source stage's migration makes one new container per source container, so moving a
    slice onto the host of another source container leaves that host two; ``compact`` merges
    them at one handover epoch the host fixes (there is no producer to mark one). Exact."""
    job = cs.run(query(), containers={"payments": 2, "running_sum": 1, "stats": 1}, checkpoint_every=4)
    try:
        apply_schedule(job, [SLOW_SOURCE])
        view = job.placement()
        first, second = sorted(view.stages["payments"])
        job.migrate("payments", view.stages["payments"][first][0], to_container=second)
        hosts = job.placement().hosts
        assert sorted(hosts[c] for c in job.placement().stages["payments"]).count(hosts[second]) == 2
        done = job.compact("payments")
        assert {t["phase"] for t in done["transfers"]} == {"done"} and len({t["to"] for t in done["transfers"]}) == 1
        after = job.placement()
        assert len({after.hosts[c] for c in after.stages["payments"]}) == len(after.stages["payments"]) == 2
        job.wait(timeout_s=300)
        mismatches, _ = compare_with_serial(job, query())
        assert not mismatches, mismatches
    finally:
        job.stop()
