"""The failure harness's schedule (``chronostream.chaos``): fault validation and seeded schedules."""

from __future__ import annotations

import pytest

from chronostream.chaos import Fault, random_faults
from master.recovery import RECOVERY_ROLES, RECOVERY_STEPS


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
    mixed = random_faults(5, 8, ["a", "b"], 80, containers=6, kinds=("kill_in_recovery",))
    drawn = [f for f in mixed if f.kind == "kill_in_recovery"]
    assert drawn and all(f.step in RECOVERY_STEPS and f.role in RECOVERY_ROLES for f in drawn)
    assert len({(f.step, f.role) for f in drawn}) > 1, "step and role are drawn, not fixed"
    others = random_faults(5, 8, ["a", "b"], 80, containers=6, kinds=("kill", "delay"))
    assert {(f.step, f.role) for f in others} == {("restored", "adopter")}, "the defaults, nothing drawn"


def test_a_kill_in_a_recovery_counts_as_two_kills_against_the_stage_cap():
    """With 4 containers a stage keeps 2: one kill in a recovery (it may take a second host of the
    stage) uses the whole allowance; the next becomes a delay."""
    faults = random_faults(5, 6, ["a"], 80, containers=4, kinds=("kill_in_recovery",))
    assert [f.kind for f in faults].count("kill_in_recovery") == 1
