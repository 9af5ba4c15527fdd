"""A memory sink's writer: parts by (slice, epoch), handed to the master once each at checkpoints."""

from __future__ import annotations

import pyarrow as pa

from chronostream.slices.sinks import MemorySink


def rows(*xs: int) -> pa.Table:
    return pa.table({"x": pa.array(xs, pa.int64())})


def test_a_checkpoint_takes_the_parts_up_to_its_epoch_once():
    w = MemorySink("s").writer("c0")
    w.write(1, 0, rows(1))
    w.write(2, 0, rows(2))
    w.write(3, 1, rows(3))
    assert sorted(w.take_parts(2)) == [(0, 1), (0, 2)]
    assert w.take_parts(2) == {}
    assert list(w.take_parts(9)) == [(1, 3)]


def test_a_part_rewritten_after_it_was_taken_is_not_handed_over_again():
    """A replay re-produces an epoch the master already holds: the sink stays idempotent."""
    w = MemorySink("s").writer("c0")
    w.write(1, 0, rows(1))
    w.take_parts(1)
    w.write(1, 0, rows(1))
    w.write(2, 0, rows(2))
    assert list(w.take_parts(5)) == [(0, 2)]
    assert w.collect()["x"].to_pylist() == [1, 2]


def test_a_part_rewritten_before_it_was_taken_is_handed_over_once_with_its_last_rows():
    w = MemorySink("s").writer("c0")
    w.write(1, 0, rows(1))
    w.write(1, 0, rows(7))
    assert {k: t["x"].to_pylist() for k, t in w.take_parts(1).items()} == {(0, 1): [7]}


def test_parts_handed_to_another_writer_keep_whether_a_checkpoint_took_them():
    """Compaction moves slices to another container in the process: their parts go with them,
    those not yet handed to the master still due at the next checkpoint, the others not again."""
    a, b = MemorySink("s").writer("c0"), MemorySink("s").writer("c1")
    a.write(1, 0, rows(1))
    a.take_parts(1)
    a.write(2, 0, rows(2))
    a.write(2, 5, rows(5))
    b.write(2, 3, rows(3))
    b.take_in(a.give_parts({0}))
    assert sorted(a.parts) == [(5, 2)] and sorted(b.parts) == [(0, 1), (0, 2), (3, 2)]
    assert sorted(b.written_at) == [(0, 1), (0, 2), (3, 2)]
    assert sorted(b.take_parts(9)) == [(0, 2), (3, 2)]
    assert sorted(a.take_parts(9)) == [(5, 2)]


def test_parts_the_master_confirmed_holding_are_let_go_and_the_rest_kept():
    """Once the master stored a checkpoint's parts, a host need not hold their rows too; parts
    not taken yet, and keys it never held, are left alone."""
    w = MemorySink("s").writer("c0")
    w.write(1, 0, rows(1))
    w.write(2, 0, rows(2))
    w.take_parts(1)
    assert w.drop_handed([(0, 1), (0, 2), (4, 4)]) == 1
    assert sorted(w.parts) == [(0, 2)]
    assert list(w.take_parts(9)) == [(0, 2)]
    assert sorted(w.written_at) == [(0, 1), (0, 2)]  # (write times stay: diagnostics)


def test_a_replayed_part_the_master_holds_is_neither_kept_nor_handed_over_again():
    w = MemorySink("s").writer("c0")
    w.write(1, 0, rows(1))
    w.drop_handed(w.take_parts(1))
    w.write(1, 0, rows(1))
    assert w.parts == {} and w.take_parts(9) == {}


def test_a_compaction_moves_which_parts_the_master_holds_with_the_slices():
    a, b = MemorySink("s").writer("c0"), MemorySink("s").writer("c1")
    a.write(1, 0, rows(1))
    a.write(1, 5, rows(5))
    a.drop_handed(a.take_parts(1))
    b.take_in(a.give_parts({0}))
    assert a.handed == {(5, 1)} and b.handed == {(0, 1)}
    b.write(1, 0, rows(1))  # a replay in the new container
    assert b.parts == {} and b.take_parts(9) == {}


def test_results_sort_rows_by_slice_then_sequence_only_when_they_are_out_of_order():
    from chronostream.slices.sinks import sort_output

    shuffled = pa.table({"_slice": [0, 1, 0], "_seq": [1, 0, 0], "x": [2, 3, 1]})
    assert sort_output(shuffled)["x"].to_pylist() == [1, 2, 3]
    in_order = pa.concat_tables([pa.table({"_slice": [0, 0], "_seq": [0, 1], "x": [1, 2]}),
                                 pa.table({"_slice": [1], "_seq": [0], "x": [3]})])
    assert sort_output(in_order) is in_order  # joined parts in (slice, epoch) order: no copy
