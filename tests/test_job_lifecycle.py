"""The job's state machine (``master.protocols.job``), alone and in the in-process driver.

Method: the machine is fed every event in every state (the transitions table
is all it may do; terminal states are final); then ``LocalCluster`` deploys a
job over several rounds (``deploy_rounds``: a started host's containers run
while the deploy waits for the others, as on Ray) with an operator that fails
in its first epoch: the job must end failed with that error, the deploy's end
must not bring it back to running (the defect found when the project was tried
as a new user would), and a job without the failing operator must finish.
"""

from __future__ import annotations

import itertools

import pytest

import chronostream as cs
from chronostream.dag import compile_query
from chronostream.master.job_state import JobState
from chronostream.master.local import LocalCluster
from chronostream.master.migration import MigrationError
from chronostream.master.placement import initial_placement
from chronostream.master.protocols.job import (TRANSITIONS, ContainerDone, ContainerFailed, Deployed, Enter,
                                               JobLifecycle, Kept, Settled, StopAsked, StopHosts)

LIVE = frozenset({0, 1})
EVENTS = [Deployed(LIVE), ContainerDone(0, LIVE), ContainerDone(1, LIVE), ContainerDone(1, LIVE, busy=True),
          Settled(LIVE), ContainerFailed("in container 1", "boom"), StopAsked()]


def test_every_event_sequence_moves_only_along_the_table_and_never_leaves_an_end():
    for path in itertools.product(range(len(EVENTS)), repeat=3):
        check_path(path)


def check_path(path: tuple[int, ...]) -> None:
    job = JobLifecycle()
    ended = None
    for i in path:
        before = job.state
        out = job.handle(EVENTS[i])
        entered = [c.state for c in out if isinstance(c, Enter)]
        for state in entered:
            assert (before, state) in TRANSITIONS
            before = state
        if ended is not None:
            assert job.state is ended and not entered
        if job.state.terminal:
            ended = job.state
        if job.state is JobState.FINISHED and entered:
            assert job.done >= LIVE
        assert any(isinstance(c, StopHosts) for c in out) == (JobState.FAILED in entered)


def test_a_failure_during_the_deploy_is_kept_when_the_deploy_ends():
    job = JobLifecycle()
    job.handle(ContainerFailed("in container 0", "boom"))
    assert job.handle(Deployed(LIVE)) == [Kept(JobState.FAILED, JobState.RUNNING)]
    assert job.state is JobState.FAILED


def test_the_story_stays_bounded():
    job = JobLifecycle()
    job.handle(Deployed(LIVE))
    for _ in range(5000):
        job.handle(Settled(LIVE))  # (a status poll)
    assert len(job.story) <= 256


class FailsOnFirstEvent(cs.Operator):
    def consume(self, stream_id: str, event: dict) -> None:
        raise ValueError(f"cannot take {event['w']!r}")


def cluster(query: cs.Query, deploy_rounds: int) -> LocalCluster:
    plan, sources = compile_query(query)
    placement = initial_placement(plan, {st.stage_id: 2 for st in plan.stages})
    return LocalCluster(plan, placement, sources, deploy_rounds=deploy_rounds)


def words(failing: bool) -> cs.Query:
    q = cs.Query(epoch_events=3)
    w = q.source("w", [{"w": x} for x in "abcabcabcabc"]).key_by("w")
    if failing:
        w.apply(FailsOnFirstEvent, slices=2, name="fails").sink(name="out")
    else:
        w.count(slices=2).sink(name="out")
    return q


# (with 4 rounds the failing operator's host starts at round 2 and fails there, before the last
# host starts at round 3; with 2 rounds every host started before the first message arrived)
@pytest.mark.parametrize("deploy_rounds,fails_in_deploy", [(0, False), (2, False), (4, True)])
def test_a_container_failing_while_the_hosts_start_fails_the_job_for_good(deploy_rounds, fails_in_deploy):
    cl = cluster(words(failing=True), deploy_rounds)
    with pytest.raises(Exception, match="cannot take"):
        cl.run(max_rounds=200)
    kinds = [k for _, k, _ in cl.timeline]
    assert cl.job.state is JobState.FAILED and cl.deployed
    assert "job_failed" in kinds and "job_running" not in kinds[kinds.index("job_failed"):], kinds
    if fails_in_deploy:  # (the deploy's end is refused)
        assert "state_kept" in kinds and "job_running" not in kinds, kinds


@pytest.mark.parametrize("deploy_rounds", [0, 3])
def test_a_job_deployed_over_several_rounds_runs_and_finishes(deploy_rounds):
    cl = cluster(words(failing=False), deploy_rounds)
    cl.run(max_rounds=200)
    kinds = [k for _, k, _ in cl.timeline]
    assert kinds.index("job_running") < kinds.index("job_finished")
    assert cl.job.state is JobState.FINISHED
    assert sorted(cl.results("out")["count"].to_pylist()) == sorted(
        cs.run(words(failing=False), executor="serial").results("out")["count"].to_pylist())


def test_a_job_still_deploying_refuses_to_rescale():
    """As on Ray (``JobMaster._check_can_migrate``): nothing moves before every host started."""
    q = words(failing=False)
    plan, sources = compile_query(q)
    placement = initial_placement(plan, {st.stage_id: 2 for st in plan.stages})
    cl = LocalCluster(plan, placement, sources, deploy_rounds=3, output_logs=True)
    with pytest.raises(MigrationError, match="the job is created"):
        cl.scale_out(1)
    cl.close()
