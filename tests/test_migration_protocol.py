"""The migration machine alone (``master.protocols.migration``): events in, commands out, no driver.

Each test plays a driver by hand: it answers the machine's commands with the
events a host would send and checks the commands and phases that follow.
"""

from __future__ import annotations

import pytest

from chronostream.master.migration import MigrationPhase as P
from chronostream.master.migration import MigrationError, Transfer
from chronostream.master.protocols.migration import (
    Abandon, AcceptSenders, Begin, BeginDual, ContainerView, DropDual, DualBegun, FixHandover, ForgetReleased,
    Freeze, HandoverFixed, HostMade, Interrupted, MakeHost, MigrationOptions, MigrationProtocol, Observe, Observed,
    ReleaseRoutes, ReleaseSource, Rehost, RemoveContainer, Reroute, Rerouted, Snapshot, Snapshotted,
    SourceReleased, StartContainer, Started, View)

STAGE = 1


def kinds(commands) -> list[str]:
    return [type(c).__name__ for c in commands]


def view(now: float, containers: dict, held: dict | None = None, handovers: dict | None = None) -> Observed:
    return Observed(View(now, {c: ContainerView(*v) for c, v in containers.items()}, held or {}, handovers or {}))


def to_dual(m: MigrationProtocol, t: Transfer, *, src_epoch: int = 10) -> None:
    """Drive a one-transfer migration (container 3 -> new 9 on a new host 5) to DUAL."""
    assert m.handle(Begin()) == [MakeHost(-1)]
    assert kinds(m.handle(HostMade(-1, 5))) == ["Observe"]
    assert m.handle(view(0, {3: (src_epoch, False)}, {5: {}})) == [Snapshot(0, 3, (4,), 5)]
    assert kinds(m.handle(Snapshotted(0, src_epoch - 1, 10))) == ["Observe"]
    assert t.phase is P.REBUILDING
    out = m.handle(view(1, {3: (src_epoch, False)}))
    assert out == [AcceptSenders(9, STAGE, (4,), 5), StartContainer(9, STAGE, (4,), 5)]
    (reroute,) = m.handle(Started(9, {4: "progress"}, {4: src_epoch}))
    assert reroute == Reroute(9, STAGE, (4,), {4: "progress"}, {4: src_epoch})
    assert kinds(m.handle(Rerouted(9, {2: {"epochs": 1}}))) == ["Observe"]
    assert t.phase is P.DUAL and t.resume == {4: src_epoch}


def test_a_migration_goes_through_every_phase_one_step_an_observation_and_completes_once_released():
    t = Transfer(9, 3, STAGE, None, [4], target=-1)
    m = MigrationProtocol(STAGE, [t])
    to_dual(m, t)
    # the destination is behind the source: DUAL waits (and says nothing moved)
    (ask,) = m.handle(view(2, {3: (14, False), 9: (11, False)}))
    assert isinstance(ask, Observe) and ask.wait and t.phase is P.DUAL
    out = m.handle(view(3, {3: (14, False), 9: (13, False)}))
    assert out[0] == ReleaseRoutes(9, STAGE, (4,)) and t.phase is P.RELEASING
    # the source has not released yet: RELEASING waits
    assert kinds(m.handle(view(4, {3: (15, False), 9: (15, False)}))) == ["Observe"]
    (release, ask) = m.handle(view(5, {3: (16, False, {4: 15}), 9: (16, False)}))
    assert release == ReleaseSource(0, 3, 9, (4,)) and isinstance(ask, Observe)
    out = m.handle(SourceReleased(0, ContainerView(16, False, {4: 15}, {14: 1.0}),
                                  ContainerView(17, False, {}, {15: 1.25})))
    assert out == [ForgetReleased(STAGE, 3, (4,)), Rehost(0, 3, 9, (4,))]
    assert t.phase is P.DONE and m.finished and t.released_at == {4: 15} and t.pause_ms == {4: 250.0}
    assert [p for _, p, _, _ in t.story] == ["warming", "rebuilding", "dual", "releasing", "done"]


def test_dual_waits_for_a_backup_off_the_new_host_then_warns_and_goes_on_after_its_timeout():
    t = Transfer(9, 3, STAGE, None, [4], target=-1)
    m = MigrationProtocol(STAGE, [t], MigrationOptions(off_host=True, off_host_timeout_s=10.0))
    to_dual(m, t)
    caught_up = {3: (14, False), 9: (14, False)}
    only_on_new_host = {5: {(STAGE, 4): 12}}
    assert kinds(m.handle(view(2, caught_up, only_on_new_host))) == ["Observe"] and t.phase is P.DUAL
    out = m.handle(view(3, caught_up, {5: {(STAGE, 4): 12}, 6: {(STAGE, 4): 9}}))  # a peer holds epoch 9 = resume - 1
    assert kinds(out)[:1] == ["ReleaseRoutes"] and t.phase is P.RELEASING
    # the same with no peer ever: after the timeout, a warning and the release
    t2 = Transfer(9, 3, STAGE, None, [4], target=-1)
    m2 = MigrationProtocol(STAGE, [t2], MigrationOptions(off_host=True, off_host_timeout_s=10.0))
    to_dual(m2, t2)
    assert kinds(m2.handle(view(2, caught_up, only_on_new_host))) == ["Observe"]
    out = m2.handle(view(13, caught_up, only_on_new_host))
    assert kinds(out)[:2] == ["Warn", "ReleaseRoutes"] and t2.phase is P.RELEASING
    assert "no backup off their new host" in out[0].message


@pytest.mark.parametrize("dest_dead", [False, True])
def test_an_interruption_in_dual_finishes_with_a_live_destination_and_aborts_without_one(dest_dead):
    t = Transfer(9, 3, STAGE, None, [4], target=-1)
    m = MigrationProtocol(STAGE, [t])
    to_dual(m, t)
    dead = frozenset({5} if dest_dead else {7})
    out = m.handle(Interrupted(dead, f"hosts {sorted(dead)} died"))
    if dest_dead:
        assert out == [DropDual(STAGE, (4,)), RemoveContainer(9, None), Freeze((3,), False)]
        assert t.phase is P.ABORTED and m.finished and "died" in t.story[-1][3]["reason"]
        return
    assert out == [ReleaseRoutes(9, STAGE, (4,)), Freeze((3,), False), ReleaseSource(0, 3, 9, (4,))]
    # the source died too: producers forget it, the placement moves (no pause wait while settling)
    out = m.handle(SourceReleased(0, None, ContainerView(20, False)))
    assert out == [ForgetReleased(STAGE, 3, (4,)), Rehost(0, 3, 9, (4,))] and t.phase is P.DONE


def test_an_interruption_before_dual_aborts_and_the_source_keeps_its_slices():
    t = Transfer(9, 3, STAGE, 5, [4])
    m = MigrationProtocol(STAGE, [t])
    m.handle(Begin())
    out = m.handle(Interrupted(frozenset({8}), "hosts [8] died"))
    assert kinds(out) == ["DropDual", "RemoveContainer", "Freeze"] and t.phase is P.ABORTED
    assert m.handle(Snapshotted(0, 3)) == []  # a late answer changes nothing


def test_a_phase_waiting_past_its_timeout_is_abandoned():
    t = Transfer(9, 3, STAGE, None, [4], target=-1)
    m = MigrationProtocol(STAGE, [t], MigrationOptions(phase_timeout_s=120.0))
    to_dual(m, t)
    behind = {3: (50, False), 9: (12, False)}
    assert kinds(m.handle(view(10, behind))) == ["Observe"]
    (abandon,) = m.handle(view(131, behind))
    assert isinstance(abandon, Abandon) and "stuck in dual" in abandon.reason


def test_a_dead_container_seen_while_catching_up_abandons_the_phase():
    t = Transfer(9, 3, STAGE, None, [4], target=-1)
    m = MigrationProtocol(STAGE, [t])
    to_dual(m, t)
    (abandon,) = m.handle(view(2, {9: (12, False)}))
    assert isinstance(abandon, Abandon) and "[3]" in abandon.reason


def test_two_sources_moving_to_one_new_container_move_together_and_release_in_one_call():
    a, b = Transfer(9, 3, STAGE, 5, [4]), Transfer(9, 7, STAGE, 5, [1, 6])
    m = MigrationProtocol(STAGE, [a, b])
    assert kinds(m.handle(Begin())) == ["Observe"]
    out = m.handle(view(0, {3: (8, False), 7: (8, False)}, {5: {(STAGE, 4): 7, (STAGE, 1): 7, (STAGE, 6): 7}}))
    assert out[-1].wait is False and kinds(out) == ["Observe"]  # the destination holds the newest: no snapshot
    assert a.phase is b.phase is P.REBUILDING
    out = m.handle(view(1, {3: (8, False), 7: (8, False)}))
    assert out[1] == StartContainer(9, STAGE, (1, 4, 6), 5)
    m.handle(Started(9, {}, {1: 8, 4: 8, 6: 8}))
    m.handle(Rerouted(9))
    out = m.handle(view(2, {3: (9, False), 7: (9, False), 9: (9, False)}))
    assert out[0] == ReleaseRoutes(9, STAGE, (1, 4, 6)) and a.phase is b.phase is P.RELEASING


def test_a_source_stage_lets_go_of_its_slices_by_itself_when_released():
    t = Transfer(9, 3, 0, None, [4], target=-1)
    m = MigrationProtocol(0, [t], MigrationOptions(source_stage=True))
    m.handle(Begin())
    m.handle(HostMade(-1, 5))
    m.handle(view(0, {3: (5, False)}, {5: {}}))
    m.handle(Snapshotted(0, 4))
    m.handle(view(1, {3: (5, False)}))
    m.handle(Started(9, {}, {4: 5}))
    m.handle(Rerouted(9))
    out = m.handle(view(2, {3: (6, False), 9: (6, False)}))
    assert out[0] == ReleaseRoutes(9, 0, (4,), {3: (4,)})


@pytest.mark.parametrize("state", ["done", "cancelled"])
def test_a_compaction_releases_once_handed_over_and_aborts_when_its_host_cancelled_it(state):
    a, b = Transfer(9, 3, STAGE, 5, [4], handover=True), Transfer(9, 7, STAGE, 5, [1], handover=True)
    m = MigrationProtocol(STAGE, [a, b])
    assert kinds(m.handle(Begin())) == ["Observe"]
    assert kinds(m.handle(view(0, {3: (8, False), 7: (8, False)}))) == ["Observe"] and a.phase is P.REBUILDING
    out = m.handle(view(1, {3: (8, False), 7: (8, False)}))
    assert out[1] == StartContainer(9, STAGE, (), 5, (3, 7))
    assert m.handle(Started(9)) == [BeginDual(9, STAGE, (1, 4))]
    assert m.handle(DualBegun(9, [9, 10])) == [FixHandover(9, (3, 7), 10)]
    (ask,) = m.handle(HandoverFixed(9, 11))
    assert ask.handovers == (9,) and a.phase is P.DUAL and a.hand_over_epoch == 11
    assert kinds(m.handle(view(2, {3: (10, False), 7: (11, False)}, handovers={9: "pending"}))) == ["Observe"]
    out = m.handle(view(3, {3: (11, False), 7: (11, False)}, handovers={9: state}))
    if state == "done":
        assert out[0] == ReleaseRoutes(9, STAGE, (1, 4)) and a.phase is b.phase is P.RELEASING
    else:
        assert out[:2] == [DropDual(STAGE, (1, 4)), RemoveContainer(9, 5, (3, 7))]
        assert a.phase is b.phase is P.ABORTED and "input ended" in a.story[-1][3]["reason"]


def test_a_compaction_interrupted_after_its_host_handed_over_finishes():
    a = Transfer(9, 3, STAGE, 5, [4], handover=True)
    m = MigrationProtocol(STAGE, [a])
    m.handle(Begin())
    m.handle(view(0, {3: (8, False)}))
    m.handle(view(1, {3: (8, False)}))
    m.handle(Started(9))
    m.handle(DualBegun(9, [9]))
    m.handle(HandoverFixed(9, 9))
    out = m.handle(Interrupted(frozenset(), "the master restarted", {9: True}))
    assert kinds(out) == ["ReleaseRoutes", "Freeze", "ReleaseSource"] and a.phase is P.RELEASING
    # not handed over: undone, the sources go on past the epoch
    b = Transfer(9, 3, STAGE, 5, [4], phase=P.DUAL, handover=True)
    out = MigrationProtocol(STAGE, [b]).handle(Interrupted(frozenset(), "the master restarted", {9: False}))
    assert out[:2] == [DropDual(STAGE, (4,)), RemoveContainer(9, 5, (3,))] and b.phase is P.ABORTED


def test_the_machine_refuses_a_transition_outside_the_table():
    t = Transfer(9, 3, STAGE, 5, [4], phase=P.RELEASING)
    with pytest.raises(MigrationError, match="no transition releasing -> dual"):
        t.advance(P.DUAL)
