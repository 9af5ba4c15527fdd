"""Owns how Python values are serialized wherever the runtime stores them: one msgpack codec.

Checkpoints (key-value state parts), the spill store (cold state values and
their keys), window key ordering and state-size sampling all encode with
``packb`` / ``packer`` and decode with ``unpackb`` / ``unpacker`` from here,
so a value that survives one of them survives all of them. On top of
msgpack's plain data (None, bool, int, float, str, bytes, list, dict) the
codec carries, as msgpack ext types, every value an Arrow column gives to
Python and a few a user's operator is likely to hold:

==== ================================ ==========================================
code Python type                      ext data (a msgpack array unless noted)
==== ================================ ==========================================
16   ``datetime``                     wall-clock microseconds since 0001-01-01, fold, zone
17   ``date``                         proleptic ordinal
18   ``time``                         hour, minute, second, microsecond, fold, zone
19   ``timedelta``                    days, seconds, microseconds
20   ``Decimal``                      ``str(d)`` as UTF-8 (exact: digits and exponent)
21   ``pandas.Timestamp``             nanoseconds since 1970 (UTC), unit, zone
22   ``pandas.Timedelta``             nanoseconds, unit
23   ``pandas.NaT``                   empty
24   ``pyarrow.Table``                an Arrow IPC stream (``chronostream.slices.arrow_ipc``)
25   ``pyarrow.RecordBatch``          an IPC stream of the batch
26   ``pyarrow.Array``                an IPC stream of one column named ""
27   ``pyarrow.ChunkedArray``         an IPC stream of one column named "", its chunks
28   ``int`` beyond 64 bits           its decimal digits (msgpack's ints are 64-bit)
==== ================================ ==========================================

A time zone is None, an offset in microseconds (``datetime.timezone``) or a
zone name (``zoneinfo``, ``pytz`` and ``dateutil`` zones; decoded as
``zoneinfo.ZoneInfo``, which is what pyarrow gives for a named zone).
Arrow timestamps of nanosecond unit and durations reach Python as pandas
objects; they come back as pandas objects of the same unit, so a column
rebuilt from restored state infers the same type. numpy scalars are
stored as the Python number they hold. Tuples are msgpack arrays: they come
back as tuples where the reader asks for them (state keys) and as lists
elsewhere, as with plain msgpack.

The codes are part of the stored format: a code, once written, keeps its
meaning. Codes below 16 belong to the frames that embed this codec (code 1:
a checkpoint's attached binary, ``slices.checkpoint``). Nothing here executes
code on load (no pickle): every decoder builds a value of a fixed type from
numbers and strings. A value of any other type fails with
``StateEncodingError`` naming its type; a caller that knows the state,
stage or slice adds them to the message.
"""

from __future__ import annotations

import datetime as dt
import io
import sys
from decimal import Decimal
from importlib import import_module
from typing import Any, BinaryIO, Callable
from zoneinfo import ZoneInfo

import msgpack
import numpy as np
import pyarrow as pa

from chronostream.slices.arrow_ipc import read_stream, stream_buffer
from chronostream.slices.errors import StateEncodingError

DATETIME, DATE, TIME, TIMEDELTA, DECIMAL = 16, 17, 18, 19, 20
PD_TIMESTAMP, PD_TIMEDELTA, PD_NAT = 21, 22, 23
ARROW_TABLE, ARROW_BATCH, ARROW_ARRAY, ARROW_CHUNKED = 24, 25, 26, 27
BIG_INT = 28

_US = dt.timedelta(microseconds=1)


def _zone(tz: dt.tzinfo | None) -> int | str | None:
    """A tzinfo as plain data: None, a fixed offset in microseconds, or a zone name."""
    if tz is None:
        return None
    key = getattr(tz, "key", None)  # zoneinfo.ZoneInfo
    if isinstance(key, str):
        return key
    offset = tz.utcoffset(None)  # a fixed offset (datetime.timezone, pytz's FixedOffset): the same at every instant
    if offset is not None:
        return offset // _US
    try:
        return pa.lib.tzinfo_to_string(tz)  # pytz and dateutil zones, by their name
    except Exception:  # noqa: BLE001 - any refusal means: not a zone with a name
        raise StateEncodingError(f"cannot encode a value with time zone {tz!r} ({type(tz).__name__}): "
                                 "only fixed offsets and named zones are stored") from None


def _tzinfo(zone: int | str | None) -> dt.tzinfo | None:
    if zone is None:
        return None
    if isinstance(zone, int):
        return dt.timezone.utc if zone == 0 else dt.timezone(zone * _US)
    return ZoneInfo(zone)


def _ext(code: int, *fields: Any) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(fields, use_bin_type=True))  # numbers and strings only


def _fields(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False, use_list=True)


def _enc_datetime(v: dt.datetime) -> msgpack.ExtType:
    # The wall clock, its fold and the zone: every field comes back as it was, an imaginary or
    # ambiguous local time included.
    tz = v.tzinfo
    wall = (v.replace(tzinfo=None) - dt.datetime.min) // _US
    zone = _zone(tz)
    fold = v.fold
    if isinstance(zone, str) and not isinstance(tz, ZoneInfo):
        # A pytz zone keeps the offset in the tzinfo, not in ``fold``: pick the fold under which
        # the ZoneInfo it decodes to gives that offset (the second of an ambiguous hour: 1).
        fold = int(v.replace(tzinfo=ZoneInfo(zone), fold=0).utcoffset() != v.utcoffset())
    return _ext(DATETIME, wall, fold, zone)


def _dec_datetime(data: bytes) -> dt.datetime:
    wall, fold, zone = _fields(data)
    return (dt.datetime.min + wall * _US).replace(tzinfo=_tzinfo(zone), fold=fold)


def _dec_date(data: bytes) -> dt.date:
    return dt.date.fromordinal(_fields(data)[0])


def _enc_time(v: dt.time) -> msgpack.ExtType:
    return _ext(TIME, v.hour, v.minute, v.second, v.microsecond, v.fold, _zone(v.tzinfo))


def _dec_time(data: bytes) -> dt.time:
    h, m, s, us, fold, zone = _fields(data)
    return dt.time(h, m, s, us, _tzinfo(zone), fold=fold)


def _dec_timedelta(data: bytes) -> dt.timedelta:
    days, seconds, us = _fields(data)
    return dt.timedelta(days, seconds, us)


def _pandas() -> Any:
    # Imported when a pandas value is decoded, not with this module: every host process
    # imports the codec and most never meet a pandas value (pandas costs 0.2 s to import).
    return import_module("pandas")


def _enc_pd_timestamp(v: Any) -> msgpack.ExtType:
    return _ext(PD_TIMESTAMP, v.value, v.unit, _zone(v.tzinfo))


def _dec_pd_timestamp(data: bytes) -> Any:
    ns, unit, zone = _fields(data)
    return _pandas().Timestamp(ns, unit="ns", tz=_tzinfo(zone)).as_unit(unit)


def _dec_pd_timedelta(data: bytes) -> Any:
    ns, unit = _fields(data)
    return _pandas().Timedelta(ns, unit="ns").as_unit(unit)


def _ipc(table: pa.Table) -> bytes:
    return stream_buffer(table).to_pybytes()


def _one_column(data: bytes) -> pa.ChunkedArray:
    return read_stream(data).column(0)


def _dec_array(data: bytes) -> pa.Array:
    col = _one_column(data)
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def _dec_batch(data: bytes) -> pa.RecordBatch:
    t = read_stream(data)
    return t.combine_chunks().to_batches()[0] if t.num_rows else pa.RecordBatch.from_pylist([], schema=t.schema)


#: Exact type -> encoder. A subclass (``bool`` is no concern: msgpack packs it) is looked up
#: along its MRO once and remembered.
_ENCODERS: dict[type, Callable[[Any], Any]] = {
    dt.datetime: _enc_datetime,
    dt.date: lambda v: _ext(DATE, v.toordinal()),
    dt.time: _enc_time,
    dt.timedelta: lambda v: _ext(TIMEDELTA, v.days, v.seconds, v.microseconds),
    Decimal: lambda v: msgpack.ExtType(DECIMAL, str(v).encode()),
    pa.Table: lambda v: msgpack.ExtType(ARROW_TABLE, _ipc(v)),
    pa.RecordBatch: lambda v: msgpack.ExtType(ARROW_BATCH, _ipc(pa.Table.from_batches([v]))),
    pa.Array: lambda v: msgpack.ExtType(ARROW_ARRAY, _ipc(pa.table({"": v}))),
    pa.ChunkedArray: lambda v: msgpack.ExtType(ARROW_CHUNKED, _ipc(pa.table({"": v}))),
    np.generic: lambda v: _numpy_scalar(v),
    int: lambda v: msgpack.ExtType(BIG_INT, str(int(v)).encode()),  # (msgpack asks only beyond 64 bits)
}

#: Ext code -> decoder.
_DECODERS: dict[int, Callable[[bytes], Any]] = {
    DATETIME: _dec_datetime,
    DATE: _dec_date,
    TIME: _dec_time,
    TIMEDELTA: _dec_timedelta,
    DECIMAL: lambda data: Decimal(data.decode()),
    PD_TIMESTAMP: _dec_pd_timestamp,
    PD_TIMEDELTA: _dec_pd_timedelta,
    PD_NAT: lambda data: _pandas().NaT,
    ARROW_TABLE: read_stream,
    ARROW_BATCH: _dec_batch,
    ARROW_ARRAY: _dec_array,
    ARROW_CHUNKED: _one_column,
    BIG_INT: lambda data: int(data.decode()),
}


def _numpy_scalar(v: np.generic) -> Any:
    if isinstance(v, (np.integer, np.floating, np.bool_)):
        return v.item()
    raise StateEncodingError(f"cannot encode a value of type numpy.{type(v).__name__} ({v!r}): "
                             "store it as a Python value")


def _pandas_encoder(t: type) -> Callable[[Any], Any] | None:
    """The encoder of a pandas type (pandas is looked for only when it is loaded: a process
    that never imported it holds no pandas value)."""
    pd = sys.modules.get("pandas")
    if pd is None:
        return None
    if issubclass(t, pd.Timestamp):
        return _enc_pd_timestamp
    if issubclass(t, pd.Timedelta):
        return lambda v: _ext(PD_TIMEDELTA, v.value, v.unit)
    if t is type(pd.NaT):
        return lambda v: msgpack.ExtType(PD_NAT, b"")
    return None


def default(obj: Any) -> Any:
    """msgpack's ``default`` hook: the ext type (or plain value) for a value msgpack does not know."""
    t = type(obj)
    enc = _ENCODERS.get(t)
    if enc is None:
        enc = _pandas_encoder(t)  # before the MRO walk: pandas types subclass datetime/timedelta
        if enc is None:
            enc = next((_ENCODERS[base] for base in t.__mro__[1:] if base in _ENCODERS), None)
        if enc is None:
            raise StateEncodingError(f"cannot encode a value of type {t.__module__}.{t.__qualname__} "
                                     f"({_short(obj)}): state values must be plain data (None, bool, int, "
                                     "float, str, bytes, list, tuple, dict), dates and times, Decimal, "
                                     "or Arrow tables and arrays")
        _ENCODERS[t] = enc
    return enc(obj)


def ext_hook(code: int, data: bytes) -> Any:
    """msgpack's ``ext_hook``: the value of one of this codec's ext types."""
    dec = _DECODERS.get(code)
    if dec is None:
        raise StateEncodingError(f"cannot decode msgpack ext type {code}: not a type this codec writes")
    return dec(data)


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


def packer() -> msgpack.Packer:
    """A reusable packer of this codec (one per thread: a Packer is not thread-safe)."""
    return msgpack.Packer(use_bin_type=True, default=default)


def packb(obj: Any) -> bytes:
    """``obj`` as msgpack bytes; ``StateEncodingError`` names any value it cannot carry.

    >>> unpackb(packb({"t": dt.datetime(2013, 1, 1, 5, 0, 0, 17), "p": Decimal("1.20")}))
    {'t': datetime.datetime(2013, 1, 1, 5, 0, 0, 17), 'p': Decimal('1.20')}
    """
    try:
        return msgpack.packb(obj, use_bin_type=True, default=default)
    except StateEncodingError:
        raise
    except (TypeError, OverflowError, ValueError) as exc:  # an int beyond 64 bits, a cycle, ...
        raise StateEncodingError(f"cannot encode {_short(obj)}: {exc}") from None


def unpackb(data: bytes | memoryview, use_list: bool = True) -> Any:
    """The value of ``packb`` bytes (arrays as lists, or as tuples with ``use_list=False``)."""
    return msgpack.unpackb(data, raw=False, use_list=use_list, strict_map_key=False, ext_hook=ext_hook)


def unpacker(stream: BinaryIO | io.BytesIO, use_list: bool = True) -> msgpack.Unpacker:
    """An unpacker reading this codec's values one at a time from ``stream``."""
    return msgpack.Unpacker(stream, raw=False, use_list=use_list, strict_map_key=False, ext_hook=ext_hook)
