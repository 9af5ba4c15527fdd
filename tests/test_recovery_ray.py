"""Recovery on Ray: real actors killed mid-stream, real lmdb output logs and backup stores.

Method: a two-stateful-stage query runs with many small epochs; the source
is slowed down (a ``delay`` fault) so faults land mid-stream; the failure
harness (``chronostream.chaos``) kills hosts as the job passes given
epochs. Each sink must equal the serial executor's row for row, and the
recovery timeline must show what the issue promises (parallel rebuild,
replica fallback, first output after recovery).
"""

from __future__ import annotations

import time

import pytest

import chronostream as cs
from chronostream.chaos import Fault, apply_schedule, compare_with_serial, inject, run_with_faults
from chronostream.slices.errors import SinkRowsLost
from chronostream.master.recovery import RECOVERY_STEPS
from campaigns import campaign_schedule, seeded_campaign
from queries import rekey_pipeline, running_sum

EPOCH = 40


def query() -> cs.Query:
    q = running_sum(6, n=2400)
    q.epoch_events = EPOCH  # 60 epochs
    return q


SLOW_SOURCE = Fault("delay", at_epoch=0, stage="payments", seconds=0.06)


def kinds(report) -> list[str]:
    return [k for _, k, _ in report.timeline]


def test_a_killed_container_is_rebuilt_in_parallel_by_its_peers_and_the_output_is_exact(ray_session):
    report = run_with_faults(query(), [SLOW_SOURCE, Fault("kill", at_epoch=15, stage="running_sum")],
                             containers={"payments": 1, "running_sum": 3, "stats": 2}, checkpoint_every=2)
    assert report.ok, report.mismatches
    assert "fault_detected" in kinds(report) and "recovery_end" in kinds(report)
    restored = [i for _, k, i in report.timeline if k == "slices_restored"]
    assert len({i["host"] for i in restored}) == 2, "both peers rebuild a share of the dead container's slices"
    assert "first_output" in kinds(report)
    print(report.format_timeline())


@pytest.mark.parametrize("stage", ["running_sum", "payments"])
def test_a_stage_on_one_host_is_restored_from_its_backups_on_other_stages_hosts(ray_session, stage):
    """A one-container stage chains its backups over the job's other hosts: its host's death is a
    parallel restore on them from a checkpoint (a source does not re-read its input from epoch 0)."""
    report = run_with_faults(query(), [SLOW_SOURCE, Fault("kill", at_epoch=15, stage=stage)],
                             containers={"payments": 1, "running_sum": 1, "stats": 2}, checkpoint_every=2)
    assert report.ok, report.mismatches
    starts = [i for _, k, i in report.timeline if k == "recovery_start"]
    assert len({i["host"] for i in starts}) > 1, report.format_timeline()
    assert all(e >= 2 for i in starts for e in i["backup_epochs"].values()), report.format_timeline()


def test_two_containers_killed_at_once_recover_with_backup_factor_two(ray_session):
    report = run_with_faults(query(), [SLOW_SOURCE, Fault("kill_two", at_epoch=12, stage="stats")],
                             containers={"payments": 1, "running_sum": 2, "stats": 3}, checkpoint_every=2,
                             backup_factor=2)
    assert report.ok, report.mismatches
    assert kinds(report).count("slices_restored") >= 1


def test_a_corrupt_replica_is_refused_by_its_checksum_and_the_other_used(ray_session):
    faults = [SLOW_SOURCE, Fault("corrupt_backup", at_epoch=10, stage="running_sum"),
              Fault("kill", at_epoch=10, stage="running_sum")]
    report = run_with_faults(query(), faults, containers={"payments": 1, "running_sum": 3, "stats": 1},
                             checkpoint_every=2, full_checkpoint_every=100, backup_factor=2)
    assert report.ok, report.mismatches
    assert "backup_rejected" in kinds(report)
    # the damaged holder had the copy, and the kill's restore refused it and used the other replica
    assert not report.not_landed(), report.format_landings() + "\n" + report.format_timeline()


def test_without_checkpoints_a_killed_containers_slices_are_recomputed_from_the_start(ray_session):
    report = run_with_faults(query(), [SLOW_SOURCE, Fault("kill", at_epoch=15, stage="stats", index=1)],
                             containers={"payments": 2, "running_sum": 2, "stats": 2})
    assert report.ok, report.mismatches


CAMPAIGN_KINDS = ("kill", "kill", "kill_two", "corrupt_backup", "delay", "kill_master")


#: Faults mixed with rescaling: the stage of a scale-out, scale-in or migration is drawn like a kill's.
ELASTIC_KINDS = ("kill", "scale_out", "scale_in", "migrate", "kill_master")


#: The source's pace while a campaign's fault settles: a recovery or master restart that takes
#: seconds on a loaded machine must not let the job run out of input before the later faults
#: land (a clean-clone CI run once saw seed 6's last fault, at epoch 46 of 60, overtaken).
CAMPAIGN_SETTLE_PACE_S = 0.5


#: The campaigns' hosts: one for the source, 4 for each stateful stage.
CAMPAIGN_HOSTS = {"payments": 1, "running_sum": 4, "stats": 4}


def campaign(seed: int, n: int, kinds: tuple[str, ...] = CAMPAIGN_KINDS, source_delay_s: float = 0.1):
    """``n`` seeded faults on the running sum's two stateful stages, 4 hosts each, before epoch 48.

    ``source_delay_s``: the source's pace; each fault waits for the previous one's recovery or
    master restart (a rescaling blocks the schedule about a second), so the source must leave
    time for every fault to land before the end (at 0.06 s an epoch a clean-clone run once saw
    the last kill of seed 1 overtaken by the job's end; rescalings need 0.15). Every fault must
    land (``seeded_campaign``)."""
    return seeded_campaign(query(), CAMPAIGN_HOSTS, ["running_sum", "stats"], seed, n, 48, kinds,
                           source_delay_s=source_delay_s, settle_pace_s=CAMPAIGN_SETTLE_PACE_S)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seeded_random_fault_campaign_ends_with_exact_output(ray_session, seed):
    """3 runs x 4 faults (kills, double kills, corrupt replicas, delays, master kills), seeded."""
    campaign(seed, 4)


@pytest.mark.extended
@pytest.mark.parametrize("seed", range(100, 110))
def test_large_seeded_fault_campaign(ray_session, seed):
    """Opt-in (``pytest -m campaign``): 10 runs x 6 faults."""
    campaign(seed, 6)


@pytest.mark.parametrize("seed", [9, 14])
def test_seeded_random_campaign_of_faults_and_rescaling_ends_with_exact_output(ray_session, seed):
    """Regression (issue 59, tests that cannot fail): 2 runs x 5 faults: kills mixed with
    scale-outs, scale-ins and single-slice migrations of both stateful stages, seeded (seed 9 kills
    a stats host, scales stats out, migrates, kills a running_sum host and scales it in; seed 14
    kills two running_sum hosts, then migrates and scales). The hosts that died are exactly the
    ones killed, and every container a recovery made that still runs at the end has a first
    output after recovery for each of its slices (the campaign checks that every sink equals the
    serial run and that every fault landed). Before, the test asserted that first outputs came
    from recovered containers, which the timeline guarantees, on seeds that scheduled no kill."""
    schedule = campaign_schedule(query(), CAMPAIGN_HOSTS, ["running_sum", "stats"], seed, 5, 48, ELASTIC_KINDS,
                                 source_delay_s=0.15)
    assert [f.kind for f in schedule].count("kill") == 2, schedule
    report = campaign(seed, 5, ELASTIC_KINDS, source_delay_s=0.15)
    events = report.timeline
    killed = {hit["host"] for _, f, hit in report.applied if f.kind == "kill"}
    died = {h for _, k, i in events if k == "recovery_planning" and i["containers"] for h in i["hosts"]}
    assert died == killed and len(killed) == 2, report.format_timeline()
    # (a recovery's container whose slices moved on, or that died in a later kill, has no first output)
    moved_off = {t["from"] for _, k, i in events if k == "migration_start" for t in i["transfers"]} | \
        {c for _, k, i in events if k == "recovery_end" for c in i["containers"]}
    restored = {i["container"]: set(i["slices"]) for _, k, i in events if k == "slices_restored"}
    firsts: dict[int, set[int]] = {}
    for _, k, i in events:
        if k == "first_output":
            firsts.setdefault(i["container"], set()).add(i["slice"])
    still_there = [c for _, k, i in events if k == "recovery_end" for c in i["new"] if c not in moved_off]
    assert still_there, "a recovery's container runs to the end: " + report.format_timeline()
    for c in still_there:
        assert firsts.get(c) == restored[c], (c, firsts.get(c), restored[c], report.format_timeline())


@pytest.mark.extended
@pytest.mark.parametrize("seed", range(200, 210))
def test_large_seeded_campaign_of_faults_and_rescaling(ray_session, seed):
    """Opt-in (``pytest -m campaign``): 10 runs x 6 faults and rescalings."""
    campaign(seed, 6, ELASTIC_KINDS, source_delay_s=0.15)


#: Master deaths in the middle of recoveries, among kills, master kills and rescalings.
MASTER_IN_RECOVERY_KINDS = ("kill", "kill_master_in_recovery", "kill_master_in_recovery", "scale_out", "migrate",
                            "kill_master")


def test_a_seeded_campaign_with_master_deaths_in_recoveries_ends_with_exact_output(ray_session):
    """One run of 5 faults (seed 6): a master death at step `restored` of one recovery and at `detected`
    of another, a migration, a kill and a master kill."""
    report = campaign(6, 5, MASTER_IN_RECOVERY_KINDS, source_delay_s=0.15)
    assert [k for k in kinds(report) if k == "recovery_resumed"], report.format_timeline()


@pytest.mark.extended
@pytest.mark.parametrize("seed", range(400, 410))
def test_large_seeded_campaign_with_master_deaths_in_recoveries(ray_session, seed):
    """Opt-in (``pytest -m campaign``): 10 runs x 6 faults, master deaths in recoveries among them."""
    campaign(seed, 6, MASTER_IN_RECOVERY_KINDS, source_delay_s=0.15)


def test_a_seeded_campaign_of_kills_rescaling_and_compactions_ends_with_exact_output(ray_session):
    """One run of 6 (seed 311): a kill, a compaction, a scale-in, a master kill, a migration and a
    compaction, so the compactions' handovers merge containers a kill and a scale-in left, between
    other faults."""
    report = campaign(311, 6, ELASTIC_KINDS + ("compact", "compact"), source_delay_s=0.15)
    merged = [i for _, k, i in report.timeline if k == "migration_end" and i["reason"].startswith("compact")]
    assert len(merged) >= 2 and all(t["phase"] == "done" for i in merged for t in i["transfers"]), merged


@pytest.mark.extended
@pytest.mark.parametrize("seed", range(300, 310))
def test_large_seeded_campaign_of_faults_rescaling_and_compaction(ray_session, seed):
    """Opt-in (``pytest -m campaign``): 10 runs x 6 faults, rescalings and compactions (``compact``
    merges the containers kills and scale-ins leave on a host, handing their slices over in process)."""
    campaign(seed, 6, ELASTIC_KINDS + ("compact", "compact"), source_delay_s=0.15)


def rekey_query(epoch_events: int) -> cs.Query:
    """The re-key pipeline (lines -> count -> buckets), 1,200 lines cut into ``epoch_events`` epochs."""
    q = rekey_pipeline(6, n_lines=1200)
    q.epoch_events = epoch_events
    return q


#: The re-key campaign's source runs at 0.4 s an epoch (20 epochs): two migrations (3-4 s each)
#: and a master restart took all of it in a run where the last kill never landed (seed 1).
REKEY_SETTLE_PACE_S = 1.5


def rekey_campaign(seed: int, kinds: tuple[str, ...]):
    """4 seeded faults over the re-key pipeline (20 epochs, a 0.4 s source), 4 containers a
    stateful stage; every sink must equal the serial run, and every fault land."""
    return seeded_campaign(rekey_query(60), {"lines": 1, "count": 4, "buckets": 4}, ["count", "buckets"], seed, 4,
                           17, kinds, source_delay_s=0.4, settle_pace_s=REKEY_SETTLE_PACE_S, min_gap=3)


@pytest.mark.extended
@pytest.mark.parametrize("seed", range(1, 9))
def test_seeded_campaign_of_faults_and_rescaling_over_a_re_key(ray_session, seed):
    """Opt-in (``pytest -m campaign``): the re-key pipeline (the built-in count, run as slice
    groups, then a per-event stage keyed by bucket), 8 runs x 4 kills, master kills and
    rescalings of either stage; every sink equals the serial run."""
    rekey_campaign(seed, ELASTIC_KINDS)


@pytest.mark.extended
@pytest.mark.parametrize("seed", range(600, 608))
def test_seeded_campaign_of_hosts_dying_in_recoveries_over_a_re_key(ray_session, seed):
    """Opt-in (``pytest -m campaign``): the re-key pipeline, where a recovery's producers and
    consumers are stateful stages, 8 runs x 4 faults: kills followed by a second host's death in
    the recovery (adopter, producer or consumer, at a seeded step), master kills, rescalings."""
    rekey_campaign(seed, HOST_IN_RECOVERY_KINDS)


def test_the_harness_slows_the_sources_while_a_fault_settles_then_gives_back_their_pace(ray_session):
    """``settle_pace_s``: during a migration (a blocking call of a second or more) the source passes
    about one epoch per 0.5 s instead of one per 0.05 s; afterwards its pace is its own again."""
    import ray

    job = cs.run(query(), containers={"payments": 1, "running_sum": 2, "stats": 1}, checkpoint_every=2,
                 source_pace_s=0.05)
    try:
        source = int(next(iter(job.placement().stages["payments"])))
        handle = ray.get(job.master.container_handles.remote())[source]
        epoch_of_source = lambda: ray.get(job.master.statistics.remote())[source].next_epoch  # noqa: E731
        before, t0 = epoch_of_source(), time.monotonic()
        applied = apply_schedule(job, [Fault("migrate", at_epoch=0, stage="running_sum")], settle_pace_s=0.5)
        took, passed = time.monotonic() - t0, epoch_of_source() - before
        assert len(applied) == 1
        assert passed <= took / 0.5 + 2, (passed, took)
        assert ray.get(handle.inject_delay.remote(0.0)) == 0.0, "the source's delay is back to none"
        job.wait(timeout_s=300)
        assert compare_with_serial(job, query())[0] == {}
    finally:
        job.stop()


def test_the_chaos_command_applies_every_fault_and_checks_the_output_against_the_serial_run(ray_session, tmp_path,
                                                                                           capsys):
    from chronostream.cli import main

    f = tmp_path / "q.py"
    f.write_text("import sys\n"
                 f"sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})\n"
                 "from queries import running_sum\n"
                 "def build():\n"
                 "    q = running_sum(6, n=2400)\n"
                 "    q.epoch_events = 40\n"
                 "    return q\n")
    assert main(["chaos", str(f), "--kill", "running_sum@10", "--fault", "kill@20:stats,index=1",
                 "--fault", "kill_master@30", "--delay", "0.05", "--settle-pace", "0.5", "--containers", "3"]) == 0
    out = capsys.readouterr().out
    assert "applied 4 of 4 faults\n" in out
    assert "sink 'sums': 2400 rows, OK" in out and "sink 'stats': 2400 rows, OK" in out
    assert out.count("recovery_end") == 2 and "master_restarted" in out


def run_then_kill_a_host(checkpoint_every: int):
    """A job run to its end, then one running_sum container's host killed: (job, what was hit)."""
    job = cs.run(query(), containers={"payments": 1, "running_sum": 2, "stats": 2},
                 checkpoint_every=checkpoint_every)
    assert job.wait(timeout_s=300).state == "finished"
    return job, inject(job, Fault("kill", at_epoch=0, stage="running_sum", index=1))


def test_a_host_that_dies_after_the_job_finished_takes_none_of_its_rows_with_it(ray_session):
    """With checkpoints every container has handed the master its memory-sink rows before it
    reports done (its last epoch is a checkpoint), so ``results()`` after a host's death equals
    the serial run. Before, collecting asked the dead host: a raw ActorDiedError."""
    job, hit = run_then_kill_a_host(checkpoint_every=2)
    try:
        assert_exact_with_the_host_settled(job, hit["host"])
    finally:
        job.stop()


def assert_exact_with_the_host_settled(job, host: int) -> None:
    """``results()`` equal the serial run, and the master settled ``host`` as lost after the end."""
    mismatches, rows = compare_with_serial(job, query())
    assert mismatches == {} and all(rows.values()), (mismatches, rows)
    lost = [i for _, k, i in job.timeline() if k == "host_lost_after_end"]
    assert [i["host"] for i in lost] == [host], job.timeline()


def test_with_checkpoints_the_hosts_let_go_of_the_rows_the_master_holds(ray_session):
    """Every memory-sink part a checkpoint handed over is stored by the master: the hosts drop
    their copies, so after the job's end ``results()`` reads each row once, from the master's
    parts alone (before, each host kept and shipped its copy too: every row read twice)."""
    import ray

    job = cs.run(query(), containers={"payments": 1, "running_sum": 2, "stats": 2}, checkpoint_every=2)
    try:
        assert job.wait(timeout_s=300).state == "finished"
        where = ray.get(job.master.sink_part_refs.remote("sums"))
        assert len(where.refs) == 1, "hosts still hold parts the master holds"
        mismatches, rows = compare_with_serial(job, query())
        assert mismatches == {} and all(rows.values()), (mismatches, rows)
    finally:
        job.stop()


def test_without_checkpoints_a_host_dead_after_the_end_makes_results_name_it_and_its_containers(ray_session):
    """Without checkpoints a container keeps its rows until they are read: results() says which
    host and containers took them, and how to keep them, rather than Ray's ActorDiedError.
    Regression (issue 59, silent row loss after a migration and a kill): the error is the
    project's ``SinkRowsLost`` (a ``RecoveryError``), not a bare ``RuntimeError``."""
    job, hit = run_then_kill_a_host(checkpoint_every=0)
    try:
        with pytest.raises(SinkRowsLost, match=rf"host {hit['host']} died after the job's end .*"
                                               rf"containers \[{hit['container']}\].*checkpoint_every"
                                               rf".*stage 'running_sum' slices \[") as err:
            job.results("sums")
        assert [d["container"] for d in err.value.lost] == [hit["container"]]
    finally:
        job.stop()


def test_a_killed_master_restarts_from_its_catalog_while_containers_keep_processing(ray_session):
    faults = [SLOW_SOURCE, Fault("kill_master", at_epoch=10), Fault("kill", at_epoch=25, stage="stats")]
    report = run_with_faults(query(), faults, containers={"payments": 1, "running_sum": 2, "stats": 3},
                             checkpoint_every=2)
    assert report.ok, report.mismatches
    kinds_ = kinds(report)
    assert "master_restarted" in kinds_
    assert kinds_.index("master_restarted") < kinds_.index("recovery_end"), "the restarted master recovers"


def test_a_restarted_master_knows_the_gc_marks_its_predecessor_applied_and_still_recovers_exactly(ray_session):
    """The marks are saved before any host trims a log to them, so the restarted master reads them
    back (it used to start with none known until its first GC round, and a slice that lost every
    copy meanwhile failed the job even while the logs were whole)."""
    faults = [SLOW_SOURCE, Fault("kill_master", at_epoch=36), Fault("kill", at_epoch=48, stage="running_sum")]
    report = run_with_faults(query(), faults, containers={"payments": 1, "running_sum": 2, "stats": 2},
                             checkpoint_every=2, gc_interval_s=0.25)
    assert report.ok, report.mismatches
    restarted = next(i for _, k, i in report.timeline if k == "master_restarted")
    assert any(mark >= 0 for mark in restarted["gc_marks"].values()), restarted


def test_a_sources_host_killed_after_a_master_restart_is_rebuilt_from_the_input(ray_session):
    """The restarted master hands the new source container the input table: its reference comes
    from a live host (the master's constructor takes none), and the driver still owns the table
    (seed 509 of the campaign below once found it deleted after the first master process died)."""
    faults = [SLOW_SOURCE, Fault("kill_master", at_epoch=10), Fault("kill", at_epoch=20, stage="payments")]
    report = run_with_faults(query(), faults, containers={"payments": 1, "running_sum": 2, "stats": 2},
                             checkpoint_every=2)
    assert report.ok, report.mismatches
    kinds_ = kinds(report)
    assert kinds_.count("recovery_end") == 1, report.format_timeline()
    assert kinds_.index("master_restarted") < kinds_.index("source_refs_from_host") < kinds_.index("recovery_end")


def slowly_doubled(batch):
    """``amount`` doubled, 2.5 ms a row (6 s for the input, in the job as in the serial run): a
    one-stage job this slow is still running when the faults land, where a delay fault came
    after it had read all of its input."""
    import pyarrow.compute as pc

    time.sleep(0.0025 * batch.num_rows)
    return batch.append_column("twice", pc.multiply(batch.column("amount"), 2))


def slow_one_stage_query() -> cs.Query:
    """One stage (2 slices): the input doubled by ``slowly_doubled``, into sink ``out``."""
    q = cs.Query(epoch_events=EPOCH)
    q.source("payments", [{"card": i % 7, "amount": i} for i in range(2400)], slices=2).map_batches(
        slowly_doubled).sink(name="out")
    return q


def test_a_master_restarted_with_every_host_dead_gets_the_input_table_back_from_the_client(ray_session):
    """A one-stage job: its master restarts, then the stage's only host dies, so no live host
    holds the input table's reference. The restarted master asks for it in its status, the
    client's Job handle (which owns the table) hands it back, and the source is rebuilt from
    the input: the sink equals the serial run."""
    faults = [Fault("kill_master", at_epoch=3), Fault("kill", at_epoch=5, stage="payments")]
    report = run_with_faults(slow_one_stage_query(), faults, containers={"payments": 1})
    assert report.ok, report.mismatches
    kinds_ = kinds(report)
    assert (kinds_.index("master_restarted") < kinds_.index("source_refs_wanted")
            < kinds_.index("source_refs_from_client") < kinds_.index("recovery_end")), report.format_timeline()


def test_a_master_restarted_with_every_host_dead_gets_the_input_table_back_while_the_client_looks_away(ray_session):
    """As above, but the process that started the job never asks for its status while the faults
    land (the test reads the master's own status): the Job handle's keeper thread answers the
    restarted master, well before its 30 s wait would fail the job."""
    import ray

    job = cs.run(slow_one_stage_query(), containers={"payments": 1})
    try:
        def until(done, what: str, within_s: float = 60.0) -> None:
            deadline = time.monotonic() + within_s
            while True:
                try:
                    if done():
                        return
                except ray.exceptions.RayActorError:
                    pass  # the master restarting
                assert time.monotonic() < deadline, what
                time.sleep(0.05)

        def happened(kind: str) -> bool:
            return any(k == kind for _, k, _ in ray.get(job.master.recovery_timeline.remote()))

        until(lambda: ray.get(job.master.status.remote()).min_epoch >= 3, "epoch 3")
        inject(job, Fault("kill_master", at_epoch=3))
        until(lambda: happened("master_restarted"), "the master's restart")
        inject(job, Fault("kill", at_epoch=5, stage="payments"))
        until(lambda: happened("source_refs_from_client"), "the references handed back", within_s=25.0)
        assert job._ref_keeper.answers == 1
        serial = cs.run(slow_one_stage_query(), executor="serial")
        assert job.results("out").to_pylist() == serial.results("out").to_pylist()
    finally:
        job.stop()
    deadline = time.monotonic() + 3
    while job._ref_keeper.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not job._ref_keeper.running, "the keeper stops with the job"


def test_output_logs_are_trimmed_by_gc_while_the_job_runs(ray_session):
    """With checkpoints, the master's GC trims every output log below the consumers' checkpoints."""
    q = running_sum(6, n=2400)
    q.epoch_events = 20  # 120 epochs
    job = cs.run(q, containers={"payments": 2, "running_sum": 2, "stats": 2}, checkpoint_every=2,
                 gc_interval_s=0.25)
    try:
        from chronostream.chaos import apply_schedule
        apply_schedule(job, [Fault("delay", 0, stage="payments", seconds=0.04)])
        job.wait(timeout_s=120)
        import ray
        status = ray.get(job.master.status.remote())
        logged = {c: s.log_entries for c, s in job.statistics().items() if s.stage == "payments"}
        expected = cs.run(running_sum(6, n=2400), executor="serial")
        for sink in ("sums", "stats"):
            assert job.results(sink).to_pylist() == expected.results(sink).to_pylist()
    finally:
        job.stop()
    assert status.gc_dropped > 0
    # Each source container logs 2 slices x 1 stream x 120 epochs = 240 batches without GC.
    assert all(n < 60 for n in logged.values()), logged


@pytest.mark.parametrize("ship_piece_bytes", [64 << 20, 700])
def test_checkpoints_shipped_through_the_object_store_restore_exactly(ray_session, ship_piece_bytes):
    """With ship_by_reference_bytes=0 every checkpoint travels as object-store arrays, which the
    backup holders keep as views (or, above ship_piece_bytes, in pieces they assemble): killed
    containers are still restored exactly from them."""
    faults = [SLOW_SOURCE, Fault("kill", at_epoch=15, stage="running_sum"), Fault("kill", at_epoch=30, stage="stats")]
    report = run_with_faults(query(), faults, containers={"payments": 1, "running_sum": 3, "stats": 2},
                             checkpoint_every=2, ship_by_reference_bytes=0, ship_piece_bytes=ship_piece_bytes)
    assert report.ok, report.mismatches
    assert len([k for k in kinds(report) if k == "recovery_end"]) == 2


@pytest.mark.parametrize("step", RECOVERY_STEPS)
def test_a_master_killed_in_the_middle_of_a_recovery_finishes_it_once_restarted(ray_session, step):
    faults = [SLOW_SOURCE, Fault("kill_master_in_recovery", at_epoch=12, stage="running_sum", step=step)]
    report = run_with_faults(query(), faults, containers={"payments": 1, "running_sum": 3, "stats": 2},
                             checkpoint_every=2)
    assert report.ok, report.mismatches
    k = kinds(report)
    assert k.index("master_crash_injected") < k.index("master_restarted") < k.index("recovery_resumed") \
        < k.index("recovery_end"), report.format_timeline()
    ends = [i for _, kind, i in report.timeline if kind == "recovery_end"]
    assert len(ends) == 1 and bool(ends[0].get("resumed")) == (step != "detected"), report.format_timeline()
    started = [i["new"] for _, kind, i in report.timeline if kind == "recovery_start"]
    if step in ("restored", "rerouted"):  # the restarted master ran the same plan again: no other container
        assert sorted(set(started)) == sorted(ends[0]["new"]) and len(started) == 2 * len(ends[0]["new"])


#: Hosts dying in the middle of recoveries, among kills, master kills and rescalings.
HOST_IN_RECOVERY_KINDS = ("kill", "kill_in_recovery", "kill_in_recovery", "scale_out", "migrate", "kill_master")


def test_a_seeded_campaign_with_hosts_dying_in_recoveries_ends_with_exact_output(ray_session):
    """One run of 5 faults (seed 0): a master kill, a migration, and two kills each followed by a
    second host's death in the recovery (an adopter, at steps `detected` and `rerouted`)."""
    report = campaign(0, 5, HOST_IN_RECOVERY_KINDS, source_delay_s=0.15)
    assert len([k for k in kinds(report) if k == "host_kill_injected"]) == 2, report.format_timeline()


@pytest.mark.extended
@pytest.mark.parametrize("seed", range(500, 510))
def test_large_seeded_campaign_with_hosts_dying_in_recoveries(ray_session, seed):
    """Opt-in (``pytest -m campaign``): 10 runs x 6 faults, hosts dying in recoveries among them
    (a producer of this query's stages is the source: the harness gives its new host the
    source's pace, so the later faults land)."""
    campaign(seed, 6, HOST_IN_RECOVERY_KINDS, source_delay_s=0.15)


#: A host killed in the middle of a recovery (of a container of the re-key pipeline's stage): which
#: step of the recovery meets the dead host.
HOST_IN_RECOVERY = [
    ("count", "planned", "consumer"),   # step 1: a consumer told of the new senders
    ("count", "planned", "adopter"),    # step 2: a host restoring adopted slices
    ("count", "restored", "adopter"),   # starting them (and producers rerouting to them)
    ("buckets", "restored", "producer"),  # step 3: a producer told to reroute and replay
    ("count", "rerouted", "adopter"),   # step 4: backups re-planned over the stage's hosts
]


@pytest.mark.parametrize("stage,step,role", HOST_IN_RECOVERY)
def test_a_host_dying_in_the_middle_of_a_recovery_is_left_out_of_it_and_recovered_next(ray_session, stage, step,
                                                                                      role):
    """A container dies; at ``step`` of its recovery a second host with ``role`` in it dies too. The
    plan goes on without that host and its recovery follows: two recoveries, every sink exact."""
    q = rekey_query(20)  # 60 epochs
    faults = [Fault("delay", at_epoch=0, stage="lines", seconds=0.08),
              Fault("kill_in_recovery", at_epoch=12, stage=stage, step=step, role=role)]
    report = run_with_faults(q, faults, containers={"lines": 1, "count": 3, "buckets": 3}, checkpoint_every=2)
    assert report.ok, report.mismatches
    events, k = report.timeline, kinds(report)
    (killed,) = [i for _, kind, i in events if kind == "host_kill_injected"]
    assert killed["role"] == role and k.index("host_kill_injected") < k.index("recovery_end"), report.format_timeline()
    assert k.count("recovery_end") == 2, report.format_timeline()
    second = [i for _, kind, i in events if kind == "recovery_planning"][1]
    assert killed["host"] in second["hosts"], report.format_timeline()


def test_a_master_dying_while_two_plans_run_finishes_both_once_restarted(ray_session):
    """An adopter dies at step 2 of a recovery, so a second plan joins the first; the master then
    dies at step `restored` of their run. The restarted master finds both plans in its record and
    runs them again: two recoveries, both resumed, every sink exact."""
    import time

    import ray

    from chronostream.chaos import apply_schedule, compare_with_serial

    q = rekey_query(20)  # 60 epochs
    job = cs.run(q, containers={"lines": 1, "count": 3, "buckets": 3}, checkpoint_every=2)
    try:
        apply_schedule(job, [Fault("delay", at_epoch=0, stage="lines", seconds=0.08)])
        while job.progress()["min_epoch"] < 12:
            time.sleep(0.02)
        ray.get(job.master.kill_in_recovery.remote("planned", "adopter"))
        ray.get(job.master.crash_in_recovery.remote("restored"))
        victim = min(job.placement().stages["count"])
        ray.kill(ray.get(job.master.container_handles.remote())[victim], no_restart=True)
        job.wait(timeout_s=300)
        mismatches, _ = compare_with_serial(job, q)
        assert not mismatches, mismatches
        timeline = job.timeline()
        k = [kind for _, kind, _ in timeline]
        assert k.index("host_kill_injected") < k.index("master_crash_injected") < k.index("recovery_resumed") \
            < k.index("recovery_end")
        ends = [i for _, kind, i in timeline if kind == "recovery_end"]
        assert len(ends) == 2 and all(e.get("resumed") for e in ends), ends
    finally:
        job.stop()


def test_a_host_dying_while_the_master_is_down_in_a_recovery_is_recovered_right_after_it(ray_session, tmp_path):
    """The master dies once its recovery plan is saved; while it is down a host of the other stage
    dies too. The restarted master runs the saved plan without that host (pushes to it stop), then
    recovers it at once: two recoveries, and every sink equals the serial run."""
    import time
    from pathlib import Path

    import ray

    from chronostream.chaos import apply_schedule, compare_with_serial
    from chronostream.master.catalog import MasterCatalog

    q = query()
    job = cs.run(q, containers={"payments": 1, "running_sum": 3, "stats": 2}, checkpoint_every=2)
    try:
        apply_schedule(job, [SLOW_SOURCE])
        while job.progress()["min_epoch"] < 12:
            time.sleep(0.02)
        handles = ray.get(job.master.container_handles.remote())
        stages = job.placement().stages
        first, second = min(stages["running_sum"]), min(stages["stats"])
        ray.get(job.master.crash_in_recovery.remote("planned"))
        catalog = MasterCatalog(Path(job.workdir) / "master")
        ray.kill(handles[first], no_restart=True)
        deadline = time.monotonic() + 60
        while not (catalog.load_recovery() or {}).get("plans"):  # the plan saved: the master exits
            assert time.monotonic() < deadline, "the recovery was never planned"
            time.sleep(0.002)
        catalog.close()
        ray.kill(handles[second], no_restart=True)
        job.wait(timeout_s=300)
        mismatches, _ = compare_with_serial(job, q)
        assert not mismatches, mismatches
        timeline = job.timeline()
        k = [kind for _, kind, _ in timeline]
        assert k.index("master_crash_injected") < k.index("recovery_resumed") < k.index("recovery_end")
        assert any(kind == "fault_detected" and i.get("by") == "probe of a restarted master"
                   for _, kind, i in timeline), timeline
        assert k.count("recovery_end") == 2, timeline
    finally:
        job.stop()
