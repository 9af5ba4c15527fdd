"""A slice migrates, then the host it came from dies: no memory-sink row it made there is lost.

Method: one source of 1,250 rows (40 keys, one hot) in 24 epochs feeds a
32-slice ``count`` on 3 containers without checkpoints; slice 0 moves to a
new host early, and later the host it came from is killed. The migrated
slice's rows of the epochs before its move were made on that host; its new
container re-makes none of them and a recovery rebuilds only the slices the
dead host still ran. The output must equal the serial executor's, row for
row and out_seq for out_seq, and an independent pandas count per key. The
in-process driver (``master.local``) shows the mechanism with the faults at
exact rounds; one Ray test runs the same schedule against real hosts.
"""

from __future__ import annotations

import random

import pandas as pd
import pytest

import chronostream as cs
from chronostream.chaos import Fault, apply_schedule, compare_with_serial
from chronostream.dag import compile_query
from chronostream.errors import SinkRowsLost
from master.local import LocalCluster
from master.migration import MigrationPhase
from master.placement import containers_per_stage, initial_placement

ROWS, KEYS, EPOCHS, SLICES = 1250, 40, 24, 32


def rows() -> list[dict]:
    rng = random.Random(59)
    return [{"k": "k0" if rng.random() < 0.3 else f"k{rng.randrange(KEYS)}", "v": i} for i in range(ROWS)]


def query() -> cs.Query:
    q = cs.Query(epoch_events=-(-ROWS // EPOCHS))
    q.source("s", rows()).key_by("k").count(slices=SLICES).sink(name="c")
    return q


def pandas_counts() -> dict[str, int]:
    return pd.DataFrame(rows()).groupby("k").size().to_dict()


def final_counts(table) -> dict[str, int]:
    """The last running count of each key (the sink holds one row per event: its key's count so far)."""
    df = table.to_pandas()
    return df.sort_values(["k", "count"]).groupby("k")["count"].last().to_dict()


def assert_exact(got, serial) -> None:
    assert got.num_rows == ROWS
    assert got.to_pylist() == serial.to_pylist(), "row for row and out_seq for out_seq"
    assert final_counts(got) == pandas_counts()


def local_cluster() -> LocalCluster:
    plan, sources = compile_query(query())
    placement = initial_placement(plan, containers_per_stage(plan, 3))
    return LocalCluster(plan, placement, sources, seed=0, output_logs=True)


def test_local_migrated_slice_keeps_its_rows_when_its_old_host_dies():
    """Regression (issue 59, silent row loss after a migration and a kill): on the in-process
    driver, slice 0 of the count moves to a new host at round 2 and the host it came from dies
    at round 14 (no checkpoints): the master takes the moved slice's sink parts from its old
    container when the move completes, so the output is exact (it lacked slice 0's rows of
    the epochs before the move)."""
    cl = local_cluster()
    stage = cl.plan.stages[1].name
    sid = cl.stage_id(stage)
    was = {}

    def move(cl):
        was["container"] = int(cl.placement.slice_to_container[sid][0])
        was["host"] = cl.hosts[was["container"]]
        cl.migrate(stage, [0])

    def kill(cl):
        was["moved_to"] = int(cl.placement.slice_to_container[sid][0])
        cl.kill([was["host"]])

    cl.run(faults={2: move, 14: kill})
    (t,) = cl.migrated
    assert t.phase is MigrationPhase.DONE and t.source == was["container"] and t.resume[0] > 2
    assert was["moved_to"] == t.new_id and cl.hosts[t.new_id] != was["host"], "slice 0 left the host first"
    assert any(k == "recovery_end" for _, k, _ in cl.timeline), "the kill was recovered"
    got = cl.results("c")
    assert_exact(got, cs.run_serial(query()).results("c"))
    assert 0 in set(got.column("_slice").to_pylist())


def test_local_source_dying_after_release_before_the_hand_over_raises_naming_the_lost_rows():
    """Regression (issue 59, silent row loss after a migration and a kill): when the source
    of a migration dies in RELEASING (the destination finishes the move, the source's rows of
    the moved slice before the destination's resume epoch die with it), ``results`` raises
    ``SinkRowsLost`` naming stage, slice, container and epochs, not a short table."""
    cl = local_cluster()
    stage = cl.plan.stages[1].name
    sid = cl.stage_id(stage)
    seen = {}

    def move(cl):
        seen["host"] = cl.hosts[int(cl.placement.slice_to_container[sid][0])]
        cl.migrate(stage, [0])

    def kill_in_releasing(cl):
        if "phase" not in seen and cl.migrations and cl.migrations[0].phase is MigrationPhase.RELEASING:
            seen["phase"] = cl.migrations[0].phase
            cl.kill([seen["host"]])

    cl.run(faults={2: move, **{r: kill_in_releasing for r in range(3, 200)}})
    assert seen.get("phase") is MigrationPhase.RELEASING, "the kill landed in RELEASING"
    with pytest.raises(SinkRowsLost, match=r"slices \[0\].*epochs before \d+") as err:
        cl.results("c")
    (lost,) = err.value.lost
    assert lost["slices"] == [0] and lost["host"] == seen["host"] and lost["before_epoch"] > 0


@pytest.mark.parametrize("again", [False, True], ids=["one_move", "moved_twice"])
def test_ray_migrate_slice_0_then_kill_its_old_host_gives_the_exact_output(ray_session, again):
    """Regression (issue 59, silent row loss after a migration and a kill): on Ray, without
    checkpoints, slice 0 of the count migrates at epoch 2 (``moved_twice``: again, to a third
    host, right after), then the host it first came from is killed at epoch 14. Checks that
    each fault landed (the migrations moved slice 0 off that host and finished; the kill hit
    that host and a recovery of its container ended) and that the sink equals the serial
    executor's row for row and out_seq for out_seq, and a pandas count per key (slice 0's
    rows made on its old host were missing, or ``results`` raised a bare ``RuntimeError``)."""
    job = cs.run(query(), containers=3, checkpoint_every=0, source_pace_s=0.1)
    try:
        stage = job.plan.stages[1].name
        first = job.placement()["stages"][stage]
        source = next(int(c) for c, slices in first.items() if 0 in slices)
        source_host = job.placement()["hosts"][source]
        # (the old container keeps the lowest id: migrations make higher ones)
        assert source == min(map(int, first))
        faults = [Fault("migrate", 2, stage, index=0), Fault("kill", 14, stage, index=0)]
        if again:  # (slice 0's container is the newest, the last by id)
            faults.append(Fault("migrate", 3, stage, index=len(first)))
        # Sources slow to a second an epoch while a fault settles: every fault lands mid-stream.
        applied = apply_schedule(job, faults, settle_pace_s=1.0)
        assert sorted(f.kind for _, f, _ in applied) == sorted(f.kind for f in faults), "every fault landed"
        assert [hit["host"] for _, f, hit in applied if f.kind == "kill"] == [source_host]
        job.wait(timeout_s=300)
        timeline = job.timeline()
        moves = [t for _, kind, info in timeline if kind == "migration_end" for t in info["transfers"]]
        assert [t["slices"] for t in moves] == [[0]] * len(moves) and {t["phase"] for t in moves} == {"done"}
        assert moves[0]["from"] == source and len(moves) == 1 + again
        now = job.placement()
        holder = next(int(c) for c, slices in now["stages"][stage].items() if 0 in slices)
        assert holder == moves[-1]["to"] and now["hosts"][holder] != source_host, "slice 0 left its first host"
        ends = [info for _, kind, info in timeline if kind == "recovery_end"]
        assert any(source in info["containers"] for info in ends), "a recovery of the old container ran"
        mismatches, counts = compare_with_serial(job, query())
        assert not mismatches, mismatches
        got = job.results("c")
        assert counts == {"c": ROWS} and final_counts(got) == pandas_counts()
        assert 0 in set(got.column("_slice").to_pylist())
    finally:
        job.stop()
