"""Owns a vectorized, exact map from key rows (Arrow columns) to dense slot numbers.

Used by the built-in keyed aggregation so that finding each row's state slot
costs numpy/Arrow work per batch, not a Python dict lookup per distinct key.
Lookup is by the stable 64-bit key hash (a sorted array + searchsorted);
every hit is verified by comparing the stored key with the batch's key, so
a hash collision is detected (and refused) instead of silently merging two
keys. Knows nothing of slices or executors.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from chronostream.hashing import hash_columns


class KeyCollision(RuntimeError):
    """Two different keys share a 64-bit hash (astronomically rare; never merged silently)."""


def _same(a: pa.Array, b: pa.Array) -> np.ndarray:
    """Element-wise key equality: nulls equal nulls, NaN equals NaN, -0.0 equals 0.0."""
    eq = pc.fill_null(pc.equal(a, b), False)
    both_null = pc.and_(pc.is_null(a), pc.is_null(b))
    out = pc.or_(eq, both_null)
    if pa.types.is_floating(a.type):
        out = pc.or_(out, pc.fill_null(pc.and_(pc.is_nan(a), pc.is_nan(b)), False))
    return np.asarray(out, dtype=bool)


class KeyIndex:
    """Distinct keys seen so far, each with a dense slot number (0, 1, 2...).

    >>> ix = KeyIndex()
    >>> ix.slots([pa.array(["a", "b"])]).tolist(), ix.slots([pa.array(["b", "c"])]).tolist()
    ([0, 1], [1, 2])
    >>> len(ix)
    3
    """

    def __init__(self) -> None:
        self._hashes = np.zeros(0, dtype=np.uint64)  # sorted
        self._slot_of_sorted = np.zeros(0, dtype=np.int64)
        self._columns: list[list[pa.Array]] = []  # per key column: chunks, in slot order
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def keys(self) -> list[pa.Array]:
        """The stored keys per column, in slot order."""
        return [pa.concat_arrays(chunks) if chunks else pa.array([]) for chunks in self._columns]

    def take(self, slots: np.ndarray) -> list[pa.Array]:
        """The keys of ``slots``, per key column (cost proportional to ``len(slots)``)."""
        idx = pa.array(slots, pa.int64())
        return [self._stored(c).take(idx) for c in range(len(self._columns))]

    def _stored(self, col: int) -> pa.Array:
        chunks = self._columns[col]
        if len(chunks) > 1:
            self._columns[col] = chunks = [pa.concat_arrays(chunks)]
        return chunks[0]

    def slots(self, unique_keys: Sequence[pa.Array]) -> np.ndarray:
        """Slot of each row of ``unique_keys`` (rows must be distinct keys); new keys get new slots."""
        n = len(unique_keys[0])
        h = hash_columns(unique_keys)
        # Work in hash order: searchsorted with sorted queries walks the stored
        # hashes once (random queries into millions of hashes miss the cache on
        # every probe), and duplicates are neighbours.
        # Any sort will do: equal hashes within a batch are refused below, so
        # their order never matters (and introsort is ~1.5x a stable sort here).
        by_hash = np.argsort(h)
        hs = h[by_hash]
        if n > 1 and bool(np.any(hs[1:] == hs[:-1])):
            raise KeyCollision("two distinct keys of one batch share a 64-bit hash")
        if not self._size:
            # First load (a restore, or a first batch): every key is new, in slot order.
            # Own compact copies: a restored column is a view into a whole checkpoint's bytes.
            slots = np.arange(n, dtype=np.int64)
            self._columns = [[col.take(pa.array(slots))] for col in unique_keys]
            self._size = n
            self._hashes, self._slot_of_sorted = hs, by_hash.astype(np.int64, copy=False)
            return slots
        pos_sorted = np.searchsorted(self._hashes, hs)
        pos = np.empty(n, dtype=np.int64)
        pos[by_hash] = pos_sorted
        found = pos < len(self._hashes)
        found[found] = self._hashes[pos[found]] == h[found]
        out = np.empty(n, dtype=np.int64)
        if found.any():
            slots = self._slot_of_sorted[pos[found]]
            take = pa.array(slots)
            sel = pa.array(np.flatnonzero(found))
            for c, col in enumerate(unique_keys):
                if not _same(self._stored(c).take(take), col.take(sel)).all():
                    raise KeyCollision("a new key shares its 64-bit hash with a stored key")
            out[found] = slots
        new = ~found
        k = int(new.sum())
        if k:
            new_slots = np.arange(self._size, self._size + k, dtype=np.int64)
            out[new] = new_slots
            sel = pa.array(np.flatnonzero(new))
            if not self._columns:
                self._columns = [[] for _ in unique_keys]
            for c, col in enumerate(unique_keys):
                self._columns[c].append(col.take(sel))
            self._size += k
            # Merge the new hashes in (already in hash order, with their insertion
            # points): O(stored + new) per batch, not a sort of every stored hash.
            new_in_order = new[by_hash]
            at = pos_sorted[new_in_order]
            self._hashes = np.insert(self._hashes, at, hs[new_in_order])
            self._slot_of_sorted = np.insert(self._slot_of_sorted, at, out[by_hash][new_in_order])
        return out
