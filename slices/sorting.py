"""Owns the stable sort of small non-negative integer keys that the framework's vectorized paths share.

Grouping rows by slice, container or dictionary code is a stable argsort of
small integers. numpy sorts 16-bit (and smaller) integers stably with a
radix sort, 3-4x faster than its int64 merge sort on the 100,000s of rows
of an epoch; codes up to 32 bits take two such passes. Many keys of a small
range (slice numbers) go to Arrow's counting sort instead. The result is
the same permutation. Also the argsort of 64-bit hashes (uniform bits), which
the key index sorts on every lookup batch and on every restore, and the
merge key packed into one integer (slice, source order, sub-order) that a
slice group's merge and routing sort rows of many producers by; and
applying such a permutation to a table (``take_permuted``). Knows
nothing else.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

#: ``stable_argsort`` hands keys below ``COUNTING_TOP``, when there are ``COUNTING_MIN_ROWS`` or
#: more, to Arrow, which counts them: slice, container and owner numbers. (Measured here with
#: pyarrow 26: it counts key ranges up to 4,096 at least; at 8,000 it merge-sorts, 8x slower
#: than numpy. Below 65,536 rows numpy's radix sort is as fast.)
COUNTING_TOP = 1024
COUNTING_MIN_ROWS = 1 << 16


def take_permuted(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """``table.take(rows)`` for ``rows`` this process computed in range (an argsort of the
    table's rows, or of some of them): Arrow's bounds check skipped, about a quarter of the
    take of a routed epoch (475 against 629 us for 41,000 words and five int columns). Rows out
    of range would read outside the table: never hand it indexes from outside.

    >>> take_permuted(pa.table({"w": ["a", "b", "c"]}), np.array([2, 0, 1]))["w"].to_pylist()
    ['c', 'a', 'b']
    """
    return pc.take(table, pa.array(rows), boundscheck=False)


def stable_argsort(keys: np.ndarray) -> np.ndarray:
    """The stable argsort of non-negative integer ``keys``: one 16-bit radix sort when they fit
    16 bits, two (low half, then high half: least significant digit first) when they fit 32.

    >>> stable_argsort(np.array([3, 1, 3, 0])).tolist()
    [3, 1, 0, 2]
    >>> stable_argsort(np.array([70000, 5, 70000, 65536, 5])).tolist()
    [1, 4, 3, 0, 2]
    """
    if not len(keys) or int(keys.min()) < 0:
        return np.argsort(keys, kind="stable")
    top = int(keys.max())
    if top < COUNTING_TOP and len(keys) >= COUNTING_MIN_ROWS:
        # Arrow's stable sort counts keys of a small range (a counting sort): one pass where
        # numpy's radix sort makes several, 5x faster from 65,536 rows (0.26 against 1.3 ms
        # for 163,840 slice numbers below 64). Its indices are uint64, below 2**63: viewed.
        return np.asarray(pc.array_sort_indices(pa.array(keys.astype(np.uint16, copy=False)))).view(np.int64)
    if top < 1 << 16:
        return np.argsort(keys.astype(np.uint16, copy=False), kind="stable")
    if top < 1 << 32:
        k = keys.astype(np.uint32, copy=False)
        low = np.argsort((k & 0xFFFF).astype(np.uint16), kind="stable")
        high = np.argsort((k[low] >> 16).astype(np.uint16), kind="stable")
        return low[high]
    return np.argsort(keys, kind="stable")


def hash_argsort(hashes: np.ndarray) -> np.ndarray:
    """A permutation sorting uint64 ``hashes`` (any order among equal ones).

    Hashes are uniform, so a stable 16-bit radix pass on their top bits leaves
    them in 65,536 buckets in order, and a stable sort of that (timsort, which
    takes the ordered stretches as they are) finishes it. Measured here
    against numpy's default argsort (introsort) of the same hashes: 0.1 vs
    0.4 ms at 10,000, 31 vs 81 ms at 1 M, 169 vs 502 ms at 4 M, 2.1 vs 3.8 s
    at 20.8 M (a 1 GB slice's key index rebuilt at a restore).

    >>> h = np.array([3 << 60, 5, 1 << 63, 7, 5], dtype=np.uint64)
    >>> h[hash_argsort(h)].tolist() == sorted(h.tolist())
    True
    """
    if len(hashes) < 2:
        return np.zeros(len(hashes), dtype=np.intp)
    by_top = np.argsort((hashes >> np.uint64(48)).astype(np.uint16), kind="stable")
    return by_top[np.argsort(hashes[by_top], kind="stable")]


def packed_merge_key(owner: np.ndarray, order: np.ndarray, sub: np.ndarray) -> np.ndarray | None:
    """One int64 per row ordered as (``owner``, ``order``, ``sub``): the owner, the order above
    the epoch's lowest and the sub-order as a small number (``sub_order_field``), in bit fields;
    None when they need more than 63 bits.

    >>> packed_merge_key(np.array([1, 0, 0]), np.array([7, 9, 7]), np.array([1 << 50, 0, 5])).tolist()
    [18, 8, 1]
    """
    if not len(owner) or int(owner.min()) < 0:
        return None
    sub_field = sub_order_field(sub)
    sub_bits = max(1, int(sub_field.max()).bit_length())
    low = int(order.min())
    order_bits = max(1, (int(order.max()) - low).bit_length())
    if int(owner.max()).bit_length() + order_bits + sub_bits > 63:
        return None
    return ((owner.astype(np.int64) << (order_bits + sub_bits)) | ((order.astype(np.int64) - low) << sub_bits)
            | sub_field)


def sub_order_field(sub: np.ndarray) -> np.ndarray:
    """Non-negative int64s ordered as ``sub``, as small as cheaply found: the sub-orders above
    the lowest, shifted right by the trailing zero bits they all share (one flat_map's rows
    differ in their top bits only: ``extend_sub_order``), unless that leaves more than 32 bits;
    then each value's rank among the distinct ones (a sort: 0.75-0.94 ms on an epoch of 41,000
    rows, more than the key's sort itself).

    >>> sub_order_field(np.array([3 << 43, 1 << 43, 5 << 43])).tolist()
    [1, 0, 2]
    >>> sub_order_field(np.array([1 << 60, 7, 1 << 40])).tolist()
    [2, 0, 1]
    """
    above = sub.astype(np.int64) - int(sub.min())
    common = int(np.bitwise_or.reduce(above))
    if common:
        above >>= (common & -common).bit_length() - 1
    if int(above.max()).bit_length() <= 32:
        return above
    return np.unique(sub, return_inverse=True)[1].reshape(-1).astype(np.int64)


def tie_free_argsort(packed: np.ndarray | None) -> np.ndarray | None:
    """A permutation sorting ``packed`` (a ``packed_merge_key``), or None when it is None or
    holds ties: rows equal in (owner, order, sub) have their order decided by fields the key
    lacks (producer slice, out_seq), so its callers sort them another way.

    >>> tie_free_argsort(np.array([5, 1, 3])).tolist()
    [1, 2, 0]
    >>> tie_free_argsort(np.array([5, 1, 5])) is None
    True
    """
    if packed is None:
        return None
    perm = np.argsort(packed)  # (not stable: without ties, every sort gives the one order)
    ranked = packed[perm]
    return None if bool(np.any(ranked[1:] == ranked[:-1])) else perm
