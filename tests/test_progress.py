"""Specification of slices.progress.ProgressVector: per-channel dedup by highest consumed out_seq.

A channel is (stream id, producer slice). Producers number their rows densely
from 0; the runtime may deliver any channel's rows again (replay, dual mode,
re-delivered messages), in batches that mix producer slices, each producer's
rows in increasing out_seq. The vector must admit every (producer, out_seq)
exactly once, and only ever grow.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from chronostream.slices.progress import ProgressVector


def batch(rows: list[tuple[int, int]]) -> pa.Table:
    """A table of (producer slice, out_seq) rows plus a payload naming each row."""
    return pa.table({
        "_slice": pa.array([p for p, _ in rows], pa.int64()),
        "_seq": pa.array([s for _, s in rows], pa.int64()),
        "payload": pa.array([f"{p}:{s}" for p, s in rows]),
    })


def ids(table: pa.Table) -> list[tuple[int, int]]:
    return list(zip(table.column("_slice").to_pylist(), table.column("_seq").to_pylist()))


@st.composite
def deliveries(draw, producers=4, max_batches=12):
    """Batches of overlapping per-producer seq ranges, each range starting at or below frontier + 1.

    Producer ranges inside one batch are interleaved in an arbitrary way that
    keeps each producer's rows in increasing out_seq.
    """
    frontier = {p: -1 for p in range(producers)}
    out = []
    for _ in range(draw(st.integers(1, max_batches))):
        ranges = {}
        for p in draw(st.sets(st.integers(0, producers - 1), max_size=producers)):
            start = draw(st.integers(0, frontier[p] + 1))
            length = draw(st.integers(0, 6))
            ranges[p] = list(range(start, start + length))
            if length:
                frontier[p] = max(frontier[p], start + length - 1)
        # Interleave: draw which producer's next row comes next.
        rows = []
        queues = {p: list(r) for p, r in ranges.items() if r}
        while queues:
            p = draw(st.sampled_from(sorted(queues)))
            rows.append((p, queues[p].pop(0)))
            if not queues[p]:
                del queues[p]
        out.append(rows)
    return out


@settings(max_examples=60, deadline=None)
@given(deliveries(), st.integers(0, 5))
def test_any_replay_pattern_admits_each_producer_seq_exactly_once(batches, stream_id):
    """Whatever the overlaps and duplicates, every (producer, out_seq) delivered is admitted once."""
    pv = ProgressVector()
    admitted: list[tuple[int, int]] = []
    for rows in batches:
        admitted.extend(ids(pv.admit(stream_id, batch(rows))))
    delivered = {r for rows in batches for r in rows}
    assert sorted(admitted) == sorted(delivered)
    assert len(admitted) == len(set(admitted))


@settings(max_examples=60, deadline=None)
@given(deliveries())
def test_admit_keeps_exactly_the_rows_above_the_vector_in_their_order(batches):
    """admit() returns the rows with out_seq above the channel's value before the batch, order kept."""
    pv = ProgressVector()
    for rows in batches:
        before = {p: pv.get((3, p)) for p, _ in rows}
        kept = pv.admit(3, batch(rows))
        expected = [(p, s) for p, s in rows if s > before[p]]
        assert ids(kept) == expected
        assert kept.column("payload").to_pylist() == [f"{p}:{s}" for p, s in expected]


@settings(max_examples=60, deadline=None)
@given(deliveries())
def test_vector_only_grows_and_ends_at_the_highest_seq_delivered(batches):
    """Every channel's value never decreases, and ends at the max out_seq delivered on it."""
    pv = ProgressVector()
    prev = {p: -1 for p in range(4)}
    for rows in batches:
        pv.admit(0, batch(rows))
        now = {p: pv.get((0, p)) for p in range(4)}
        assert all(now[p] >= prev[p] for p in range(4))
        prev = now
    for p in range(4):
        seqs = [s for rows in batches for q, s in rows if q == p]
        assert pv.get((0, p)) == (max(seqs) if seqs else -1)


def test_get_of_unknown_channel_is_minus_one():
    """An unknown stream, or a producer slice beyond those seen, reads -1."""
    pv = ProgressVector()
    assert pv.get((0, 0)) == -1
    pv.admit(1, batch([(2, 0)]))
    assert pv.get((1, 2)) == 0
    assert pv.get((1, 0)) == -1
    assert pv.get((1, 99)) == -1
    assert pv.get((2, 2)) == -1


def test_streams_are_independent_channels():
    """Consuming (stream 1, slice 0) does not mark anything consumed on stream 2."""
    pv = ProgressVector()
    assert pv.admit(1, batch([(0, 0), (0, 1)])).num_rows == 2
    assert pv.admit(2, batch([(0, 0), (0, 1)])).num_rows == 2
    assert pv.admit(1, batch([(0, 1), (0, 2)])).num_rows == 1


def test_rows_at_or_below_the_vector_are_dropped_even_if_never_seen():
    """Dedup is by high-water mark: after seq 5, an unseen seq 3 counts as consumed (dropped)."""
    pv = ProgressVector()
    assert ids(pv.admit(0, batch([(0, 5)]))) == [(0, 5)]
    assert pv.admit(0, batch([(0, 3), (0, 5)])).num_rows == 0
    assert ids(pv.admit(0, batch([(0, 3), (0, 6)]))) == [(0, 6)]


def test_admitting_an_empty_table_changes_nothing():
    """An empty batch is returned as is and leaves the vector untouched."""
    pv = ProgressVector()
    empty = batch([])
    assert pv.admit(0, empty).num_rows == 0
    assert pv.consumed == {}
    assert pv.get((0, 0)) == -1


def test_fully_new_batch_is_returned_whole():
    """A batch entirely above the vector is admitted unchanged (same rows, same columns)."""
    pv = ProgressVector()
    t = batch([(1, 0), (0, 0), (1, 1)])
    assert pv.admit(0, t).equals(t)


def test_copy_is_independent_of_the_original():
    """Advancing a copy does not advance the original, and vice versa."""
    pv = ProgressVector()
    pv.admit(0, batch([(0, 0)]))
    cp = pv.copy()
    cp.admit(0, batch([(0, 1)]))
    pv.admit(0, batch([(1, 4)]))
    assert (pv.get((0, 0)), cp.get((0, 0))) == (0, 1)
    assert (pv.get((0, 1)), cp.get((0, 1))) == (4, -1)


def test_constructor_copies_the_given_arrays():
    """A vector built from arrays does not alias them (a checkpoint header stays frozen)."""
    arr = np.array([3, -1], dtype=np.int64)
    pv = ProgressVector({7: arr})
    pv.admit(7, batch([(0, 4)]))
    assert arr.tolist() == [3, -1]
    assert pv.get((7, 0)) == 4


def test_as_dict_lists_only_consumed_channels():
    """as_dict() names "stream:slice" -> out_seq for channels with something consumed."""
    pv = ProgressVector()
    pv.admit(2, batch([(0, 0), (3, 0), (3, 1)]))
    pv.admit(1, batch([(1, 7)]))
    assert pv.as_dict() == {"1:1": 7, "2:0": 0, "2:3": 1}
