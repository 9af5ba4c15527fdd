"""The slice-granularity benchmark's floor (``benchmarks.slices --floor``): its premise, checked.

The floor is the copy that puts a one-slice count's output into the order a
many-slice count's memory sink holds it; these tests check that the copy it
times is exactly that order, so the figure it reports is the cost of the
right rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

import chronostream as cs
from benchmarks.slices import slice_ordered_epochs, word_count
from chronostream.datasets import zipf_text
from chronostream.slices.sorting import take_permuted

EPOCH = 64  # lines an epoch: 400 lines make 7 epochs
COLUMNS = ["word", "count", "_order", "_sub"]


def test_the_floor_copy_gives_the_one_slice_output_in_a_many_slice_runs_order():
    """Each epoch of the one-slice run's output, taken by the benchmark's permutation, is the
    16-slice run's output of that epoch: its rows by slice, each slice's in ``_seq`` order."""
    lines = zipf_text(400, seed=3)
    one = cs.run(word_count(lines, 1, EPOCH), executor="local", containers=1).results("counts")
    many = cs.run(word_count(lines, 16, EPOCH), executor="local", containers=1).results("counts")
    chunks = slice_ordered_epochs(one, 16, EPOCH)
    assert len(chunks) == 7
    moved = pa.concat_tables([take_permuted(t.select(COLUMNS), perm) for t, perm in chunks])
    # ``results`` orders by (_slice, _seq); a stable sort by epoch makes that (epoch, slice, _seq).
    by_epoch = np.argsort(np.asarray(many.column("_order")) // EPOCH, kind="stable")
    assert moved.equals(many.select(COLUMNS).take(pa.array(by_epoch)))


def test_the_floor_permutation_moves_rows_when_a_run_has_many_slices():
    """The copy the floor times is a real reordering (not the identity the one-slice run keeps)."""
    one = cs.run(word_count(zipf_text(100, seed=3), 1, EPOCH), executor="local", containers=1).results("counts")
    assert all(not np.array_equal(perm, np.arange(len(perm))) for _t, perm in slice_ordered_epochs(one, 16, EPOCH))
