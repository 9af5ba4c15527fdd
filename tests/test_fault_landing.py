"""Regression (issue 59, tests that cannot fail): the failure harness judges whether each fault landed.

Without Ray: ``chaos.judge_landing`` on hand-made timelines (a damaged backup
counts only when its holder had the copy and a later restore rejected it and
used another replica; a kill only when a recovery re-hosted the container),
``ChaosReport`` naming faults the job ended before, ``random_faults`` never
turning a fault into another kind and pairing the faults that need a second
one, and ``run_with_faults`` reading every sink before it stops the job.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

import chronostream.chaos
from chronostream.chaos import ChaosReport, Fault, judge_landing, random_faults, run_with_faults
from chronostream.master.job_state import JobState

DAMAGE = Fault("corrupt_backup", 10, "count", index=1)
#: What ``inject`` answers for DAMAGE: slice 3 of stage 1 (container 7 on host 2), its copy on host 5 damaged.
HIT = {"stage": "count", "stage_id": 1, "slice": 3, "container": 7, "host": 2, "holder_host": 5}


def restore(t: float, holder_of_3: int | None, rejected_host: int | None = 5) -> list:
    """A recovery of container 7 at time ``t``: slices 3 and 4 restored into container 9, slice 3
    from ``holder_of_3``; with ``rejected_host``, that host's copy of slice 3 refused first."""
    events = [(t, "recovery_start", {"container": 7, "new": 9, "host": 6, "slices": [3, 4]})]
    if rejected_host is not None:
        events.append((t + 0.1, "backup_rejected", {"container": 9, "stage": 1, "slice": 3, "host": rejected_host,
                                                    "error": "checksum mismatch"}))
    return events + [
        (t + 0.2, "slices_restored", {"container": 9, "host": 6, "slices": [3, 4], "stage": 1,
                                      "restored_from": [holder_of_3, 6]}),
        (t + 0.3, "recovery_end", {"containers": [7], "new": [9], "hosts": [6]})]


def test_a_damaged_backup_lands_when_a_later_restore_rejects_it_and_uses_the_other_replica():
    """Regression (issue 59, tests that cannot fail): a damage is judged landed from the restore that names the other replica."""
    landing = judge_landing(DAMAGE, 100.0, HIT, restore(101.0, holder_of_3=6))
    assert landing.landed, landing.did
    assert "host 5" in landing.did and "host 6" in landing.did


@pytest.mark.parametrize("timeline, why", [
    ([], "no restore of the slice followed"),
    (restore(101.0, holder_of_3=5, rejected_host=None), "no restore rejected it"),
    (restore(101.0, holder_of_3=5), "not another replica"),
    (restore(99.0, holder_of_3=6), "no restore of the slice followed"),  # (a restore before the damage)
])
def test_a_damaged_backup_no_restore_read_or_replaced_did_not_land(timeline, why):
    """Regression (issue 59, tests that cannot fail): a damage followed by no restore, by one that took the damaged copy
    without a word, by one that used the damaged holder anyway, or preceded by the only restore:
    not landed (before, any applied damage counted)."""
    landing = judge_landing(DAMAGE, 100.0, HIT, timeline)
    assert not landing.landed and why in landing.did, landing.did


def test_a_damage_on_holders_that_had_no_backup_did_not_land():
    """Regression (issue 59, tests that cannot fail): no holder had the copy: nothing was damaged, not landed."""
    hit = {**HIT, "holder_host": None, "chain": [5, 6]}
    landing = judge_landing(DAMAGE, 100.0, hit, restore(101.0, holder_of_3=6))
    assert not landing.landed and "nothing was damaged" in landing.did


def test_a_kill_lands_only_when_a_recovery_re_hosts_the_container():
    """Regression (issue 59, tests that cannot fail): a kill lands when a recovery re-hosted its container, not another's."""
    kill = Fault("kill", 10, "count")
    hit = {"stage": "count", "container": 7, "host": 2}
    assert judge_landing(kill, 100.0, hit, restore(101.0, holder_of_3=6)).landed
    other = [(101.0, "recovery_end", {"containers": [8], "new": [9], "hosts": [6]})]
    assert not judge_landing(kill, 100.0, hit, other).landed
    assert not judge_landing(kill, 100.0, hit, []).landed


def test_a_kill_in_a_recovery_needs_the_second_host_killed_and_recovered():
    fault = Fault("kill_in_recovery", 10, "count", role="consumer")
    hit = {"stage": "count", "container": 7, "host": 2}
    skipped = restore(101.0, 6) + [(101.05, "host_kill_skipped", {"role": "consumer", "why": "no live host"})]
    landing = judge_landing(fault, 100.0, hit, skipped)
    assert not landing.landed and "no second host was killed" in landing.did
    second = restore(101.0, 6) + [(101.05, "host_kill_injected", {"role": "consumer", "host": 4}),
                                  (101.1, "recovery_planning", {"hosts": [4], "containers": [12]}),
                                  (101.4, "recovery_end", {"containers": [12], "new": [13], "hosts": [6]})]
    assert judge_landing(fault, 100.0, hit, second).landed


def test_rescalings_land_when_they_move_slices():
    assert judge_landing(Fault("migrate", 5, "count"), 1.0, {"slice": 3, "moved": [3]}, []).landed
    assert not judge_landing(Fault("migrate", 5, "count"), 1.0, {"slice": 3, "moved": []}, []).landed
    assert not judge_landing(Fault("compact", 5, "count"), 1.0, {"moved": []}, []).landed
    assert judge_landing(Fault("scale_in", 5, "count"), 1.0, {"moved": [0, 4]}, []).landed


def test_the_report_names_the_faults_the_job_ended_before():
    """Regression (issue 59, tests that cannot fail): a fault the job's end overtook is listed as not landed."""
    kill = Fault("kill", 10, "count")
    report = ChaosReport(faults=[DAMAGE, kill], applied=[(100.0, DAMAGE, HIT)], timeline=restore(101.0, 6))
    landed = report.landings()
    assert [x.landed for x in landed] == [True, False]
    assert report.not_landed()[0].fault == kill and "never applied" in report.not_landed()[0].did
    assert "NOT LANDED: kill a container of stage 'count' at epoch 10" in report.format_landings()


KINDS = ("kill", "kill_two", "corrupt_backup", "truncate_backup", "kill_spare", "scale_in", "compact", "delay")


@pytest.mark.parametrize("seed", range(20))
def test_a_random_schedule_holds_only_the_kinds_asked_for_within_the_caps(seed):
    """Regression (issue 59, tests that cannot fail): no fault over the kill cap becomes a 0.01 s delay: a ``delay`` appears only when asked for,
    kills stay within the cap (2 of 4 hosts a stage), a damaged backup comes with a kill of its
    container and a dead spare with a scale-out, and a compaction follows a kill or a scale-in."""
    asked = tuple(k for k in KINDS if k != "delay")
    faults = random_faults(seed, 3, ["a", "b"], 60, containers=4, kinds=asked)
    assert {f.kind for f in faults} <= set(asked) | {"scale_out"}, faults
    cost = {"kill": 1, "kill_two": 2}  # (a damaged backup's cost is the kill that follows it)
    for stage in ("a", "b"):
        assert sum(cost.get(f.kind, 0) for f in faults if f.stage == stage) <= 2, faults
    for i, f in enumerate(faults):
        if f.kind in ("corrupt_backup", "truncate_backup"):
            assert faults[i + 1] == Fault("kill", f.at_epoch, f.stage, f.index), faults
        if f.kind == "kill_spare":
            assert faults[i + 1] == Fault("scale_out", f.at_epoch, f.stage, f.index), faults
        if f.kind == "compact":
            before = [g.kind for g in faults[:i] if g.stage == f.stage]
            assert {"kill", "kill_two", "scale_in"} & set(before), faults


def test_a_schedule_the_caps_cannot_hold_is_refused_not_changed():
    """Regression (issue 59, tests that cannot fail): a schedule no kind fits is refused, naming the cap (it was filled with delays)."""
    with pytest.raises(ValueError, match=r"none of \['kill'\] fits \(kills so far 2, at most 2 a stage of 4 hosts"):
        random_faults(0, 3, ["count"], 40, containers=4, kinds=("kill",))


def test_a_damaged_backup_is_drawn_only_once_there_are_backups_to_damage():
    """Regression (issue 59, tests that cannot fail): a damage at epoch 1, before the first
    checkpoint reached a holder, damages nothing: damages are drawn from ``backups_from`` on."""
    for seed in range(30):
        faults = random_faults(seed, 4, ["a"], 40, containers=8, kinds=("corrupt_backup", "kill"), backups_from=6)
        assert all(f.at_epoch >= 6 for f in faults if f.kind == "corrupt_backup"), faults


def test_kill_in_recovery_roles_are_drawn_among_the_stage_s_own():
    faults = random_faults(3, 4, ["a", "b"], 60, containers=10, kinds=("kill_in_recovery",),
                           roles={"a": ("adopter",), "b": ("adopter", "producer")})
    assert {f.role for f in faults if f.stage == "a"} <= {"adopter"}
    assert {f.role for f in faults} <= {"adopter", "producer"}


class _FakeJob:
    """A finished job whose rows are gone once it is stopped (as a real job's workdir is)."""

    class plan:  # noqa: N801 - stands in for the job's plan
        sinks = [type("Sink", (), {"name": "out"})]
        stages = []

    def __init__(self, table: pa.Table) -> None:
        self.table, self.stopped = table, False

    def progress(self):
        return {"state": JobState.FINISHED, "min_epoch": 99}

    def wait(self, timeout_s=None):
        return self

    def results(self, name):
        assert not self.stopped, "rows read after the job was stopped"
        return self.table

    def timeline(self):
        return [(1.0, "job_finished", {})]

    def stop(self):
        self.stopped = True


def test_run_with_faults_hands_back_every_sink_s_rows_read_before_the_job_stops(monkeypatch):
    """Regression (issue 59, tests that cannot fail): the report holds each sink's rows, read before the job is stopped."""
    rows = pa.table({"_slice": [0, 1], "_seq": [0, 0], "v": [1, 2]})
    jobs = []

    def fake_run(query, executor="ray", **kw):
        jobs.append(_FakeJob(rows))
        return jobs[-1]

    monkeypatch.setattr(chronostream.chaos, "run", fake_run)
    report = run_with_faults(object(), [])
    assert jobs[0].stopped, "the job is stopped"
    assert report.outputs["out"].equals(rows) and report.ok and report.rows == {"out": 2}
