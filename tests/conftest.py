"""Session fixtures: Ray starts once per test session, sized for this 2-core machine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Every routed part between hosts of this one node goes through shared-memory files
# (containers/shm_transport.py), however small: the suite's kills, migrations and recoveries then
# exercise that path, where the default (100 KB and more) would leave most of its small epochs on Ray.
os.environ.setdefault("CHRONOSTREAM_SHM_MIN_BYTES", "0")
# The records of the jobs the tests start (chronostream.job_records) go to a directory of the
# session's, not the user's ~/.chronostream.
if "CHRONOSTREAM_HOME" not in os.environ:
    _TEST_HOME = os.environ["CHRONOSTREAM_HOME"] = tempfile.mkdtemp(prefix="chronostream-test-home-")
else:
    _TEST_HOME = None

#: Spare hosts the test session keeps warm (a job here runs 3-9 hosts).
WARM_HOSTS = 6
#: The simulator campaign the suite runs (``python -m chronostream.sim``), beside the other tests.
SIM_CAMPAIGN_SEEDS = "1-150"
_CAMPAIGN = pytest.StashKey[tuple]()  # (the campaign's process, its output directory)

#: The Ray tests ``make test`` runs: a few end-to-end ones per protocol, showing that the Ray
#: driver carries out what the simulator checks in process (deploy and sinks, errors, recovery,
#: a master restart, migration, scale-out and in, compaction, threads, node loss) and the
#: safety bounds. Every other Ray test is marked ``extended`` (``pytest -m extended`` runs them).
RAY_TIER = {
    # deploy, sinks, errors (the demo's job is ``make demo``; its test is extended)
    "test_api.py::test_parquet_sink_on_ray_reads_back_like_the_serial_run",
    "test_runtime_equivalence.py::test_runtime_output_equals_serial_executor[join-slices7-containers2]",
    "test_runtime_equivalence.py::test_runtime_output_equals_serial_executor[word_count-slices64-containers2]",
    "test_bad_input.py::test_operator_error_on_ray_fails_the_job_with_the_event_error",
    "test_spark.py::test_word_count_round_trip_validates",
    "test_sourcelog.py::test_job_on_ray_tailing_a_growing_log_equals_a_bounded_run",
    "test_backups_runtime.py::test_a_job_with_too_few_hosts_for_its_backup_factor_says_how_many_copies_its_slices_get",
    # recovery, a master restart (damaged copies, GC and hosts dying mid-recovery: the simulator
    # and the extended tests)
    "test_recovery_ray.py::test_a_killed_container_is_rebuilt_in_parallel_by_its_peers_and_the_output_is_exact",
    "test_recovery_ray.py::test_a_killed_master_restarts_from_its_catalog_while_containers_keep_processing",
    "test_recovery_ray.py::test_a_master_killed_in_the_middle_of_a_recovery_finishes_it_once_restarted[rerouted]",
    "test_multinode.py::test_a_node_killed_mid_stream_loses_one_container_per_stage_and_the_output_is_exact",
    # migration, scaling, compaction, threads
    "test_migration_ray.py::test_scale_out_one_to_two_to_four_then_in_to_one_gives_the_serial_output",
    "test_migration_ray.py::test_a_master_killed_in_the_middle_of_a_scale_out_settles_it_once_restarted",
    "test_migration_ray.py::test_a_producer_dying_while_a_compaction_waits_undoes_it_and_recovery_gives_the_serial_output",
    "test_migration_ray.py::test_threads_scaled_up_and_down_mid_stream_give_the_serial_output",
    # savepoints, submitted jobs, resumes (the kill -9 of a whole cluster is test_resume's, beside)
    "test_submit.py::test_a_submitted_job_outlives_its_submitter_and_is_controlled_by_name",
    "test_job_records.py::test_a_job_of_another_cluster_is_not_looked_for_on_this_one",
    "test_savepoints.py::test_a_savepoint_mid_run_holds_every_slice_at_one_epoch_and_equals_pandas",
    "test_savepoints.py::test_a_job_resumed_from_a_savepoint_on_other_containers_with_an_upgraded_operator_goes_on_exactly",
    "test_resume.py::test_a_job_tailing_a_source_log_goes_on_from_the_log_after_its_every_process_died",
    # what a running job shows
    "test_dashboard.py::test_the_dashboard_shows_a_migration_and_a_recovery_in_a_real_browser",
    "test_migration_ray.py::test_bad_scaling_requests_are_refused_with_a_clear_error",
    "test_migration_ray.py::test_ray_started_for_jobs_allocates_from_the_filesystem_at_once_when_the_object_store_is_full",
    # safety and bounds: loopback, hosts outliving no master, deleting only the job's files, memory
    "test_liveness_bounds.py::test_a_ray_the_project_starts_listens_on_loopback_only",
    "test_liveness_bounds.py::test_hosts_leave_when_their_master_dies",
    "test_file_safety.py::test_a_stop_deletes_only_what_the_job_made_in_a_callers_workdir",
    "test_backpressure.py::test_fast_source_into_slow_operator_keeps_memory_bounded",
    "test_shm_transport.py::test_a_hosts_stop_leaves_its_files_to_their_receivers_and_the_jobs_stop_removes_them",
    "test_shm_transport.py::test_a_stopped_host_takes_no_message_and_unlinks_its_files_unread",
    "test_host_pool.py::test_a_spare_refuses_to_run_a_job_before_it_is_adopted",
    "test_host_pool.py::test_an_adopted_spare_keeps_its_id_and_refuses_another",
    "test_host_pool.py::test_a_spare_that_died_in_the_pool_is_dropped_and_the_next_one_handed_out",
    "test_host_pool.py::test_a_spare_handed_out_and_never_adopted_exits_when_its_lease_ends",
}


@pytest.fixture(scope="session")
def ray_session():
    """An in-process Ray instance shared by every integration test."""
    import ray

    import chronostream as cs

    cs.ensure_ray(num_cpus=2)
    # Warm spare hosts (master.host_pool): jobs deploy onto processes started while the tests
    # before them ran. $CHRONOSTREAM_TEST_WARM_HOSTS=0 runs every test on hosts started for it.
    cs.keep_warm_hosts(int(os.environ.get("CHRONOSTREAM_TEST_WARM_HOSTS", WARM_HOSTS)))
    yield ray
    from chronostream.source_ref_keeper import stop_all

    stop_all()  # no Job's keeper thread inside a Ray call while Ray shuts down
    ray.shutdown()


@pytest.fixture(scope="session")
def spark():
    """One local[2] SparkSession for the whole test session."""
    from chronostream.spark import spark_session

    session = spark_session("local[2]")
    yield session
    session.stop()


def pytest_collection_modifyitems(config, items):
    """Tests on the shared Ray instance are marked ``ray`` (``pytest -m 'not ray'`` runs the
    rest); Ray tests outside ``RAY_TIER`` are marked ``extended`` as well. Tests waiting for the
    simulator campaign run last: its process runs beside every other test first."""
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
        if item.get_closest_marker("ray") and item.nodeid.split("/")[-1] not in RAY_TIER:
            item.add_marker(pytest.mark.extended)
    items.sort(key=lambda item: "sim_campaign" in getattr(item, "fixturenames", ()))  # (stable)


def pytest_collection_finish(session):
    """When a selected test needs the simulator campaign, start it now, in a process of its own:
    it runs on the second core while the session goes on (``sim_campaign`` waits for it)."""
    if not any("sim_campaign" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    out = Path(tempfile.mkdtemp(prefix="chronostream-sim-campaign-"))
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        # On two processes at the lowest priority: the Ray tests' hosts get the cores when they
        # need them, the campaign both cores while the suite waits on Ray. Linux schedules each
        # session as a group (autogroup) with an equal share, whatever its processes' nice
        # values: the campaign gets a session of its own, and that group the lowest priority.
        proc = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "chronostream.sim", "--seeds",
                                 SIM_CAMPAIGN_SEEDS, "--jobs", "2", "--json"],
                                stdout=stdout, stderr=stderr, cwd=Path(__file__).parent.parent,
                                start_new_session=True)
    try:
        Path(f"/proc/{proc.pid}/autogroup").write_text("19")
    except OSError:
        pass  # (no autogroups here: nice alone orders the processes)
    session.config.stash[_CAMPAIGN] = (proc, out)


@pytest.fixture(scope="session")
def sim_campaign(request):
    """The campaign's outcome: (exit code, its last stdout line as JSON, its stderr)."""
    proc, out = request.config.stash[_CAMPAIGN]
    code = proc.wait(timeout=1800)
    lines = (out / "stdout").read_text().strip().splitlines()
    err = (out / "stderr").read_text()
    shutil.rmtree(out, ignore_errors=True)
    return code, json.loads(lines[-1]) if lines else {}, err


def pytest_unconfigure(config):
    started = config.stash.get(_CAMPAIGN, None)
    if started is not None and started[0].poll() is None:
        os.killpg(started[0].pid, signal.SIGKILL)  # (the campaign and its worker processes: a session of their own)
    if _TEST_HOME is not None:
        shutil.rmtree(_TEST_HOME, ignore_errors=True)  # (the job records of the session's jobs)
