"""Stable, vectorized hashing of key columns to slices.

Owns: the one function that maps keys to slices. The hash is the same in
every process, machine, Python version and run (never Python's ``hash()``),
and it hashes a whole Arrow column at once: FNV-1a over the UTF-8 / binary
bytes (one numpy pass per byte position, not per row), splitmix64 over
integers, and a final splitmix64 mix. Knows nothing of slices' contents.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_NULL_HASH = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64, copy=True)
        z += np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


_PADDED_BYTES_LIMIT = 1 << 22  # rows x longest value: above it, no padded byte matrix


def _offsets_and_data(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A string/binary array's value offsets (``len(arr) + 1``, slicing applied) and its
    data buffer, as numpy views."""
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int64 if large else np.int32,
                            count=arr.offset + len(arr) + 1)[arr.offset:]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    return offsets, data


def _hash_binary(arr: pa.Array) -> np.ndarray:
    """FNV-1a of each value's bytes, vectorized over rows (loop over byte positions)."""
    n = len(arr)
    offsets, data = _offsets_and_data(arr)
    starts = offsets[:-1].astype(np.int64)
    lengths = (offsets[1:] - offsets[:-1]).astype(np.int64)
    h = np.full(n, _FNV_OFFSET, dtype=np.uint64)
    if n == 0:
        return h
    # Rows sorted by length: at byte position j the rows still going are a
    # suffix, so each position is two in-place ufuncs on that suffix. The
    # fixed cost per call matters: a container hashes every slice's new keys
    # each epoch, and a slice's batch can be a few hundred rows.
    order = np.argsort(lengths, kind="stable")
    sorted_len = lengths[order]
    sorted_start = starts[order]
    hs = h[order]
    max_len = int(sorted_len[-1])
    first_live = np.searchsorted(sorted_len, np.arange(max_len), side="right").tolist()
    with np.errstate(over="ignore"):
        if n * max_len <= _PADDED_BYTES_LIMIT and len(data):
            # One gather for every byte (positions past a value's end are clipped
            # and never read: they are outside the live suffix).
            pos = np.minimum(sorted_start[:, None] + np.arange(max_len), len(data) - 1)
            padded = data[pos].astype(np.uint64).T.copy()  # row j: byte j of every value
            for j, lo in enumerate(first_live):
                live = hs[lo:]
                np.bitwise_xor(live, padded[j, lo:], out=live)
                np.multiply(live, _FNV_PRIME, out=live)
        else:
            for j, lo in enumerate(first_live):
                if lo >= n:
                    break
                live = slice(lo, n)
                byte = data[sorted_start[live] + j].astype(np.uint64)
                hs[live] = (hs[live] ^ byte) * _FNV_PRIME
    h[order] = hs
    # Mix in the length so "" and a value of zero bytes hash apart from prefixes.
    return h ^ _splitmix64(lengths.astype(np.uint64))


def _temporal_as_int64(arr: pa.Array) -> np.ndarray:
    """Temporal values in one canonical unit (microseconds, days for dates) as int64.

    Canonical units make a timestamp[ms] column and the Python datetime the
    serial executor sees hash alike (finer units are truncated: hashing needs
    consistency, not injectivity).
    """
    t = arr.type
    if pa.types.is_timestamp(t):
        arr = arr.cast(pa.timestamp("us", tz=t.tz), safe=False)
    elif pa.types.is_date(t):
        arr = arr.cast(pa.date32()).cast(pa.int32())
    elif pa.types.is_time(t):
        arr = arr.cast(pa.time64("us"), safe=False)
    elif pa.types.is_duration(t):
        arr = arr.cast(pa.duration("us"), safe=False)
    else:
        raise TypeError(f"cannot hash key column of type {t}; use a string, integer, float, bool or temporal key")
    return np.asarray(arr.cast(pa.int64()).fill_null(0), dtype=np.int64)


def _is_binary(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _distinct_hashes(arr: pa.Array) -> tuple[np.ndarray, pa.DictionaryArray] | None:
    """(hash of each distinct value, the column dictionary-encoded) for a string/binary column
    whose values repeat; None when it is short or mostly distinct (hash the rows directly).

    Keys repeat (that is why they are keys): each distinct value is hashed once.
    """
    if len(arr) <= 256:
        return None
    encoded = pc.dictionary_encode(arr)
    if len(encoded.dictionary) * 2 >= len(arr):
        return None
    return _hash_binary(encoded.dictionary), encoded


def binary_fingerprint(arr: pa.Array) -> int:
    """CRC-32 of a string/binary array's value lengths and bytes: equal for arrays of equal
    values (whatever their offsets or slicing), so a hash computed for one array can be
    checked to belong to another before it is trusted (``KEY_HASHES_META``).

    >>> binary_fingerprint(pa.array(["ab", "c"])) == binary_fingerprint(pa.array(["x", "ab", "c"]).slice(1))
    True
    >>> binary_fingerprint(pa.array(["ab", "c"])) == binary_fingerprint(pa.array(["a", "bc"]))
    False
    """
    offsets, data = _offsets_and_data(arr)
    lengths = np.diff(offsets).astype(np.int64)
    return zlib.crc32(data[int(offsets[0]):int(offsets[-1])], zlib.crc32(lengths.tobytes()))


def _contiguous(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    return (arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)) if isinstance(arr, pa.ChunkedArray) else arr


def hash_array(arr: pa.Array | pa.ChunkedArray, distinct: bool = False) -> np.ndarray:
    """Return a stable uint64 hash per value of an Arrow array.

    ``distinct``: the caller knows the values are distinct (a key dictionary),
    so there are no repeats worth finding first.

    >>> int(hash_array(pa.array(["a"]))[0]) == int(hash_array(pa.array(["x", "a"]))[1])
    True
    """
    arr = _contiguous(arr)
    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.cast(t.value_type)
        t = arr.type
    if _is_binary(t):
        repeats = None if distinct else _distinct_hashes(arr)
        if repeats is not None:
            dict_hash, encoded = repeats
            idx = np.asarray(encoded.indices.fill_null(0), dtype=np.int64)
            h = dict_hash[idx] if len(dict_hash) else np.zeros(len(arr), np.uint64)
        else:
            h = _hash_binary(arr)
    elif pa.types.is_null(t):
        h = np.full(len(arr), _NULL_HASH, dtype=np.uint64)
    elif pa.types.is_boolean(t):
        h = _splitmix64(np.asarray(arr.fill_null(False).cast(pa.uint8()), dtype=np.uint64))
    elif pa.types.is_unsigned_integer(t):
        h = _splitmix64(np.asarray(arr.cast(pa.uint64()).fill_null(0), dtype=np.uint64))
    elif pa.types.is_integer(t):
        h = _splitmix64(np.asarray(arr.cast(pa.int64()).fill_null(0), dtype=np.int64).view(np.uint64))
    elif pa.types.is_temporal(t):
        h = _splitmix64(_temporal_as_int64(arr).view(np.uint64))
    elif pa.types.is_floating(t):
        f = np.asarray(arr.cast(pa.float64()).fill_null(0.0), dtype=np.float64)
        f = np.where(f == 0.0, 0.0, f)  # -0.0 and 0.0 are one key
        f = np.where(np.isnan(f), np.nan, f)  # every NaN is one key
        h = _splitmix64(f.view(np.uint64))
    else:
        raise TypeError(f"cannot hash key column of type {t}; use a string, integer, float, bool or temporal key")
    if arr.null_count:
        valid = np.asarray(pc.is_valid(arr), dtype=bool)
        h = np.where(valid, h, _NULL_HASH)
    return h


def hash_columns(columns: Sequence[pa.Array | pa.ChunkedArray], distinct: bool = False) -> np.ndarray:
    """Combine the stable hashes of several key columns (order matters).

    ``distinct``: each column's values are distinct (see ``hash_array``).
    """
    if not columns:
        raise ValueError("hash_columns needs at least one key column")
    h = hash_array(columns[0], distinct)
    with np.errstate(over="ignore"):
        for col in columns[1:]:
            h = _splitmix64(h * np.uint64(31) ^ hash_array(col, distinct))
    return h


def slice_of(columns: Sequence[pa.Array | pa.ChunkedArray], num_slices: int) -> np.ndarray:
    """Return the slice (0..num_slices-1) of each row, as int64.

    >>> slice_of([pa.array([1, 2, 3])], 1).tolist()
    [0, 0, 0]
    """
    return slice_and_codes(columns, num_slices)[0]


def slice_and_codes(columns: Sequence[pa.Array | pa.ChunkedArray],
                    num_slices: int) -> tuple[np.ndarray, pa.DictionaryArray | None]:
    """``slice_of``, with the key column dictionary-encoded when that encoding was the
    way there (one string key column without nulls, whose values repeat); else None.

    A consumer that groups rows by the key can reuse the codes instead of
    encoding the column again (``containers.routing``, ``KEY_CODES``).

    >>> s, codes = slice_and_codes([pa.array(["a", "b"] * 200)], 4)
    >>> codes.dictionary.to_pylist(), bool((s == slice_of([pa.array(["a", "b"] * 200)], 4)).all())
    (['a', 'b'], True)
    """
    return slices_codes_and_hashes(columns, num_slices)[:2]


def slices_codes_and_hashes(columns: Sequence[pa.Array | pa.ChunkedArray], num_slices: int
                            ) -> tuple[np.ndarray, pa.DictionaryArray | None, np.ndarray | None]:
    """``slice_and_codes``, and the hash of each value of the codes' dictionary (None without
    codes): ``hash_array(codes.dictionary, distinct=True)``, already computed on the way.

    >>> s, codes, h = slices_codes_and_hashes([pa.array(["a", "b"] * 200)], 4)
    >>> bool((h == hash_array(codes.dictionary, distinct=True)).all())
    True
    """
    if num_slices < 1:
        raise ValueError(f"num_slices must be >= 1, got {num_slices}")
    if len(columns) == 1:
        arr = _contiguous(columns[0])
        if _is_binary(arr.type) and not arr.null_count:
            repeats = _distinct_hashes(arr)
            if repeats is not None:  # the slice of each distinct key, then of each row
                dict_hash, encoded = repeats
                idx = np.asarray(encoded.indices, dtype=np.int64)
                return (dict_hash % np.uint64(num_slices)).astype(np.int64)[idx], encoded, dict_hash
    return (hash_columns(columns) % np.uint64(num_slices)).astype(np.int64), None, None


# Key value types whose equal values (same exact type) always build the same
# one-row Arrow array, so their slice can be remembered. Floats qualify: the
# hash already treats -0.0 and 0.0 as one key and every NaN as one key (a NaN
# unequal to itself only misses the memo).
_MEMO_TYPES = frozenset({str, int, float, bool, bytes, type(None)})
_MEMO_LIMIT = 1 << 16
_scalar_slices: dict[tuple, int] = {}


def slice_of_scalar(values: Sequence[object], num_slices: int) -> int:
    """The slice of one key given as Python values (used by the serial executor).

    The serial executor routes one event at a time, and building and hashing a
    one-row array costs about 0.2 ms: the slices of plain keys (str, int,
    float, bool, bytes, None) are remembered, up to 65,536 of them.

    >>> slice_of_scalar(["a"], 8) == int(slice_of([pa.array(["a"])], 8)[0])
    True
    """
    if all(type(v) in _MEMO_TYPES for v in values):
        memo = (num_slices, *[(type(v), v) for v in values])
        hit = _scalar_slices.get(memo)
        if hit is None:
            if len(_scalar_slices) >= _MEMO_LIMIT:
                _scalar_slices.clear()
            hit = _scalar_slices[memo] = int(slice_of([pa.array([v]) for v in values], num_slices)[0])
        return hit
    return int(slice_of([pa.array([v]) for v in values], num_slices)[0])
