"""Warm spare hosts (``master.host_pool``, ``cs.keep_warm_hosts``) on Ray: real spare processes.

Method: the pool is filled and waited for, then a job deploys, scales out or
loses its master; the timeline's ``spare_adopted`` events say which hosts
were spares, and each sink must equal the serial executor's row for row.
The pool is the test session's (conftest may keep one for every test):
each test here sets the size it needs and gives the session's size back.
"""

from __future__ import annotations

import json
import time

import pytest
import ray
from ray.exceptions import RayActorError

import chronostream as cs
from chronostream.chaos import Fault, run_with_faults
from chronostream.client import RAY_NAMESPACE
from chronostream.master.host_pool import HOST_POOL_NAME
from queries import running_sum

SLOW_SOURCE = Fault("delay", at_epoch=0, stage="payments", seconds=0.05)


def query(n: int = 3000) -> cs.Query:
    q = running_sum(6, n=n)
    q.epoch_events = 40
    return q


@pytest.fixture
def warm_pool(ray_session):
    """A function filling the session's pool to a size (and waiting for it); the size before
    the test comes back after it."""
    before = _pool_size()

    def fill(size: int) -> dict:
        stats = cs.keep_warm_hosts(size, wait_s=90)
        assert stats.ready == size, stats
        return stats

    yield fill
    cs.keep_warm_hosts(before)


def _pool():
    return ray.get_actor(HOST_POOL_NAME, namespace=RAY_NAMESPACE)


def _pool_size() -> int:
    """The session pool's size (0 when no pool was made)."""
    try:
        return ray.get(_pool().stats.remote()).size
    except ValueError:
        return 0


def spare_handle(name: str):
    return ray.get_actor(name, namespace=RAY_NAMESPACE)


def wait_until_gone(handle, failure: str, timeout_s: float = 30.0) -> None:
    """Until the spare behind ``handle`` no longer answers (its process is dead); fails with
    ``failure`` after ``timeout_s``. (Through the handle, not the name: Ray frees a killed
    actor's name before its process exits, and the pool, which holds a handle, could still
    lease the process meanwhile.)"""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.ready.remote(), timeout=5)
        except RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.2)
    pytest.fail(failure)


def adopted(timeline) -> list[dict]:
    return [i for _, k, i in timeline if k == "spare_adopted"]


def test_a_job_deploys_and_scales_out_onto_warm_spares_with_the_serial_output(warm_pool):
    spares = set(warm_pool(4).names)
    report = run_with_faults(query(), [SLOW_SOURCE, Fault("scale_out", 10, "running_sum", n=1)],
                             containers={"payments": 1, "running_sum": 1, "stats": 1}, checkpoint_every=2)
    assert report.ok, report.mismatches
    took = adopted(report.timeline)
    assert len(took) == 4, "three hosts at deploy and the scale-out's new host were spares"
    assert {i["spare"] for i in took} == spares
    assert len({i["host"] for i in took}) == 4


def test_a_spare_that_dies_before_its_adoption_is_replaced_by_a_host_the_master_starts(warm_pool):
    """The pool leased it (it answered), then it died before the master's adopt reached it: the
    scale-out still gets its host, and the output is the serial run's."""
    warm_pool(4)
    faults = [SLOW_SOURCE, Fault("kill_spare", 5), Fault("scale_out", 10, "running_sum", n=1)]
    report = run_with_faults(query(), faults, containers={"payments": 1, "running_sum": 1, "stats": 1},
                             checkpoint_every=2)
    assert report.ok, report.mismatches
    killed = [i for _, k, i in report.timeline if k == "spare_kill_injected"]
    lost = [i for _, k, i in report.timeline if k == "spare_lost"]
    assert len(killed) == 1 and lost == killed, report.format_timeline()
    took = adopted(report.timeline)
    assert len(took) == 3 and lost[0]["spare"] not in {i["spare"] for i in took}, "the deploy's three"
    ends = [i for _, k, i in report.timeline if k == "migration_end"]
    assert [t["phase"] for t in ends[0]["transfers"]] == ["done"], "the scale-out moved its slices"
    assert ends[0]["transfers"][0]["host"] == lost[0]["host"], "to the host the master started in its place"


def test_without_a_ready_spare_a_job_starts_its_hosts_itself(warm_pool):
    warm_pool(0)
    report = run_with_faults(query(1200), [], containers={"payments": 1, "running_sum": 1, "stats": 1})
    assert report.ok, report.mismatches
    assert adopted(report.timeline) == []


def test_a_restarted_master_finds_the_spares_it_adopted_and_recovers_nothing(warm_pool):
    warm_pool(4)
    report = run_with_faults(query(), [SLOW_SOURCE, Fault("kill_master", at_epoch=15)],
                             containers={"payments": 1, "running_sum": 2, "stats": 1}, checkpoint_every=2)
    assert report.ok, report.mismatches
    kinds = [k for _, k, _ in report.timeline]
    assert "master_restarted" in kinds
    assert len(adopted(report.timeline)) == 4
    assert "recovery_start" not in kinds, "every adopted host was found again by its name"


def test_a_spare_handed_out_and_never_adopted_exits_when_its_lease_ends(warm_pool):
    warm_pool(1)
    name, spare = ray.get(_pool().take.remote(None, 0.5))
    time.sleep(2.0)
    with pytest.raises(RayActorError):
        ray.get(spare.ready.remote(), timeout=30)


def test_an_adopted_spare_keeps_its_id_and_refuses_another(warm_pool, tmp_path):
    warm_pool(1)
    _name, spare = ray.get(_pool().take.remote())
    try:
        ray.get(spare.adopt.remote(7, None, str(tmp_path), 0.5))
        ray.get(spare.adopt.remote(7, None, str(tmp_path), 0.5))  # again, as a restarted master does
        with pytest.raises(ValueError, match="host 7 cannot be adopted again as host 8"):
            ray.get(spare.adopt.remote(8, None, str(tmp_path), 0.5))
    finally:
        ray.kill(spare)


def test_a_spare_refuses_to_run_a_job_before_it_is_adopted(warm_pool):
    warm_pool(1)
    _name, spare = ray.get(_pool().take.remote())
    try:
        with pytest.raises(RuntimeError, match="adopt"):
            ray.get(spare.configure.remote(None, None))
    finally:
        ray.kill(spare)


def test_a_pool_resized_to_zero_stops_its_spares(warm_pool):
    names = warm_pool(2).names
    handles = [spare_handle(name) for name in names]
    assert cs.keep_warm_hosts(0).ready == 0
    for name, handle in zip(names, handles):
        wait_until_gone(handle, f"spare {name} still answers after the pool was resized to 0")


def test_a_negative_pool_size_is_refused():
    with pytest.raises(ValueError, match="size must be >= 0"):
        cs.keep_warm_hosts(-1)


def test_the_cli_resizes_the_pool_and_prints_its_counts(warm_pool, capsys):
    from chronostream.cli import main

    assert main(["warm-hosts", "2", "--wait", "90"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["size"] == 2 and printed["ready"] == 2
    assert main(["warm-hosts", "-1"]) == 1
    assert "N must be >= 0" in capsys.readouterr().err


def test_a_spare_that_died_in_the_pool_is_dropped_and_the_next_one_handed_out(warm_pool):
    first, second = warm_pool(2).names
    killed = spare_handle(first)
    ray.kill(killed)
    # (``ray.kill`` only asks: until the process is gone it may still take a lease, and the
    # pool would rightly hand it out)
    wait_until_gone(killed, f"spare {first} still answers 30 s after it was killed")
    name, spare = ray.get(_pool().take.remote())
    try:
        assert name == second
        assert ray.get(_pool().stats.remote()).dropped >= 1
    finally:
        ray.kill(spare)


def test_a_pool_made_after_one_died_takes_over_its_unadopted_spares_and_leaves_leased_ones(warm_pool):
    """Spares are detached: a pool that dies would leave them running, unadopted, for good. The
    next pool (the next ``keep_warm_hosts``) keeps the ones nobody took; a leased one belongs to
    the master that took it."""
    first, second = warm_pool(2).names
    taken, leased = ray.get(_pool().take.remote())
    left = second if taken == first else first
    try:
        ray.kill(_pool())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the dead pool's name is free
            try:
                _pool()
            except ValueError:
                break
            time.sleep(0.2)
        stats = cs.keep_warm_hosts(2, wait_s=90)
        # (the spare the dead pool was starting to replace the taken one may be found too)
        assert stats.found >= 1 and left in stats.names and taken not in stats.names, stats
        assert stats.ready == 2
    finally:
        ray.kill(leased)
