"""Specification of running many slices as one group (slices/group.py, KeyedAggregate.consume_slices,
KeyIndexGroup): the group gives exactly what each slice gives alone.

A group is a speed-up only: per slice, the outputs (rows, ``_slice``,
``_seq``, lineage), the running state, the progress vector and the dead
letters must equal running that slice by itself; and a job whose containers
run their slices as groups must equal the serial oracle.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import chronostream as cs
from chronostream.dag import compile_query
from chronostream.slices.errors import EventError
from chronostream.slices.hashing import hash_columns, slice_of
from chronostream.slices.keyindex import KeyCollision, KeyIndex, KeyIndexGroup
from chronostream.slices import operators
from chronostream.slices.operators import KeyedAggregate, OperatorContext
from chronostream.slices.types import ORDER, SEQ, SLICE, SUB
from chronostream.containers.core import ContainerCore
from chronostream.containers.routing import OutputRoute, route
from chronostream.master.local import collect, run_local
from chronostream.master.placement import containers_per_stage, initial_placement
import chronostream.slices.group
from chronostream.slices.group import grouped_merge_order, in_grouped_merge_order, process_inputs, process_parts, runs_grouped
from chronostream.slices.slice import SliceRuntime
from queries import keyed_join

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")

SPECS = [("count", None), ("sum", "i"), ("min", "i"), ("max", "f"), ("mean", "f")]


def make_ops(n: int, key=("k",), specs=SPECS) -> list[KeyedAggregate]:
    ops = []
    for s in range(n):
        op = KeyedAggregate(list(key), specs)
        op.bind(OperatorContext("agg", s, ["out"]))
        op.setup()
        ops.append(op)
    return ops


def epoch_batch(rows: list[dict], owner: np.ndarray, first_order: int) -> tuple[pa.Table, np.ndarray]:
    """The rows grouped by owning op (stable), with lineage, and the bounds per op."""
    by_owner = np.argsort(owner, kind="stable")
    t = pa.Table.from_pylist([rows[i] for i in by_owner.tolist()],
                             schema=pa.schema([("k", pa.string()), ("i", pa.int64()), ("f", pa.float64())]))
    t = t.append_column(ORDER, pa.array(first_order + by_owner.astype(np.int64)))
    t = t.append_column(SUB, pa.array(np.zeros(len(rows), np.int64)))
    bounds = np.searchsorted(owner[by_owner], np.arange(owner.max() + 2 if len(owner) else 1))
    return t, bounds


def hashed_epochs(epochs: list[list[dict]], n_ops: int):
    """Per epoch: its rows, the batch grouped by the op their key hashes to, and bounds per op."""
    order = 0
    for rows in epochs:
        owner = slice_of([pa.array([r["k"] for r in rows])], n_ops)
        batch, bounds = epoch_batch(rows, owner, order)
        order += len(rows)
        yield rows, batch, np.concatenate((bounds, np.full(n_ops + 1 - len(bounds), bounds[-1])))


def exact(table: pa.Table) -> list[dict]:
    return [{k: (v.hex() if isinstance(v, float) else v) for k, v in r.items()} for r in table.to_pylist()]


row = st.fixed_dictionaries({"k": st.sampled_from(["a", "b", "c", "", "ü", "dd", "eee", "f"]),
                             "i": st.integers(-10**6, 10**6),
                             "f": st.floats(-1e9, 1e9, allow_nan=False)})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(row, min_size=1, max_size=30), min_size=1, max_size=5), st.integers(2, 5))
def test_one_group_call_equals_every_slice_consuming_alone(epochs, n_ops):
    """Rows routed by key hash, over several epochs: each op's output rows and full state after
    consume_slices equal those of the same op fed its rows alone with consume_batch."""
    grouped, alone = make_ops(n_ops), make_ops(n_ops)
    for _rows, batch, bounds in hashed_epochs(epochs, n_ops):
        out, out_bounds = KeyedAggregate.consume_slices(grouped, "in", batch, bounds)["out"]
        assert out_bounds.tolist() == bounds.tolist()
        for i, op in enumerate(alone):
            part = batch.slice(int(bounds[i]), int(bounds[i + 1] - bounds[i]))
            want = []
            if part.num_rows:
                op.consume_batch("in", part)
                want = exact(op._ctx.take_outputs({})["out"])
            assert exact(out.slice(int(bounds[i]), part.num_rows)) == want
    for g, a in zip(grouped, alone):
        assert len(g.key_index) == len(a.key_index)
        gs = g.checkpoint_state(delta=False)["__op__aggregate"]
        as_ = a.checkpoint_state(delta=False)["__op__aggregate"]
        assert gs == as_


def test_a_key_given_to_two_slices_of_a_group_is_refused_and_changes_no_state():
    """Routing gives a key to one slice; a batch that gives one key to two ops (a routing bug) is a
    KeyCollision before any op's state changes (the caller then reruns each slice alone)."""
    ops = make_ops(2)
    first, bounds = epoch_batch([{"k": "a", "i": 1, "f": 0.5}, {"k": "b", "i": 2, "f": 1.0}], np.array([0, 1]), 0)
    KeyedAggregate.consume_slices(ops, "in", first, bounds)
    before = [op.checkpoint_state(delta=False, clear=False)["__op__aggregate"] for op in ops]
    both, bounds = epoch_batch([{"k": "a", "i": 3, "f": 0.0}, {"k": "a", "i": 4, "f": 0.0}], np.array([0, 1]), 2)
    with pytest.raises(KeyCollision):
        KeyedAggregate.consume_slices(ops, "in", both, bounds)
    assert [op.checkpoint_state(delta=False, clear=False)["__op__aggregate"] for op in ops] == before


def state_by_key(op: KeyedAggregate) -> dict:
    if not len(op.key_index):
        return {}
    keys = op.key_index.keys()[0].to_pylist()
    return {k: {name: arr[i].item() for name, arr in sorted(op.arrays.items())} for i, k in enumerate(keys)}


def routed_codes(batch: pa.Table, void_from: int | None = None) -> pa.Table:
    """``batch`` with key codes as routing ships them: a dictionary over a whole epoch (keys these
    rows lack, another order); rows from ``void_from`` on come from a sender without codes."""
    keys = batch.column("k").combine_chunks()
    extra = pa.array(["zz", "f", "yy"] + keys.to_pylist()[::-1], pa.string())
    codes = pc.dictionary_encode(pa.concat_arrays([extra, keys])).slice(len(extra))
    coded = batch.append_column("_codes.k", codes)
    if void_from is None:
        return coded
    return pa.concat_tables([coded.slice(0, void_from), batch.slice(void_from)], promote_options="permissive")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(row, min_size=1, max_size=30), min_size=1, max_size=4), st.integers(1, 5), st.booleans())
def test_routed_key_codes_give_the_outputs_and_state_of_encoding_the_key(epochs, n_ops, partly):
    """Group ids from routing's codes (a part of their dictionary used; some rows without codes when
    ``partly``) give each op the outputs and state it gets when the key is encoded afresh."""
    coded_ops, plain_ops = make_ops(n_ops), make_ops(n_ops)
    for rows, batch, bounds in hashed_epochs(epochs, n_ops):
        coded = routed_codes(batch, void_from=len(rows) // 2 if partly else None)
        ids = operators._routed_key_codes(coded, ["k"])
        if partly:
            assert ids is None
        else:
            inverse, (distinct,), hashes = ids
            assert hashes is None  # these codes came without routing's hashes
            assert distinct.take(pa.array(inverse)).to_pylist() == [r["k"] for r in batch.to_pylist()]
            assert sorted(distinct.to_pylist()) == sorted({r["k"] for r in rows})
        got, _ = KeyedAggregate.consume_slices(coded_ops, "in", coded, bounds)["out"]
        want, _ = KeyedAggregate.consume_slices(plain_ops, "in", batch, bounds)["out"]
        assert exact(got) == exact(want)
    for c, p in zip(coded_ops, plain_ops):  # keys may hold other slots: compare per key
        assert state_by_key(c) == state_by_key(p)


def routed_batch(batch: pa.Table, n_ops: int) -> pa.Table:
    """``batch`` as one sender's part arrives from ``containers.routing.route``: key codes and
    their hashes in the field metadata (rows stay in the batch's order)."""
    tagged = batch.append_column("row", pa.array(np.arange(batch.num_rows)))
    part, _dst = route(tagged, ("k",), OutputRoute(1, np.zeros(max(n_ops, 2), np.int64)), key_codes=True)[0]
    return part.take(pa.array(np.argsort(np.asarray(part.column("row"))))).drop_columns(["row"])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(row, min_size=1, max_size=30), min_size=1, max_size=3), st.integers(1, 4))
def test_routed_hashes_are_the_keys_hashes_and_give_the_same_outputs_and_state(epochs, n_ops):
    """Routing ships each key's hash with its codes; the group uses them (its own hashing is not
    called) and gives the outputs and state it gives when it encodes and hashes the key itself."""
    routed_ops, plain_ops = make_ops(n_ops), make_ops(n_ops)
    epochs = [rows * (257 // len(rows) + 1) for rows in epochs]  # routing encodes epochs of 257+ rows
    for rows, batch, bounds in hashed_epochs(epochs, n_ops):
        coded = routed_batch(batch, n_ops)
        inverse, (distinct,), hashes = operators._routed_key_codes(coded, ["k"])
        assert hashes.tolist() == hash_columns([distinct], distinct=True).tolist()
        assert distinct.take(pa.array(inverse)).to_pylist() == [r["k"] for r in batch.to_pylist()]
        calls = []
        real = operators.hash_columns
        operators.hash_columns = lambda *a, **k: calls.append(a) or real(*a, **k)
        try:
            got, _ = KeyedAggregate.consume_slices(routed_ops, "in", coded, bounds)["out"]
        finally:
            operators.hash_columns = real
        assert calls == []
        want, _ = KeyedAggregate.consume_slices(plain_ops, "in", batch, bounds)["out"]
        assert exact(got) == exact(want)
    for r, p in zip(routed_ops, plain_ops):
        assert state_by_key(r) == state_by_key(p)


def test_hashes_routed_for_another_dictionary_are_not_trusted():
    """Parts of two senders merge into one dictionary and keep one part's metadata: hashes shipped
    for a dictionary other than the one the rows now use (another length, or the same length and
    other values) are ignored, and the group hashes the keys itself."""
    words = [f"w{i % 7}" for i in range(300)]
    first = routed_batch(pa.table({"k": words, ORDER: np.arange(300)}), 2)
    other = routed_batch(pa.table({"k": [f"v{i % 9}" for i in range(300)], ORDER: np.arange(300)}), 2)
    merged = pa.concat_tables([first, other]).take(pa.array(np.arange(600)))  # one chunk, dictionaries unified
    assert merged.column("_codes.k").num_chunks == 1
    assert operators._routed_key_codes(merged, ["k"])[2] is None
    swapped = first.column("_codes.k").combine_chunks()
    relabeled = pa.DictionaryArray.from_arrays(swapped.indices, pa.array([f"x{i}" for i in range(7)]))
    forged = first.set_column(first.schema.get_field_index("_codes.k"), first.schema.field("_codes.k"), relabeled)
    assert operators._routed_key_codes(forged, ["k"])[2] is None
    assert operators._routed_key_codes(first, ["k"])[2] is not None


def test_a_key_in_two_slices_rows_is_refused_and_changes_nothing():
    """Rows not routed by hash (one key under two ops) are refused with KeyCollision, before any
    state changes: the group runner then runs the slices one by one."""
    ops = make_ops(2)
    rows = [{"k": "x", "i": 1, "f": 1.0}, {"k": "x", "i": 2, "f": 2.0}]
    batch, bounds = epoch_batch(rows, np.array([0, 1]), 0)
    with pytest.raises(KeyCollision):
        KeyedAggregate.consume_slices(ops, "in", batch, bounds)
    assert all(not op.arrays.get("count", np.zeros(1)).any() for op in ops)
    assert all(op._dirty_slots == [] for op in ops)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), max_size=25, unique=True), max_size=8), st.integers(1, 4),
       st.sampled_from([1 << 17, 1, 4]), st.booleans(), st.sampled_from([1 << 20, 1, 3]))
def test_group_slots_equal_each_members_own_numbering(batches, members, recent_max, preloaded, merge_step):
    """Keys partitioned over members (key % members): the group gives each key the slot its member
    would (first-seen order per member), and each member's own lookups agree afterwards; also
    when new keys wait in the group's recent run and merge into its main run every 1 or 4 keys
    (a merge moving 1 or 3 main entries per lookup, so it spans lookups),
    and when the members held keys of their own before the group was built (``preloaded``: the
    first batch goes to each member alone; the group verifies hits on them in its own copy)."""
    indexes = [KeyIndex() for _ in range(members)]
    ref: list[dict] = [{} for _ in range(members)]
    if preloaded and batches:
        for m, ix in enumerate(indexes):
            own = [k for k in batches[0] if k % members == m]
            if own:
                assert ix.slots([pa.array([f"k{k}" for k in own])]).tolist() == \
                    [ref[m].setdefault(k, len(ref[m])) for k in own]
        batches = batches[1:]
    group = KeyIndexGroup(indexes)
    group.RECENT_MAX = recent_max
    group.MERGE_STEP_MIN = merge_step
    for keys in batches:
        if not keys:
            continue
        col = pa.array([f"k{k}" for k in keys])
        member = np.array([k % members for k in keys])
        got = group.slots(member, [col], hash_columns([col])).tolist()
        assert got == [ref[k % members].setdefault(k, len(ref[k % members])) for k in keys]
        assert group.matches(indexes)
    for m, ix in enumerate(indexes):
        assert len(ix) == len(ref[m])
        assert (ix.keys()[0].to_pylist() if len(ix) else []) == [f"k{k}" for k in sorted(ref[m], key=ref[m].get)]
        if ref[m]:
            keys = sorted(ref[m])
            assert ix.slots([pa.array([f"k{k}" for k in keys])]).tolist() == [ref[m][k] for k in keys]


def test_a_members_keys_read_between_group_lookups_are_its_keys_in_slot_order():
    """A group stores a member's new keys only when the member's keys are read: reads between
    lookups (a checkpoint's ``take``, ``keys``) see every key added so far, at its slot, and
    keys added after a read follow it."""
    a, b = KeyIndex(), KeyIndex()
    group = KeyIndexGroup([a, b])
    first = pa.array(["p", "q", "r"])
    assert group.slots(np.array([0, 1, 0]), [first], hash_columns([first])).tolist() == [0, 0, 1]
    assert a.take(np.array([1, 0]))[0].to_pylist() == ["r", "p"]
    second = pa.array(["s", "q", "t", "u"])
    assert group.slots(np.array([0, 1, 1, 0]), [second], hash_columns([second])).tolist() == [2, 0, 1, 3]
    assert a.keys()[0].to_pylist() == ["p", "r", "s", "u"]
    assert b.take(np.array([1, 0]))[0].to_pylist() == ["t", "q"]
    assert (len(a), len(b)) == (4, 2) and group.matches([a, b])


def test_a_member_nobody_reads_stores_its_keys_every_deferred_max_batches():
    """Without reads (a job without checkpoints) a member's unstored batches stay bounded, and the
    keys it stored along the way are its keys in slot order."""
    a, b = KeyIndex(), KeyIndex()
    group = KeyIndexGroup([a, b])
    group.DEFERRED_MAX = 3
    for i in range(10):
        keys = pa.array([f"a{i}", f"b{i}"])
        group.slots(np.array([0, 1]), [keys], hash_columns([keys]))
        assert len(a._deferred) < 3 and len(b._deferred) < 3
    assert a._keys.size == 9 and a.keys()[0].to_pylist() == [f"a{i}" for i in range(10)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 60), max_size=12, unique=True),
                          st.lists(st.integers(0, 3), max_size=2)), max_size=14),
       st.integers(1, 4), st.sampled_from([1, 2, 3]))
def test_members_store_their_deferred_keys_together_or_alone_in_slot_order(batches, members, deferred_max):
    """Members store the keys a group added for them all together every ``DEFERRED_MAX`` batches
    (``_store_deferred``) and alone whenever their keys are read between lookups (``reads``: the
    members read after each batch, a checkpoint's ``keys``); either way each member's keys are
    its keys in slot order, and its own lookups find every key at the slot the group gave it."""
    indexes = [KeyIndex() for _ in range(members)]
    group = KeyIndexGroup(indexes)
    group.DEFERRED_MAX = deferred_max
    ref: list[dict] = [{} for _ in range(members)]
    for keys, reads in batches:
        if keys:
            col = pa.array([f"k{k}" for k in keys])
            got = group.slots(np.array([k % members for k in keys]), [col], hash_columns([col])).tolist()
            assert got == [ref[k % members].setdefault(k, len(ref[k % members])) for k in keys]
        for m in reads:
            if m < members:
                want = [f"k{k}" for k in sorted(ref[m], key=ref[m].get)]
                assert (indexes[m].keys()[0].to_pylist() if len(indexes[m]) else []) == want
        assert len(group._log) < deferred_max and all(len(ix._deferred) < deferred_max for ix in indexes)
    for m, ix in enumerate(indexes):
        want = sorted(ref[m], key=ref[m].get)
        assert (ix.keys()[0].to_pylist() if len(ix) else []) == [f"k{k}" for k in want]
        if want:
            assert ix.slots([pa.array([f"k{k}" for k in want])]).tolist() == list(range(len(want)))


def test_a_group_still_serving_members_a_hand_back_settled_keeps_their_unstored_keys_bounded():
    """A member's own lookup (a slice rerun alone) settles the group's keys into every member
    (``_hand_back``), and the group, whose members kept their sizes, goes on serving them: the
    batches it adds for them stay bounded, and their keys stay their keys in slot order."""
    a, b = KeyIndex(), KeyIndex()
    group = KeyIndexGroup([a, b])
    group.DEFERRED_MAX = 3
    first = pa.array(["a0", "b0"])
    group.slots(np.array([0, 1]), [first], hash_columns([first]))
    assert a.slots([pa.array(["a0"])]).tolist() == [0]  # a hit only: the sizes stay
    assert a._group is None and b._group is None and group.matches([a, b])
    for i in range(1, 10):
        keys = pa.array([f"a{i}", f"b{i}"])
        assert group.slots(np.array([0, 1]), [keys], hash_columns([keys])).tolist() == [i, i]
        assert len(a._deferred) < 3 and len(b._deferred) < 3
    assert a.keys()[0].to_pylist() == [f"a{i}" for i in range(10)]
    assert b.slots([pa.array([f"b{i}" for i in range(10)])]).tolist() == list(range(10))


def test_a_member_leaving_its_group_gets_its_sorted_keys_cut_from_the_groups_not_re_sorted():
    """After keys added through a group, a member's own sorted (hash, slot) arrays (needed for its
    own lookups, e.g. once a migration breaks the group up) are the ones a full sort gives; they
    come from the group's arrays, and the member forgets the group."""
    rng = np.random.default_rng(8)
    members = [KeyIndex() for _ in range(3)]
    members[1].slots([pa.array(["pre0", "pre1"])])  # keys of its own before the group
    group = KeyIndexGroup(members)
    for _ in range(4):
        keys = pa.array(sorted({f"k{int(i)}" for i in rng.integers(0, 400, 60)}))
        owner = slice_of([keys], 3)
        group.slots(owner, [keys], hash_columns([keys]))
    want = []
    for m in members:  # what a sort of each member's keys gives
        assert m._deferred and not m._pending and m._group is group  # keys stored only when read
        m._materialize()
        assert m._pending and not m._deferred
        assert m._runs.only_main()
        hs = np.concatenate([m._runs.main[0]] + [h for h, _ in m._pending])
        sl = np.concatenate([m._runs.main[1]] + [x for _, x in m._pending])
        want.append((hs[np.argsort(hs)].tolist(), sl[np.argsort(hs)].tolist()))
    for m, (want_h, want_s) in zip(members, want):
        hashes, slots = m.sorted_hashes()  # the first call hands every member its arrays
        assert (hashes.tolist(), slots.tolist()) == (want_h, want_s)
        assert m._group is None and not m._pending and not m._deferred


def test_members_of_one_group_settled_by_two_threads_at_once_each_keep_every_key_once():
    """After a thread-table change two threads build new groups from the members of one old
    group, each settling its own members while the other's settling hands every member of the
    old group its arrays. Each member must end with each of its keys once, at its own slot (a
    hand-back landing in the middle of a member's own merge doubled its pending keys: the
    next group refused them as a collision, or a count restarted at 1). A race: repeated, with
    a thread switch every microsecond; before the fix about 3 rounds in 100 went wrong."""
    import sys
    import threading

    def settle_in_two_threads(seed: int) -> list[str]:
        rng = np.random.default_rng(seed)
        members = [KeyIndex() for _ in range(8)]
        group = KeyIndexGroup(members)
        for _ in range(3):
            keys = pa.array(sorted({f"k{int(i)}" for i in rng.integers(0, 4000, 800)}))
            group.slots(slice_of([keys], 8), [keys], hash_columns([keys]))
        sizes = [len(m) for m in members]
        start, errors = threading.Barrier(2), []

        def settle(own: list[KeyIndex]) -> None:
            start.wait()
            try:
                for m in own:
                    m.sorted_hashes()
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(repr(exc))
        threads = [threading.Thread(target=settle, args=(members[i::2],)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, (m, n) in enumerate(zip(members, sizes)):
            hashes, slots = m.sorted_hashes()
            if len(np.unique(hashes)) != n or sorted(slots.tolist()) != list(range(n)):
                errors.append(f"member {i}: {len(hashes)} entries for {n} keys")
        return errors

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        failed = {seed: e for seed in range(150) if (e := settle_in_two_threads(seed))}
    finally:
        sys.setswitchinterval(interval)
    assert failed == {}


def test_a_member_settling_while_another_thread_hands_it_its_arrays_waits_for_the_hand_back():
    """The interleaving behind the race above, forced: thread A settles member 0, whose group
    hands every member its arrays; thread B settles member 1 just as A reaches member 1, then
    reads its pending keys while A hands member 1 its arrays. B must wait for the hand-back
    (the group's lock) and find member 1 settled; a member that looked settled before the
    hand-back replaced its arrays (``_group`` cleared first) let B read a half-handed-back
    state: pending keys gone between two reads (an IndexError), or member 1 left empty."""
    import threading

    members = [KeyIndex() for _ in range(2)]
    group = KeyIndexGroup(members)
    for b in range(3):
        keys = pa.array([f"k{b}-{i}" for i in range(200)])
        group.slots(slice_of([keys], 2), [keys], hash_columns([keys]))
    sizes = [len(m) for m in members]
    assert min(sizes) > 0
    m1, old_runs = members[1], members[1]._runs
    go_b, b_parked, a_done = threading.Event(), threading.Event(), threading.Event()
    b_thread: list[threading.Thread] = []

    class Lock:  # the group's lock, telling when thread B is about to wait for it
        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            if threading.current_thread() in b_thread:
                b_parked.set()
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    group._lock = Lock(group._lock)
    only_main, merged = old_runs.only_main, old_runs.merged

    def hand_back_reaches_member_1():  # (thread A, in the hand-back, before member 1's writes)
        go_b.set()
        assert b_parked.wait(10)
        return only_main()

    def member_1_merges():  # (thread B, settling member 1 on its own: held until A is done)
        if threading.current_thread() in b_thread:
            b_parked.set()
            assert a_done.wait(10)
        return merged()

    old_runs.only_main, old_runs.merged = hand_back_reaches_member_1, member_1_merges
    errors: list[str] = []

    def settle_a() -> None:
        try:
            members[0].sorted_hashes()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"A: {exc!r}")
        finally:
            a_done.set()

    def settle_b() -> None:
        try:
            assert go_b.wait(10)
            m1.sorted_hashes()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"B: {exc!r}")

    b_thread.append(threading.Thread(target=settle_b))
    a = threading.Thread(target=settle_a)
    b_thread[0].start()
    a.start()
    a.join()
    b_thread[0].join()
    assert errors == []
    for i, (m, n) in enumerate(zip(members, sizes)):
        hashes, slots = m.sorted_hashes()
        assert (len(np.unique(hashes)), sorted(slots.tolist())) == (n, list(range(n))), f"member {i}"


@pytest.mark.parametrize("block", [None, 512])
def test_a_group_keeps_each_keys_member_and_slot_past_many_batches_of_new_keys(block, monkeypatch):
    """The group finds a hit's member and slot by the key's place in its key copy (numpy blocks
    filled as keys come; ``block``: blocks of 512 places, so thousands of keys span several):
    after thousands of keys in many batches, hits give every key its member's slot, and members
    leaving the group get the (hash, slot) arrays of their own keys."""
    if block is not None:
        from chronostream.slices.keyindex import _PlaceTable

        monkeypatch.setattr(_PlaceTable, "BLOCK", block)
    members = [KeyIndex() for _ in range(3)]
    members[2].slots([pa.array(["own0", "own1", "own2"])])
    group = KeyIndexGroup(members)
    ref: list[dict[str, int]] = [{}, {}, {"own0": 0, "own1": 1, "own2": 2}]
    rng = np.random.default_rng(3)
    for b in range(12):
        keys = pa.array(sorted({f"k{int(i)}" for i in rng.integers(0, 6000, 700)} | {f"new{b}"}))
        owner = slice_of([keys], 3)
        got = group.slots(owner, [keys], hash_columns([keys])).tolist()
        assert got == [ref[o].setdefault(k, len(ref[o])) for k, o in zip(keys.to_pylist(), owner.tolist())]
    assert sum(map(len, ref)) > 3000
    for m, want in zip(members, ref):
        hashes, slots = m.sorted_hashes()  # cut from the group's arrays
        keys = sorted(want)
        by_hash = dict(zip(hashes.tolist(), slots.tolist()))
        assert len(by_hash) == len(want)
        assert [by_hash[int(h)] for h in hash_columns([pa.array(keys)])] == [want[k] for k in keys]


def test_group_refuses_a_key_held_by_another_member_and_changes_nothing():
    a, b = KeyIndex(), KeyIndex()
    a.slots([pa.array(["x"])])
    group = KeyIndexGroup([a, b])
    col = pa.array(["x", "y"])
    with pytest.raises(KeyCollision):
        group.slots(np.array([1, 1]), [col], hash_columns([col]))
    assert (len(a), len(b)) == (1, 0)
    assert group.matches([a, b])


def test_group_checks_every_hit_against_the_stored_key_old_or_added_through_it():
    """A key whose (forged) hash a different stored key holds is a KeyCollision, whether that key
    was stored before the group was built or added through the group, in any member."""
    a, b = KeyIndex(), KeyIndex()
    a.slots([pa.array(["p", "q"])], hashes=np.array([10, 20], np.uint64))
    group = KeyIndexGroup([a, b])
    added = pa.array(["r", "s"])
    assert group.slots(np.array([1, 0]), [added], np.array([30, 40], np.uint64)).tolist() == [0, 2]
    both = pa.array(["q", "r", "s"])
    assert group.slots(np.array([0, 1, 0]), [both], np.array([20, 30, 40], np.uint64)).tolist() == [1, 0, 2]
    for member, key, forged in [(0, "x", 20), (1, "y", 30), (0, "z", 40)]:
        with pytest.raises(KeyCollision):
            group.slots(np.array([member]), [pa.array([key])], np.array([forged], np.uint64))
    assert (len(a), len(b)) == (3, 1)


def test_group_no_longer_matches_a_member_replaced_or_grown_alone():
    a, b = KeyIndex(), KeyIndex()
    group = KeyIndexGroup([a, b])
    assert group.matches([a, b]) and not group.matches([b, a]) and not group.matches([a])
    b.slots([pa.array(["z"])])
    assert not group.matches([a, b])
    assert not KeyIndexGroup([a, b]).matches([a, KeyIndex()])


def test_a_group_serves_the_members_that_stay_when_others_leave_and_forgets_the_others():
    """Slices 0 and 2 of a group of three leave (migrated away): the group still gives slice 1 the
    slots its own index would, adds its new keys without the member re-sorting anything, and no
    longer holds the members that left."""
    rng = np.random.default_rng(3)
    members = [KeyIndex() for _ in range(3)]
    group = KeyIndexGroup(members)
    ref: dict[str, int] = {}
    for round_ in range(6):
        keys = pa.array(sorted({f"k{int(i)}" for i in rng.integers(0, 300, 50)}))
        owner = slice_of([keys], 3)
        stays = members[1:2] if round_ >= 3 else members
        if round_ >= 3:  # only slice 1's rows arrive now
            keys = keys.filter(pa.array(owner == 1))
            owner = np.zeros(len(keys), dtype=np.int64)
            assert KeyIndexGroup.covering(stays) is group
            member_of = group.positions(stays)[owner]
        else:
            member_of = owner
        got = group.slots(member_of, [keys], hash_columns([keys])).tolist()
        for k, m, slot in zip(keys.to_pylist(), member_of.tolist(), got):
            if m == 1:
                assert slot == ref.setdefault(k, len(ref))
    assert group.members[0] is None and group.members[2] is None and group.members[1] is members[1]
    assert members[1]._deferred  # nothing was merged into its own arrays meanwhile
    fresh = KeyIndex()
    keys = sorted(ref, key=ref.get)
    assert fresh.slots([pa.array(keys)]).tolist() == members[1].slots([pa.array(keys)]).tolist()


def test_no_group_covers_members_grown_alone_or_not_its_own():
    a, b, c = KeyIndex(), KeyIndex(), KeyIndex()
    group = KeyIndexGroup([a, b])
    assert KeyIndexGroup.covering([c]) is None and KeyIndexGroup.covering([a, c]) is None
    b.slots([pa.array(["z"])])  # b settled and grew alone: the group's entries for it are stale
    assert KeyIndexGroup.covering([b]) is None
    assert KeyIndexGroup.covering([a]) is group


def test_the_slices_left_after_a_migration_keep_their_results_without_a_re_sort():
    """consume_slices over three slices, then over the one left (the others migrated away): its
    outputs and state equal those of the same slice fed alone from the start, and its key index
    never merged the keys the group added (no stall of the epoch after the move)."""
    epochs = [[{"k": w, "i": i, "f": i / 3} for i, w in enumerate(words)]
              for words in (["a", "b", "c", "dd", "eee"], ["b", "ü", "f", "a"], ["c", "c", "dd", "x", "y"])]
    grouped, alone = make_ops(3), make_ops(3)
    for e, (_rows, batch, bounds) in enumerate(hashed_epochs(epochs * 3, 3)):
        ops = grouped if e < 3 else grouped[1:2]
        part = batch.slice(int(bounds[1]), int(bounds[2] - bounds[1]))
        if e < 3:
            out, _ = KeyedAggregate.consume_slices(ops, "in", batch, bounds)["out"]
            got = out.slice(int(bounds[1]), part.num_rows)
        elif part.num_rows:  # (a slice without rows sits the epoch out)
            got, _ = KeyedAggregate.consume_slices(ops, "in", part, np.array([0, part.num_rows]))["out"]
        if part.num_rows:
            alone[1].consume_batch("in", part)
            assert exact(got) == exact(alone[1]._ctx.take_outputs({})["out"])
    assert grouped[1].key_index._deferred and grouped[1].key_index._group is not None
    assert state_by_key(grouped[1]) == state_by_key(alone[1])


def test_grouped_merge_order_is_each_slices_merge_order():
    """Rows arriving out of order within a slice, from two producers, are put in (slice, order,
    sub, producer, seq) order; rows already in order are left as they are."""
    owner = np.array([0, 0, 0, 1, 1])
    order = np.array([5, 2, 2, 1, 0])
    sub = np.array([0, 1, 0, 0, 0])
    producer = np.array([0, 1, 0, 0, 0])
    seq = np.array([9, 3, 4, 1, 0])
    assert grouped_merge_order(owner, order, sub, producer, seq).tolist() == [2, 1, 0, 4, 3]
    assert grouped_merge_order(owner, np.array([0, 1, 1, 0, 7]), sub * 0, producer * 0,
                               seq).tolist() == [0, 1, 2, 3, 4]


def test_grouped_merge_order_of_interleaved_producers_equals_the_full_sort_with_or_without_ties():
    """A keyed stage fed by a stage of many slices gets each event's rows from several producers,
    interleaved: the order is still (slice, order, sub, producer, seq), ties included (seeded)."""
    rng = np.random.default_rng(7)
    for _ in range(500):
        n = int(rng.integers(2, 80))
        owner = rng.integers(0, 4, n)
        owner = np.sort(owner) if rng.random() < 0.7 else owner
        order = rng.integers(0, 8, n) + (1 << 40)
        sub = rng.integers(0, 3, n) << int(rng.integers(0, 60)) if rng.random() < 0.8 else \
            rng.integers(0, 1 << 62, n)  # (sub-orders of no common shape: ranked)
        producer = rng.integers(0, 3, n)
        seq = np.arange(n)  # (each producer's rows arrive in its out_seq order)
        if rng.random() < 0.5:  # as routing sends a many-slice producer's rows: in (slice, order, sub)
            routed = np.lexsort((sub, order, owner))  # (stable: ties keep their arrival order)
            owner, order, sub, producer, seq = owner[routed], order[routed], sub[routed], producer[routed], seq[routed]
        expected = np.lexsort((seq, producer, sub, order, owner))
        assert grouped_merge_order(owner, order, sub, producer, seq).tolist() == expected.tolist()


def test_rows_of_several_producers_in_slice_order_and_sub_order_are_not_reordered():
    """Routing sorts a many-slice producer's rows by (slice, order, sub): the merge takes them
    as they are, though one event's rows come from several producers."""
    owner = np.array([0, 0, 0, 1, 1])
    order = np.array([4, 4, 6, 4, 4])
    sub = np.array([1, 2, 0, 0, 0])
    producer = np.array([3, 0, 1, 0, 2])  # (the last two tie on sub: producer order decides)
    assert in_grouped_merge_order(owner, order, sub, producer)
    assert not in_grouped_merge_order(owner, order, sub, np.array([3, 0, 1, 2, 0]))


# -- the slice group against slices run alone ---------------------------------------------------

SLICES = 6


def poison_every_third_count(r: dict) -> list[dict]:
    """A per-event chain step: raises on counts divisible by 3, else one or two rows."""
    if r["count"] % 3 == 0:
        raise ValueError(f"count {r['count']} of {r['w']!r}")
    return [{"w": r["w"], "n": r["count"]}] * (1 + r["count"] % 2)


def count_plan(dead_letters: bool = False, value_sum: bool = False, chained: bool = False):
    lines = pa.table({"w": ["a"], "v": pa.array([1], pa.int64())})
    q = cs.Query()
    keyed = q.source("s", lines, slices=1).key_by("w")
    out = (keyed.aggregate(count=True, sum="v", slices=SLICES, name="agg") if value_sum
           else keyed.count(slices=SLICES, name="agg"))
    if chained:  # vectorized and per-event steps, a filter and a fan-out
        out = out.filter_batches(lambda t: pc.not_equal(t["w"], "w7")) \
            .flat_map(poison_every_third_count, schema=pa.schema([("w", pa.string()), ("n", pa.int64())])) \
            .map_batches(lambda t: t.append_column("n2", pc.multiply(t["n"], 2)))
    out.sink(name="out")
    if dead_letters:
        q.dead_letters()
    plan, _ = compile_query(q)
    stage = next(s for s in plan.stages if s.name == "agg")
    return plan, stage


def routed_inputs(words: list[str], values: list, first: int, stream_id: int) -> tuple[dict[int, dict], tuple]:
    """One epoch from a one-slice producer (out_seq = source order): cut by consumer slice (the
    input of slices run alone), and as the one part routing sends (sorted by slice, slice per row)."""
    t = pa.table({"w": words, "v": pa.array(values, pa.int64()),
                  ORDER: pa.array(np.arange(first, first + len(words), dtype=np.int64)),
                  SUB: pa.array(np.zeros(len(words), np.int64)),
                  SLICE: pa.array(np.zeros(len(words), np.int64)),
                  SEQ: pa.array(np.arange(first, first + len(words), dtype=np.int64))})
    dst = slice_of([t.column("w")], SLICES)
    by_slice = np.argsort(dst, kind="stable")
    part = (t.take(pa.array(by_slice)), dst[by_slice])
    return {s: {stream_id: [t.filter(pa.array(dst == s))]} for s in range(SLICES) if (dst == s).any()}, part


def run_both(plan, stage, epochs: list[tuple[list[str], list]], dead: bool = False):
    alone = [SliceRuntime(plan, stage.stage_id, s, dead) for s in range(SLICES)]
    grouped = [SliceRuntime(plan, stage.stage_id, s, dead) for s in range(SLICES)]
    sid = stage.inputs[0].stream_id
    first = 0
    outs_alone, outs_grouped = [], []
    for e, (words, values) in enumerate(epochs):
        inputs, part = routed_inputs(words, values, first, sid)
        first += len(words)
        outs_alone.append({s: alone[s].process(e, inputs[s]) for s in sorted(inputs)})
        outs_alone[-1] = {s: o for s, o in outs_alone[-1].items() if o}
        outs_grouped.append(process_parts(grouped, e, [part]))
    return alone, grouped, outs_alone, outs_grouped


def as_rows(outs):
    return [{s: {sid: t.to_pylist() for sid, t in per.items()} for s, per in epoch.items()} for epoch in outs]


def test_a_group_epoch_equals_each_slice_alone_row_for_row():
    """Outputs per slice and stream (rows, _slice, _seq, lineage), counters and progress vectors."""
    plan, stage = count_plan()
    assert runs_grouped(stage)
    rng = np.random.default_rng(3)
    vocab = [f"w{i}" for i in range(40)]
    epochs = [([vocab[i] for i in rng.integers(0, 40, 200)], [1] * 200) for _ in range(4)]
    alone, grouped, oa, og = run_both(plan, stage, epochs)
    assert as_rows(og) == as_rows(oa)
    assert sum(len(e) for e in og) > SLICES  # several slices produced in several epochs
    for a, g in zip(alone, grouped):
        assert (a.events_in, a.events_out, a.last_epoch, a.next_seq) == (g.events_in, g.events_out,
                                                                       g.last_epoch, g.next_seq)
        assert a.progress.as_dict() == g.progress.as_dict()


def rows_out(outs) -> int:
    return sum(t.num_rows for per in outs.values() for t in per.values())


def test_a_chain_after_the_group_runs_once_and_equals_each_slices_chain_row_for_row():
    """A filter, a per-event fan-out that raises on some rows, and a vectorized map after the
    aggregate: run once over the group's output, each slice gets the rows, ``_seq`` numbers and
    dead letters (naming it) that it gets running its chain alone."""
    plan, stage = count_plan(dead_letters=True, chained=True)
    assert runs_grouped(stage)
    rng = np.random.default_rng(4)
    vocab = [f"w{i}" for i in range(12)]
    epochs = [([vocab[i] for i in rng.integers(0, 12, 80)], [1] * 80) for _ in range(3)]
    alone, grouped, oa, og = run_both(plan, stage, epochs, dead=True)
    assert as_rows(og) == as_rows(oa)
    dead_a = [d for rt in alone for d in rt.take_dead_letters()]
    dead_g = [d for rt in grouped for d in rt.take_dead_letters()]
    assert len(dead_a) > SLICES and dead_g == dead_a
    rows = [r for epoch in og for per in epoch.values() for t in per.values() for r in t.to_pylist()]
    assert rows and "w7" not in {r["w"] for r in rows} and all(r["n2"] == 2 * r["n"] for r in rows)


def test_rows_delivered_twice_are_dropped_by_each_slices_progress_vector():
    plan, stage = count_plan()
    grouped = [SliceRuntime(plan, stage.stage_id, s) for s in range(SLICES)]
    _, part = routed_inputs(["a", "b", "c", "a"], [1, 1, 1, 1], 0, stage.inputs[0].stream_id)
    assert rows_out(process_parts(grouped, 0, [part])) == 4
    assert process_parts(grouped, 1, [part]) == {}
    assert sum(rt.duplicates_dropped for rt in grouped) == 4


def test_a_copy_of_a_part_from_a_second_sender_in_the_same_epoch_is_dropped():
    """Dual mode: two senders run one producer slice and both send its rows. The first copy
    counts, the second is dropped per slice, and the outputs equal those of one copy."""
    plan, stage = count_plan()
    once = [SliceRuntime(plan, stage.stage_id, s) for s in range(SLICES)]
    twice = [SliceRuntime(plan, stage.stage_id, s) for s in range(SLICES)]
    _, part = routed_inputs(["a", "b", "c", "a", "d"], [1] * 5, 0, stage.inputs[0].stream_id)
    early = (part[0].slice(0, 3), part[1][:3])  # the second sender is behind: a prefix of the part
    assert as_rows([process_parts(twice, 0, [part, early])]) == as_rows([process_parts(once, 0, [part])])
    assert sum(rt.duplicates_dropped for rt in twice) == 3
    assert [rt.progress.as_dict() for rt in twice] == [rt.progress.as_dict() for rt in once]


def test_rows_of_slices_outside_the_group_or_restored_past_the_epoch_are_skipped():
    """A thread's group gets every part: it runs only its own slices, and not those whose state
    a checkpoint after this epoch restored."""
    plan, stage = count_plan()
    words = [f"w{i}" for i in range(60)]
    _, part = routed_inputs(words, [1] * 60, 0, stage.inputs[0].stream_id)
    group = [SliceRuntime(plan, stage.stage_id, s) for s in (1, 2, 4)]
    group[1].last_epoch = 5  # slice 2: restored from epoch 5's checkpoint
    out = process_parts(group, 3, [part])
    assert sorted(out) == [1, 4]
    assert rows_out(out) == int(np.isin(part[1], [1, 4]).sum())
    assert (group[0].last_epoch, group[1].last_epoch, group[2].last_epoch) == (3, 5, 3)


def test_a_poison_epoch_reruns_slice_by_slice_with_the_same_dead_letters():
    """An int64 sum overflow in one slice: the group call fails, the epoch reruns per slice, and the
    outputs and dead letters equal running every slice alone."""
    plan, stage = count_plan(dead_letters=True, value_sum=True)
    big = 2**62
    epochs = [(["a", "b", "c", "a"], [1, 2, 3, big]), (["a", "b", "a"], [big, 5, 6])]
    alone, grouped, oa, og = run_both(plan, stage, epochs, dead=True)
    assert as_rows(og) == as_rows(oa)
    dead_a = [d for rt in alone for d in rt.take_dead_letters()]
    dead_g = [d for rt in grouped for d in rt.take_dead_letters()]
    assert dead_a and dead_g == dead_a


class Tally(cs.Operator):
    """Per event: the key's running total of ``v``, produced once or twice (odd totals twice);
    with ``poison_every=P``, a total divisible by P raises after the state took it."""

    def __init__(self, poison_every: int = 0) -> None:
        self.poison_every = poison_every

    def setup(self) -> None:
        self.totals = self.register_state("totals")

    def consume(self, stream_id: str, event: dict) -> None:
        total = self.totals.get(event["w"], 0) + event["v"]
        self.totals.set(event["w"], total)
        if self.poison_every and total % self.poison_every == 0:
            raise ValueError(f"total {total} of {event['w']!r}")
        for _ in range(1 + total % 2):
            self.produce("out", {"w": event["w"], "total": total})


TALLY_SCHEMA = pa.schema([("w", pa.string()), ("total", pa.int64())])


def tally_plan(dead_letters: bool = False, declared: bool = False, chain_poison: str | None = None):
    """``declared``: the operator's output schema is given (the group then builds one table);
    ``chain_poison``: the map after it raises on that word."""
    lines = pa.table({"w": ["a"], "v": pa.array([1], pa.int64())})
    q = cs.Query()

    def twice(r: dict) -> dict:
        if r["w"] == chain_poison:
            raise ValueError(f"poison word {r['w']}")
        return {**r, "twice": 2 * r["total"]}
    q.source("s", lines, slices=1).key_by("w") \
        .apply(Tally, 5, slices=SLICES, name="tally", output_schemas={"out": TALLY_SCHEMA} if declared else None) \
        .map(twice).sink(name="out")
    if dead_letters:
        q.dead_letters()
    plan, _ = compile_query(q)
    return plan, next(s for s in plan.stages if s.name == "tally")


def tallies_alone_and_grouped(plan, stage, seed: int) -> list[tuple[SliceRuntime, SliceRuntime]]:
    """4 seeded epochs of words and values (dead letters on) through each slice alone and through
    the group: asserts outputs, dead letters, counters and progress vectors equal; returns the
    (alone, grouped) runtimes of each slice for more checks."""
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(30)]
    epochs = [([vocab[i] for i in rng.integers(0, 30, 150)], rng.integers(1, 4, 150).tolist()) for _ in range(4)]
    alone, grouped, oa, og = run_both(plan, stage, epochs, dead=True)
    assert as_rows(og) == as_rows(oa)
    assert sum(len(e) for e in og) > SLICES
    dead_a = [d for rt in alone for d in rt.take_dead_letters()]
    dead_g = [d for rt in grouped for d in rt.take_dead_letters()]
    assert len(dead_a) > SLICES and dead_g == dead_a
    for a, g in zip(alone, grouped):
        assert (a.events_in, a.events_out, a.last_epoch, a.next_seq) == (g.events_in, g.events_out,
                                                                       g.last_epoch, g.next_seq)
        assert a.progress.as_dict() == g.progress.as_dict()
    return list(zip(alone, grouped))


@pytest.mark.parametrize("declared", [False, True])
def test_a_per_event_operators_group_epoch_equals_each_slice_alone_with_the_same_dead_letters(declared):
    """A per-event operator runs as a group (one admission, merge and dict conversion for all
    slices; one output table, chain and numbering too, its schema declared or inferred alike by
    every slice): each
    slice's outputs, chain, numbering, counters, progress vector and dead letters (an event
    raising midway) equal running it alone, epoch after epoch (so its state does too)."""
    plan, stage = tally_plan(dead_letters=True, declared=declared)
    assert runs_grouped(stage)
    for a, g in tallies_alone_and_grouped(plan, stage, seed=8):
        assert g.busy_s > 0


@pytest.mark.parametrize("declared", [False, True])
def test_a_chain_error_of_an_earlier_slice_fails_the_group_before_a_later_slices_event_error(declared):
    """Alone, a slice's chain runs before the next slice's loop: in one epoch, a chain error in a
    lower slice is the error, not an operator error in a higher one; the group raises the same."""
    words = [f"w{i}" for i in range(40)]
    slices = slice_of([pa.array(words)], SLICES)
    low, high = (words[int(np.flatnonzero(slices == s)[0])] for s in (1, 4))
    plan, stage = tally_plan(declared=declared, chain_poison=low)
    inputs, part = routed_inputs([high] * 5 + [low], [1] * 6, 0, stage.inputs[0].stream_id)  # high's 5th: total 5
    alone = [SliceRuntime(plan, stage.stage_id, s) for s in range(SLICES)]
    with pytest.raises(EventError) as alone_error:
        for s in sorted(inputs):
            alone[s].process(0, inputs[s])
    with pytest.raises(EventError) as grouped_error:
        process_parts([SliceRuntime(plan, stage.stage_id, s) for s in range(SLICES)], 0, [part])
    assert f"poison word {low}" in str(alone_error.value) and str(grouped_error.value) == str(alone_error.value)


class BatchTally(cs.Operator):
    """Vectorized ``Tally`` that does not fuse slices: each row gets its key's running total of
    ``v`` (column ``total``). A batch holding a total divisible by ``poison_every`` raises
    before it touches state (the row-wise contract: the runtime retries its rows one by one)."""

    def __init__(self, poison_every: int = 0) -> None:
        self.poison_every = poison_every

    def setup(self) -> None:
        self.totals = self.register_state("totals")

    def consume_batch(self, stream_id: str, batch: pa.Table) -> None:
        running: dict[str, int] = {}
        totals = []
        for w, v in zip(batch["w"].to_pylist(), batch["v"].to_pylist()):
            running[w] = running.get(w, self.totals.get(w, 0)) + v
            totals.append(running[w])
            if self.poison_every and running[w] % self.poison_every == 0:
                raise ValueError(f"total {running[w]} of {w!r}")
        for w, total in running.items():
            self.totals.set(w, total)
        self.produce_batch("out", batch.select(["w", ORDER, SUB]).append_column("total", pa.array(totals, pa.int64())))


def batch_tally_plan(dead_letters: bool = False):
    lines = pa.table({"w": ["a"], "v": pa.array([1], pa.int64())})
    q = cs.Query()
    q.source("s", lines, slices=1).key_by("w").apply(BatchTally, 5, slices=SLICES, name="tally") \
        .map_batches(lambda t: t.append_column("twice", pc.multiply(t["total"], 2))).sink(name="out")
    if dead_letters:
        q.dead_letters()
    plan, _ = compile_query(q)
    return plan, next(s for s in plan.stages if s.name == "tally")


def test_a_vectorized_operators_group_epoch_equals_each_slice_alone_with_the_same_dead_letters():
    """A ``consume_batch`` operator without ``consume_slices`` runs as a group (one admission and
    merge, then each slice's own call on its share): outputs, chain, numbering, counters,
    progress vectors and dead letters (poison rows retried one by one) equal each slice alone."""
    plan, stage = batch_tally_plan(dead_letters=True)
    assert runs_grouped(stage) and not BatchTally.fuses_slices()
    for a, g in tallies_alone_and_grouped(plan, stage, seed=9):
        assert sorted(a.ctx.states["totals"].items()) == sorted(g.ctx.states["totals"].items())


class HalfOrWhole(cs.Operator):
    """Per event, no declared schema: ``v`` halved for words starting with ``h`` (a float), as it
    is for the others (an int): Arrow infers each slice's ``v`` type from its own rows."""

    def consume(self, stream_id: str, event: dict) -> None:
        v = event["v"] / 2 if event["w"].startswith("h") else event["v"]
        self.produce("out", {"w": event["w"], "v": v})


def test_undeclared_outputs_a_group_builds_keep_each_slices_inferred_types(monkeypatch):
    """A slice whose rows all give ints keeps an int64 column, one whose rows give floats a double
    one, as alone: one table for the group would type them alike (then each slice builds its own);
    when every slice infers alike the group builds one."""
    q = cs.Query()
    q.source("s", pa.table({"w": ["a"], "v": pa.array([1], pa.int64())}), slices=1).key_by("w") \
        .apply(HalfOrWhole, slices=SLICES, name="halves").sink(name="out")
    plan, _ = compile_query(q)
    stage = next(st for st in plan.stages if st.name == "halves")
    vocab = [f"h{i}" for i in range(3)] + [f"w{i}" for i in range(37)]
    owner = slice_of([pa.array(vocab)], SLICES)
    floats = {int(o) for w, o in zip(vocab, owner) if w.startswith("h")}
    ints_only = [w for w, o in zip(vocab, owner) if int(o) not in floats]
    assert ints_only, "some slice owns only whole-number words"
    rng = np.random.default_rng(5)
    mixed = [vocab[i] for i in rng.integers(0, 40, 120)]
    alike = [ints_only[i] for i in rng.integers(0, len(ints_only), 60)]
    together = []
    chain_and_number = chronostream.slices.group._chain_and_number
    monkeypatch.setattr(chronostream.slices.group, "_chain_and_number",
                        lambda rts, outs: together.append(len(rts)) or chain_and_number(rts, outs))
    alone, grouped, oa, og = run_both(plan, stage, [(mixed, [3] * 120), (alike, [3] * 60)])
    assert together == [SLICES], "the epoch typed alike, and only it, built one table"
    assert as_rows(og) == as_rows(oa)
    types = lambda outs: {(e, s): str(t.schema.field("v").type)  # noqa: E731
                          for e, per in enumerate(outs) for s, o in per.items() for t in o.values()}
    assert types(og) == types(oa)
    assert set(types(oa).values()) == {"int64", "double"}


class TypeProbe(cs.Operator):
    """Vectorized: each row with the type its batch's ``v`` column has (``v_type``)."""

    def consume_batch(self, stream_id: str, batch: pa.Table) -> None:
        v_type = str(batch.schema.field("v").type)
        self.produce_batch("out", batch.select(["w", ORDER, SUB]).append_column(
            "v_type", pa.array([v_type] * batch.num_rows)))


def sender_part(words: list[str], values: pa.Array, producer: int, first: int) -> tuple[pa.Table, np.ndarray]:
    """One sender's part: producer slice ``producer``'s rows (out_seq from 0), sorted by slice."""
    n = len(words)
    t = pa.table({"w": words, "v": values, ORDER: pa.array(np.arange(first, first + n, dtype=np.int64)),
                  SUB: pa.array(np.zeros(n, np.int64)), SLICE: pa.array(np.full(n, producer, np.int64)),
                  SEQ: pa.array(np.arange(n, dtype=np.int64))})
    dst = slice_of([t.column("w")], SLICES)
    by_slice = np.argsort(dst, kind="stable")
    return t.take(pa.array(by_slice)), dst[by_slice]


def test_senders_parts_of_different_schemas_give_each_slice_the_types_it_gets_alone():
    """One sender's ``v`` is all null (typed null), the other's int64: a slice that gets rows of
    the first sender only sees a null column alone, so in the group too (one table would have
    promoted it to int64)."""
    q = cs.Query()
    q.source("s", pa.table({"w": ["a"], "v": [1]}), slices=2).key_by("w") \
        .apply(TypeProbe, slices=SLICES, name="probe").sink(name="out")
    plan, _ = compile_query(q)
    stage = next(s for s in plan.stages if s.name == "probe")
    words = [f"w{i}" for i in range(40)]
    slices = slice_of([pa.array(words)], SLICES)
    only_nulls = int(slices[0])
    a_words = [w for w, s in zip(words, slices) if s != only_nulls][:10] + [words[0]]
    b_words = [w for w, s in zip(words, slices) if s != only_nulls][10:20]
    part_a = sender_part(a_words, pa.nulls(len(a_words)), 0, 0)
    part_b = sender_part(b_words, pa.array(range(len(b_words)), pa.int64()), 1, 100)
    sid = stage.inputs[0].stream_id
    alone = {}
    for s in range(SLICES):
        rt = SliceRuntime(plan, stage.stage_id, s)
        rows = [t.filter(pa.array(dst == s)) for t, dst in (part_a, part_b) if (dst == s).any()]
        if rows:
            alone[s] = {k: t.to_pylist() for k, t in rt.process(0, {sid: rows}).items()}
    grouped = process_parts([SliceRuntime(plan, stage.stage_id, s) for s in range(SLICES)], 0, [part_a, part_b])
    assert {s: {k: t.to_pylist() for k, t in per.items()} for s, per in grouped.items()} == alone
    assert {r["v_type"] for per in alone[only_nulls].values() for r in per} == {"null"}


def keyed_part(columns: dict, order: np.ndarray, producer: int, first_seq: int) -> tuple[pa.Table, np.ndarray]:
    """One sender's part of a stream keyed by ``w``: lineage ``order``, out_seq from ``first_seq``,
    sorted by slice."""
    n = len(order)
    t = pa.table({**columns, ORDER: pa.array(order.astype(np.int64)), SUB: pa.array(np.zeros(n, np.int64)),
                  SLICE: pa.array(np.full(n, producer, np.int64)),
                  SEQ: pa.array(np.arange(first_seq, first_seq + n, dtype=np.int64))})
    dst = slice_of([t.column("w")], SLICES)
    by_slice = np.argsort(dst, kind="stable")
    return t.take(pa.array(by_slice)), dst[by_slice]


def join_plan():
    q = cs.Query()
    left = q.source("l", pa.table({"w": ["a"], "v": [1]}), slices=1).key_by("w")
    right = q.source("r", pa.table({"w": ["a"], "tier": ["x"]}), slices=1).key_by("w")
    cs.join(left, right, slices=SLICES, name="join").map(lambda r: {**r, "v2": 2 * r["v"]}).sink(name="out")
    plan, _ = compile_query(q)
    stage = next(s for s in plan.stages if s.name == "join")
    return plan, stage, {i.name: i.stream_id for i in stage.inputs}


def test_a_joins_group_epoch_equals_each_slice_alone_row_for_row():
    """A join (a per-event operator with two inputs) runs as a group: one admission per stream,
    one merge of both inputs for every slice (ties in source order broken as alone: by input),
    then each slice's loop. Outputs, counters, progress vectors and state equal each slice alone,
    epoch after epoch."""
    plan, stage, sid = join_plan()
    assert runs_grouped(stage)
    rng = np.random.default_rng(4)
    vocab = [f"w{i}" for i in range(12)]
    alone = [SliceRuntime(plan, stage.stage_id, s) for s in range(SLICES)]
    grouped = [SliceRuntime(plan, stage.stage_id, s) for s in range(SLICES)]
    seen_outputs = 0
    for e in range(4):
        n_l, n_r = 40, 15
        order_l = np.sort(rng.integers(e * 100, e * 100 + 100, n_l))  # equal orders within and across inputs
        order_r = np.sort(rng.integers(e * 100, e * 100 + 100, n_r))
        left = keyed_part({"w": [vocab[i] for i in rng.integers(0, 12, n_l)], "v": rng.integers(0, 9, n_l)},
                          order_l, 0, e * n_l)
        right = keyed_part({"w": [vocab[i] for i in rng.integers(0, 12, n_r)],
                            "tier": [str(x) for x in rng.integers(0, 3, n_r)]}, order_r, 0, e * n_r)
        want = {}
        for s in range(SLICES):
            inputs = {sid[name]: [t.filter(pa.array(dst == s))] for name, (t, dst) in (("left", left), ("right", right))
                      if (dst == s).any()}
            if inputs:
                out = alone[s].process(e, inputs)
                if out:
                    want[s] = {k: t.to_pylist() for k, t in out.items()}
        got = process_inputs(grouped, e, [(sid["left"], left), (sid["right"], right)])
        assert {s: {k: t.to_pylist() for k, t in per.items()} for s, per in got.items()} == want
        seen_outputs += sum(len(rows) for per in want.values() for rows in per.values())
    assert seen_outputs > 50
    for a, g in zip(alone, grouped):
        assert (a.events_in, a.events_out, a.last_epoch, a.next_seq) == (g.events_in, g.events_out,
                                                                       g.last_epoch, g.next_seq)
        assert a.progress.as_dict() == g.progress.as_dict()
        for name in ("left", "right"):
            assert sorted(a.ctx.states[name].items()) == sorted(g.ctx.states[name].items())


# -- a job whose container runs its slices as a group ------------------------------------------


def word_count_job(slices: int) -> cs.Query:
    rng = np.random.default_rng(5)
    words = [f"w{int(i)}" for i in rng.zipf(1.3, 3000) % 500]
    q = cs.Query(epoch_events=257)
    q.source("words", pa.table({"word": words}), slices=2).key_by("word") \
        .count(slices=slices, name="count").sink(name="counts")
    return q


def run_local_job(query: cs.Query, containers: int):
    """``query`` run in process on ``containers`` containers a stage: its plan and cores."""
    plan, sources = compile_query(query)
    placement = initial_placement(plan, containers_per_stage(plan, containers))
    return plan, run_local(plan, placement, sources, seed=2)


def local_counts(query: cs.Query, containers: int):
    plan, cores = run_local_job(query, containers)
    return collect(plan, cores, "counts").to_pylist(), sum(c.grouped_epochs for c in cores.values())


@pytest.mark.parametrize("containers", [1, 3])
def test_a_job_run_as_slice_groups_equals_the_serial_oracle(containers):
    expected = cs.run_serial(word_count_job(16)).results("counts").to_pylist()
    got, grouped = local_counts(word_count_job(16), containers)
    assert grouped > 0
    assert got == expected


def test_a_job_whose_counts_reuse_routings_key_codes_equals_the_serial_oracle(monkeypatch):
    """Epochs of a few thousand repeating words: the router's hash encodes them, the counting
    containers group by those codes (checked: they were read), and the output is the oracle's."""
    rng = np.random.default_rng(9)
    words = [f"w{int(i)}" for i in rng.zipf(1.3, 12000) % 700]
    q = cs.Query(epoch_events=3000)
    q.source("words", pa.table({"word": words}), slices=1).key_by("word") \
        .count(slices=8, name="count").sink(name="counts")
    read = []
    real = operators._routed_key_codes
    monkeypatch.setattr(operators, "_routed_key_codes",
                        lambda b, k: read.append(real(b, k)) or read[-1])
    got, grouped = local_counts(q, 2)
    assert grouped > 0 and sum(r is not None for r in read) >= 8  # 2 containers x 4 epochs
    assert got == cs.run_serial(q).results("counts").to_pylist()


def chained_count_job(slices: int, poison: bool = False) -> cs.Query:
    """The word count with a chain after the count (a filter, a per-event map, a vectorized
    map) feeding a second keyed stage; ``poison``: the per-event map raises on one word."""
    rng = np.random.default_rng(6)
    words = [f"w{int(i)}" for i in rng.zipf(1.3, 3000) % 500]
    q = cs.Query(epoch_events=257)

    def bucket(r: dict) -> dict:
        if poison and r["word"] == "w3":
            raise ValueError(f"poison word {r['word']}")
        return {"word": r["word"], "count": r["count"], "bucket": r["count"] % 4}

    counts = q.source("words", pa.table({"word": words}), slices=2).key_by("word").count(slices=slices, name="count")
    chained = counts.filter_batches(lambda t: pc.not_equal(t["word"], "w1")) \
        .map(bucket, schema=pa.schema([("word", pa.string()), ("count", pa.int64()), ("bucket", pa.int64())])) \
        .map_batches(lambda t: t.append_column("twice", pc.multiply(t["count"], 2)))
    chained.sink(name="counts")
    chained.key_by("bucket").aggregate(count=True, sum="twice", slices=3, name="buckets").sink(name="buckets")
    return q


@pytest.mark.parametrize("containers", [1, 2])
def test_a_job_whose_aggregate_has_a_chained_output_runs_it_grouped_and_equals_the_serial_oracle(containers):
    """The chain runs once over each group's output; its rows feed both a sink and a keyed stage."""
    plan, cores = run_local_job(chained_count_job(16), containers)
    count_stage = next(st.stage_id for st in plan.stages if st.name == "count")
    assert sum(c.grouped_epochs for c in cores.values() if c.stage.stage_id == count_stage) > 0
    serial = cs.run_serial(chained_count_job(16))
    for sink in ("counts", "buckets"):
        got = collect(plan, cores, sink)
        assert got.num_rows > 0 and got.to_pylist() == serial.results(sink).to_pylist()


def test_a_grouped_chain_that_raises_fails_the_job_with_the_serial_runs_error():
    """The same stage, slice, source order and event as the serial executor names."""
    with pytest.raises(EventError) as serial:
        cs.run_serial(chained_count_job(16, poison=True))
    with pytest.raises(EventError) as grouped:
        cs.run(chained_count_job(16, poison=True), executor="local", containers=2)
    assert "poison word w3" in str(serial.value) and str(grouped.value) == str(serial.value)


def test_turning_groups_off_runs_slices_alone_with_the_same_output(monkeypatch):
    on, grouped_on = local_counts(word_count_job(16), 2)
    monkeypatch.setattr(ContainerCore, "GROUP_SLICES", False)
    off, grouped_off = local_counts(word_count_job(16), 2)
    assert (grouped_on > 0, grouped_off) == (True, 0)
    assert on == off


def test_a_slice_that_left_a_group_settling_its_keys_leaves_the_group_serving_the_others():
    """Two threads' slices after a scale-up: the group covers the slices one thread kept while a
    slice of the other thread settles its own keys (hand_back): the kept slices' lookups through
    the group and the settled slice's own lookups both still give the first-seen numbering."""
    a, b = KeyIndex(), KeyIndex()
    group = KeyIndexGroup([a, b])
    first = pa.array(["a0", "b0", "a1", "b1"])
    assert group.slots(np.array([0, 1, 0, 1]), [first], hash_columns([first])).tolist() == [0, 0, 1, 1]
    assert KeyIndexGroup.covering([a]) is group
    assert b.slots([pa.array(["b1", "b2", "b0"])]).tolist() == [1, 2, 0]  # b settles alone
    more = pa.array(["a2", "a0"])
    assert group.slots(group.positions([a])[[0, 0]], [more], hash_columns([more])).tolist() == [2, 0]
    assert a.slots([pa.array(["a1", "a2", "a3"])]).tolist() == [1, 2, 3]


def tally_job(slices: int, poison_every: int = 0, declared: bool = False, chain_poison: str | None = None) -> cs.Query:
    """Words tallied per event into sink ``counts``; ``chain_poison``: a map after the tally
    raises on that word."""
    rng = np.random.default_rng(7)
    words = [f"w{int(i)}" for i in rng.zipf(1.3, 3000) % 400]
    q = cs.Query(epoch_events=257)

    def check(r: dict) -> dict:
        if r["w"] == chain_poison:
            raise ValueError(f"poison word {r['w']}")
        return r
    q.source("words", pa.table({"w": words, "v": pa.array(rng.integers(1, 5, 3000), pa.int64())}), slices=2) \
        .key_by("w").apply(Tally, poison_every, slices=slices, name="tally",
                           output_schemas={"out": TALLY_SCHEMA} if declared else None) \
        .map(check).sink(name="counts")
    return q


@pytest.mark.parametrize("containers,declared", [(1, False), (2, False), (2, True)])
def test_a_job_with_a_per_event_operator_runs_it_grouped_and_equals_the_serial_oracle(containers, declared):
    plan, cores = run_local_job(tally_job(16, declared=declared), containers)
    stage = plan.stage("tally").stage_id
    assert sum(c.grouped_epochs for c in cores.values() if c.stage.stage_id == stage) > 0
    got = collect(plan, cores, "counts")
    serial = cs.run_serial(tally_job(16, declared=declared)).results("counts")
    assert got.num_rows > 3000 and got.to_pylist() == serial.to_pylist()


@pytest.mark.parametrize("declared", [False, True])
def test_a_grouped_per_event_operator_that_raises_fails_the_job_with_the_serial_runs_error(declared):
    """The same stage, slice, source order and event as the serial executor names."""
    with pytest.raises(EventError) as serial:
        cs.run_serial(tally_job(16, poison_every=97, declared=declared))
    with pytest.raises(EventError) as grouped:
        cs.run(tally_job(16, poison_every=97, declared=declared), executor="local", containers=2)
    assert "total 97" in str(serial.value) and str(grouped.value) == str(serial.value)


def test_outputs_taken_together_equal_each_contexts_own_and_undeclared_ones_join_only_when_typed_alike():
    def filled(slice_id: int, values: list) -> OperatorContext:
        ctx = OperatorContext("st", slice_id, ["out"])
        for j, v in enumerate(values):
            ctx.begin_event(10 * slice_id + j, 0)
            ctx.produce("out", {"v": v})
            ctx.produce("out", {"v": v})  # a fan-out: sub-orders extended
        return ctx
    schema = pa.schema([("v", pa.float64())])
    # Undeclared, an int slice and a float slice would be typed alike together: refused, nothing taken.
    ctxs = [filled(0, [1, 2]), filled(1, [0.5])]
    assert OperatorContext.take_outputs_together(ctxs, {"out": None}) is None
    assert [c.take_outputs({"out": None})["out"] for c in ctxs] == \
        [c.take_outputs({"out": None})["out"] for c in [filled(0, [1, 2]), filled(1, [0.5])]]
    alone = [c.take_outputs({"out": schema}).get("out") for c in [filled(0, [1, 2]), filled(1, []), filled(2, [0.5])]]
    together = OperatorContext.take_outputs_together([filled(0, [1, 2]), filled(1, []), filled(2, [0.5])],
                                                     {"out": schema})
    table, bounds = together["out"]
    assert bounds.tolist() == [0, 4, 4, 6]
    assert alone[1] is None and table.to_pylist() == alone[0].to_pylist() + alone[2].to_pylist()
    # Undeclared and inferred alike (ints in both slices): each context's own table, joined.
    alone = [c.take_outputs({"out": None})["out"] for c in [filled(0, [1, 2]), filled(2, [7])]]
    together = OperatorContext.take_outputs_together([filled(0, [1, 2]), filled(1, []), filled(2, [7])],
                                                     {"out": None})
    table, bounds = together["out"]
    assert bounds.tolist() == [0, 4, 4, 6] and table.schema == alone[0].schema
    assert table.to_pylist() == alone[0].to_pylist() + alone[1].to_pylist()


def test_outputs_refused_together_for_their_types_are_built_once(monkeypatch):
    """An int slice and a float slice: each table is built once, and each slice's emit takes it
    as built (the rows of the slice alone, with its own types)."""
    import chronostream.slices.operators as operators
    built = []
    real = operators._events_table
    monkeypatch.setattr(operators, "_events_table", lambda *a: built.append(1) or real(*a))
    ctxs = [OperatorContext("st", s, ["out"]) for s in range(2)]
    for ctx, v in zip(ctxs, [1, 0.5]):
        ctx.begin_event(ctx.slice_id, 0)
        ctx.produce("out", {"v": v})
    assert OperatorContext.take_outputs_together(ctxs, {"out": None}) is None
    types = [c.take_outputs({"out": None})["out"].schema.field("v").type for c in ctxs]
    assert types == [pa.int64(), pa.float64()] and len(built) == 2


def batch_tally_job(slices: int, poison_every: int = 0) -> cs.Query:
    rng = np.random.default_rng(7)
    words = [f"w{int(i)}" for i in rng.zipf(1.3, 3000) % 400]
    q = cs.Query(epoch_events=257)
    q.source("words", pa.table({"w": words, "v": pa.array(rng.integers(1, 5, 3000), pa.int64())}), slices=2) \
        .key_by("w").apply(BatchTally, poison_every, slices=slices, name="tally").sink(name="counts")
    return q


#: Jobs whose stage runs grouped (a user's vectorized operator, the join): (query, stage, sink).
NEWLY_GROUPED = {"vectorized": (lambda: batch_tally_job(16), "tally", "counts"),
                 "join": (lambda: keyed_join(8), "join", "joined")}


@pytest.mark.parametrize("containers", [1, 2])
@pytest.mark.parametrize("job", sorted(NEWLY_GROUPED))
def test_a_job_with_a_vectorized_operator_or_a_join_runs_it_grouped_and_equals_the_serial_oracle(job, containers):
    query, stage_name, sink = NEWLY_GROUPED[job]
    plan, cores = run_local_job(query(), containers)
    stage = plan.stage(stage_name).stage_id
    assert sum(c.grouped_epochs for c in cores.values() if c.stage.stage_id == stage) > 0
    got = collect(plan, cores, sink)
    serial = cs.run_serial(query()).results(sink)
    assert got.num_rows > 100 and got.to_pylist() == serial.to_pylist()


def test_a_grouped_vectorized_operator_that_raises_fails_the_job_with_the_serial_runs_error():
    """The same stage, slice, source order and event as the serial executor names."""
    with pytest.raises(EventError) as serial:
        cs.run_serial(batch_tally_job(16, poison_every=97))
    with pytest.raises(EventError) as grouped:
        cs.run(batch_tally_job(16, poison_every=97), executor="local", containers=2)
    assert "total 97" in str(serial.value) and str(grouped.value) == str(serial.value)



def many_key_epochs(n_epochs: int, seed: int, keys: int = 5000, rows: int = 400) -> list[list[dict]]:
    """Epochs of rows over many keys (new ones keep coming), int and float values."""
    rng = np.random.default_rng(seed)
    return [[{"k": f"k{int(k)}", "i": int(i), "f": float(f)}
             for k, i, f in zip(rng.integers(0, keys, rows), rng.integers(-1000, 1000, rows), rng.normal(size=rows))]
            for _ in range(n_epochs)]


def feed_alone(ops: list[KeyedAggregate], batch: pa.Table, bounds: np.ndarray) -> None:
    for i, op in enumerate(ops):
        if bounds[i + 1] > bounds[i]:
            op.consume_batch("in", batch.slice(int(bounds[i]), int(bounds[i + 1] - bounds[i])))
            op._ctx.take_outputs({})


def snapshots(ops: list[KeyedAggregate], delta: bool) -> list:
    return [op.checkpoint_state(delta=delta)["__op__aggregate"] for op in ops]


def test_a_groups_slot_arena_rebuilt_as_keys_come_keeps_every_value_and_delta():
    """A group keeps its slices' arrays back to back in one slot arena (one gather and one
    scatter per array for all of them); as thousands of new keys outgrow it, it is rebuilt.
    Every delta checkpoint (the slots changed since the last one) and the final full state of
    each slice equal the same slice's alone."""
    grouped, alone = make_ops(4), make_ops(4)
    arenas = set()
    for e, (_rows, batch, bounds) in enumerate(hashed_epochs(many_key_epochs(10, seed=1), 4)):
        KeyedAggregate.consume_slices(grouped, "in", batch, bounds)
        feed_alone(alone, batch, bounds)
        arenas.add(id(grouped[0]._arena[0]))
        if e % 3 == 2:
            assert snapshots(grouped, delta=True) == snapshots(alone, delta=True)
    assert len(arenas) > 1, "the keys outgrew the first arena"
    assert all(op.arrays["count"].base is grouped[0]._arena[0].arrays["count"] for op in grouped)
    assert snapshots(grouped, delta=False) == snapshots(alone, delta=False)


def test_a_slice_grown_alone_between_group_batches_leaves_the_arena_and_loses_nothing():
    """A slice that consumes on its own between group batches (its arrays replaced as its keys
    grow) is no longer the arena's view: the group builds a new arena from its arrays."""
    grouped, alone = make_ops(3), make_ops(3)
    epochs = list(hashed_epochs(many_key_epochs(4, seed=2), 3))
    for _rows, batch, bounds in epochs[:2]:
        KeyedAggregate.consume_slices(grouped, "in", batch, bounds)
        feed_alone(alone, batch, bounds)
    first = grouped[0]._arena[0]
    solo = pa.Table.from_pylist([{"k": f"solo{j}", "i": j, "f": 0.5} for j in range(3000)],
                                schema=pa.schema([("k", pa.string()), ("i", pa.int64()), ("f", pa.float64())]))
    solo = solo.append_column(ORDER, pa.array(np.arange(10**6, 10**6 + 3000))).append_column(
        SUB, pa.array(np.zeros(3000, np.int64)))
    for ops in (grouped, alone):
        ops[1].consume_batch("in", solo)
        ops[1]._ctx.take_outputs({})
    assert grouped[1].arrays["count"].base is not first.arrays["count"], "grown: its own arrays"
    for _rows, batch, bounds in epochs[2:]:
        KeyedAggregate.consume_slices(grouped, "in", batch, bounds)
        feed_alone(alone, batch, bounds)
    assert grouped[0]._arena[0] is not first
    assert snapshots(grouped, delta=False) == snapshots(alone, delta=False)


def test_a_group_whose_state_exceeds_the_arena_bound_updates_each_slice_on_its_own(monkeypatch):
    from chronostream.slices import slot_arrays

    monkeypatch.setattr(operators, "ARENA_MAX_BYTES", 1000)
    grouped, alone = make_ops(3), make_ops(3)
    for _rows, batch, bounds in hashed_epochs(many_key_epochs(3, seed=4), 3):
        KeyedAggregate.consume_slices(grouped, "in", batch, bounds)
        feed_alone(alone, batch, bounds)
    assert grouped[0]._arena is None and grouped[0]._arena_refused == grouped, "not tried again each batch"
    assert all(op.arrays["count"].base is None for op in grouped)
    assert slot_arrays.ARENA_MAX_BYTES > 1000
    assert snapshots(grouped, delta=False) == snapshots(alone, delta=False)


def test_a_slice_that_made_an_array_alone_is_not_written_through_the_arenas_stale_view():
    """A slice without rows in the group's batches has none of the arrays; consuming alone, it
    makes them (a new ``arrays`` dict, its dirty mask and length unchanged). The group's next
    batch must see that it no longer holds the dict the arena gave it."""
    grouped, alone = make_ops(2), make_ops(2)
    rows = [{"k": f"a{j}", "i": j, "f": 0.25 * j} for j in range(20)]
    only_first, _ = epoch_batch(rows, np.zeros(20, np.int64), 0)
    for ops in (grouped, alone):
        if ops is grouped:
            KeyedAggregate.consume_slices(ops, "in", only_first, np.array([0, 20, 20]))
        else:
            feed_alone(ops, only_first, np.array([0, 20, 20]))
    assert grouped[1].arrays == {}
    own, _ = epoch_batch([{"k": "b0", "i": 5, "f": 1.5}], np.zeros(1, np.int64), 100)
    for ops in (grouped, alone):
        ops[1].consume_batch("in", own)
        ops[1]._ctx.take_outputs({})
    both, _ = epoch_batch([{"k": "a1", "i": 7, "f": 2.0}, {"k": "b0", "i": 9, "f": 3.0}], np.array([0, 1]), 200)
    KeyedAggregate.consume_slices(grouped, "in", both, np.array([0, 1, 2]))
    feed_alone(alone, both, np.array([0, 1, 2]))
    assert snapshots(grouped, delta=False) == snapshots(alone, delta=False)
