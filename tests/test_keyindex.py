"""KeyIndex (slices/keyindex.py): dense slots for distinct keys, found by hash, verified by key."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chronostream.slices.keyindex import KeyCollision, KeyIndex, mid_max


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 60), max_size=40, unique=True), max_size=12),
       st.booleans(), st.sampled_from([1 << 17, 1, 5]), st.sampled_from([1 << 20, 1, 3]))
def test_slots_match_a_dict_that_numbers_keys_in_first_seen_order(batches, as_strings, recent_max, merge_step):
    """Every batch (distinct keys, old and new mixed, any order) gets the slot a dict would give:
    a key keeps the slot it first got; new keys are numbered in their order in the batch. Also
    when new keys' hashes wait in the recent run and go on to the middle run every 1 or 5 keys,
    and a full middle run merges into the main one 1 or 3 main entries per lookup (so the merge
    spans lookups)."""
    ix, ref = KeyIndex(), {}
    ix.RECENT_MAX = recent_max
    ix.MERGE_STEP_MIN = merge_step
    for batch in batches:
        keys = [f"k{k}" for k in batch] if as_strings else batch
        got = ix.slots([pa.array(keys)]).tolist() if keys else []
        want = [ref.setdefault(k, len(ref)) for k in keys]
        assert got == want
        assert len(ix._runs.recent[0]) < recent_max
    assert len(ix) == len(ref)
    hashes, slots = ix.sorted_hashes()
    assert np.all(np.diff(hashes.astype(np.float64)) >= 0)  # sorted for the lookups
    assert ix._runs.only_main() and sorted(slots.tolist()) == list(range(len(ref)))


def test_new_keys_reach_the_main_run_through_the_middle_one_a_chunk_per_lookup_and_none_is_lost():
    """A full recent run (RECENT_MAX) joins the middle run at once; a full middle run (the
    geometric mean of the main and recent runs' sizes) freezes and merges into the main one a
    chunk per lookup. Meanwhile keys of every run are found at their slots, and once done the
    main run holds every key in hash order."""
    ix = KeyIndex()
    ix.RECENT_MAX, ix.MERGE_STEP_MIN = 50, 40
    ix.slots([pa.array(np.arange(1000))])  # the main run
    assert mid_max(1000, 50) == 223
    nxt = 1000
    for _ in range(100):  # batches of 7 new keys: recent runs of 56 join the middle run
        if ix._runs.merging is not None:
            break
        assert ix.slots([pa.array(np.arange(nxt, nxt + 7))]).tolist() == list(range(nxt, nxt + 7))
        nxt += 7
        assert len(ix._runs.recent[0]) < 50 and len(ix._runs.mid[0]) < 223
    assert nxt - 1000 == 224 and not len(ix._runs.mid[0]) and not len(ix._runs.recent[0])
    steps = 0
    while ix._runs.merging is not None:
        probe = [3, 999, 1000, nxt - 1, nxt]
        assert ix.slots([pa.array(probe)]).tolist() == probe
        nxt += 1
        steps += 1
    assert steps >= 10  # 1,000 main entries, 40 a lookup
    hashes, slots = ix.sorted_hashes()
    assert len(hashes) == nxt and np.all(hashes[1:] > hashes[:-1])
    assert ix.slots([pa.array(np.arange(nxt))]).tolist() == list(range(nxt))


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


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=60), st.sampled_from([1 << 20, 16, 40]), st.data())
def test_stored_keys_take_what_was_appended_in_few_chunks(sizes, sealed, data):
    """Keys appended in batches of any size come back by slot, in any order and with repeats,
    per column. Chunks below SEALED keys are each more than twice the next; a chunk of SEALED
    keys or more is never merged again (so no append copies the whole key column): at most
    keys / SEALED + log2(SEALED) + 1 chunks."""
    from chronostream.slices.keyindex import StoredKeys

    stored, ref = StoredKeys(), []
    stored.SEALED = sealed
    for size in sizes:
        before = [c[0] for c in stored.chunks]
        words = [f"w{len(ref) + i}" for i in range(size)]
        stored.append([pa.array(words), pa.array(np.arange(len(ref), len(ref) + size), pa.int64())])
        ref += words
        sealed_before = [c for c in before if len(c) >= sealed]
        assert all(a is b for a, b in zip(sealed_before, (c[0] for c in stored.chunks)))  # kept, not copied
        open_chunks = [c for c in stored.chunks if len(c[0]) < sealed]
        assert all(len(a[0]) > 2 * len(b[0]) for a, b in zip(open_chunks, open_chunks[1:]))
        assert len(stored.chunks) <= len(ref) // sealed + max(1, int(np.log2(max(min(len(ref), sealed), 1))) + 1)
        if ref:
            slots = np.array(data.draw(st.lists(st.integers(0, len(ref) - 1), max_size=20)), dtype=np.int64)
            words_out, ints_out = stored.take(slots)
            assert words_out.to_pylist() == [ref[i] for i in slots]
            assert ints_out.to_pylist() == slots.tolist()
    assert len(stored) == len(ref)
    if ref:
        assert stored.columns()[0].to_pylist() == ref and len(stored.chunks) == 1


def test_a_hit_among_the_recent_keys_is_verified_like_any_other():
    """A key whose (forged) hash is held by a different key still waiting in the recent run is a
    KeyCollision; the real key is found there with its slot."""
    ix = KeyIndex()
    ix.slots([pa.array(["a", "b"])], hashes=np.array([10, 20], np.uint64))
    assert ix.slots([pa.array(["c"])], hashes=np.array([30], np.uint64)).tolist() == [2]
    assert ix._runs.recent[0].tolist() == [30]
    assert ix.slots([pa.array(["c", "a"])], hashes=np.array([30, 10], np.uint64)).tolist() == [2, 0]
    with pytest.raises(KeyCollision):
        ix.slots([pa.array(["z"])], hashes=np.array([30], np.uint64))
    assert len(ix) == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=12), st.sampled_from([1, 3, 4, 7]), st.data())
def test_a_groups_place_table_gives_back_each_places_member_and_slot_across_blocks(sizes, block, data):
    """Appends of any sizes land in blocks of BLOCK places (one growing array would be copied
    whole when doubled); any places read back what was appended there, as one flat array would."""
    from chronostream.slices.keyindex import _PlaceTable

    table, owners, slots = _PlaceTable(), [], []
    table.BLOCK = block
    for i, n in enumerate(sizes):
        owner, slot = np.full(n, i, np.int32), np.arange(n, dtype=np.int64) + 100 * i
        table.append(owner, slot)
        owners.append(owner), slots.append(slot)
    flat_owner = np.concatenate(owners) if owners else np.zeros(0, np.int32)
    flat_slot = np.concatenate(slots) if slots else np.zeros(0, np.int64)
    assert table.size == len(flat_owner)
    assert all(len(b) <= block for b in table.owners), "no block holds more than BLOCK places"
    places = np.array(data.draw(st.lists(st.integers(0, max(len(flat_owner) - 1, 0)), max_size=20)
                                if len(flat_owner) else st.just([])), dtype=np.int64)
    # (a few places are read block by block, many with one pass over every block)
    for asked in (places, places[:1], np.arange(len(flat_owner))):
        owner, slot = table.get(asked)
        assert owner.tolist() == flat_owner[asked].tolist() and slot.tolist() == flat_slot[asked].tolist()
