"""Specification of containers.routing: splitting a produced stream by destination container.

``route`` must partition the rows exactly (nothing lost, nothing doubled),
send each row to the container that owns its consumer slice (the stable hash
of its key, or of ``_order`` when unkeyed), sort each part by consumer slice
and, inside a consumer slice, keep the producer order (slice, out_seq) of a
table in source order, or put the rows of one that is not (a producer's many
slices' outputs) in (``_order``, ``_sub``) order, the merge order the
consumer needs.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chronostream.slices.hashing import slice_of
from chronostream.containers.routing import OutputRoute, consumer_slices, place_slices_evenly, route, rows_of_slice


@st.composite
def produced_streams(draw):
    """A produced table (rows in producer order: _slice, then _seq) and an output route. Its
    source orders ascend (a source's or one producer slice's output) or do not (several
    producer slices' outputs, one slice after another); orders and sub-orders repeat."""
    n = draw(st.integers(0, 60))
    producers = draw(st.integers(1, 3))
    words = draw(st.lists(st.sampled_from(["a", "b", "c", "dd", "", "éé", "w42"]), min_size=n, max_size=n))
    nums = draw(st.lists(st.integers(-5, 5), min_size=n, max_size=n))
    prod = sorted(draw(st.lists(st.integers(0, producers - 1), min_size=n, max_size=n)))
    seq = [sum(1 for q in prod[:i] if q == p) for i, p in enumerate(prod)]
    orders = draw(st.lists(st.integers(0, n), min_size=n, max_size=n))
    table = pa.table({
        "word": pa.array(words, pa.string()), "num": pa.array(nums, pa.int64()),
        "_order": pa.array(sorted(orders) if draw(st.booleans()) else orders, pa.int64()),
        "_sub": pa.array(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), pa.int64()),
        "_slice": pa.array(prod, pa.int64()), "_seq": pa.array(seq, pa.int64()),
        "rid": pa.array(range(n), pa.int64()),  # row identity, for the checks
    })
    num_slices = draw(st.integers(1, 9))
    n_containers = draw(st.integers(1, 4))
    ids = draw(st.lists(st.integers(0, 50), min_size=n_containers, max_size=n_containers, unique=True))
    # Any slice -> container map, not only the even one (migration makes it arbitrary).
    s2c = np.array(draw(st.lists(st.sampled_from(ids), min_size=num_slices, max_size=num_slices)), dtype=np.int64)
    key = draw(st.sampled_from([("word",), ("num",), ("word", "num"), None]))
    return table, key, OutputRoute(stage_id=1, slice_to_container=s2c)


def expected_slices(table: pa.Table, key, num_slices: int) -> np.ndarray:
    if num_slices == 1:
        return np.zeros(table.num_rows, dtype=np.int64)
    cols = [table.column("_order")] if key is None else [table.column(k) for k in key]
    return slice_of(cols, num_slices)


@settings(max_examples=50, deadline=None)
@given(produced_streams())
def test_route_partitions_rows_exactly(case):
    """The parts together hold every input row exactly once (same values)."""
    table, key, out = case
    parts = route(table, key, out)
    rids = [r for t, _ in parts.values() for r in t.column("rid").to_pylist()]
    assert sorted(rids) == list(range(table.num_rows))
    if parts:
        merged = pa.concat_tables([t for t, _ in parts.values()]).sort_by("rid")
        assert merged.equals(table)


@settings(max_examples=50, deadline=None)
@given(produced_streams())
def test_every_row_goes_to_the_container_owning_its_consumer_slice(case):
    """Row r lands in the part of container slice_to_container[slice_of(key(r))], tagged with that slice."""
    table, key, out = case
    want = expected_slices(table, key, out.num_slices)
    for c, (t, dst) in route(table, key, out).items():
        rid = np.asarray(t.column("rid"), dtype=np.int64)
        assert dst.tolist() == want[rid].tolist()
        assert (out.slice_to_container[dst] == c).all()
        assert len(dst) == t.num_rows > 0


@settings(max_examples=50, deadline=None)
@given(produced_streams())
def test_parts_are_sorted_by_consumer_slice_and_each_slices_rows_in_input_or_merge_order(case):
    """Inside a part, consumer slices ascend. A slice's rows keep their input order when the
    table is in source order; else they are in (_order, _sub) order, unless two rows of a slice
    are equal in both (then every slice's rows keep their input order: the merge sorts those)."""
    table, key, out = case
    order, sub = np.asarray(table.column("_order")), np.asarray(table.column("_sub"))
    want = expected_slices(table, key, out.num_slices)
    in_source_order = bool((np.diff(order) >= 0).all())
    ties = len({(int(w), int(o), int(u)) for w, o, u in zip(want, order, sub)}) < table.num_rows
    for t, dst in route(table, key, out).values():
        assert (np.diff(dst) >= 0).all()
        rid = np.asarray(t.column("rid"))
        for s in np.unique(dst):
            got = rid[dst == s].tolist()
            if in_source_order or ties:
                assert got == sorted(got)
            else:
                assert got == sorted(got, key=lambda r: (order[r], sub[r]))


@settings(max_examples=50, deadline=None)
@given(produced_streams())
def test_rows_of_slice_returns_exactly_that_slices_rows(case):
    """rows_of_slice(part, s) is the input's rows for slice s (in the part's order), or None when none."""
    table, key, out = case
    want = expected_slices(table, key, out.num_slices)
    parts = route(table, key, out)
    for s in range(out.num_slices + 1):
        c = int(out.slice_to_container[s]) if s < out.num_slices else None
        expected = np.flatnonzero(want == s).tolist()
        for cid, part in parts.items():
            got = rows_of_slice(part, s)
            if cid == c and expected:
                assert got is not None
                assert sorted(got.column("rid").to_pylist()) == expected
                assert got.equals(part[0].filter(pa.array(part[1] == s)))
            else:
                assert got is None


def test_route_of_an_empty_table_has_no_parts():
    """No rows, no messages."""
    table = pa.table({"word": pa.array([], pa.string()), "_order": pa.array([], pa.int64())})
    assert route(table, ("word",), OutputRoute(0, np.array([0, 1]))) == {}


def test_single_slice_consumer_gets_everything_on_slice_zero():
    """With one consumer slice all rows go to its container, in input order, without hashing."""
    table = pa.table({"k": ["x", "y", "z"], "_order": [2, 0, 1]})
    parts = route(table, ("k",), OutputRoute(0, np.array([5])))
    assert list(parts) == [5]
    t, dst = parts[5]
    assert t.equals(table) and dst.tolist() == [0, 0, 0]


def test_unkeyed_stream_is_spread_by_source_order():
    """Without a key the consumer slice is the stable hash of _order."""
    table = pa.table({"x": list(range(20)), "_order": list(range(100, 120))})
    got = consumer_slices(table, None, 4)
    assert got.tolist() == slice_of([table.column("_order")], 4).tolist()
    assert len(set(got.tolist())) > 1


def test_missing_key_column_raises_key_error_naming_it():
    """Routing by a column the stream lacks is an error naming the column and the stream's columns."""
    table = pa.table({"x": [1], "_order": [0]})
    with pytest.raises(KeyError, match="nope"):
        consumer_slices(table, ("nope",), 3)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 200), st.lists(st.integers(0, 1000), min_size=1, max_size=12, unique=True))
def test_place_slices_evenly_balances_within_one(num_slices, containers):
    """Slice counts per container differ by at most one, and only the given containers are used."""
    placed = place_slices_evenly(num_slices, containers)
    assert len(placed) == num_slices
    assert set(placed.tolist()) <= set(containers)
    counts = [int((placed == c).sum()) for c in containers]
    assert max(counts) - min(counts) <= 1
    assert sum(counts) == num_slices


def test_place_slices_evenly_needs_a_container():
    """An empty container list is refused."""
    with pytest.raises(ValueError, match="at least one container"):
        place_slices_evenly(4, [])


def test_output_route_lists_its_distinct_containers_sorted():
    """containers() is the sorted set of containers in the slice map; num_slices its length."""
    r = OutputRoute(3, np.array([7, 2, 7, 2, 9]))
    assert r.containers() == [2, 7, 9]
    assert r.num_slices == 5


@settings(max_examples=60, deadline=None)
@given(produced_streams(), st.data())
def test_a_slice_in_dual_mode_reaches_its_owner_and_its_dual_container_in_the_same_order(case, data):
    """Migration phase 2: rows of a dual slice go to the owner (as before) and, as an exact
    copy in the owner's order, to the dual container; every other row is routed as without
    dual mode."""
    table, key, out = case
    n = out.num_slices
    dual_slices = data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    dual = {s: 1000 + s % 2 for s in dual_slices}
    want = expected_slices(table, key, n)
    plain = route(table, key, out)
    parts = route(table, key, OutputRoute(out.stage_id, out.slice_to_container, dual))
    for c, (t, dst) in parts.items():
        if c < 1000:  # an owner: exactly what it got without dual mode
            assert t.equals(plain[c][0]) and dst.tolist() == plain[c][1].tolist()
            continue
        rid = np.asarray(t.column("rid"), dtype=np.int64)
        mine = [s for s in sorted(dual) if dual[s] == c and (want == s).any()]
        owners = [plain[int(out.slice_to_container[s])] for s in mine]
        expect = [r for s, (pt, pd) in zip(mine, owners) for r in np.asarray(pt.column("rid"))[pd == s].tolist()]
        assert rid.tolist() == expect, "the dual container gets its slices' rows, by slice, in the owner's order"
        assert dst.tolist() == want[rid].tolist()
    assert set(parts) - set(plain) <= {dual[s] for s in set(want.tolist()) & set(dual)}
    assert OutputRoute(1, out.slice_to_container, dual).containers() == sorted(
        set(out.slice_to_container.tolist()) | set(dual.values()))


def test_key_codes_ride_with_a_repeating_string_key_and_decode_to_it_row_for_row():
    """With ``key_codes``, every part of a repeating string key carries the key dictionary-encoded
    (routing's hash computed it) beside the plain key, aligned row for row."""
    words = [f"w{i % 37}" for i in range(1000)]
    table = pa.table({"word": words, "_order": list(range(1000))})
    parts = route(table, ("word",), OutputRoute(0, np.array([3, 4, 3, 4, 4])), key_codes=True)
    assert sorted(parts) == [3, 4]
    for t, _dst in parts.values():
        codes = t.column("_codes.word")
        assert pa.types.is_dictionary(codes.type)
        assert codes.cast(pa.string()).to_pylist() == t.column("word").to_pylist()


def test_no_key_codes_unless_asked_or_when_the_key_is_not_one_repeating_string():
    """Codes only for a consumer that reads them, and only where hashing encoded the key anyway."""
    words = [f"w{i % 37}" for i in range(1000)]
    table = pa.table({"word": words, "num": list(range(1000)), "_order": list(range(1000))})
    s2c = OutputRoute(0, np.array([3, 4]))
    cases = [(("word",), False), (("num",), True), (("word", "num"), True),
             (("word",), True)]  # last: a 1-slice consumer is not hashed at all
    for (key, ask), out in zip(cases, [s2c, s2c, s2c, OutputRoute(0, np.array([3]))]):
        for t, _dst in route(table, key, out, key_codes=ask).values():
            assert not [c for c in t.column_names if c.startswith("_codes.")], (key, ask)
    distinct = pa.table({"word": [f"u{i}" for i in range(1000)], "_order": list(range(1000))})
    for t, _dst in route(distinct, ("word",), s2c, key_codes=True).values():
        assert "_codes.word" not in t.column_names  # mostly distinct: hashed row by row, no encoding


def test_rows_of_many_producer_slices_reach_each_consumer_slice_in_merge_order():
    """Two producer slices' outputs, one after the other (a keyed stage after a stage of many
    slices): each consumer slice gets its rows in (_order, _sub) order, so the consumer's merge
    need not sort them again; a table in source order keeps its input order, even where a
    sub-order goes back (equal orders from one producer: its out_seq order is the merge order)."""
    rows = {"k": [1, 1, 1, 1, 1, 1], "_order": [3, 5, 9, 4, 5, 8], "_sub": [0, 2, 0, 0, 1, 0],
            "_slice": [0, 0, 0, 1, 1, 1], "_seq": [0, 1, 2, 0, 1, 2], "rid": [0, 1, 2, 3, 4, 5]}
    one_container = OutputRoute(1, np.array([7, 7]))
    ((t, dst),) = route(pa.table(rows), ("k",), one_container).values()
    assert t.column("rid").to_pylist() == [0, 3, 4, 1, 5, 2]
    two_containers = OutputRoute(1, np.array([7, 8]))
    ((t, dst),) = route(pa.table(rows), ("k",), two_containers).values()
    assert t.column("rid").to_pylist() == [0, 3, 4, 1, 5, 2]
    in_source_order = dict(rows, _order=[3, 4, 4, 5, 5, 8], _sub=[0, 2, 1, 0, 0, 0], _slice=[0] * 6)
    ((t, dst),) = route(pa.table(in_source_order), ("k",), one_container).values()
    assert t.column("rid").to_pylist() == [0, 1, 2, 3, 4, 5]
