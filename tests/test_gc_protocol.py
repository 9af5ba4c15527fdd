"""Garbage collection as a machine (``master.protocols.gc``): what a round may drop, and in what order.

Method: seeded random rounds of what hosts hold (epochs rising and falling as
hosts die, copies restart and chains move) on a two-stage and a three-stage
plan; every round's commands are checked against the rules the runtime's
exactness rests on: a mark never falls, a trim never passes the saved marks,
the marks are saved before the trim that needs them, and a restarted master
(a new machine with the saved marks) keeps them.
"""

from __future__ import annotations

import random

import pytest

import chronostream as cs
from chronostream.dag import compile_query
from chronostream.master.protocols.gc import ChainsRead, DropStale, GcProtocol, HeldRead, SaveMarks, Trim


def plan_of(stages: int):
    q = cs.Query(epoch_events=2)
    s = q.source("w", [{"w": x, "v": 1} for x in "abcdabcd"]).key_by("w")
    s = s.aggregate(sum=["v"], slices=3, name="a")
    if stages == 3:
        s.key_by("w").aggregate(count=True, slices=2, name="b").sink(name="out")
    else:
        s.sink(name="out")
    return compile_query(q)[0]


@pytest.mark.parametrize("seed", range(20))
def test_marks_never_fall_and_are_saved_before_any_trim(seed):
    rng = random.Random(seed)
    plan = plan_of(rng.choice([2, 3]))
    keys = [(st.stage_id, s) for st in plan.stages for s in range(st.num_slices)]
    gc = GcProtocol(plan, slack=rng.choice([2, 4]))
    saved: dict[int, int] = {}
    for _round in range(40):
        held = tuple({k: rng.randint(-1, 30) for k in keys if rng.random() < 0.8} for _ in range(rng.randint(1, 3)))
        for cmd in gc.handle(HeldRead(held)):
            if isinstance(cmd, SaveMarks):
                assert all(v >= saved.get(st, -1) for st, v in cmd.marks.items()), "a saved mark fell"
                saved = dict(cmd.marks)
            elif isinstance(cmd, Trim):
                assert all(v <= saved.get(st, -1) for st, v in cmd.marks.items()), "trimmed past the saved marks"
        assert gc.marks == saved
    again = GcProtocol(plan, slack=2, marks=saved)  # (a restarted master)
    cmds = again.handle(HeldRead(({},)))
    assert not [c for c in cmds if isinstance(c, SaveMarks)] and again.marks == saved


def test_a_copy_off_its_chain_is_dropped_once_the_chain_holds_a_newer_one():
    gc = GcProtocol(plan_of(2), slack=2)
    held = {1: {(1, 0): 10}, 2: {(1, 0): 3}, 3: {(1, 0): 9}}
    assert gc.handle(ChainsRead({(1, 0): [1, 3]}, held)) == [DropStale(2, ((1, 0),))]
    assert gc.handle(ChainsRead({(1, 0): [1, 2, 3]}, held)) == []  # (on the chain: kept)
