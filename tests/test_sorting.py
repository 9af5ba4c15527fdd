"""The framework's shared sorts give numpy's orderings, faster (slices/sorting.py)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from chronostream.slices.hashing import hash_columns
from chronostream.slices.sorting import hash_argsort, stable_argsort


@pytest.mark.parametrize("n", [0, 1, 2, 1000, 300_000])
def test_hash_argsort_is_a_permutation_that_sorts_the_hashes(n):
    h = hash_columns([pa.array(np.arange(n, dtype=np.int64))])
    order = hash_argsort(h)
    assert np.array_equal(np.sort(order), np.arange(n))
    assert np.array_equal(h[order], np.sort(h))


def test_hash_argsort_sorts_hashes_that_share_their_top_bits_and_repeat():
    rng = np.random.default_rng(3)
    # One radix bucket for all (same top 16 bits), with repeats: the stable pass must finish the sort.
    h = (np.uint64(0xABCD) << np.uint64(48)) | rng.integers(0, 1 << 20, 50_000).astype(np.uint64)
    assert np.array_equal(h[hash_argsort(h)], np.sort(h))
    # Extremes of the range.
    h = np.array([np.iinfo(np.uint64).max, 0, 1 << 63, (1 << 63) - 1, 0], dtype=np.uint64)
    assert h[hash_argsort(h)].tolist() == sorted(h.tolist())


def test_stable_argsort_equals_numpy_stable_argsort_across_widths():
    rng = np.random.default_rng(4)
    for top in (10, 1 << 16, 1 << 30, 1 << 40):
        keys = rng.integers(0, top, 20_000)
        assert np.array_equal(stable_argsort(keys), np.argsort(keys, kind="stable"))


@pytest.mark.parametrize("top", [1, 64, 1023, 1024])
def test_many_keys_of_a_small_range_sort_like_numpys_stable_argsort_into_int64_positions(top):
    """From COUNTING_MIN_ROWS keys below COUNTING_TOP, Arrow counts them: the same permutation,
    as int64 (uint64 positions would turn arithmetic with int64 into floats)."""
    from chronostream.slices import sorting

    rng = np.random.default_rng(top)
    keys = rng.integers(0, top, sorting.COUNTING_MIN_ROWS + 17)
    got = stable_argsort(keys)
    assert got.dtype == np.int64
    assert np.array_equal(got, np.argsort(keys, kind="stable"))
