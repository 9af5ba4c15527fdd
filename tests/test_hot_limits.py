"""Values and maps with a hot limit keep at most N entries in memory, the rest in lmdb: same answers.

Method: a ``KeyValueState`` and a ``MapState`` with a hot limit over a real
lmdb spill store (``containers/spill.py``) must read like a dict (of dicts)
under random writes, deletes and reads, never hold more than the limit in
memory, leave no dead copies on disk beyond one pending batch, and
checkpoint and restore like an unbounded state (a restore spills as it
loads). Then whole jobs: a per-card map of merchants over thousands of
(card, merchant) entries, with a limit of 40 entries per slice, on the
in-process runtime through a migration and through a kill, and on Ray
through a killed container, must equal the serial executor row for row,
with most entries cold while it runs. Queues with a limit read like deques
per key; windows with one (sliding, and tumbling closed by the slice's
clock) equal the serial run through a migration with each state at or
under its limit.
"""

from __future__ import annotations

import itertools

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import chronostream as cs
from chronostream.chaos import Fault, run_with_faults
from chronostream.dag import compile_query
from chronostream.datasets import payments
from chronostream.slices.state import STALE_BATCH, KeyValueState
from chronostream.slices.statelib import MapState
from chronostream.containers.spill import SpillStore
from chronostream.master.local import LocalCluster
from chronostream.master.placement import containers_per_stage, initial_placement
from chronostream.slices.checkpoint import capture_kv, restore_kv

_names = itertools.count()


@pytest.fixture(scope="module")
def store():
    s = SpillStore()  # a temporary directory, removed with the store
    yield s
    s.close()


def bounded(store: SpillStore, limit: int) -> KeyValueState:
    """A key-value state holding at most ``limit`` values in memory, spilling to ``store``."""
    return KeyValueState("kv", cold=store.tier(0, next(_names), "kv"), hot_limit=limit)


def on_disk(state: KeyValueState) -> int:
    """Entries under the state's own prefix of the spill store (live cold copies and dead ones)."""
    tier = state._cold
    with tier.store.opened().begin() as txn:
        cur = txn.cursor()
        n = 0
        if cur.set_range(tier.prefix):
            for k in cur.iternext(values=False):
                if not k.startswith(tier.prefix):
                    break
                n += 1
    return n


KV_OPS = st.lists(st.one_of(st.tuples(st.just("set"), st.integers(0, 60), st.integers(-(2**63), 2**63 - 1)),
                            st.tuples(st.just("delete"), st.integers(0, 60)),
                            st.tuples(st.just("get"), st.integers(0, 60))), max_size=400)


@settings(max_examples=60, deadline=None)
@given(ops=KV_OPS, limit=st.integers(1, 12))
def test_a_bounded_state_reads_like_a_dict_and_never_holds_more_than_its_limit(store, ops, limit):
    """Random writes, deletes and reads: every read as a dict's, at most ``limit`` values in memory."""
    s, ref = bounded(store, limit), {}
    for op in ops:
        if op[0] == "set":
            s.set(op[1], op[2])
            ref[op[1]] = op[2]
        elif op[0] == "delete":
            s.delete(op[1])
            ref.pop(op[1], None)
        else:
            assert s.get(op[1], "none") == ref.get(op[1], "none")
        assert s.hot_len() <= limit
    assert len(s) == len(ref)
    assert dict(s.items()) == ref
    assert on_disk(s) <= len(s) - s.hot_len() + STALE_BATCH, "dead cold copies beyond one pending batch"


def test_the_values_written_longest_ago_go_cold_first(store):
    """A write makes a key the most recent; eviction takes the oldest writes, an eighth of the limit extra."""
    s = bounded(store, 8)
    for k in range(8):
        s.set(k, k)
    s.set(0, "again")  # 0 is now the newest
    s.set(8, 8)  # 9 values: down to 7 (the limit less an eighth), the two oldest writes cold
    assert sorted(s._data) == [0, 3, 4, 5, 6, 7, 8]
    assert s.get(1) == 1 and s.hot_len() == 7, "a read of a cold value does not bring it back"
    s.set(1, "warm")
    assert 1 in s._data and s.get(1) == "warm"


def test_rewriting_cold_values_leaves_no_dead_copies_once_the_next_eviction_runs(store):
    """Cold copies of rewritten values are deleted in the eviction's transaction, not one by one."""
    s = bounded(store, 100)
    for k in range(1_000):
        s.set(k, k)
    for k in range(0, 1_000, 3):
        s.set(k, -k)  # cold ones come back to memory; others go cold
    s.set("last", 0)
    s.set("one more", 0)
    for k in range(200):  # enough new writes to evict once more after the rewrites
        s.set(("fresh", k), k)
    assert on_disk(s) <= len(s) - s.hot_len() + STALE_BATCH
    assert dict(s.items()) == {**{k: (-k if k % 3 == 0 else k) for k in range(1_000)}, "last": 0,
                               "one more": 0, **{("fresh", k): k for k in range(200)}}


MAP_OPS = st.lists(st.one_of(st.tuples(st.just("set"), st.integers(0, 4), st.integers(0, 30), st.integers(-(2**63), 2**63 - 1)),
                             st.tuples(st.just("delete"), st.integers(0, 4), st.integers(0, 30)),
                             st.tuples(st.just("increment"), st.integers(0, 4), st.integers(0, 30))),
                   max_size=300)


@settings(max_examples=50, deadline=None)
@given(ops=MAP_OPS, limit=st.integers(1, 20), page=st.integers(1, 4))
def test_a_bounded_map_reads_like_a_dict_of_dicts(store, ops, limit, page):
    """Maps whose entries, directory pages and headers go cold and come back: contents as a dict of dicts."""
    m = MapState(KeyValueState("m", cold=store.tier(1, next(_names), "m")), page_size=page, hot_entries=limit)
    ref: dict[int, dict[int, int]] = {}
    for op in ops:
        if op[0] == "set":
            m.set(op[1], op[2], op[3])
            ref.setdefault(op[1], {})[op[2]] = op[3]
        elif op[0] == "delete":
            m.delete(op[1], op[2])
            ref.get(op[1], {}).pop(op[2], None)
        else:
            n = m.increment(op[1], op[2])
            got = ref.setdefault(op[1], {}).get(op[2], 0) + 1
            if got:
                ref[op[1]][op[2]] = got
            assert n == got
        assert m.state.hot_len() <= limit
    for key in range(5):
        assert dict(m.items(key)) == ref.get(key, {})
        assert m.len(key) == len(ref.get(key, {}))


def test_full_and_delta_captures_read_cold_values_and_a_restore_spills_as_it_loads(store):
    """Dirty values that went cold are captured; the restored state holds the same contents within its limit."""
    s = bounded(store, 10)
    for k in range(50):
        s.set(k, [k, "x"])
    full = capture_kv(s, delta=False)
    s.clear_dirty()
    for k in range(0, 50, 2):
        s.set(k, [k, "y"])  # dirty, and most go cold again before the capture
    s.delete(7)
    delta = capture_kv(s, delta=True)
    assert s.hot_len() <= 10
    restored = bounded(store, 10)
    restore_kv(restored, full)
    restore_kv(restored, delta)
    assert restored.hot_len() <= 10 and len(restored) == 49
    assert dict(restored.items()) == dict(s.items())
    assert not restored.dirty_keys()


def test_a_value_the_spill_store_cannot_encode_is_refused_naming_the_state_and_nothing_is_lost(store):
    """A set cannot go cold: a TypeError naming the state, every value still readable."""
    s = bounded(store, 2)
    s.set("a", {2, 3})
    s.set("b", 1)
    with pytest.raises(TypeError, match="state 'kv' holds a value the spill store cannot encode"):
        s.set("c", 2)
    assert dict(s.items()) == {"a": {2, 3}, "b": 1, "c": 2}


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 65_535, 65_536, 70_000])
def test_a_full_capture_packs_chunk_by_chunk_to_the_same_bytes_as_one_pack(monkeypatch, n):
    """Chunked packing (headers cut and one put in front) gives msgpack's bytes for the whole lists."""
    import msgpack

    from chronostream.slices import checkpoint

    monkeypatch.setattr(checkpoint, "KV_CHUNK", 7 if n < 100 else 4096)
    pairs = [(("e", i, str(i)), [i, float(i)]) for i in range(n)]
    keys_b, values_b = checkpoint._packed_columns(iter(pairs))
    assert keys_b == msgpack.packb([k for k, _ in pairs], use_bin_type=True)
    assert values_b == msgpack.packb([v for _, v in pairs], use_bin_type=True)


def test_the_spill_store_reads_a_state_back_in_batches_and_allows_writes_between_them(store):
    """``SpillTier.items`` resumes after the last key of each batch: every entry once, in key order."""
    tier = store.tier(2, next(_names), "kv")
    tier.write_many([(("k", i), i) for i in range(10)])
    seen = []
    for k, v in tier.items(batch=3):
        seen.append((k, v))
        tier.put(("a", len(seen)), 0)  # a write between batches, behind the cursor ("a" < "k")
    assert seen == [(("k", i), i) for i in sorted(range(10), key=lambda i: msgpack_bytes(("k", i)))]


def msgpack_bytes(obj) -> bytes:
    import msgpack

    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("streamed", [False, True], ids=["small part", "part above STREAM_PART_BYTES"])
def test_a_mostly_cold_state_round_trips_through_a_full_capture(store, monkeypatch, streamed):
    """20,000 entries, 100 in memory: the capture and the restore (entry by entry for a large
    part) give every entry back."""
    from chronostream.slices import checkpoint

    if streamed:
        monkeypatch.setattr(checkpoint, "STREAM_PART_BYTES", -1)
    s = bounded(store, 100)
    for i in range(20_000):
        s.set(("e", i % 37, i), {"n": i})
    restored = bounded(store, 100)
    restore_kv(restored, capture_kv(s, delta=False))
    assert restored.hot_len() <= 100 and len(restored) == 20_000
    assert dict(restored.items()) == dict(s.items())


def test_without_a_cold_tier_the_limit_keeps_everything_in_memory():
    """The serial executor's states have no spill store: a limit there changes nothing."""
    s = KeyValueState("kv", hot_limit=3)
    for k in range(10):
        s.set(k, k)
    assert s.hot_len() == 10 and dict(s.items()) == {k: k for k in range(10)}


@pytest.mark.parametrize("limit", [0, -1, 2.5, True, "10"])
def test_a_hot_limit_that_is_not_a_positive_int_is_refused_naming_the_state(limit):
    with pytest.raises(ValueError, match="state 'visits': hot_entries must be a positive int"):
        MapState(KeyValueState("visits"), hot_entries=limit)


# -- whole jobs --------------------------------------------------------------------------------


class MerchantHistory(cs.Operator):
    """Per card: visits and cents per merchant (a map of [visits, cents]) and the last payment's
    time (a value), both with a hot limit. Emits per payment the card's visits to the merchant,
    its distinct merchants, cents spent there and the gap since the card's previous payment."""

    LIMIT = 40

    def setup(self) -> None:
        self.history = self.register_map("history", page_size=4, hot_entries=self.LIMIT)
        self.last_ts = self.register_value("last_ts", hot_entries=self.LIMIT)

    def consume(self, stream_id: str, event: dict) -> None:
        card, merchant = event["card"], event["merchant"]
        visits, cents = self.history.get(card, merchant, [0, 0])
        visits, cents = visits + 1, cents + round(event["amount"] * 100)
        self.history.set(card, merchant, [visits, cents])
        prev = self.last_ts.get(card)
        self.last_ts.set(card, event["ts"])
        self.produce("out", {"card": card, "merchant": merchant, "visits": visits, "cents": cents,
                             "merchants": self.history.len(card), "gap": None if prev is None else event["ts"] - prev})


def merchant_history_query(n: int = 3_000, slices: int = 4) -> cs.Query:
    """Payments of 300 cards at 80 merchants: a few thousand (card, merchant) entries per job."""
    q = cs.Query(epoch_events=100)
    pay = q.source("payments", payments(n, cards=300, merchants=80, s=0.6, seed=9), order_by="ts")
    pay.key_by("card").apply(MerchantHistory, slices=slices, name="history").sink(name="history")
    return q


def cold_share(cl: LocalCluster) -> tuple[int, int]:
    """(entries, of which in memory) over every live slice's two states."""
    states = [rt.ctx.states[name] for core in cl.cores.values() for rt in core.slices.values()
              if rt.ctx is not None for name in ("history", "last_ts")]
    return sum(len(s) for s in states), sum(s.hot_len() for s in states)


@pytest.fixture(scope="module")
def expected() -> list[dict]:
    return cs.run(merchant_history_query(), executor="serial").results("history").to_pylist()


def test_a_bounded_map_equals_the_serial_output_through_a_migration(expected):
    """In-process runtime, a slice migrated mid-stream (rebuilt from its backup): the serial rows."""
    plan, sources = compile_query(merchant_history_query())
    cl = LocalCluster(plan, initial_placement(plan, containers_per_stage(plan, 1)), sources, seed=5,
                      checkpoint_every=3)
    cl.run(faults={12: lambda c: c.scale_out("history", 1)})
    assert [t.phase.value for t in cl.migrated] == ["done"]
    assert cl.results("history").to_pylist() == expected
    total, hot = cold_share(cl)
    assert hot <= 4 * 2 * MerchantHistory.LIMIT < total / 3, f"{hot} of {total} entries in memory"
    reported = sum(m.state_cold_keys for core in cl.cores.values() for m in core.slice_metrics())
    assert reported == total - hot, "the metrics count the cold entries"


def test_a_bounded_map_equals_the_serial_output_through_a_kill(expected):
    """In-process runtime, a host killed mid-stream: its slices restored from backups spill as they load."""
    plan, sources = compile_query(merchant_history_query())
    cl = LocalCluster(plan, initial_placement(plan, {0: 1, 1: 2}), sources, seed=6, checkpoint_every=2)
    victim = cl.placement.containers[1][0]
    cl.run(kills={15: [victim]})
    assert any(k == "recovery_end" for _, k, _ in cl.timeline), "the kill landed mid-stream"
    assert cl.results("history").to_pylist() == expected
    total, hot = cold_share(cl)
    assert hot <= 4 * 2 * MerchantHistory.LIMIT < total / 3, f"{hot} of {total} entries in memory"


def test_the_limit_does_not_change_the_output_of_the_serial_executor(expected):
    """The oracle with the limit (no cold tier) and without it give the same rows."""

    class Unbounded(MerchantHistory):
        LIMIT = None  # type: ignore[assignment]

    q = cs.Query(epoch_events=100)
    pay = q.source("payments", payments(3_000, cards=300, merchants=80, s=0.6, seed=9), order_by="ts")
    pay.key_by("card").apply(Unbounded, slices=4, name="history").sink(name="history")
    assert cs.run(q, executor="serial").results("history").to_pylist() == expected


def test_a_bounded_map_recovers_on_ray(ray_session, expected):
    """A history container dies mid-stream on Ray; its slices come back from backups: the serial rows."""
    faults = [Fault("delay", 0, "payments", seconds=0.03), Fault("kill", 12, "history", index=0)]
    report = run_with_faults(merchant_history_query(), faults, containers={"payments": 1, "history": 2},
                             checkpoint_every=3)
    assert report.ok, report.mismatches
    assert "recovery_end" in [k for _, k, _ in report.timeline]
    assert pa.Table.from_pylist(expected).num_rows == 3_000


def test_without_checkpoints_no_state_holds_the_keys_it_changed(expected):
    """Nothing reads a delta in a job without checkpoints: dirty sets are emptied each epoch (a cold
    key would otherwise keep a Python object alive in the dirty set); with checkpoints they fill."""
    plan, sources = compile_query(merchant_history_query())
    plain = LocalCluster(plan, initial_placement(plan, containers_per_stage(plan, 1)), sources).run()
    assert plain.results("history").to_pylist() == expected
    states = [st for core in plain.cores.values() for rt in core.slices.values() if rt.ctx is not None
              for st in rt.ctx.states.values()]
    assert states and not any(st.dirty_keys() for st in states)
    total, hot = cold_share(plain)
    assert hot < total / 3


# -- lists, queues and windows -----------------------------------------------------------------

QUEUE_OPS = st.lists(st.tuples(st.sampled_from(["append", "popleft", "peek"]), st.integers(0, 30),
                               st.integers(0, 10**6)), max_size=300)


@settings(max_examples=40, deadline=None)
@given(ops=QUEUE_OPS, limit=st.integers(1, 12), chunk=st.integers(1, 4))
def test_a_bounded_queue_reads_like_a_deque_per_key(store, ops, limit, chunk):
    """Queues of many keys, each short (no middle chunk to spill): the limit still bounds memory."""
    from collections import deque

    from chronostream.slices.statelib import QueueState

    q = QueueState(KeyValueState("q", cold=store.tier(2, next(_names), "q")), chunk_size=chunk, hot_entries=limit)
    model: dict[int, deque] = {}
    for op, key, value in ops:
        d = model.setdefault(key, deque())
        if op == "append":
            q.append(key, value)
            d.append(value)
        elif d:
            assert (q.popleft(key) if op == "popleft" else q.peekleft(key)) == (d.popleft() if op == "popleft" else d[0])
        assert q.state.hot_len() <= limit
    for key, d in model.items():
        assert list(q.items(key)) == list(d)


def test_a_list_or_queue_hot_limit_that_is_not_a_positive_int_is_refused():
    from chronostream.slices.statelib import ListState

    with pytest.raises(ValueError, match="state 'seen': hot_entries must be a positive int"):
        ListState(KeyValueState("seen"), hot_entries=0)


WINDOWS = {
    "sliding": dict(windows=cs.SlidingWindow(500, time="ts"), count=True, sum="amount", max="amount"),
    "tumbling by slice": dict(windows=cs.TumblingWindow(400, time="ts", emit="close", clock="slice"),
                              count=True, mean="amount", distinct="merchant"),
}


def window_query(kind: str, hot_entries: int | None, n: int = 4_000) -> cs.Query:
    """Payments of 500 cards, each card idle most of the time: most window state is cold."""
    q = cs.Query(epoch_events=200)
    pay = q.source("payments", payments(n, cards=500, merchants=40, s=0.4, seed=13), order_by="ts")
    pay.key_by("card").window(**WINDOWS[kind], hot_entries=hot_entries, slices=4, name="w").sink(name="w")
    return q


@pytest.mark.parametrize("kind", list(WINDOWS))
def test_a_window_with_a_hot_limit_equals_the_serial_output_through_a_migration(kind):
    expected = cs.run(window_query(kind, None), executor="serial").results("w").to_pylist()
    assert expected
    plan, sources = compile_query(window_query(kind, 10))
    cl = LocalCluster(plan, initial_placement(plan, containers_per_stage(plan, 1)), sources, seed=7,
                      checkpoint_every=3)
    cl.run(faults={9: lambda c: c.scale_out("w", 1)})
    assert [t.phase.value for t in cl.migrated] == ["done"]
    assert cl.results("w").to_pylist() == expected
    states = [st for core in cl.cores.values() for rt in core.slices.values() if rt.ctx is not None
              for st in rt.ctx.states.values()]
    total, hot = sum(len(s) for s in states), sum(s.hot_len() for s in states)
    assert all(s.hot_len() <= 10 for s in states)
    assert hot < total / 2, f"{hot} of {total} window entries in memory"


def test_a_window_hot_limit_that_is_not_a_positive_int_is_a_query_error_naming_the_window():
    with pytest.raises(cs.QueryError, match="window 'w': hot_entries must be a positive int"):
        window_query("sliding", 0)


def test_a_window_with_a_hot_limit_recovers_on_ray(ray_session):
    """A window container dies mid-stream on Ray; its slices, mostly cold, come back from backups."""
    faults = [Fault("delay", 0, "payments", seconds=0.03), Fault("kill", 10, "w", index=0)]
    report = run_with_faults(window_query("sliding", 10), faults, containers={"payments": 1, "w": 2},
                             checkpoint_every=3)
    assert report.ok, report.mismatches
    assert "recovery_end" in [k for _, k, _ in report.timeline]


def test_a_full_spill_disk_fails_the_job_naming_stage_and_slice_even_with_dead_letters(monkeypatch):
    """Not the event's fault: every later event would fail too, so no dead letter swallows it."""
    import chronostream.containers.spill as spill

    monkeypatch.setattr(spill, "SPILL_DISK_FLOOR", 1 << 62)
    q = window_query("sliding", 10, n=600)
    q.dead_letters()
    with pytest.raises(cs.EventError) as err:
        cs.run(q, executor="local", containers=1)
    assert err.value.stage == "w" and 0 <= err.value.slice_id < 4
    assert "StoreFullError" in str(err.value) and "spill store" in str(err.value)  # (a RuntimeFault)
