"""Specification of chronostream.slices.hashing: the one function that maps keys to slices.

The hash is a cross-process, cross-machine contract (the serial oracle, the
local executor and every Ray container must agree on it), so besides the
properties below a few values are pinned and a pure-Python reference of the
documented algorithm (FNV-1a + length mix for bytes, splitmix64 for
integers) is checked against the vectorized code.
"""

from __future__ import annotations

import datetime as dt
import struct

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chronostream.slices.hashing import hash_array, hash_columns, slice_of, slice_of_scalar

MASK = (1 << 64) - 1
NULL_HASH = 0x9E3779B97F4A7C15

ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
texts = st.text(max_size=12)
finite_floats = st.floats(allow_nan=False, allow_infinity=True, width=64)


# -- a pure-Python reference of the documented algorithm -----------------------


def ref_splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def ref_bytes(b: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in b:
        h = ((h ^ byte) * 0x100000001B3) & MASK
    return h ^ ref_splitmix64(len(b))


def ref_int(v: int) -> int:
    return ref_splitmix64(v & MASK)


def ref_float(f: float) -> int:
    if f == 0.0:
        f = 0.0
    return ref_splitmix64(struct.unpack("<Q", struct.pack("<d", f))[0])


def hashes(arr) -> list[int]:
    return [int(x) for x in hash_array(arr)]


def one_by_one(values, typ) -> list[int]:
    return [int(hash_array(pa.array([v], typ))[0]) for v in values]


# -- stability -------------------------------------------------------------------


def test_known_integer_hashes_are_pinned():
    """Integer hashes are fixed forever (splitmix64(0) is the textbook 0xE220A8397B1DCDAF)."""
    assert hashes(pa.array([0, 1, -1, 2**40])) == [
        16294208416658607535, 10451216379200822465, 16490336266968443936, 2296115805719413641]
    assert hashes(pa.array([0]))[0] == 0xE220A8397B1DCDAF


def test_known_string_hashes_are_pinned():
    """String hashes (including the empty string and non-ASCII UTF-8) are fixed forever."""
    assert hashes(pa.array(["", "a", "hello", "wörd"])) == [
        3013529228739079818, 4497391372655112269, 14354066344916516433, 8201267594425588743]


def test_known_float_bool_timestamp_and_null_hashes_are_pinned():
    """Float, bool, timestamp and null hashes are fixed forever."""
    assert hashes(pa.array([0.0, 1.5, -2.25])) == [16294208416658607535, 15481881892811333770, 2419326526608464148]
    assert hashes(pa.array([False, True])) == [16294208416658607535, 10451216379200822465]
    assert hashes(pa.array([0, 1_700_000_000_000_000], pa.timestamp("us"))) == [
        16294208416658607535, 13238526803727093263]
    assert hashes(pa.array([None], pa.int64())) == [NULL_HASH]


def test_known_multi_column_hashes_and_slices_are_pinned():
    """hash_columns and slice_of give fixed values for a fixed input."""
    assert [int(x) for x in hash_columns([pa.array(["a", "b"]), pa.array([1, 2])])] == [
        16047895125850971986, 11964061032911608950]
    assert slice_of([pa.array(["w0", "w1", "w2", "w3", "w4", "w5"])], 7).tolist() == [5, 0, 6, 1, 4, 1]


@settings(max_examples=60, deadline=None)
@given(st.lists(ints, max_size=20))
def test_integer_hash_matches_reference_splitmix64(values):
    """Each int64 key hashes to splitmix64 of its two's-complement bits."""
    assert hashes(pa.array(values, pa.int64())) == [ref_int(v) for v in values]


@settings(max_examples=60, deadline=None)
@given(st.lists(texts, max_size=20))
def test_string_hash_matches_reference_fnv1a_with_length_mix(values):
    """Each string key hashes to FNV-1a of its UTF-8 bytes xor splitmix64(byte length)."""
    assert hashes(pa.array(values, pa.string())) == [ref_bytes(v.encode()) for v in values]


@settings(max_examples=60, deadline=None)
@given(st.lists(finite_floats, max_size=20))
def test_float_hash_matches_reference_splitmix64_of_bits(values):
    """Each float key hashes to splitmix64 of its IEEE-754 bits (with -0.0 read as 0.0)."""
    assert hashes(pa.array(values, pa.float64())) == [ref_float(v) for v in values]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.none(), texts), max_size=30))
def test_hash_is_identical_on_repeated_calls(values):
    """Hashing the same column twice gives the same values (no hidden state, no randomness)."""
    arr = pa.array(values, pa.string())
    assert np.array_equal(hash_array(arr), hash_array(arr))
    assert hash_array(arr).dtype == np.uint64


# -- independence of layout (offsets, slicing, chunking) ---------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.none(), texts), min_size=1, max_size=40), st.data())
def test_hash_of_sliced_string_array_equals_hash_of_copied_suffix(values, data):
    """hash(arr.slice(k, m)) == hash(pa.array(values[k:k+m])): buffer offsets never leak in."""
    k = data.draw(st.integers(0, len(values)))
    m = data.draw(st.integers(0, len(values) - k))
    for typ in (pa.string(), pa.large_string()):
        arr = pa.array(values, typ)
        assert hashes(arr.slice(k, m)) == hashes(pa.array(values[k:k + m], typ))
        assert hashes(arr.slice(k)) == hashes(pa.array(values[k:], typ))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_hash_of_sliced_fixed_width_array_equals_hash_of_copied_suffix(data):
    """Slicing int, float, bool and timestamp columns does not change any row's hash."""
    typ, elem = data.draw(st.sampled_from([
        (pa.int64(), ints), (pa.int32(), st.integers(-(2**31), 2**31 - 1)),
        (pa.float64(), finite_floats), (pa.bool_(), st.booleans()),
        (pa.timestamp("ns"), st.integers(-(2**62), 2**62)),
    ]))
    values = data.draw(st.lists(st.one_of(st.none(), elem), min_size=1, max_size=40))
    k = data.draw(st.integers(0, len(values)))
    arr = pa.array(values, typ)
    assert hashes(arr.slice(k)) == hashes(pa.array(values[k:], typ))
    assert hashes(arr)[k:] == hashes(arr.slice(k))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.one_of(st.none(), texts), max_size=8), min_size=1, max_size=5))
def test_hash_of_chunked_array_equals_hash_of_contiguous_array(chunks):
    """A ChunkedArray hashes row for row like the same values in one chunk."""
    flat = [v for c in chunks for v in c]
    chunked = pa.chunked_array([pa.array(c, pa.string()) for c in chunks], pa.string())
    assert hashes(chunked) == hashes(pa.array(flat, pa.string()))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.one_of(st.none(), st.sampled_from(["", "a", "b", "ab", "ba", "w0", "wörd", "x" * 40])),
                min_size=257, max_size=700),
       st.integers(0, 100))
def test_dictionary_fast_path_equals_hashing_each_value_alone(values, k):
    """Long columns with repeated keys (the dictionary-encoded path) hash each row like a lone value."""
    arr = pa.array(values, pa.string())
    alone = {v: one_by_one([v], pa.string())[0] for v in set(values) - {None}}
    expected = [NULL_HASH if v is None else alone[v] for v in values]
    assert hashes(arr) == expected
    assert hashes(arr.slice(k)) == expected[k:]  # sliced input, still > 256 rows
    assert hashes(pa.array(values, pa.large_binary()).cast(pa.large_binary())) == [
        NULL_HASH if v is None else ref_bytes(v.encode()) for v in values]


def test_dictionary_fast_path_is_taken_and_matches_slow_path():
    """A 1000-row, 3-distinct-key column (fast path) equals the per-value hash of each key."""
    values = ["alpha", "beta", "gamma"] * 333 + ["alpha"]
    h = hashes(pa.array(values))
    per_key = {v: hashes(pa.array([v]))[0] for v in ("alpha", "beta", "gamma")}
    assert h == [per_key[v] for v in values]


def test_dictionary_typed_column_hashes_like_its_plain_values():
    """A dictionary<int32, string> column hashes like the decoded strings."""
    plain = pa.array(["x", "y", None, "x"])
    assert hashes(plain.dictionary_encode()) == hashes(plain)


# -- key types ---------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-128, 127), max_size=20))
def test_integer_width_does_not_change_the_hash(values):
    """int8/int16/int32/int64 (and unsigned, when in range) of the same value hash alike."""
    base = hashes(pa.array(values, pa.int64()))
    for typ in (pa.int8(), pa.int16(), pa.int32()):
        assert hashes(pa.array(values, typ)) == base
    nonneg = [abs(v) for v in values]
    assert hashes(pa.array(nonneg, pa.uint64())) == hashes(pa.array(nonneg, pa.int64()))


def test_negative_zero_hashes_like_zero():
    """-0.0 and 0.0 are one key: same hash and same slice."""
    h = hashes(pa.array([0.0, -0.0]))
    assert h[0] == h[1]
    assert hashes(pa.array([-0.0], pa.float32())) == hashes(pa.array([0.0]))


def test_float32_hashes_like_float64_of_the_same_value():
    """A float32 column hashes like its values widened to float64 (what to_pylist gives the oracle)."""
    arr = pa.array([1.5, -3.25, 1e10], pa.float32())
    assert hashes(arr) == hashes(pa.array(arr.to_pylist(), pa.float64()))


def test_string_large_string_and_binary_of_same_bytes_hash_alike():
    """The hash reads bytes: string, large_string, binary and large_binary agree."""
    vals = ["", "a", "héllo", "x" * 100]
    base = hashes(pa.array(vals, pa.string()))
    assert hashes(pa.array(vals, pa.large_string())) == base
    assert hashes(pa.array([v.encode() for v in vals], pa.binary())) == base
    assert hashes(pa.array([v.encode() for v in vals], pa.large_binary())) == base


def test_strings_that_differ_only_in_trailing_nul_bytes_hash_apart():
    """The length mix separates "a", "a\\x00" and "a\\x00\\x00" (FNV alone would not for some)."""
    h = hashes(pa.array(["a", "a\x00", "a\x00\x00", "", "\x00"]))
    assert len(set(h)) == 5


def test_bool_keys_hash_like_the_integers_zero_and_one():
    """False/True hash apart, and like the integers 0 and 1."""
    assert hashes(pa.array([False, True])) == hashes(pa.array([0, 1]))
    assert len(set(hashes(pa.array([False, True])))) == 2


def test_timestamp_hashes_as_its_int64_value():
    """A timestamp key hashes like the int64 count of its unit since the epoch."""
    us = [0, 1_700_000_000_123_456, -5]
    assert hashes(pa.array(us, pa.timestamp("us"))) == hashes(pa.array(us, pa.int64()))
    assert hashes(pa.array(us, pa.timestamp("us", tz="UTC"))) == hashes(pa.array(us, pa.int64()))


def test_timestamp_key_routes_the_same_in_the_oracle_and_the_runtime():
    """slice_of_scalar(datetime) (serial executor) equals slice_of on a timestamp[ms] column (runtime)."""
    col = pa.array([dt.datetime(2024, 1, 1, 0, 0, s) for s in range(8)], pa.timestamp("ms"))
    runtime = slice_of([col], 13).tolist()
    oracle = [slice_of_scalar([v], 13) for v in col.to_pylist()]
    assert oracle == runtime


def test_nulls_of_any_type_hash_to_one_constant_distinct_from_zero_values():
    """A null key hashes to the null constant whatever its type, and not like 0, 0.0, False or ""."""
    for typ, zero in ((pa.int64(), 0), (pa.float64(), 0.0), (pa.bool_(), False), (pa.string(), ""),
                      (pa.timestamp("us"), 0)):
        h = hashes(pa.array([None, zero], typ))
        assert h[0] == NULL_HASH
        assert h[1] != NULL_HASH


def test_null_typed_key_hashes_like_a_typed_null():
    """pa.array([None]) (null type) hashes like a null string/int, so slice_of_scalar([None]) works."""
    assert hashes(pa.nulls(2)) == [NULL_HASH, NULL_HASH]
    assert slice_of_scalar([None], 7) == slice_of([pa.array([None], pa.string())], 7)[0]


def test_uint64_keys_above_int64_max_are_hashable():
    """A uint64 key of 2**63 hashes (as its 64-bit pattern, like int64 -2**63)."""
    assert hashes(pa.array([2**63], pa.uint64())) == hashes(pa.array([-(2**63)], pa.int64()))


def test_date32_key_hashes_or_raises_clear_type_error():
    """A date32 key column either hashes or is refused with the TypeError naming the supported types."""
    try:
        h = hashes(pa.array([dt.date(2024, 1, 1), dt.date(2024, 1, 2)]))
    except TypeError as exc:
        assert "cannot hash key column" in str(exc)
    else:
        assert h[0] != h[1]


@pytest.mark.parametrize("arr", [
    pa.array([1], pa.decimal128(5, 2)),
    pa.array([[1, 2]]),
    pa.array([{"a": 1}]),
], ids=["decimal", "list", "struct"])
def test_unsupported_key_type_raises_type_error_naming_the_type(arr):
    """Decimal, list and struct keys are refused with a TypeError naming the type and the alternatives."""
    with pytest.raises(TypeError, match=r"cannot hash key column of type .*use a string, integer"):
        hash_array(arr)


def test_empty_columns_hash_to_empty_arrays():
    """An empty column of any supported type gives an empty uint64 array."""
    for typ in (pa.string(), pa.int64(), pa.float64(), pa.bool_(), pa.large_binary()):
        h = hash_array(pa.array([], typ))
        assert h.shape == (0,) and h.dtype == np.uint64


# -- multi-column keys and slices ------------------------------------------------------


def test_multi_column_key_differs_from_its_first_column_alone():
    """Adding a second key column changes the hash (it is mixed in, not ignored)."""
    a, b = pa.array(["x", "y", "z"]), pa.array([1, 2, 3])
    assert not np.array_equal(hash_columns([a, b]), hash_columns([a]))
    assert np.array_equal(hash_columns([a]), hash_array(a))


def test_multi_column_key_order_matters():
    """(a, b) and (b, a) hash apart."""
    a, b = pa.array([1, 2, 3]), pa.array([4, 5, 6])
    assert not np.array_equal(hash_columns([a, b]), hash_columns([b, a]))


def test_hash_columns_needs_a_column():
    """An empty key is refused with ValueError."""
    with pytest.raises(ValueError, match="at least one key column"):
        hash_columns([])


@settings(max_examples=80, deadline=None)
@given(st.lists(ints, min_size=1, max_size=30), st.lists(texts, min_size=1, max_size=30),
       st.integers(1, 10**9))
def test_slice_of_is_in_range_for_any_slice_count(ivals, svals, n):
    """slice_of returns int64 slices in [0, n) for every row, for any n >= 1."""
    for cols in ([pa.array(ivals)], [pa.array(svals)], [pa.array(ivals[:1] * len(svals)), pa.array(svals)]):
        s = slice_of(cols, n)
        assert s.dtype == np.int64
        assert s.shape == (len(cols[0]),)
        assert ((s >= 0) & (s < n)).all()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(ints, texts, st.booleans()), min_size=1, max_size=3), st.integers(1, 64))
def test_slice_of_scalar_agrees_with_slice_of_columns(key, n):
    """The serial executor's per-key slice equals the runtime's column slice for int/str/bool keys."""
    cols = [pa.array([v]) for v in key]
    assert slice_of_scalar(key, n) == int(slice_of(cols, n)[0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(ints, st.floats(), st.booleans(), texts, st.binary(max_size=4), st.none()),
                min_size=1, max_size=12), st.integers(1, 64))
def test_remembered_scalar_slices_equal_the_slices_of_fresh_one_row_columns(values, n):
    """The serial executor remembers the slices of plain keys: asked again, and asked for values
    that compare equal across types (1, True, 1.0; -0.0, 0.0; NaN), each answer is still its own
    one-row column's slice."""
    for v in values + [True, 1, 1.0, -0.0, 0.0, float("nan")] + values[::-1]:
        assert slice_of_scalar([v], n) == int(slice_of([pa.array([v])], n)[0]), (v, n)


def test_slice_of_with_one_slice_is_all_zero():
    """With one slice every row goes to slice 0."""
    assert slice_of([pa.array(["a", "b", None])], 1).tolist() == [0, 0, 0]


@pytest.mark.parametrize("n", [0, -1])
def test_slice_of_rejects_non_positive_slice_counts(n):
    """num_slices < 1 raises ValueError."""
    with pytest.raises(ValueError, match="num_slices must be >= 1"):
        slice_of([pa.array([1])], n)


def test_slice_of_spreads_many_keys_over_all_slices():
    """10,000 distinct keys cover all 16 slices, none with more than twice its share."""
    s = slice_of([pa.array([f"key{i}" for i in range(10_000)])], 16)
    counts = np.bincount(s, minlength=16)
    assert (counts > 0).all() and counts.max() < 2 * 10_000 / 16


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(["", "a", "b", "ab", "ba", "w0", "wörd", "x" * 40]), min_size=257, max_size=600),
       st.sampled_from([2, 3, 7, 64]), st.booleans())
def test_slices_of_a_repeating_string_column_equal_the_hash_of_each_row_modulo_the_slices(values, n, chunked):
    """Routing takes the slice of each distinct key and gathers it per row; same answer as per row."""
    arr = pa.array(values)
    col = pa.chunked_array([arr[:100], arr[100:]]) if chunked else arr
    expected = [int(h) % n for h in hash_array(arr)]
    assert slice_of([col], n).tolist() == expected
    assert slice_of([col], n).tolist()[:5] == [slice_of_scalar([v], n) for v in values[:5]]
