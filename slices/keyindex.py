"""Owns a vectorized, exact map from key rows (Arrow columns) to dense slot numbers.

Used by the built-in keyed aggregation so that finding each row's state slot
costs numpy/Arrow work per batch, not a Python dict lookup per distinct key.
Lookup is by the stable 64-bit key hash (a sorted array + searchsorted);
every hit is verified by comparing the stored key with the batch's key, so
a hash collision is detected (and refused) instead of silently merging two
keys. Knows nothing of slices or executors.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager, nullcontext
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from chronostream.slices.hashing import hash_columns
from chronostream.slices.sorting import hash_argsort, stable_argsort


class KeyCollision(RuntimeError):
    """Two different keys share a 64-bit hash (astronomically rare; never merged silently)."""


def common_key_type(types: Sequence[pa.DataType]) -> pa.DataType:
    """One type for key arrays of ``types``: a batch whose keys are all null has its key column
    typed null (it takes the others' type); other types promote as Arrow unifies schemas
    (``permissive``: int64 and float64 give float64).

    >>> common_key_type([pa.null(), pa.string()]), common_key_type([pa.int64(), pa.float64()])
    (DataType(string), DataType(double))
    """
    named = [pa.schema([("k", t)]) for t in types if not pa.types.is_null(t)]
    if not named:
        return pa.null()
    return pa.unify_schemas(named, promote_options="permissive").field("k").type if len(named) > 1 \
        else named[0].field("k").type


def _unified(arrays: Sequence[pa.Array]) -> list[pa.Array]:
    """``arrays`` (of one key column) in one type (``common_key_type``)."""
    if all(a.type == arrays[0].type for a in arrays[1:]):
        return list(arrays)
    t = common_key_type([a.type for a in arrays])
    return [a if a.type == t else a.cast(t) for a in arrays]


def _same(a: pa.Array, b: pa.Array) -> np.ndarray:
    """Element-wise key equality: nulls equal nulls, NaN equals NaN, -0.0 equals 0.0.

    >>> _same(pa.array([None, None]), pa.array([None, None])).tolist()  # (a key column all null)
    [True, True]
    >>> _same(pa.array([1, None]), pa.array([None, None])).tolist()
    [False, True]
    """
    if a.type != b.type:
        a, b = _unified([a, b])
    if pa.types.is_null(a.type):  # (both all null, typed null: Arrow has no equality for it)
        return np.ones(len(a), dtype=bool)
    eq = pc.fill_null(pc.equal(a, b), False)
    both_null = pc.and_(pc.is_null(a), pc.is_null(b))
    out = pc.or_(eq, both_null)
    if pa.types.is_floating(a.type):
        out = pc.or_(out, pc.fill_null(pc.and_(pc.is_nan(a), pc.is_nan(b)), False))
    return np.asarray(out, dtype=bool)


def _in_hash_order(hashes: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(the permutation sorting ``hashes``, the sorted hashes); equal hashes are refused.

    Lookups work in hash order: searchsorted with sorted queries walks the stored
    hashes once (random queries into millions of hashes miss the cache on every
    probe). Any order of equal hashes will do: they are refused (``hash_argsort``).
    """
    by_hash = hash_argsort(hashes)
    hs = hashes[by_hash]
    if len(hs) > 1 and bool(np.any(hs[1:] == hs[:-1])):
        raise KeyCollision(what)
    return by_hash, hs


def _find(stored: np.ndarray, hashes: np.ndarray, by_hash: np.ndarray,
          hs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each query hash is (or would go) in the sorted ``stored`` hashes:
    (position per query, found per query). ``hs``: the queries in hash order (``by_hash``)."""
    pos = np.empty(len(hashes), dtype=np.int64)
    pos[by_hash] = np.searchsorted(stored, hs)
    found = pos < len(stored)
    found[found] = stored[pos[found]] == hashes[found]
    return pos, found


def _find_recent(recent: np.ndarray, hashes: np.ndarray, by_hash: np.ndarray,
                 found: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Queries not ``found`` in the main run, looked up in the sorted ``recent`` run: (the rows
    that are there, their positions in it). Queries go in hash order again."""
    rest = by_hash[~found[by_hash]]
    at = np.minimum(np.searchsorted(recent, hashes[rest]), len(recent) - 1)
    hit = recent[at] == hashes[rest]
    return rest[hit], at[hit]


def _merge_runs(main: np.ndarray, recent: np.ndarray,
                payloads: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The sorted ``recent`` run merged into the sorted ``main`` one, with each (main, recent)
    payload array moved alike (O(main + recent)). Also how a batch of new keys (sorted)
    joins a recent run."""
    merge = _ChunkedMerge([main] + [m for m, _ in payloads], [recent] + [r for _, r in payloads])
    merge.step(len(main))
    return merge.out[0], merge.out[1:]


def merge_step(main_size: int, new_keys: int, mid_max: int, step_min: int) -> int:
    """Main entries a lookup that brought ``new_keys`` moves of a running merge: the main run's
    share of those keys among ``mid_max`` (the merge ends before the next middle run is full,
    when keys keep coming), and at least ``step_min`` (it ends when they stop).

    >>> merge_step(20_800_000, 30_000, mid_max(20_800_000, 1 << 17), 1 << 18)  # 1.7% of the main run
    377919
    >>> merge_step(20_800_000, 0, mid_max(20_800_000, 1 << 17), 1 << 18)
    262144
    """
    return max(step_min, -(-main_size * new_keys // mid_max))


def mid_max(main_size: int, recent_max: int) -> int:
    """Entries at which a middle run merges into a main run of ``main_size``: the geometric mean
    of the main and recent runs' sizes (at least ``recent_max``).

    Per new key, merges into the main run copy about main / mid_max entries and merges into the
    middle one about mid_max / (2 recent_max): with the mean, sqrt(main / recent_max) and half
    that, 13 + 6 at 20.8 M keys, where merging each recent run straight into the main run copied
    about main / recent_max, 159.

    >>> mid_max(20_800_000, 1 << 17), mid_max(1000, 1 << 17)
    (1651150, 131072)
    """
    return max(recent_max, math.isqrt(main_size * recent_max))


class _ChunkedMerge:
    """A sorted ``frozen`` run merged into the sorted ``main`` one a chunk at a time, each array
    of a run moved alike (hashes first, then payloads); ``main`` and ``frozen`` are not changed.

    Merging a key index's new keys into a main run of 20.8 M keys in one go took 167 ms of
    the epoch that brought them (17 ms otherwise). In chunks, each lookup does a share of it
    while the frozen run is looked up beside the main one (``_SortedRuns``).

    >>> m = _ChunkedMerge([np.array([10, 20, 30], np.uint64)], [np.array([5, 25, 40], np.uint64)])
    >>> m.step(1), m.step(1), m.step(1)
    (False, False, True)
    >>> m.out[0].tolist()
    [5, 10, 20, 25, 30, 40]
    """

    def __init__(self, main: list[np.ndarray], frozen: list[np.ndarray]) -> None:
        self.main, self.frozen = main, frozen
        self.at = np.searchsorted(main[0], frozen[0])  # frozen[i] goes before main[at[i]]
        n = len(main[0]) + len(frozen[0])
        self.out = [np.empty(n, dtype=a.dtype) for a in main]
        self.merged = 0  # main entries already in ``out``
        self.f_merged = 0  # frozen entries already in ``out``

    def step(self, count: int) -> bool:
        """Merge the next ``count`` main entries (and the frozen ones among them); True when done."""
        n = len(self.main[0])
        c, e = self.merged, min(n, self.merged + max(1, count))
        a = self.f_merged
        b = len(self.at) if e == n else int(np.searchsorted(self.at, e))
        # Straight into ``out`` (np.insert would build each block in a fresh temporary first:
        # twice the copying, and fresh pages to fault in at every step).
        where = self.at[a:b] - c + np.arange(b - a)  # the frozen entries' places in the block
        from_main = np.ones((e - c) + (b - a), dtype=bool)
        from_main[where] = False
        for out, m, f in zip(self.out, self.main, self.frozen):
            block = out[c + a:e + b]
            block[where] = f[a:b]
            block[from_main] = m[c:e]
        self.merged, self.f_merged = e, b
        return e == n


class _SortedRuns:
    """Hashes in increasing order, each with payloads (parallel arrays), held in a few sorted runs.

    New entries go into a small *recent* run (a merge of O(recent) per batch); a full recent run
    (``recent_max``) merges at once into a *middle* run; a full middle run (``mid_max`` of the
    main run's size) freezes and merges into the *main* run a chunk per lookup (``advance``),
    while lookups search the main, the frozen, the middle and the recent runs. Merging every
    recent run into the main one (the previous layout) copied the main run once per
    ``recent_max`` new keys: at 12-16 M keys, lookups that carried its chunks took 40-130 ms on
    this VM, and merges were about a third of a batch's time while keys kept coming.

    >>> runs = _SortedRuns(np.array([10, 30], np.uint64), [np.array([0, 1])])
    >>> runs.add(np.array([20], np.uint64), [np.array([2])], recent_max=1)
    >>> h = np.array([30, 20, 5], np.uint64)
    >>> found, (slot,) = runs.find(h, *_in_hash_order(h, ""))
    >>> found.tolist(), slot[found].tolist()
    ([True, True, False], [1, 2])
    >>> [a.tolist() for a in runs.merged()]
    [[10, 20, 30], [0, 2, 1]]
    """

    def __init__(self, hashes: np.ndarray, payloads: Sequence[np.ndarray]) -> None:
        self.main: list[np.ndarray] = [hashes, *payloads]
        self.mid = self._empty()
        self.recent = self._empty()
        self.merging: _ChunkedMerge | None = None  # a frozen middle run being merged into the main one

    def _empty(self) -> list[np.ndarray]:
        return [a[:0].copy() for a in self.main]

    def only_main(self) -> bool:
        """True when every entry is in the main run (no merge running, no middle or recent entries)."""
        return self.merging is None and not len(self.mid[0]) and not len(self.recent[0])

    def find(self, hashes: np.ndarray, by_hash: np.ndarray, hs: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """(found per query, each payload's value per query: set where found). ``hs``: the
        queries in hash order (``by_hash``)."""
        pos, found = _find(self.main[0], hashes, by_hash, hs)
        values = [np.empty(len(hashes), dtype=p.dtype) for p in self.main[1:]]
        hit = pos[found]
        for v, p in zip(values, self.main[1:]):
            v[found] = p[hit]
        side = [self.merging.frozen] if self.merging is not None else []
        for run in side + [self.mid, self.recent]:
            if len(run[0]):
                rows, at = _find_recent(run[0], hashes, by_hash, found)
                found[rows] = True
                for v, p in zip(values, run[1:]):
                    v[rows] = p[at]
        return found, values

    def add(self, hashes: np.ndarray, payloads: Sequence[np.ndarray], recent_max: int) -> None:
        """New entries (``hashes`` sorted, none held yet), with their payloads in that order."""
        self.recent = _merged_run(self.recent, [hashes, *payloads])
        if len(self.recent[0]) < recent_max:
            return
        self.mid, self.recent = _merged_run(self.mid, self.recent), self._empty()
        if len(self.mid[0]) >= mid_max(len(self.main[0]), recent_max):
            self.finish_merge()  # (a middle run refilled before the last merge ended)
            self.merging, self.mid = _ChunkedMerge(self.main, self.mid), self._empty()

    def advance(self, new_keys: int, recent_max: int, step_min: int) -> None:
        """A running merge's share for a lookup that brought ``new_keys`` (``merge_step``)."""
        if self.merging is not None:
            self._step(merge_step(len(self.main[0]), new_keys, mid_max(len(self.main[0]), recent_max), step_min))

    def _step(self, count: int) -> None:
        assert self.merging is not None
        if self.merging.step(count):
            self.main, self.merging = self.merging.out, None

    def finish_merge(self) -> None:
        """Complete a running merge at once."""
        if self.merging is not None:
            self._step(len(self.main[0]))

    def merged(self) -> list[np.ndarray]:
        """Every entry in the main run (merges completed at once): [hashes, *payloads]."""
        self.finish_merge()
        for run in (self.mid, self.recent):
            if len(run[0]):
                self.main = _merged_run(self.main, run)
        self.mid, self.recent = self._empty(), self._empty()
        return self.main


def _merged_run(main: list[np.ndarray], other: list[np.ndarray]) -> list[np.ndarray]:
    """Two sorted runs ([hashes, *payloads] each) as one."""
    hashes, payloads = _merge_runs(main[0], other[0], list(zip(main[1:], other[1:])))
    return [hashes, *payloads]


class StoredKeys:
    """The keys of a ``KeyIndex`` in slot order, per key column, in a few chunks.

    Each chunk is kept more than twice the size of the next (the last
    chunks merge, in one concatenation, when an append breaks that), so a
    key is copied O(log keys) times over the index's life. Concatenating
    every chunk whenever keys had arrived (the previous layout) copied the
    whole key column once per epoch that brought new keys: while a 7 M-key
    state was loading, each delta checkpoint copied tens of MB of keys to
    look up a few thousand. A chunk of ``SEALED`` keys or more is never
    merged again: the merge that joined every chunk copied the whole key
    column inside one epoch, a stall that grew with the state (211 ms at
    12.5 M int keys, one process, 2026-11-25). So there are at most
    keys / ``SEALED`` + log2(``SEALED``) + 1 chunks, and a merge copies
    at most about 3 x ``SEALED`` keys. ``take`` costs O(len(slots)) plus a
    sort by chunk.

    >>> k = StoredKeys()
    >>> for part in (["a", "b"], ["c"], ["d", "e", "f"]):
    ...     k.append([pa.array(part)])
    >>> k.take(np.array([5, 0, 2]))[0].to_pylist(), len(k), len(k.chunks)
    (['f', 'a', 'c'], 6, 1)
    """

    #: Chunks this long are not merged with others any more.
    SEALED = 1 << 20

    def __init__(self) -> None:
        self.chunks: list[list[pa.Array]] = []  # each: one array per key column, in slot order
        self.starts: list[int] = []  # first slot of each chunk
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def conform(self, columns: Sequence[pa.Array]) -> list[pa.Array]:
        """``columns`` (new keys) in the stored keys' types, per key column: a batch whose key
        column came out typed null (every key of the batch null) takes the stored type, and
        stored keys typed null (or of a narrower type: permissive promotion, as Arrow unifies
        schemas) take the new column's. Keys of different types then share one index.

        >>> k = StoredKeys()
        >>> k.append([pa.nulls(1)])
        >>> cols = k.conform([pa.array(["a"])])
        >>> k.append(cols); k.take(np.array([1, 0]))[0].to_pylist(), k.chunks[0][0].type
        (['a', None], DataType(string))
        """
        if not self.chunks:
            return list(columns)
        out = []
        for c, col in enumerate(columns):
            have = self.chunks[0][c].type  # (every chunk of a column has one type)
            if col.type == have:
                out.append(col)
                continue
            common = common_key_type([have, col.type])
            if common != have:
                for chunk in self.chunks:
                    chunk[c] = chunk[c].cast(common)
            out.append(col if col.type == common else col.cast(common))
        return out

    def append(self, columns: Sequence[pa.Array]) -> None:
        """Add the keys of the next ``len(columns[0])`` slots (in the stored types: ``conform``)."""
        k = len(columns[0])
        if not k:
            return
        columns = self.conform(columns)
        self.chunks.append(list(columns))
        self.starts.append(self.size)
        self.size += k
        # Keep each chunk below SEALED more than twice the size of the next: the chunks from
        # ``first`` on are merged, with one concatenation.
        first, tail = len(self.chunks) - 1, k
        while first > 0 and len(self.chunks[first - 1][0]) <= 2 * tail \
                and len(self.chunks[first - 1][0]) < self.SEALED:
            first -= 1
            tail += len(self.chunks[first][0])
        if first < len(self.chunks) - 1:
            merged = [pa.concat_arrays(list(col)) for col in zip(*self.chunks[first:])]
            del self.chunks[first:], self.starts[first + 1:]
            self.chunks.append(merged)

    def take(self, slots: np.ndarray) -> list[pa.Array]:
        """The keys of ``slots``, per key column."""
        if len(self.chunks) == 1:
            idx = pa.array(slots, pa.int64())
            return [col.take(idx) for col in self.chunks[0]]
        chunk = np.searchsorted(np.asarray(self.starts), slots, side="right") - 1
        order = stable_argsort(chunk)
        cut = np.searchsorted(chunk[order], np.arange(len(self.chunks) + 1))
        pieces = [[] for _ in self.chunks[0]] if self.chunks else []
        for j, cols in enumerate(self.chunks):
            if cut[j + 1] > cut[j]:
                idx = pa.array(slots[order[cut[j]:cut[j + 1]]] - self.starts[j], pa.int64())
                for c, col in enumerate(cols):
                    pieces[c].append(col.take(idx))
        back = np.empty(len(order), dtype=np.int64)
        back[order] = np.arange(len(order))
        back_idx = pa.array(back)
        return [(pa.concat_arrays(p) if len(p) > 1 else p[0]).take(back_idx) if p else self.chunks[0][c].slice(0, 0)
                for c, p in enumerate(pieces)]

    def columns(self) -> list[pa.Array]:
        """Every key, per column (merged into one chunk)."""
        if len(self.chunks) > 1:
            self.chunks = [[pa.concat_arrays(list(col)) for col in zip(*self.chunks)]]
            self.starts = [0]
        return list(self.chunks[0]) if self.chunks else []


class _GroupAdded:
    """One ``KeyIndexGroup.slots`` call's new keys, grouped by member: their hashes, their slots
    in their member and the keys per column; member ``i``'s share is rows ``cut[i]:cut[i + 1]``."""

    __slots__ = ("hashes", "slots", "keys", "cut")

    def __init__(self, hashes: np.ndarray, slots: np.ndarray, keys: list[pa.Array], cut: np.ndarray) -> None:
        self.hashes, self.slots, self.keys, self.cut = hashes, slots, keys, cut


def _concat(arrays: list[pa.Array]) -> pa.Array:
    return arrays[0] if len(arrays) == 1 else pa.concat_arrays(_unified(arrays))


class KeyIndex:
    """Distinct keys seen so far, each with a dense slot number (0, 1, 2...).

    >>> ix = KeyIndex()
    >>> ix.slots([pa.array(["a", "b"])]).tolist(), ix.slots([pa.array(["b", "c"])]).tolist()
    ([0, 1], [1, 2])
    >>> len(ix)
    3
    """

    #: New keys' hashes (a small sorted run) merge into the middle run at this many (``_SortedRuns``).
    RECENT_MAX = 1 << 17
    #: A merge of the middle run into the main one moves, per lookup, at least this many main
    #: entries, and as many as keep it ahead of the next middle run (``merge_step``).
    MERGE_STEP_MIN = 1 << 18

    def __init__(self) -> None:
        # Key hashes in increasing order, each with its slot.
        self._runs = _SortedRuns(np.zeros(0, dtype=np.uint64), [np.zeros(0, dtype=np.int64)])
        self._keys = StoredKeys()
        self._size = 0
        # Keys a KeyIndexGroup added (hashes, slots), not yet merged into the sorted arrays:
        # the group does the lookups meanwhile, so the merge waits for this index's own.
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._group: KeyIndexGroup | None = None  # the group that added them
        # Keys a group added and this index has not even stored yet: (the group's batch of new
        # keys, this index's rows lo:hi of it). Stored (``_materialize``) when this index's keys
        # or pending hashes are read: a group of 64 slices storing each slice's few new keys
        # every epoch cost benchmarks.slices' word count ~10% of its time.
        self._deferred: list[tuple[_GroupAdded, int, int]] = []

    def __len__(self) -> int:
        return self._size

    def keys(self) -> list[pa.Array]:
        """The stored keys per column, in slot order."""
        self._materialize()
        return self._keys.columns()

    def take(self, slots: np.ndarray) -> list[pa.Array]:
        """The keys of ``slots``, per key column (cost proportional to ``len(slots)``)."""
        self._materialize()
        return self._keys.take(slots) if self._size else []

    @contextmanager
    def _group_locked(self) -> Iterator["KeyIndexGroup | None"]:
        """Hold the lock of this index's group (None: no group, no lock) and yield the group.

        Another thread may hand this index its arrays meanwhile (``KeyIndexGroup._hand_back``,
        from a member of the same group settling: two threads of a container whose slices
        shared a group before a thread-table change). The group is read again once the lock
        is held, and the lock taken anew when it changed while this thread waited."""
        while True:
            group = self._group
            with group._lock if group is not None else nullcontext():
                if self._group is group:
                    yield group
                    return

    def _materialize(self) -> None:
        """Store the keys a group added to this index (``_deferred``), one append for all."""
        if not self._deferred:
            return
        with self._group_locked():
            if not self._deferred:  # (stored by a hand-back while this thread waited)
                return
            pieces, self._deferred = self._deferred, []
            cols = [_concat([added.keys[c].slice(lo, hi - lo) for added, lo, hi in pieces])
                    for c in range(len(pieces[0][0].keys))]
            self._keys.append(cols)
            self._pending.append((np.concatenate([added.hashes[lo:hi] for added, lo, hi in pieces]),
                                  np.concatenate([added.slots[lo:hi] for added, lo, hi in pieces])))

    def _settle(self) -> None:
        """Merge the keys a group added into this index's own sorted arrays, and leave the group.

        Under the group's lock from the first check to the last write: a hand-back from
        another thread replaces ``_runs`` and clears ``_pending``, and one landing between
        them and this merge doubled every pending key (a thread reschedule's lost counts)."""
        if self._group is None and not self._pending and not self._deferred:
            # Nothing of a group's here, and no other thread touches an index outside a
            # group: no lock to take on the single-slice path (one call per batch).
            return
        with self._group_locked() as group:
            self._materialize()
            if self._pending:
                self._runs.finish_merge()  # the keys a group added join the main run whole
            if self._pending and group is not None:
                # The group's sorted arrays hold this index's keys: filtered out, they are
                # in hash order already (O(keys)), where a sort of millions of keys would
                # stall the slice for a second when its group breaks up (a migration).
                group._hand_back()
            if self._pending:
                hashes, slots = self._runs.merged()
                hs = np.concatenate([hashes] + [h for h, _ in self._pending])
                sl = np.concatenate([slots] + [s for _, s in self._pending])
                order = np.argsort(hs, kind="stable")  # timsort: the stored hashes are one sorted run
                self._runs = _SortedRuns(hs[order], [sl[order]])
                self._pending = []
            # Settled, it holds nothing of the group's: no hand-back from another thread may
            # touch it any more (nor undo the ``_group`` a new group is about to set).
            self._group = None

    def sorted_hashes(self) -> tuple[np.ndarray, np.ndarray]:
        """(hashes in increasing order, the slot of each)."""
        self._settle()
        hashes, slots = self._runs.merged()
        return hashes, slots

    def slots(self, unique_keys: Sequence[pa.Array], hashes: np.ndarray | None = None) -> np.ndarray:
        """Slot of each row of ``unique_keys`` (rows must be distinct keys); new keys get new slots.

        ``hashes``: ``hash_columns(unique_keys)`` when the caller has it already.
        """
        self._settle()
        n = len(unique_keys[0])
        h = hash_columns(unique_keys) if hashes is None else hashes
        by_hash, hs = _in_hash_order(h, "two distinct keys of one batch share a 64-bit hash")
        if not self._size:
            # First load (a restore, or a first batch): every key is new, in slot order.
            # Own compact copies: a restored column is a view into a whole checkpoint's bytes.
            slots = np.arange(n, dtype=np.int64)
            self._keys = StoredKeys()
            self._keys.append([col.take(pa.array(slots)) for col in unique_keys])
            self._size = n
            self._runs = _SortedRuns(hs, [by_hash.astype(np.int64, copy=False)])
            return slots
        found, (out,) = self._runs.find(h, by_hash, hs)
        if found.any():
            slots = out[found]
            sel = pa.array(np.flatnonzero(found))
            for stored, col in zip(self._keys.take(slots), unique_keys):
                if not _same(stored, col.take(sel)).all():
                    raise KeyCollision("a new key shares its 64-bit hash with a stored key")
        new = ~found
        k = int(new.sum())
        if k:
            new_slots = np.arange(self._size, self._size + k, dtype=np.int64)
            out[new] = new_slots
            sel = pa.array(np.flatnonzero(new))
            self._keys.append([col.take(sel) for col in unique_keys])
            self._size += k
            # New hashes go into the small recent run (O(recent) per batch), which merges on
            # into the middle and main runs (_SortedRuns). Inserting into the main run every
            # batch cost O(keys) per batch: loading 4 M keys spent half its time in np.insert.
            new_order = by_hash[new[by_hash]]
            self._runs.add(h[new_order], [out[new_order]], self.RECENT_MAX)
        self._runs.advance(k, self.RECENT_MAX, self.MERGE_STEP_MIN)
        return out


class _PlaceTable:
    """Each place's member and slot in a ``KeyIndexGroup``'s key copy, as numpy blocks.

    A lookup's hits read theirs with one fancy index per block (one block below ``BLOCK``
    places), where Arrow columns in the key copy cost two takes, a concatenation and a take
    back per chunk. Blocks of ``BLOCK`` places, never one growing array: doubling a single
    array copies all of it inside one epoch, a stall that grows with the state (section 3a of
    docs/design.md); here an append copies at most the last block while it doubles.

    >>> t = _PlaceTable()
    >>> t.append(np.array([0, 1, 1], np.int32), np.array([0, 0, 1]))
    >>> [a.tolist() for a in t.get(np.array([2, 0]))]
    [[1, 0], [1, 0]]
    """

    BLOCK = 1 << 20

    def __init__(self) -> None:
        self.owners: list[np.ndarray] = [np.zeros(0, np.int32)]
        self.slots: list[np.ndarray] = [np.zeros(0, np.int64)]
        self.size = 0

    def append(self, owner: np.ndarray, slot: np.ndarray) -> None:
        """The member and slot of the next ``len(owner)`` places."""
        done = 0
        while done < len(owner):
            at = self.size - (len(self.owners) - 1) * self.BLOCK  # used places of the last block
            if at == self.BLOCK:
                self.owners.append(np.zeros(0, np.int32))
                self.slots.append(np.zeros(0, np.int64))
                at = 0
            k = min(len(owner) - done, self.BLOCK - at)
            if at + k > len(self.owners[-1]):  # double the last block (at most BLOCK places)
                cap = min(self.BLOCK, max(at + k, 2 * len(self.owners[-1]), 1024))
                self.owners[-1] = np.concatenate([self.owners[-1][:at], np.zeros(cap - at, np.int32)])
                self.slots[-1] = np.concatenate([self.slots[-1][:at], np.zeros(cap - at, np.int64)])
            self.owners[-1][at:at + k] = owner[done:done + k]
            self.slots[-1][at:at + k] = slot[done:done + k]
            self.size += k
            done += k

    def get(self, places: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(member, slot) of each of ``places``."""
        if len(self.owners) == 1:
            return self.owners[0][places], self.slots[0][places]
        if len(places) * len(self.owners) > self.size:  # (many places, a group's hand-back: one pass)
            return np.concatenate(self.owners)[places], np.concatenate(self.slots)[places]
        owner, slot = np.empty(len(places), np.int32), np.empty(len(places), np.int64)
        block, offset = places // self.BLOCK, places % self.BLOCK
        for b in np.unique(block).tolist():  # (a loop over blocks, not places)
            rows = block == b
            owner[rows], slot[rows] = self.owners[b][offset[rows]], self.slots[b][offset[rows]]
        return owner, slot


class KeyIndexGroup:
    """One lookup over the key indexes of several slices (the slices a container runs as a group).

    Derived data, kept beside the members: every member's keys by hash, with
    the member and slot of each. ``slots`` finds the keys of many members in
    one pass and gives new keys slots in their member (whose own sorted arrays
    catch up lazily, on its next own lookup). A group is valid while its
    members are the same objects with the sizes it left them at: a member
    restored, replaced or grown on its own makes ``matches`` false, and the
    caller builds a new group. A group also still serves a subset of its
    members (``covering``: slices that stay when others migrate away or move
    to another thread): the members that left are forgotten, their entries
    stay (a hit on one is a ``KeyCollision``, as for any key whose hash
    another slice holds). Breaking the group up instead would make each
    member that stays merge the keys the group added for it, a pass over
    millions of keys in the epoch that follows the move.

    >>> a, b = KeyIndex(), KeyIndex()
    >>> g = KeyIndexGroup([a, b])
    >>> keys = pa.array(["x", "y", "z"])
    >>> g.slots(np.array([0, 1, 0]), [keys], hash_columns([keys])).tolist()
    [0, 0, 1]
    >>> len(a), len(b), a.slots([pa.array(["z"])]).tolist()
    (2, 1, [1])
    """

    #: New keys wait in a sorted recent run until there are this many (see ``KeyIndex``), then
    #: merge into the main run a share per lookup (``merge_step``).
    RECENT_MAX = KeyIndex.RECENT_MAX
    MERGE_STEP_MIN = KeyIndex.MERGE_STEP_MIN
    #: A member stores the keys the group added for it at the latest after this many batches.
    DEFERRED_MAX = 64

    def __init__(self, members: Sequence[KeyIndex]) -> None:
        self.members: list[KeyIndex | None] = list(members)  # None: a member that left (``covering``)
        parts = [m.sorted_hashes() for m in members]
        hs = np.concatenate([h for h, _ in parts]) if parts else np.zeros(0, np.uint64)
        member = np.repeat(np.arange(len(parts), dtype=np.int32), [len(h) for h, _ in parts])
        slot = np.concatenate([s for _, s in parts]).astype(np.int64) if parts else np.zeros(0, np.int64)
        # Timsort merges the members' sorted runs: 2 x 7 M keys in 0.36 s, where the default
        # quicksort took 1.3 s (a group rebuilt after a migration stalled its slices that long).
        order = np.argsort(hs, kind="stable")
        hs, member, slot = hs[order], member[order], slot[order]
        # The group's own copy of every key it knows, one chunk per member here, then one per
        # batch of new keys; a key's place in it indexes ``_places`` (its member and slot
        # there). Hits are verified with one take from it: one take per member (64 slices:
        # 64 takes an epoch, each a few Arrow calls per chunk) cost the word count of
        # benchmarks.slices 12-14% of its time.
        self._keys = StoredKeys()
        for m in members:
            if len(m):
                self._keys.append(m.keys())
        sizes = np.array([len(m) for m in members], dtype=np.int64)
        offsets = np.cumsum(sizes) - sizes
        self._places = _PlaceTable()  # each place's member and slot
        self._places.append(np.repeat(np.arange(len(members), dtype=np.int32), sizes),
                            np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(offsets, sizes))
        at = offsets[member] + slot if len(members) else np.zeros(0, np.int64)
        # Every key's hash in increasing order, with its place in the key copy; new keys go in as
        # in a KeyIndex (_SortedRuns). One payload, not (member, slot, place): each batch's new
        # keys are merged into the recent run, a copy of all of it, and three payloads made that
        # copy (and the middle run's merges) 1.75x a KeyIndex's.
        self._runs = _SortedRuns(hs, [at])
        if len(hs) > 1 and bool(np.any(hs[1:] == hs[:-1])):
            # Two members hold keys of one hash: a key in two slices, or a collision.
            raise KeyCollision("two slices of the group hold keys sharing a 64-bit hash")
        self._sizes = sizes.tolist()
        # Threads of one container (scale-up) can meet in one group: one keeps using it for
        # the slices it kept (covering) while another's slices hand their keys back. (Made
        # before any member points here: another thread may take it as soon as one does.)
        self._lock = threading.RLock()
        # The batches of new keys since every member last stored its deferred ones (``_store_deferred``).
        self._log: list[_GroupAdded] = []
        for m in members:
            m._group = self

    def _store_deferred(self) -> None:
        """Every member stores the keys the group added for it and it has not stored yet
        (``KeyIndex._materialize``, for all of them at once): one take of the logged batches'
        keys in (member, slot) order, then a slice of it per member, where each member joining
        a piece per batch cost a 64-slice word count about 1.5% of its run. The caller holds
        the group's lock.

        A member's deferred entries are the logged batches from its first one on (it stored
        the earlier ones when it read its keys); members no longer here or in another group
        store theirs themselves."""
        log, self._log = self._log, []
        if not log:
            return
        where = {id(added): b for b, added in enumerate(log)}
        first = np.full(len(self.members), len(log), dtype=np.int64)  # each member's first batch
        for i, m in enumerate(self.members):
            if m is None or m._group is not self or not m._deferred:
                continue
            b = where.get(id(m._deferred[0][0]))
            if b is None:  # (entries from before the log: cannot happen; stored the slow way)
                m._materialize()
            else:
                first[i] = b
        cuts = np.stack([added.cut for added in log])  # (batch, member + 1)
        sizes = cuts[:, -1]
        counts = np.diff(cuts, axis=1)
        counts[np.arange(len(log))[:, None] < first[None, :]] = 0
        starts = (np.cumsum(sizes) - sizes)[:, None] + cuts[:, :-1]
        # Rows of the logged batches in (member, batch) order: within a batch a member's rows are
        # its new slots in order, so each member's run is in slot order.
        per = counts.T.ravel()
        rows = np.repeat(starts.T.ravel() - (np.cumsum(per) - per), per) + np.arange(int(per.sum()))
        idx = pa.array(rows)
        keys = [_concat([added.keys[c] for added in log]).take(idx) for c in range(len(log[0].keys))]
        hashes = np.concatenate([added.hashes for added in log])[rows]
        slots = np.concatenate([added.slots for added in log])[rows]
        bounds = np.concatenate([[0], np.cumsum(counts.sum(axis=0))]).tolist()
        for i, m in enumerate(self.members):
            lo, hi = bounds[i], bounds[i + 1]
            if hi > lo:
                m._keys.append([col.slice(lo, hi - lo) for col in keys])  # type: ignore[union-attr]
                m._pending.append((hashes[lo:hi], slots[lo:hi]))  # type: ignore[union-attr]
                m._deferred = []  # type: ignore[union-attr]

    def _hand_back(self) -> None:
        """Give every member that holds keys this group added its sorted arrays, cut out of the
        group's (one stable radix sort by member keeps each member's entries in hash order).
        The caller holds the group's lock (``KeyIndex._settle``).

        Only members the group left at their size get them (the group's entries are then
        exactly their keys); the others merge their pending keys by sorting, as before.
        """
        for m in self.members:
            if m is not None and m._group is self:
                m._materialize()
        hashes, at = self._runs.merged()
        member, slot = self._places.get(at)  # each entry's member and slot there
        order = stable_argsort(member.astype(np.int64))
        cut = np.searchsorted(member[order], np.arange(len(self.members) + 1))
        for i, m in enumerate(self.members):
            if m is None or m._group is not self:
                continue
            if m._pending and len(m) == self._sizes[i] and m._runs.only_main():
                rows = order[cut[i]:cut[i + 1]]
                m._runs = _SortedRuns(hashes[rows], [slot[rows]])
                m._pending = []
            # Last: a member whose ``_group`` is None settles without the lock (``_settle``), so
            # its thread must not see None before its arrays are in place. (Cleared first, a
            # member settling meanwhile read its pending keys while this replaced them: an
            # IndexError between two reads of ``_pending``, or the member left empty.)
            m._group = None

    def matches(self, members: Sequence[KeyIndex]) -> bool:
        """True when ``members`` are this group's members, unchanged since its last call."""
        return (len(members) == len(self.members)
                and all(a is b and len(a) == n for a, b, n in zip(members, self.members, self._sizes)))

    @staticmethod
    def covering(members: Sequence[KeyIndex]) -> "KeyIndexGroup | None":
        """The group that added the pending keys of ``members`` if it holds every one of them,
        unchanged since its last call, with its other members forgotten; else None.

        >>> a, b = KeyIndex(), KeyIndex()
        >>> g = KeyIndexGroup([a, b])
        >>> KeyIndexGroup.covering([b]) is g, g.members[0] is None, g.positions([b]).tolist()
        (True, True, [1])
        """
        group = members[0]._group if members else None
        if group is None:
            return None
        with group._lock:
            where = {id(m): i for i, m in enumerate(group.members) if m is not None}
            if not all(m._group is group and id(m) in where and len(m) == group._sizes[where[id(m)]]
                       for m in members):
                return None
            keep = {id(m) for m in members}
            group.members = [m if m is not None and id(m) in keep else None for m in group.members]
            return group

    def positions(self, members: Sequence[KeyIndex]) -> np.ndarray:
        """Each of ``members``' index among this group's members (they must be members)."""
        where = {id(m): i for i, m in enumerate(self.members) if m is not None}
        return np.array([where[id(m)] for m in members], dtype=np.int64)

    def _by_member(self, member: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows grouped by member, stably; where each member's rows start in that order)."""
        order = stable_argsort(member)
        return order, np.searchsorted(member[order], np.arange(len(self.members) + 1))

    def slots(self, member_of: np.ndarray, keys: Sequence[pa.Array], hashes: np.ndarray) -> np.ndarray:
        """Slot of each row of ``keys`` in the index of member ``member_of[row]``; rows must be
        distinct keys. New keys get new slots in their member. Raises ``KeyCollision`` (changing
        nothing) when a key's hash is held by another member or by a different stored key."""
        with self._lock:
            return self._slots(member_of, keys, hashes)

    def _slots(self, member_of: np.ndarray, keys: Sequence[pa.Array], hashes: np.ndarray) -> np.ndarray:
        n = len(hashes)
        by_hash, hs = _in_hash_order(hashes, "two keys of one group batch share a 64-bit hash")
        # ``at_keys``: each hit's position in the group's key copy.
        found, (at_keys,) = self._runs.find(hashes, by_hash, hs)
        rows = np.flatnonzero(found)
        out = np.empty(n, dtype=np.int64)
        if len(rows):
            # Verify the hits key by key: one take from the group's copy, one comparison.
            places = at_keys[rows]
            stored = self._keys.take(places)
            owner, slot = self._places.get(places)
            if bool(np.any(owner != member_of[rows])):
                raise KeyCollision("a key's hash is held by another slice of the group")
            out[rows] = slot
            sel = pa.array(rows)
            for got, col in zip(stored, keys):
                if not _same(got, col.take(sel)).all():
                    raise KeyCollision("a new key shares its 64-bit hash with a stored key")
        new = np.flatnonzero(~found)
        if len(new):
            by_member, cut = self._by_member(member_of[new])
            rows = new[by_member]  # the new keys, grouped by member
            taken = [col.take(pa.array(rows)) for col in keys]
            at_keys[rows] = np.arange(len(self._keys), len(self._keys) + len(new), dtype=np.int64)
            # A member's new keys take its next slots, in batch order; the member stores them
            # when it reads its keys (``KeyIndex._materialize``), not once per batch.
            counts = np.diff(cut)
            sizes = np.asarray(self._sizes, dtype=np.int64)
            new_slots = np.arange(len(new), dtype=np.int64) + np.repeat(sizes - cut[:-1], counts)
            out[rows] = new_slots
            self._places.append(np.repeat(np.arange(len(counts), dtype=np.int32), counts), new_slots)
            self._keys.append(taken)
            added = _GroupAdded(hashes[rows], new_slots, taken, cut)
            cuts = cut.tolist()  # (Python ints: this loop runs once per member with new keys)
            for i in np.flatnonzero(counts).tolist():
                m = self.members[i]
                lo, hi = cuts[i], cuts[i + 1]
                m._size += hi - lo  # type: ignore[union-attr]
                m._deferred.append((added, lo, hi))  # type: ignore[union-attr]
                if m._group is not self and len(m._deferred) >= self.DEFERRED_MAX:  # type: ignore[union-attr]
                    # (a member whose keys a hand-back settled while the group still serves it:
                    # ``_store_deferred`` leaves it alone, so it keeps its own bound)
                    m._materialize()  # type: ignore[union-attr]
            self._log.append(added)
            if len(self._log) >= self.DEFERRED_MAX:
                # Bounded: a member nobody reads (no checkpoints) would otherwise hold one entry
                # per batch, and every batch's keys, for the whole job.
                self._store_deferred()
            self._sizes = (sizes + counts).tolist()
            # New keys go into the recent run (O(recent) per batch), as in a single index.
            new_order = by_hash[~found[by_hash]]
            self._runs.add(hashes[new_order], [at_keys[new_order]], self.RECENT_MAX)
        self._runs.advance(len(new), self.RECENT_MAX, self.MERGE_STEP_MIN)
        return out

