"""KeyIndex (chronostream/keyindex.py): dense slots for distinct keys, found by hash, verified by key."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chronostream.keyindex import KeyCollision, KeyIndex


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 60), max_size=40, unique=True), max_size=12),
       st.booleans())
def test_slots_match_a_dict_that_numbers_keys_in_first_seen_order(batches, as_strings):
    """Every batch (distinct keys, old and new mixed, any order) gets the slot a dict would give:
    a key keeps the slot it first got; new keys are numbered in their order in the batch."""
    ix, ref = KeyIndex(), {}
    for batch in batches:
        keys = [f"k{k}" for k in batch] if as_strings else batch
        got = ix.slots([pa.array(keys)]).tolist() if keys else []
        want = [ref.setdefault(k, len(ref)) for k in keys]
        assert got == want
    assert len(ix) == len(ref)
    assert np.all(np.diff(ix._hashes.astype(np.float64)) >= 0)  # stays sorted for the lookups


def test_multi_column_keys_are_one_key_per_combination():
    ix = KeyIndex()
    a, b = pa.array([1, 1, 2]), pa.array(["x", "y", "x"])
    assert ix.slots([a, b]).tolist() == [0, 1, 2]
    assert ix.slots([pa.array([2, 1]), pa.array(["x", "y"])]).tolist() == [2, 1]


def test_a_batch_repeating_a_key_is_refused():
    """slots() takes distinct keys; a repeat looks like two keys sharing a hash and is refused
    rather than given two slots."""
    with pytest.raises(KeyCollision):
        KeyIndex().slots([pa.array([5, 5])])
