"""Specification of the recovery planner (master.recovery.plan_recovery): pure data in, a plan out."""

from __future__ import annotations

import pytest

import chronostream as cs
from chronostream.dag import compile_query
from chronostream.master.recovery import BackupsLost, low_water_marks, plan_recovery

# Dead container 0 of stage 1 had slices 0..3; hosts 1 and 2 hold their backups.
LOST = {0: (1, [0, 1, 2, 3])}
LIVE = {1: [1, 2]}


def two_stage_query() -> cs.Query:
    """A source (stage 0) feeding a count of 2 slices (stage 1)."""
    q = cs.Query()
    q.source("w", [{"w": "a"}]).key_by("w").count(slices=2).sink(name="c")
    return q


def hosts_by_slice(plan) -> dict[int, int]:
    return {s: a.host for a in plan for s in a.slices}


def test_slices_spread_over_the_holders_of_the_newest_backup():
    backups = {(1, s): [(1, 8), (2, 8)] for s in range(4)}
    plan = plan_recovery(LOST, backups, LIVE, 10)
    assert sorted(hosts_by_slice(plan).values()) == [1, 1, 2, 2]


def test_without_a_floor_only_the_newest_backup_counts():
    """A holder one checkpoint behind (still being shipped) is not used when GC marks are unknown."""
    backups = {(1, s): [(1, 8), (2, 6)] for s in range(4)}
    plan = plan_recovery(LOST, backups, LIVE, 10)
    assert set(hosts_by_slice(plan).values()) == {1}


def test_a_slightly_older_backup_above_the_floor_keeps_recovery_parallel():
    """Within ``slack`` epochs of the newest and at or above the GC floor, older copies share the work,
    and each adoption records the epoch of the copy it restores from."""
    backups = {(1, s): [(1, 8), (2, 6)] for s in range(4)}
    plan = plan_recovery(LOST, backups, LIVE, 10, floor={1: 5}, slack=4)
    assert sorted(hosts_by_slice(plan).values()) == [1, 1, 2, 2]
    for a in plan:
        assert all(a.epochs[s] == (8 if a.host == 1 else 6) for s in a.slices)
        assert all(a.holders[s][0] == a.host for s in a.slices), "the chosen copy is tried first"


def test_a_backup_older_than_the_gc_floor_is_never_chosen():
    """Upstream logs were trimmed up to epoch 7: restoring from epoch 6 could not be replayed."""
    backups = {(1, s): [(1, 8), (2, 6)] for s in range(4)}
    plan = plan_recovery(LOST, backups, LIVE, 10, floor={1: 7}, slack=4)
    assert set(hosts_by_slice(plan).values()) == {1}


def test_copies_all_older_than_the_gc_floor_are_a_clear_loss_naming_the_slice():
    """The holder of the newest copy died too: what is left cannot be replayed from."""
    backups = {(1, s): [(2, 6)] for s in range(4)}
    with pytest.raises(BackupsLost, match=r"slice 0 is lost: the copies left \(host 2 at epoch 6\) are older "
                                          r"than epoch 7"):
        plan_recovery(LOST, backups, LIVE, 10, floor={1: 7}, slack=4)


def test_gc_keeps_the_logs_a_copy_within_the_slack_needs():
    """A copy one checkpoint behind the newest is one a recovery takes (the newest's holder dead
    with the slice), so GC keeps its producers' outputs; a copy far behind holds nothing back."""
    plan, _ = compile_query(two_stage_query())
    lagging = [{(1, 0): 8, (1, 1): 8}, {(1, 0): 6, (1, 1): 8}]
    assert low_water_marks(plan, lagging, slack=4) == {0: 6}
    assert low_water_marks(plan, lagging) == {0: 8}
    stale = [{(1, 0): 8, (1, 1): 8}, {(1, 0): 1, (1, 1): 8}]
    assert low_water_marks(plan, stale, slack=4) == {0: 8}


def test_a_stage_with_no_live_host_is_adopted_by_the_holders_of_its_backups():
    """A stage that lived on one host backs up to other stages' hosts (``host_backup_peers``):
    when that host dies the holders restore it where the copies are, spread over them."""
    backups = {(1, s): [(5, 8), (6, 8)] for s in range(4)}
    plan = plan_recovery(LOST, backups, {1: []}, 10)
    assert sorted(hosts_by_slice(plan).values()) == [5, 5, 6, 6]
    assert all(a.epochs[s] == 8 and a.holders[s][0] == a.host for a in plan for s in a.slices)


def test_holders_on_the_stages_live_hosts_adopt_before_holders_on_other_stages_hosts():
    """A stage on fewer hosts than its backup factor + 1 keeps copies on other stages' hosts too
    (``host_backup_peers``): its own live host restores what it holds, the stage stays there."""
    backups = {(1, s): [(5, 8), (1, 8)] for s in range(4)}
    plan = plan_recovery(LOST, backups, {1: [1]}, 10)
    assert set(hosts_by_slice(plan).values()) == {1}


def test_a_slice_whose_stage_hosts_hold_no_copy_is_adopted_by_a_holder_on_another_stages_host():
    """The stage still has a live host, but the only copies left are on other stages' hosts (the
    other of its two hosts died with it): a holder restores it, no loss."""
    backups = {(1, s): [(5, 8)] for s in range(4)}
    plan = plan_recovery(LOST, backups, LIVE, 10, checkpointed={(1, s) for s in range(4)})
    assert set(hosts_by_slice(plan).values()) == {5}
    assert all(a.epochs[s] == 8 for a in plan for s in a.slices)


def test_a_stage_with_no_live_host_and_no_backup_gets_a_new_host():
    plan = plan_recovery(LOST, {}, {1: []}, 10)
    assert set(hosts_by_slice(plan).values()) == {None}
    assert all(a.epochs[s] == -1 for a in plan for s in a.slices), "rebuilt from the start"


def test_a_source_whose_every_backup_is_lost_is_rebuilt_from_the_start():
    """A source re-reads its input and needs no upstream log: losing every copy is no error."""
    with pytest.raises(BackupsLost, match="slice 0"):
        plan_recovery(LOST, {}, LIVE, 10, checkpointed={(1, s) for s in range(4)})
    plan = plan_recovery(LOST, {}, LIVE, 10, checkpointed={(1, s) for s in range(4)}, rebuildable={1})
    assert all(a.epochs[s] == -1 and a.holders[s] == [] for a in plan for s in a.slices)


def test_a_checkpointed_slice_with_no_copy_left_is_rebuilt_from_the_start_while_no_upstream_log_was_trimmed():
    """Every copy gone (or none arrived yet: a checkpoint taken, not yet received), but no GC mark
    applied to the stage's upstream logs: replaying them from epoch 0 rebuilds the slice exactly."""
    checkpointed = {(1, s) for s in range(4)}
    plan = plan_recovery(LOST, {}, LIVE, 10, checkpointed=checkpointed, floor={0: -1, 1: -1})
    assert sorted(s for a in plan for s in a.slices) == [0, 1, 2, 3]
    assert all(a.epochs[s] == -1 and a.holders[s] == [] for a in plan for s in a.slices)
    assert set(hosts_by_slice(plan).values()) <= {1, 2}


def test_a_checkpointed_slice_with_no_copy_left_after_a_trim_is_a_loss_naming_its_chains_holders():
    checkpointed = {(1, s) for s in range(4)}
    with pytest.raises(BackupsLost, match=r"slice 0 is lost \(container 0 died and no live host holds a copy; "
                                          r"its chain's holders were hosts \[3\]\)"):
        plan_recovery(LOST, {}, LIVE, 10, checkpointed=checkpointed, floor={0: -1, 1: 4},
                      chain={(1, s): [3] for s in range(4)})
    with pytest.raises(BackupsLost, match="slice 0"):  # marks unknown (a restarted master): no guess
        plan_recovery(LOST, {}, LIVE, 10, checkpointed=checkpointed, floor=None)


def test_a_slice_no_master_saw_checkpointed_is_a_loss_once_its_upstream_logs_were_trimmed():
    """A restarted master has no statistics of containers that died before it came: a trimmed
    upstream log says the slice was checkpointed all the same, so a rebuild from the start (which
    would miss the trimmed rows) is refused, not planned."""
    with pytest.raises(BackupsLost, match="slice 0"):
        plan_recovery(LOST, {}, LIVE, 10, floor={0: -1, 1: 4})
    plan = plan_recovery(LOST, {}, LIVE, 10, floor={0: -1, 1: -1})  # (nothing trimmed: replay from 0)
    assert all(a.epochs[s] == -1 for a in plan for s in a.slices)
