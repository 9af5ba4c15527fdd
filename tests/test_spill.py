"""Long queues keep their middle on local disk (lmdb), Railgun's event reservoir: same answers, bounded memory.

Method: the state library's queue over a ``KeyValueState`` with a real lmdb
spill store (``containers/spill.py``) must behave exactly like a Python
deque under random operations, keep only its end chunks in memory however
long it grows, leave nothing on disk once drained, and checkpoint/restore
like an unspilled state (a restore re-spills). Then whole jobs: a 7-day
sliding window over a few busy cards on the in-process runtime (with
migration) and on Ray (with a killed container) must equal the serial
executor, with most of the window's chunks cold while it runs.
"""

from __future__ import annotations

import collections
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import chronostream as cs
from chronostream.chaos import Fault, run_with_faults
from chronostream.dag import compile_query
from chronostream.datasets import payments
from chronostream.slices.state import KeyValueState
from chronostream.slices.statelib import QueueState
from chronostream.containers.spill import SpillStore
from chronostream.master.local import LocalCluster, collect
from chronostream.master.placement import containers_per_stage, initial_placement
from chronostream.slices.checkpoint import capture_kv, restore_kv

STORE = SpillStore()  # a temporary directory, removed with the store
_names = itertools.count()


def spilling_queue(chunk: int = 4) -> QueueState:
    """A queue whose state spills to the module's lmdb store under a fresh name."""
    return QueueState(KeyValueState("q", cold=STORE.tier(0, next(_names), "q")), chunk_size=chunk)


def chunks_in_memory(q: QueueState) -> int:
    return sum(1 for k, _ in q.state._data.items() if k[0] == "c")


OPS = st.lists(st.one_of(st.tuples(st.just("append"), st.integers(0, 10**6)), st.just(("popleft",)),
                         st.just(("pop",)), st.tuples(st.just("set"), st.integers(0, 200), st.integers(-(2**63), 2**63 - 1)),
                         st.tuples(st.just("get"), st.integers(0, 200))), max_size=300)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, chunk=st.integers(1, 5), burst=st.integers(0, 60))
def test_a_spilling_queue_matches_a_deque_under_random_operations(ops, chunk, burst):
    """Appends, pops at both ends and writes anywhere, spilled or not: the queue reads like a deque."""
    q, ref = spilling_queue(chunk), collections.deque()
    for i in range(burst):  # start long enough that chunks are cold
        q.append("k", -i)
        ref.append(-i)
    for op in ops:
        if op[0] == "append":
            q.append("k", op[1])
            ref.append(op[1])
        elif ref and op[0] == "popleft":
            assert q.popleft("k") == ref.popleft()
        elif ref and op[0] == "pop":
            assert q.pop("k") == ref.pop()
        elif ref and op[0] == "set":
            q.set("k", op[1] % len(ref), op[2])
            ref[op[1] % len(ref)] = op[2]
        elif ref and op[0] == "get":
            assert q.get("k", op[1] % len(ref)) == ref[op[1] % len(ref)]
        assert q.len("k") == len(ref)
    assert list(q.items("k")) == list(ref)


def test_a_long_sliding_queue_keeps_three_chunks_in_memory_and_the_rest_on_disk():
    """20,000 items through a 5,000-item window: memory holds the head chunk and the last two."""
    q = spilling_queue(chunk=64)
    for i in range(20_000):
        q.append("card", i)
        if q.len("card") > 5_000:
            q.popleft("card")
        assert chunks_in_memory(q) <= 3
    assert list(q.items("card")) == list(range(15_000, 20_000))
    cold = len(q.state) - q.state.hot_len()
    assert cold >= 5_000 // 64 - 3, "the window's middle is on disk"


def test_a_drained_queue_leaves_nothing_on_disk():
    """Every spilled chunk comes back (or is deleted) as the head passes it: no disk leak."""
    q = spilling_queue(chunk=8)
    before = STORE.entries()
    for i in range(1_000):
        q.append("k", i)
    assert STORE.entries() > before
    while q.len("k"):
        q.popleft("k")
    assert STORE.entries() == before and q.state.hot_len() == len(q.state) == 1  # the meta entry


def test_states_whose_names_share_a_prefix_keep_their_cold_values_apart():
    """A state "a/b" is not under state "a"'s prefix: clearing "a" leaves it, and "a"'s keys
    (msgpack(98) is b"b") do not read as "a/b"'s."""
    store = SpillStore()
    try:
        a, ab = store.tier(2, 0, "a"), store.tier(2, 0, "a/b")
        a.put(98, "a's")
        ab.put(1, "a/b's")
        assert dict(ab.items()) == {1: "a/b's"}
        a.clear()
        assert ab.get_or(1, None) == "a/b's" and a.get_or(98, None) is None
    finally:
        store.close()


def test_a_spill_store_refuses_a_write_that_would_leave_its_disk_below_the_floor(monkeypatch):
    """Written through its memory map, a full disk would kill the process (SIGBUS): the store
    refuses first, naming its directory, and the refused batch writes nothing."""
    import shutil as _shutil

    import chronostream.containers.spill as spill
    from chronostream.slices.errors import RuntimeFault

    store = SpillStore()
    try:
        tier = store.tier(0, 0, "visits")
        tier.write_many([((i,), "x" * 100) for i in range(100)])
        free = _shutil.disk_usage(store.path).free
        monkeypatch.setattr(spill, "SPILL_DISK_FLOOR", free + (1 << 40))
        monkeypatch.setattr(spill, "DISK_CHECK_BYTES", 1)  # look at every write
        with pytest.raises(RuntimeFault, match=f"spill store at {store.path} would leave .* MB free"):
            tier.write_many([((i,), "y" * 100) for i in range(100, 200)], deleted=[(0,)])
        with pytest.raises(RuntimeFault):
            tier.put((7,), "z")
        assert store.entries() == 100 and tier.get((0,)) == "x" * 100 and tier.get((7,)) == "x" * 100
    finally:
        store.close()


def test_a_spill_store_looks_at_its_disk_once_per_check_interval(monkeypatch):
    import chronostream.containers.spill as spill

    looks = []
    real = spill.shutil.disk_usage
    monkeypatch.setattr(spill.shutil, "disk_usage", lambda p: looks.append(p) or real(p))
    monkeypatch.setattr(spill, "DISK_CHECK_BYTES", 64 << 10)
    store = SpillStore()
    try:
        tier = store.tier(0, 0, "visits")
        for i in range(1000):
            tier.put((i,), "v" * 1000)  # about 1 MB in all: 16 looks, not 1,000
        assert 10 <= len(looks) <= 20
    finally:
        store.close()


def test_cold_chunks_are_checkpointed_and_a_restore_spills_them_again():
    """Full and delta captures read cold chunks back; the restored queue re-spills its middle (settle)."""
    q = spilling_queue(chunk=8)
    for i in range(500):
        q.append("a", i)
        q.append("b", -i)
    full = capture_kv(q.state, delta=False)
    q.state.clear_dirty()
    for i in range(100):
        q.popleft("a")
        q.append("b", 1000 + i)  # new chunks spill: some dirty keys are cold at capture time
    delta = capture_kv(q.state, delta=True)

    restored = spilling_queue(chunk=8)
    restore_kv(restored.state, full)
    restore_kv(restored.state, delta)
    assert chunks_in_memory(restored) > 100, "a restore loads every chunk"
    assert restored.settle() > 0
    assert chunks_in_memory(restored) <= 6
    for key in ("a", "b"):
        assert list(restored.items(key)) == list(q.items(key))


def busy_cards_query(n: int = 3_000, slices: int = 4) -> cs.Query:
    """Four busy cards over 7 days: each card's 7-day window holds hundreds of payments (many chunks)."""
    q = cs.Query(epoch_events=50)
    pay = q.source("payments", payments(n, cards=4, s=0.5, span_s=3 * 86_400, seed=4), order_by="ts")
    pay.key_by("card").window([cs.SlidingWindow(300, time="ts", name="5m"),
                               cs.SlidingWindow(7 * 86_400, time="ts", name="7d")],
                              count=True, sum="amount", max="amount", slices=slices, name="profiles") \
        .sink(name="profiles")
    return q


def test_a_long_window_keeps_its_middle_in_lmdb_and_equals_the_serial_output_through_a_migration():
    """In-process runtime, a slice migrated mid-stream: the serial rows, most window chunks cold."""
    plan, sources = compile_query(busy_cards_query())
    cl = LocalCluster(plan, initial_placement(plan, containers_per_stage(plan, 1)), sources, seed=3,
                      output_logs=True, checkpoint_every=4)
    cl.run(faults={20: lambda c: c.scale_out("profiles", 1)})
    expected = cs.run(busy_cards_query(), executor="serial").results("profiles")
    assert cl.results("profiles").to_pylist() == expected.to_pylist()
    assert [t.phase.value for t in cl.migrated] == ["done"]
    events = [rt.ctx.states["window.events"] for core in cl.cores.values() for rt in core.slices.values()
              if rt.ctx is not None]
    total, hot = sum(len(s) for s in events), sum(s.hot_len() for s in events)
    assert hot < total / 3, f"{hot} of {total} window entries in memory"


def test_a_long_window_recovers_on_ray_with_its_chunks_spilled(ray_session):
    """A profiles container dies mid-stream; its slices come back from backups and re-spill: serial output."""
    faults = [Fault("delay", 0, "payments", seconds=0.03), Fault("kill", 20, "profiles", index=0)]
    report = run_with_faults(busy_cards_query(), faults, containers={"payments": 1, "profiles": 2},
                             checkpoint_every=4)
    assert report.ok, report.mismatches
    assert "recovery_end" in [k for _, k, _ in report.timeline]


def test_spilling_can_be_turned_off():
    """spill_state=False: the same rows, everything in memory."""
    q = busy_cards_query(800)
    plan, sources = compile_query(q)
    cores = LocalCluster(plan, initial_placement(plan, containers_per_stage(plan, 1)), sources,
                         spill_state=False).run().cores
    assert all(not st.spills for core in cores.values() for rt in core.slices.values() if rt.ctx
               for st in rt.ctx.states.values())
    expected = cs.run(busy_cards_query(800), executor="serial").results("profiles")
    assert collect(plan, cores, "profiles").to_pylist() == expected.to_pylist()


@pytest.fixture(autouse=True, scope="module")
def _close_store():
    yield
    STORE.close()
