"""The recovery machine alone (``master.protocols.recovery``): events in, commands out, no driver."""

from __future__ import annotations

import pytest

from chronostream.master.protocols.recovery import (
    AcceptSenders, AtStep, BackupsRead, Declared, DeclareDead, Finish, HostMade, HostsDied,
    PlanInputs, PlanRecord, ReadBackups, RecoveryProtocol, RecoveryStep, ReplayToConsumers, Reroute, Rerouted,
    Restore, Restored, RestoreSlices, Retargeted, RetargetBackups, StepFailed, Survey, Surveyed)
from chronostream.master.recovery import Adoption, BackupsLost

STAGE = 1


def kinds(commands) -> list[str]:
    return [type(c).__name__ for c in commands]


def plan_one(r: RecoveryProtocol, dead: int, lost: dict, backups: dict, live: dict, next_id: int) -> list:
    """Drive ``r`` from a host's death to its plan; return the commands after ``BackupsRead``."""
    assert r.handle(HostsDied(frozenset({dead}))) == [DeclareDead(frozenset({dead}))]
    (survey,) = r.handle(Declared(frozenset({dead})))
    assert isinstance(survey, Survey) and survey.dead == {dead}
    assert r.handle(Surveyed(lost, 1.0)) == [AtStep("detected", lost), ReadBackups(lost)]
    return r.handle(BackupsRead(PlanInputs(backups, live, next_id)))


def restores(plan) -> dict:
    return {a.new_id: Restore({s: {} for s in a.slices}, {s: 7 for s in a.slices}) for a in plan}


def test_a_recovery_plans_saves_before_any_host_hears_then_adopts_reroutes_and_finishes():
    r = RecoveryProtocol()
    out = plan_one(r, 2, {5: (STAGE, [0, 3])}, {(STAGE, 0): [(1, 4)], (STAGE, 3): [(3, 4)]}, {STAGE: [1, 3]}, 9)
    assert kinds(out) == ["ApplyPlan", "AtStep", "AcceptSenders", "RestoreSlices"]
    apply, _, accept, restore = out
    plan = apply.made.plan
    assert [(a.new_id, a.host, a.slices) for a in plan] == [(9, 1, [0]), (10, 3, [3])] and apply.next_id == 11
    assert r.record() == {"dead": [], "plans": [apply.made.to_plain()]}  # saved with the plan, before any host
    assert accept.not_made == {9, 10} and restore.plan == tuple(plan)
    out = r.handle(Restored(0, restores(plan)))
    assert kinds(out) == ["AtStep", "StartContainers", "Reroute", "Reroute", "ReplayToConsumers",
                          "ReplayToConsumers", "AtStep", "RetargetBackups"]
    assert out[0].step == "restored" and out[6].step == "rerouted" and out[7] == RetargetBackups(frozenset({STAGE}))
    assert out[4] == ReplayToConsumers(plan[0], 7, frozenset({9, 10}))
    assert r.handle(Rerouted(9, 2)) == [] and r.handle(Rerouted(10, 3)) == []
    (finish,) = r.handle(Retargeted())
    assert isinstance(finish, Finish) and finish.epochs == {9: 2, 10: 3} and r.finished and r.record() is None
    assert [s for _, s, _ in r.story][-1] == "done"


def test_a_stage_with_no_live_host_left_gets_a_new_host_made_before_its_slices_restore():
    r = RecoveryProtocol()
    out = plan_one(r, 2, {5: (STAGE, [0])}, {}, {}, 9)
    apply = out[0]
    (a,) = apply.made.plan
    assert a.host == 10 and apply.made.new_hosts == [10] and apply.next_id == 11
    assert kinds(out) == ["ApplyPlan", "AtStep", "MakeHost", "AcceptSenders", "RestoreSlices"]
    assert r.handle(Restored(0, restores([a]))) == []  # the host is still coming
    assert kinds(r.handle(HostMade(10)))[:2] == ["AtStep", "StartContainers"]


def test_a_host_dying_in_a_step_is_planned_for_and_every_plan_runs_again_without_its_adoptions():
    r = RecoveryProtocol()
    out = plan_one(r, 2, {5: (STAGE, [0, 3])}, {(STAGE, 0): [(1, 4)], (STAGE, 3): [(3, 4)]}, {STAGE: [1, 3]}, 9)
    first = out[0].made
    # host 3 (adopting slice 3 as container 10) dies while the slices restore
    assert r.handle(StepFailed(frozenset({3}), "actor died")) == [DeclareDead(frozenset({3}))]
    assert r.step is RecoveryStep.DECLARING
    (survey,) = r.handle(Declared(frozenset({3})))
    assert survey.plans == (first,)  # the record keeps the unfinished plan with the new dead host
    out = r.handle(Surveyed({10: (STAGE, [3])}, 2.0))
    assert kinds(out) == ["AtStep", "ReadBackups"]
    out = r.handle(BackupsRead(PlanInputs({(STAGE, 3): [(1, 4)]}, {STAGE: [1]}, 11)))
    second = out[0].made
    assert [(a.new_id, a.host, a.replaces) for a in second.plan] == [(11, 1, 10)]
    runs = [c.plan for c in out if isinstance(c, RestoreSlices)]
    assert [[a.new_id for a in run] for run in runs] == [[9], [11]], "container 10 on the dead host is not made"
    assert [c.not_made for c in out if isinstance(c, AcceptSenders)] == [{9, 11}, {11}]
    r.handle(Restored(0, restores(runs[0])))
    out = r.handle(Restored(1, restores(runs[1])))
    assert [c.adoption.new_id for c in out if isinstance(c, Reroute)] == [9, 11]


def test_a_restarted_master_runs_its_saved_plans_again_and_plans_for_hosts_it_had_not():
    saved = PlanRecord([2], {5: (STAGE, [0])}, [], [Adoption(9, 5, STAGE, 1, [0], {0: [1]}, {0: 4})], 1.0)
    r = RecoveryProtocol([PlanRecord.from_plain({**saved.to_plain(), "resumed": True})], gone={2})
    out = r.handle(HostsDied(frozenset()))
    assert kinds(out) == ["AcceptSenders", "RestoreSlices"] and out[1].plan[0].new_id == 9
    finish_cmds = r.handle(Restored(0, restores(out[1].plan)))
    assert kinds(finish_cmds)[:2] == ["AtStep", "StartContainers"]
    r.handle(Rerouted(9, 0))
    (finish,) = r.handle(Retargeted())
    assert finish.plans[0].resumed


def test_a_survey_that_finds_nothing_lost_finishes_at_once():
    r = RecoveryProtocol()
    r.handle(HostsDied(frozenset({4})))
    r.handle(Declared(frozenset({4})))
    assert r.handle(Surveyed({}, 1.0)) == [Finish((), (), {})] and r.finished


def test_a_slice_with_every_backup_lost_fails_the_planning_naming_it():
    r = RecoveryProtocol()
    r.handle(HostsDied(frozenset({2})))
    r.handle(Declared(frozenset({2})))
    r.handle(Surveyed({5: (STAGE, [0])}, 1.0))
    with pytest.raises(BackupsLost, match="slice 0"):
        r.handle(BackupsRead(PlanInputs({}, {STAGE: [1]}, 9, checkpointed=frozenset({(STAGE, 0)}))))


def test_the_machine_refuses_a_step_outside_its_table():
    r = RecoveryProtocol()
    with pytest.raises(AssertionError, match="no step declaring -> done"):
        r._to(RecoveryStep.DONE)
