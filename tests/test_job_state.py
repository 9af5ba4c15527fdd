"""A job's state is a ``JobState`` wherever it is read, and the master's reading calls return
typed results (``master/job_state.py``, ``master/rpc_results.py``).

The enum and its persisted form are checked without Ray (the catalog on real lmdb); the
client's reading of a ``MasterStatus`` with a stand-in master; the executors' and a Ray job's
states, and the JSON the CLI prints from a typed result, on real runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import msgpack
import pytest

import chronostream as cs
from chronostream.client import RAY_NAMESPACE, Job
from chronostream.master.catalog import MasterCatalog
from chronostream.master.job_state import JobState
from chronostream.master.rpc_results import MasterStatus, PlacementView
from queries import word_count

#: The keys ``chronostream placement KEY`` printed while the master answered with a dict.
PLACEMENT_KEYS = ["stages", "nodes", "hosts", "master_node", "backup_copies"]
#: The keys ``chronostream warm-hosts N`` printed while the pool answered with a dict.
POOL_KEYS = ["size", "ready", "by_node", "handed_out", "started", "dropped", "found", "pool_node"]


def test_exactly_finished_failed_and_stopped_are_terminal():
    """``terminal`` replaces the old set of terminal states: the same three, nothing else."""
    assert {s for s in JobState if s.terminal} == {JobState.FINISHED, JobState.FAILED, JobState.STOPPED}
    assert not JobState.CREATED.terminal and not JobState.RUNNING.terminal
    assert [s.value for s in JobState] == ["created", "running", "finished", "failed", "stopped"]


@pytest.mark.parametrize("state", list(JobState))
def test_a_state_round_trips_through_its_persisted_string(state: JobState):
    """The catalog stores a state's plain value (msgpack) and ``JobState(value)`` reads the same
    member back; the value is the string a catalog written before the enum holds."""
    packed = msgpack.packb({"state": state.value})
    back = msgpack.unpackb(packed, raw=False)["state"]
    assert type(back) is str and back == state.name.lower()
    assert JobState(back) is state
    assert state == back and f"job_{state}" == f"job_{back}"  # (timeline kinds are made this way)
    assert json.loads(json.dumps({"state": state})) == {"state": back}


def test_the_catalog_reads_back_the_state_it_saved_as_a_member(tmp_path):
    """``save_progress`` / ``load_progress`` on a real lmdb catalog, reopened (as a restarted
    master reads it): every state comes back as the same member; a catalog without a saved
    progress reads as running."""
    for state in JobState:
        cat = MasterCatalog(tmp_path / state.value)
        assert cat.load_progress()["state"] is JobState.RUNNING
        cat.save_progress(state, {2, 0}, 1.5, 2.5)
        cat.close()
        again = MasterCatalog(tmp_path / state.value)
        prog = again.load_progress()
        assert prog["state"] is state and prog["done"] == [0, 2] and prog["finished_at"] == 2.5
        again.close()


def test_the_catalog_reads_a_state_saved_as_a_plain_string(tmp_path):
    """A progress record whose state is the bare string (as every catalog held before the enum)
    reads back as the member: a job written by an older master resumes."""
    from chronostream.containers.lmdb_store import put_all

    cat = MasterCatalog(tmp_path)
    put_all(cat.env, [(b"progress", msgpack.packb({"state": "stopped", "done": [1], "started_at": 0.0,
                                                  "finished_at": 3.0}, use_bin_type=True))], store="test")
    assert cat.load_progress()["state"] is JobState.STOPPED
    cat.close()


class _FakeMaster:
    """Answers ``status`` with a given ``MasterStatus`` (``master.status.remote()``)."""

    def __init__(self, status: MasterStatus) -> None:
        self.status = self
        self._status = status

    def remote(self) -> MasterStatus:
        return self._status


def test_the_client_reads_the_master_s_status_by_field(monkeypatch):
    """``Job.status`` and ``Job.progress`` take each figure from its field of the master's
    ``MasterStatus`` (``done`` is ``done_containers``), the state as the member it is."""
    import ray

    error = ValueError("boom")
    status = MasterStatus(state=JobState.FAILED, error=error, containers=5, done=3, elapsed_s=7.5, epochs=40,
                          min_epoch=12, recoveries=2, gc_dropped=9, stale_backups_dropped=1, wants_source_refs=False)
    monkeypatch.setattr(ray, "get", lambda what: what)
    job = Job.__new__(Job)  # (no plan or actors: only the reading path runs)
    job.master, job._source_refs, job.key, job.progress_bar = _FakeMaster(status), None, "j", False
    st = job.status()
    assert st == cs.JobStatus(JobState.FAILED, 5, 3, 7.5, error)
    assert st.state is JobState.FAILED
    assert job.progress() == {"state": JobState.FAILED, "epochs": 40, "min_epoch": 12, "done": 3,
                              "containers": 5, "elapsed_s": 7.5, "recoveries": 2}
    with pytest.raises(cs.JobFailed, match="boom"):
        job.wait()


def test_a_placement_view_prints_as_the_dict_the_cli_printed():
    """``asdict`` of a ``PlacementView`` has the keys, in the order, the master's dict had."""
    view = PlacementView(stages={"count": {3: [0, 2], 4: [1]}}, nodes={3: "n0"}, hosts={3: 3, 4: 3},
                         master_node="n0", backup_copies={"count": 1})
    assert list(asdict(view)) == PLACEMENT_KEYS
    assert view.containers_of("count") == [3, 4]
    assert json.loads(json.dumps(asdict(view)))["stages"] == {"count": {"3": [0, 2], "4": [1]}}


@pytest.mark.parametrize("executor", ["local", "serial"])
def test_an_in_process_run_s_state_is_a_member(executor: str):
    """``cs.run(q, executor="local")`` (and the serial oracle) return a finished job whose
    status carries ``JobState.FINISHED``, not a bare string."""
    job = cs.run(word_count(4, n_lines=40), executor=executor)
    st = job.status()
    assert type(st.state) is JobState and st.state is JobState.FINISHED and st.state.terminal


def test_a_ray_job_s_states_are_members_and_the_cli_prints_the_same_json_keys(ray_session, capsys):
    """A job on Ray: the master's ``status`` is a ``MasterStatus``; ``Job.status().state`` and
    ``Job.progress()["state"]`` are ``JobState`` members, running or finished while it runs,
    finished after ``wait``; ``chronostream placement KEY`` and ``chronostream warm-hosts N``
    print the JSON keys they printed when the master and the pool answered with dicts, and the
    placement's values are the typed view's."""
    import ray

    from chronostream.cli import main
    from chronostream.master.host_pool import HOST_POOL_NAME, PoolStats

    job = cs.run(word_count(4, n_lines=400), containers=2)
    try:
        raw = ray.get(job.master.status.remote())
        assert isinstance(raw, MasterStatus) and type(raw.state) is JobState
        early = job.progress()["state"]
        assert type(early) is JobState and early in (JobState.RUNNING, JobState.FINISHED)
        done = job.wait(timeout_s=120)
        assert type(done.state) is JobState and done.state is JobState.FINISHED
        assert job.status().state is JobState.FINISHED and job.progress()["state"] is JobState.FINISHED

        view = job.placement()
        assert isinstance(view, PlacementView)
        address = ["--address", ray.get_runtime_context().gcs_address]
        capsys.readouterr()
        assert main(["placement", job.key, *address]) == 0
        printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert list(printed) == PLACEMENT_KEYS
        assert printed == json.loads(json.dumps(asdict(view), default=str))
        assert sorted(printed["stages"]) == sorted(s.name for s in job.plan.stages)

        pool = ray.get_actor(HOST_POOL_NAME, namespace=RAY_NAMESPACE)
        stats = ray.get(pool.stats.remote())
        assert isinstance(stats, PoolStats)
        assert main(["warm-hosts", str(stats.size), *address]) == 0  # (the session's size: unchanged)
        assert list(json.loads(capsys.readouterr().out.strip().splitlines()[-1])) == POOL_KEYS
    finally:
        job.stop()
