"""The failure harness's schedule (``chronostream.chaos``): fault validation and seeded schedules."""

from __future__ import annotations

import re

import pytest

from chronostream.chaos import Fault, random_faults
from chronostream.master.recovery import RECOVERY_ROLES, RECOVERY_STEPS


def test_a_kill_in_a_recovery_names_an_unknown_role_and_the_roles_there_are():
    with pytest.raises(ValueError, match="unknown role 'bystander'; roles: \\('adopter', 'producer', 'consumer'\\)"):
        Fault("kill_in_recovery", 5, "count", role="bystander")


def test_a_kill_in_a_recovery_refuses_an_unknown_step():
    with pytest.raises(ValueError, match="unknown recovery step 'halfway'"):
        Fault("kill_in_recovery", 5, "count", step="halfway")


def test_a_kill_in_a_recovery_describes_its_second_victim():
    text = Fault("kill_in_recovery", 5, "count", step="planned", role="producer").describe()
    assert text == "kill a host (producer) at recovery step 'planned' after killing a container of stage 'count' at epoch 5"


def test_random_schedules_draw_a_step_and_a_role_only_for_kills_in_recoveries():
    mixed = random_faults(5, 6, ["a", "b"], 80, containers=10, kinds=("kill_in_recovery",))
    drawn = [f for f in mixed if f.kind == "kill_in_recovery"]
    assert drawn and all(f.step in RECOVERY_STEPS and f.role in RECOVERY_ROLES for f in drawn)
    assert len({(f.step, f.role) for f in drawn}) > 1, "step and role are drawn, not fixed"
    others = random_faults(5, 8, ["a", "b"], 80, containers=6, kinds=("kill", "delay"))
    assert {(f.step, f.role) for f in others} == {("restored", "adopter")}, "the defaults, nothing drawn"


def test_a_kill_in_a_recovery_counts_as_two_kills_against_the_stage_cap():
    """With 4 containers a stage keeps 2: one kill in a recovery (it may take a second host of the
    stage) uses the whole allowance; the rest of the schedule is drawn among the kinds that fit, and
    with none left the schedule is refused, not turned into delays."""
    faults = random_faults(5, 6, ["a"], 80, containers=4, kinds=("kill_in_recovery", "migrate"))
    assert [f.kind for f in faults].count("kill_in_recovery") == 1 and "delay" not in {f.kind for f in faults}
    with pytest.raises(ValueError, match="none of \\['kill_in_recovery'\\] fits"):
        random_faults(5, 6, ["a"], 80, containers=4, kinds=("kill_in_recovery",))


def test_a_fault_written_as_text_carries_its_stage_and_options():
    f = Fault.parse("kill_in_recovery@12:running_sum,step=planned,role=producer,index=2")
    assert (f.kind, f.at_epoch, f.stage, f.step, f.role, f.index) == \
        ("kill_in_recovery", 12, "running_sum", "planned", "producer", 2)
    assert Fault.parse("delay@0:payments,seconds=0.05").seconds == 0.05
    assert Fault.parse("kill_spare@5").stage is None


@pytest.mark.parametrize("spec, says", [
    ("kill", "KIND@EPOCH"),
    ("kill@x:count", "KIND@EPOCH"),
    ("explode@3", "unknown fault kind 'explode'"),
    ("scale_out@3:count,hosts=2", "'hosts=2' is not NAME=VALUE with NAME one of"),
    ("scale_out@3:count,n=two", "n must be int, got 'two'"),
    ("kill_in_recovery@3:count,step=later", "unknown recovery step 'later'"),
])
def test_a_fault_written_wrongly_is_refused_saying_what_is_wrong(spec, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        Fault.parse(spec)


def test_the_chaos_command_refuses_a_wrong_fault_before_running_anything(tmp_path, capsys):
    from chronostream.cli import main

    f = tmp_path / "q.py"
    f.write_text("raise SystemExit('the query file was loaded')\n")
    with pytest.raises(SystemExit, match=re.escape("chronostream chaos: unknown fault kind 'explode'")):
        main(["chaos", str(f), "--fault", "explode@3"])
    with pytest.raises(SystemExit, match="unknown fault kind 'nap'"):
        main(["chaos", str(f), "--faults", "2", "--kinds", "kill,nap"])
