"""Specification of the recovery planner (master.recovery.plan_recovery): pure data in, a plan out."""

from __future__ import annotations

from master.recovery import plan_recovery

# Dead container 0 of stage 1 had slices 0..3; hosts 1 and 2 hold their backups.
LOST = {0: (1, [0, 1, 2, 3])}
LIVE = {1: [1, 2]}


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
