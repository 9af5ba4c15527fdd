"""The state library: every handle behaves like its plain-Python model, survives checkpoints, and stays delta-friendly.

Method: model-based property tests drive each handle (value, list, queue,
map, top-K) and a plain Python model with the same random operations; at a
random point the handle's key-value state is checkpointed (a full
checkpoint, then deltas, through the real codec and merge) and restored into
a fresh handle, and both the original and the restored handle must then
answer every later operation like the model. Then: chunking keeps the dirty
set of a long queue small, names cannot be registered twice with different
kinds, and a real query whose operator uses every handle kind reproduces its
outputs after a slice is restored half-way (tests/test_checkpoint.py's
harness).
"""

from __future__ import annotations

from collections import deque

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import chronostream as cs
from chronostream.slices.operators import OperatorContext
from chronostream.slices.state import KeyValueState
from chronostream.slices.statelib import ListState, MapState, QueueState, TopKState, ValueState
from chronostream.slices.checkpoint import SliceCheckpoint, capture_kv, decode, encode, merge, restore_kv

keys = st.one_of(st.sampled_from(["a", "b", ""]), st.integers(-2, 2), st.tuples(st.sampled_from(["x", "y"]),
                                                                                   st.integers(0, 2)))
items = st.one_of(st.integers(-100, 100), st.text(max_size=3), st.lists(st.integers(0, 9), max_size=3))


class Checkpointer:
    """A full checkpoint of one key-value state, then deltas; ``restored()`` merges them into a fresh state."""

    def __init__(self, state: KeyValueState) -> None:
        self.state = state
        self.chain: list[SliceCheckpoint] = []

    def take(self) -> None:
        delta = bool(self.chain)
        ckpt = SliceCheckpoint(0, 0, len(self.chain), "delta" if delta else "full",
                               len(self.chain) - 1 if delta else -1, {}, {}, {"s": capture_kv(self.state, delta)})
        self.state.clear_dirty()
        self.chain.append(decode(encode(ckpt)))

    def restored(self) -> KeyValueState:
        full = self.chain[0]
        for d in self.chain[1:]:
            full = merge(full, d)
        fresh = KeyValueState(self.state.name)
        restore_kv(fresh, full.state["s"])
        return fresh


def run_restoring_half_way(make, step, ops: list, cut: int, copy_model) -> None:
    """Apply ``ops`` to a handle and its model, checkpointing (full, then deltas) up to ``cut``;
    restore a fresh handle from the merged chain and apply the rest to both, each against its own model."""
    state = KeyValueState("s")
    handle = make(state)
    model: dict = {}
    ckpt = Checkpointer(state)
    ckpt.take()
    for i, op in enumerate(ops[:cut]):
        step(handle, model, op)
        if i % 5 == 4:
            ckpt.take()
    ckpt.take()
    restored, model2 = make(ckpt.restored()), copy_model(model)
    for op in ops[cut:]:
        step(handle, model, op)
        step(restored, model2, op)


def queue_step(h: QueueState, model: dict, op: tuple) -> None:
    """Apply one operation to the handle and to the model (key -> deque); every answer must agree."""
    name, key, item = op
    d = model.setdefault(key, deque())
    if name == "append":
        h.append(key, item)
        d.append(item)
    elif d:
        got = {"popleft": h.popleft, "pop": h.pop, "peek": h.peek, "peekleft": h.peekleft}[name](key)
        want = {"popleft": d.popleft, "pop": d.pop, "peek": lambda: d[-1], "peekleft": lambda: d[0]}[name]()
        assert got == want
    else:
        with pytest.raises(IndexError):
            getattr(h, name)(key)
    assert h.len(key) == len(d)
    assert list(h.items(key)) == list(d)
    head, tail = h.index_range(key)
    assert [h.item_at(key, i) for i in range(head, tail)] == list(d)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "append", "append", "popleft", "pop", "peek", "peekleft"]),
                          keys, items), max_size=120),
       st.integers(1, 5), st.data())
def test_queue_matches_a_deque_and_survives_checkpoint_restore(ops, chunk, data):
    """QueueState == collections.deque under random appends/pops, before and after a delta-chain restore."""
    run_restoring_half_way(lambda state: QueueState(state, chunk_size=chunk), queue_step, ops,
                           data.draw(st.integers(0, len(ops))), lambda m: {k: deque(v) for k, v in m.items()})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "append", "pop", "items", "len", "get0", "set"]), keys,
                          items), max_size=100), st.integers(1, 4))
def test_list_matches_a_python_list(ops, chunk):
    """ListState == list under appends, pops, indexed get/set and iteration."""
    lst = ListState(KeyValueState("s"), chunk_size=chunk)
    model: dict = {}
    for name, key, item in ops:
        m = model.setdefault(key, [])
        if name == "append":
            lst.append(key, item)
            m.append(item)
        elif name == "pop":
            assert (lst.pop(key) if m else None) == (m.pop() if m else None)
        elif name == "set" and m:
            lst.set(key, -1, item)
            m[-1] = item
        elif name == "get0" and m:
            assert lst.get(key, 0) == m[0] and lst.get(key, -1) == m[-1]
        assert list(lst.items(key)) == m
        assert lst.len(key) == len(m)


def map_step(h: MapState, model: dict, op: tuple) -> None:
    """Apply one operation to the map handle and to the model (key -> dict); every answer must agree."""
    name, key, mk, v = op
    d = model.setdefault(key, {})
    if name == "set":
        h.set(key, mk, v)
        d[mk] = v
    elif name == "delete":
        h.delete(key, mk)
        d.pop(mk, None)
    elif isinstance(d.get(mk, 0), int):
        h.increment(key, mk, v)
        d[mk] = d.get(mk, 0) + v
        if d[mk] == 0:
            del d[mk]
    assert h.len(key) == len(d)
    assert dict(h.items(key)) == d
    assert sorted(map(repr, h.keys(key))) == sorted(map(repr, d))
    assert h.get(key, mk, "none") == d.get(mk, "none")


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "set", "delete", "incr"]), keys,
                          st.one_of(st.integers(0, 6), st.tuples(st.text(max_size=1), st.integers(0, 2))),
                          st.integers(-3, 3)), max_size=120),
       st.integers(1, 4), st.data())
def test_map_matches_a_dict_and_survives_checkpoint_restore(ops, page, data):
    """MapState == dict of dicts (get, len, items, keys) before and after a delta-chain restore."""
    run_restoring_half_way(lambda state: MapState(state, page_size=page), map_step, ops,
                           data.draw(st.integers(0, len(ops))), lambda m: {k: dict(v) for k, v in m.items()})


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(keys, st.integers(-5, 5)), max_size=60))
def test_topk_keeps_the_k_best_scores_earliest_first_on_ties(k, offers):
    """TopKState.items == the k highest scores of everything offered, ties broken by offer order."""
    t = TopKState(KeyValueState("s"), k=k)
    seen: dict = {}
    for i, (key, score) in enumerate(offers):
        t.offer(key, score, f"item{i}")
        seen.setdefault(key, []).append((score, i))
        best = sorted(seen[key], key=lambda e: (-e[0], e[1]))[:k]
        assert t.items(key) == [(s, f"item{j}") for s, j in best]


def test_value_state_get_set_clear():
    """ValueState: one value per key, a default when missing, clear removes it."""
    v = ValueState(KeyValueState("s"))
    v.set(("card", 1), {"n": 1})
    assert v.get(("card", 1)) == {"n": 1} and v.get("other", 0) == 0
    v.clear(("card", 1))
    assert v.get(("card", 1)) is None


def test_a_sliding_queue_dirties_a_bounded_number_of_keys_whatever_its_length():
    """Delta-friendliness: with 100,000 items queued, an append plus a popleft dirties at most 3 state keys."""
    state = KeyValueState("s")
    q = QueueState(state, chunk_size=64)
    for i in range(100_000):
        q.append("k", i)
    assert len(state) == 1 + 100_000 // 64 + 1  # meta + chunks
    state.clear_dirty()
    for i in range(10):
        q.append("k", -i)
        assert q.popleft("k") == i
    # 10 appends touch the tail chunk (possibly two), 10 poplefts only the meta (and the first chunk at most).
    assert len(state.dirty_keys()) <= 4
    assert len(capture_kv(state, delta=True)["values"]) < 2_000  # bytes: a few chunks, not 100,000 items


def test_bound_view_forwards_the_key():
    """``handle.at(key)`` is the handle with its key filled in."""
    q = QueueState(KeyValueState("s"), chunk_size=2)
    view = q.at("k")
    view.append(1)
    view.append(2)
    assert len(view) == 2 and list(view) == [1, 2] and view.popleft() == 1 and q.len("k") == 1


def test_nan_keys_are_one_key_even_inside_tuples_after_a_round_trip():
    """Keys are canonicalized: every NaN, also inside a tuple key, is one key, before and after restore."""
    state = KeyValueState("s")
    q = QueueState(state, chunk_size=2)
    q.append(("a", float("nan")), 1)
    q.append(("a", float("nan")), 2)
    assert q.len(("a", float("nan"))) == 2
    ckpt = Checkpointer(state)
    ckpt.take()
    assert list(QueueState(ckpt.restored(), chunk_size=2).items(("a", float("nan")))) == [1, 2]


def test_a_name_registers_one_kind_only():
    """Registering a name as two kinds (or as a handle and a plain key-value state) raises."""
    op = cs.Operator()
    op.bind(OperatorContext("s", 0, ("out",)))
    q = op.register_queue("events")
    assert op.register_queue("events") is q
    with pytest.raises(ValueError, match="queue"):
        op.register_map("events")
    with pytest.raises(ValueError, match="queue"):
        op.register_state("events")
    with pytest.raises(ValueError, match="already registered"):
        op.register_queue("events", chunk_size=8)
    op.register_state("plain")
    with pytest.raises(ValueError, match="key-value"):
        op.register_list("plain")


# -- a real query: every handle kind through a slice checkpoint and restore ------------------


class EveryHandle(cs.Operator):
    """Per card: last amount (value), all shops (list), last 5 amounts (queue), visits per shop (map),
    the 3 biggest payments (top-K). Emits a digest of all of them at every event."""

    def setup(self) -> None:
        self.last = self.register_value("last")
        self.shops = self.register_list("shops", chunk_size=3)
        self.recent = self.register_queue("recent", chunk_size=2)
        self.visits = self.register_map("visits", page_size=2)
        self.top = self.register_topk("top", k=3)

    def consume(self, stream_id: str, event: dict) -> None:
        card, shop, cents = event["card"], event["shop"], event["cents"]
        prev = self.last.get(card, 0)
        self.last.set(card, cents)
        self.shops.append(card, shop)
        self.recent.append(card, cents)
        if self.recent.len(card) > 5:
            self.recent.popleft(card)
        self.visits.increment(card, shop)
        self.top.offer(card, cents, shop)
        self.produce("out", {"card": card, "prev": prev, "n_shops": self.shops.len(card),
                             "recent": sum(self.recent.items(card)), "visits": self.visits.get(card, shop),
                             "distinct": self.visits.len(card), "top": [s for s, _ in self.top.items(card)]})


def every_handle_query(slices: int) -> cs.Query:
    from queries import EPOCH, payments

    t = payments(1200, seed=4, cards=15)
    t = t.append_column("shop", pa.array([f"s{i % 7}" for i in range(t.num_rows)]))
    q = cs.Query(epoch_events=EPOCH)
    q.source("payments", t).key_by("card").apply(EveryHandle, slices=slices, name="every").sink(name="digest")
    return q


def test_every_handle_kind_survives_a_slice_restored_half_way(monkeypatch, tmp_path):
    """A slice restored half-way from its backup chain (full + deltas) continues with identical outputs."""
    import queries
    from test_checkpoint import test_restored_slice_continues_exactly_like_the_original as restored_half_way

    monkeypatch.setitem(queries.QUERIES, "every_handle", (every_handle_query, ["digest"], ["card"]))
    restored_half_way("every_handle", tmp_path)


def test_every_handle_query_local_equals_serial():
    """The operator using every handle kind gives the oracle's rows on the in-process runtime."""
    expected = cs.run(every_handle_query(4), executor="serial").results("digest").to_pylist()
    got = cs.run(every_handle_query(4), executor="local", containers=2, seed=3).results("digest").to_pylist()
    assert got == expected


def test_a_churning_map_reuses_emptied_directory_pages():
    """200,000 inserts, each deleting the entry 100 older: the directory stays O(live entries) pages."""
    m = MapState(KeyValueState("index"), page_size=64)
    for i in range(200_000):
        m.set("loc", i, i)
        if i >= 100:
            m.delete("loc", i - 100)
    pages = m.state.get(("h", "loc"))[0]
    assert m.len("loc") == 100 and sorted(m.keys("loc")) == list(range(199_900, 200_000))
    assert pages <= 4, f"{pages} directory pages for 100 live entries"
