"""Seeded source tables for the simulator's random queries: keys, event times, values and
payloads of many Arrow types.

Owns: what a source table of a random query holds (``DataShape``: the column kinds one query's
sources share) and drawing it from a ``numpy.random.Generator`` (``draw_shape``,
``draw_table``), the same table bit for bit from the same generator state. Knows nothing of
queries, operators or the runtime.

Every source table has these columns (``BASE_COLUMNS``):

====== ===================================================================================
``i``  int64, the row's position in its source (0..n-1)
``t``  event time, non-decreasing in row order: int64, or ``timestamp[us, tz]``
``k``  the key: a string with odd unicode (combining marks, emoji, right-to-left text,
       NFC and NFD spellings of one word as two keys) or an int64; Zipf-distributed (hot
       keys); null in a few rows when ``DataShape.null_keys``
``g``  int64 in ``[0, groups)``: a second, small key
``v``  int64 in [-500, 500], never null
``x``  float64, multiples of 1/8 in [-500, 500] (sums of them are exact), never null
====== ===================================================================================

and some of the payloads (``PAYLOADS``): ``n`` (nullable int64), ``dec`` (decimal128(12, 3),
nullable), ``txt`` (odd unicode text, nullable), ``lst`` (list<int32>: empty lists, nulls, null
items), ``st`` (struct<a: int64, b: string>, nullable), ``ts2`` (a second timestamp with a
time zone, nullable) and ``nul`` (a column of Arrow's null type: every value null). No NaN
anywhere: NaN is not equal to itself, so rows holding one could not be compared with the
serial executor's.

>>> rng = np.random.default_rng(1)
>>> shape = draw_shape(rng)
>>> t = draw_table(rng, shape, rows=5, start=0)
>>> t.num_rows, t.schema.names[:6]
(5, ['i', 't', 'k', 'g', 'v', 'x'])
"""

from __future__ import annotations

import datetime as dt
import decimal
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

BASE_COLUMNS = ("i", "t", "k", "g", "v", "x")
PAYLOADS = ("n", "dec", "txt", "lst", "st", "ts2", "nul")
#: Time zones of timestamp columns: named zones with odd offsets and fixed offsets.
ZONES = ("UTC", "Asia/Kolkata", "America/St_Johns", "Asia/Kathmandu", "+05:45", "-03:30")
#: Pieces of key and text values: combining marks, emoji (with joiners and flags), right-to-left
#: scripts, a right-to-left override, zero-width characters, a ligature, "é" spelled NFC and NFD.
ODD_TEXT = ("é", "e\u0301", "👩\u200d🚀", "🇫🇷", "שלום", "مرحبا", "a\u200bb", "Ω", "ǅ", "\u202eevil",
            "日本語", "x\u0308\u0301", "😀😀", "ﬁ", "İ", "z", "", " ")
#: Event times of timestamp columns start here (microseconds since the Unix epoch: 2024-03-10).
TS_BASE_US = 1_710_028_800_000_000


@dataclass(frozen=True)
class DataShape:
    """What the sources of one query share: the time column's type, the key's kind and
    distribution, and which payload columns they carry."""

    time_kind: str  # "int" | "ts"
    zone: str  # the time zone of ``t`` when a timestamp, and of ``ts2``
    key_kind: str  # "str" | "int"
    keys: int  # distinct keys
    zipf_a: float  # Zipf exponent of the key frequencies (hot keys)
    null_keys: bool  # a few rows have a null key
    groups: int  # distinct values of ``g``
    time_step: int  # largest gap between consecutive event times (seconds for timestamps)
    payloads: tuple[str, ...]

    def features(self) -> set[str]:
        """The type feature tags of these tables (``RandomQuery.features``)."""
        out = {f"{self.key_kind}_key", "hot_keys" if self.zipf_a < 1.6 else "zipf_keys"}
        out |= {"timestamp_tz"} if self.time_kind == "ts" or "ts2" in self.payloads else set()
        out |= {"null_key"} if self.null_keys else set()
        names = {"n": "nulls", "dec": "decimal", "txt": "unicode", "lst": "list", "st": "struct", "nul": "null_column"}
        out |= {names[p] for p in self.payloads if p in names}
        if self.key_kind == "str":
            out.add("unicode")
        return out


def draw_shape(rng: np.random.Generator) -> DataShape:
    """One query's ``DataShape``."""
    payloads = tuple(p for p in PAYLOADS if rng.random() < 0.45)
    return DataShape(
        time_kind="ts" if rng.random() < 0.35 else "int",
        zone=str(ZONES[int(rng.integers(len(ZONES)))]),
        key_kind="str" if rng.random() < 0.6 else "int",
        keys=int(rng.choice([3, 8, 20, 60, 200])),
        zipf_a=float(rng.choice([1.2, 1.5, 2.0, 3.0])),
        null_keys=bool(rng.random() < 0.12),
        groups=int(rng.integers(2, 8)),
        time_step=int(rng.choice([1, 3, 10])),
        payloads=payloads,
    )


def odd_strings(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` distinct strings made of ``ODD_TEXT`` pieces and a number."""
    out: list[str] = []
    seen: set[str] = set()
    i = 0
    while len(out) < n:
        a, b = (ODD_TEXT[int(j)] for j in rng.integers(len(ODD_TEXT), size=2))
        s = f"{a}{i}{b}" if rng.random() < 0.8 else a + b
        i += 1
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def _zipf_index(rng: np.random.Generator, a: float, n: int, universe: int) -> np.ndarray:
    """``n`` indices in ``[0, universe)``, Zipf(``a``)-distributed (index 0 the hottest)."""
    return np.minimum(rng.zipf(a, n) - 1, universe - 1)


def _key_column(rng: np.random.Generator, shape: DataShape, rows: int) -> pa.Array:
    idx = _zipf_index(rng, shape.zipf_a, rows, shape.keys)
    null = rng.random(rows) < (0.03 if shape.null_keys else 0.0)
    if shape.key_kind == "str":
        universe = odd_strings(np.random.default_rng(int(shape.keys * 7919 + shape.groups)), shape.keys)
        return pa.array([None if z else universe[j] for j, z in zip(idx.tolist(), null.tolist())], pa.string())
    # Int keys spread over a wide range (negative ones too), the hottest first.
    universe_i = np.random.default_rng(shape.keys).permutation(shape.keys) * 1_000_003 - 40_000_000
    return pa.array([None if z else int(universe_i[j]) for j, z in zip(idx.tolist(), null.tolist())], pa.int64())


def _time_column(rng: np.random.Generator, shape: DataShape, rows: int, start: int) -> pa.Array:
    """Non-decreasing event times (ties included) from ``start`` steps."""
    steps = start + np.cumsum(rng.integers(0, shape.time_step + 1, rows))
    if shape.time_kind == "int":
        return pa.array(steps.astype(np.int64), pa.int64())
    return pa.array((TS_BASE_US + steps * 1_000_000).astype(np.int64), pa.int64()).cast(
        pa.timestamp("us", tz=shape.zone))


def _nullable(rng: np.random.Generator, values: list, share: float) -> list:
    nulls = rng.random(len(values)) < share
    return [None if z else v for v, z in zip(values, nulls.tolist())]


def _payload(rng: np.random.Generator, shape: DataShape, name: str, rows: int) -> pa.Array:
    if name == "n":
        return pa.array(_nullable(rng, rng.integers(-50, 50, rows).tolist(), 0.2), pa.int64())
    if name == "dec":
        vals = [decimal.Decimal(int(u)).scaleb(-3) for u in rng.integers(-10**9, 10**9, rows)]
        return pa.array(_nullable(rng, vals, 0.1), pa.decimal128(12, 3))
    if name == "txt":
        pool = odd_strings(rng, 40)
        return pa.array(_nullable(rng, [pool[int(j)] for j in rng.integers(40, size=rows)], 0.1), pa.string())
    if name == "lst":
        lens = rng.integers(0, 4, rows).tolist()
        vals = [[None if rng.random() < 0.1 else int(rng.integers(-9, 9)) for _ in range(m)] for m in lens]
        return pa.array(_nullable(rng, vals, 0.1), pa.list_(pa.int32()))
    if name == "st":
        pool = odd_strings(rng, 10)
        pairs = zip(rng.integers(-99, 99, rows).tolist(), rng.integers(10, size=rows).tolist())
        vals = [{"a": a, "b": pool[b]} for a, b in pairs]
        return pa.array(_nullable(rng, vals, 0.1), pa.struct([("a", pa.int64()), ("b", pa.string())]))
    if name == "nul":
        return pa.nulls(rows)
    if name == "ts2":
        us = TS_BASE_US + rng.integers(-10**12, 10**12, rows)
        return pa.array(_nullable(rng, us.tolist(), 0.1), pa.int64()).cast(pa.timestamp("us", tz=shape.zone))
    raise ValueError(f"unknown payload {name!r}")


def draw_table(rng: np.random.Generator, shape: DataShape, rows: int, start: int) -> pa.Table:
    """One source table of ``rows`` rows in ``shape``; its event times start ``start`` steps in."""
    cols = {
        "i": pa.array(np.arange(rows, dtype=np.int64)),
        "t": _time_column(rng, shape, rows, start),
        "k": _key_column(rng, shape, rows),
        "g": pa.array(rng.integers(0, shape.groups, rows).astype(np.int64)),
        "v": pa.array(rng.integers(-500, 501, rows).astype(np.int64)),
        "x": pa.array(rng.integers(-4000, 4001, rows).astype(np.float64) / 8.0),
    }
    for p in shape.payloads:
        cols[p] = _payload(rng, shape, p, rows)
    return pa.table(cols)


def time_us(value: object) -> int:
    """A ``t`` value as a number: an int as it is, a timestamp in microseconds since the epoch.

    >>> time_us(dt.datetime(1970, 1, 1, 0, 0, 1, tzinfo=dt.timezone.utc)), time_us(7)
    (1000000, 7)
    """
    if isinstance(value, dt.datetime):
        epoch = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
        return (value - epoch) // dt.timedelta(microseconds=1)
    return int(value)  # type: ignore[call-overload]
