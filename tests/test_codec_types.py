"""Every value a stream can carry survives every place the runtime stores it.

Python values (what Arrow columns give to Python and what operators keep in
state: datetimes naive and zoned, dates, times, durations, Decimal, bytes,
lists, dicts, None, pandas timestamps) go through the shared codec
(``chronostream.slices.codec``) in checkpoints and the spill store; Arrow tables
of every type go through checkpoints' table parts, carried outputs, the
output log and the codec. A round trip must give the same types and the
same values. The built-in join keyed on a timestamp column is checkpointed
and restored at the kernel level (no Ray) and in a local cluster that kills
a container, against the uninterrupted run and the serial executor.
"""

from __future__ import annotations

import datetime as dt
import random
from collections import defaultdict
from decimal import Decimal
from zoneinfo import ZoneInfo

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import chronostream as cs
from chronostream.slices import codec
from chronostream.dag import compile_query
from chronostream.slices.errors import ChronoStreamError, StateEncodingError
from chronostream.slices.state import KeyValueState
from chronostream.containers.backup_store import BackupStore
from chronostream.containers.output_log import OutputLog
from chronostream.containers.spill import SpillStore
from chronostream.master.local import LocalCluster, build_cores
from chronostream.master.placement import containers_per_stage, initial_placement
from queries import per_key_sequences
from chronostream.slices.checkpoint import (CarriedOutputs, SliceCheckpoint, capture, capture_kv, decode, decode_outputs, encode,
                               encode_outputs, frozen_table_part, read_table_part, restore, restore_kv)
from chronostream.slices.slice import SliceRuntime

NY = ZoneInfo("America/New_York")


# -- Python values ------------------------------------------------------------------------


def same(a, b) -> bool:
    """Equal in type and value, all the way down (an aware datetime also in its zone and offset,
    a naive one in its fold, a Decimal in its digits and exponent, a float in its sign)."""
    if type(a) is not type(b):
        return False
    if a is pd.NaT:
        return b is pd.NaT
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return repr(a) == repr(b)
    if isinstance(a, Decimal):
        return str(a) == str(b)
    if isinstance(a, (dt.datetime, dt.time)) and not isinstance(a, pd.Timestamp):
        return a == b and a.fold == b.fold and str(a) == str(b) and a.tzname() == b.tzname() \
            and (a.utcoffset() if isinstance(a, dt.datetime) else True) == \
            (b.utcoffset() if isinstance(b, dt.datetime) else True)
    if isinstance(a, (pd.Timestamp, pd.Timedelta)):
        return a == b and a.unit == b.unit and a.isoformat() == b.isoformat()
    return a == b


def aware_datetimes():
    return st.builds(lambda d, tz: d.replace(tzinfo=tz),
                     st.datetimes(min_value=dt.datetime(1900, 1, 2), max_value=dt.datetime(2200, 1, 1)),
                     st.sampled_from([dt.timezone.utc, dt.timezone(dt.timedelta(hours=5, minutes=30)),
                                      dt.timezone(-dt.timedelta(hours=8)), NY, ZoneInfo("Europe/Paris"),
                                      ZoneInfo("UTC"), ZoneInfo("Asia/Kathmandu")]))


SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
    st.text(max_size=8), st.binary(max_size=8),
    st.datetimes(allow_imaginary=False), aware_datetimes(), st.dates(), st.times(), st.timedeltas(),
    st.decimals(allow_nan=False, allow_infinity=True, places=None),
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=12)
KEYS = st.one_of(st.text(max_size=4), st.integers(-5, 5), st.datetimes(allow_imaginary=False), aware_datetimes(),
                 st.dates(), st.tuples(st.text(max_size=3), aware_datetimes()),
                 st.tuples(st.dates(), st.decimals(allow_nan=False, allow_infinity=False, places=2)))

#: Values pyarrow hands out that hypothesis does not draw: pandas objects (nanosecond units), the
#: odd cases of each type, and nested mixtures.
EXAMPLES = [
    pd.Timestamp("2013-01-01 05:00:00.000000001"),
    pd.Timestamp("2013-11-03 05:30:00.000000007", tz="UTC").tz_convert("America/New_York"),
    pd.Timestamp("2020-02-29 12:00", tz="UTC").as_unit("s"),
    pd.Timedelta(7, unit="ns"), pd.Timedelta(days=-3, microseconds=5).as_unit("us"),
    pd.NaT,
    dt.datetime(2021, 11, 7, 1, 30, fold=1), dt.datetime(2021, 11, 7, 1, 30, fold=1, tzinfo=NY),
    dt.datetime.min, dt.datetime.max, dt.date.min, dt.date.max, dt.timedelta.max, dt.timedelta.min,
    dt.time(23, 59, 59, 999999, tzinfo=dt.timezone(dt.timedelta(hours=-3))),
    Decimal("1.20"), Decimal("-0"), Decimal("1E+30"), Decimal("-123456789012345678901234567890.123456789"),
    Decimal("Infinity"), 1 << 70, -(1 << 64),
    {"t": dt.datetime(2013, 1, 1, 5, tzinfo=NY), "p": [Decimal("0.1"), None, b"\x00\xff"],
     "s": {"d": dt.date(2013, 1, 1), "dur": dt.timedelta(microseconds=-1)}},
]


def kv_round_trip(key, value):
    """``key -> value`` through a full checkpoint (capture, encode, decode, restore)."""
    s = KeyValueState("s")
    s.set(key, value)
    ckpt = SliceCheckpoint(1, 2, 3, "full", -1, {}, {}, {"s": capture_kv(s, delta=False)})
    back = KeyValueState("s")
    restore_kv(back, decode(encode(ckpt)).state["s"])
    (k, v), = back.items()
    return k, v


def delta_round_trip(key, value):
    """``key -> value`` through a delta checkpoint."""
    s = KeyValueState("s")
    s.set("x", 0)
    s.clear_dirty()
    s.set(key, value)
    part = decode(encode(SliceCheckpoint(1, 2, 4, "delta", 3, {}, {}, {"s": capture_kv(s, delta=True)}))).state["s"]
    back = KeyValueState("s")
    restore_kv(back, part)
    (k, v), = back.items()
    return k, v


@pytest.fixture(scope="module")
def spill():
    store = SpillStore()
    yield store
    store.close()


_tiers = iter(range(1 << 30))


def spill_round_trip(store, key, value):
    """``key -> value`` through a state's cold tier (put, get, items)."""
    tier = store.tier(1, 1, f"s{next(_tiers)}")
    tier.put(key, value)
    got = tier.get(key)
    (k, v), = tier.items()
    assert same(v, got)
    return k, got


def check_round_trips(store, key, value):
    assert same(codec.unpackb(codec.packb(value)), value)
    for k, v in (kv_round_trip(key, value), delta_round_trip(key, value), spill_round_trip(store, key, value)):
        assert same(v, value), (v, value)
        assert same(k, key), (k, key)


@settings(max_examples=150, deadline=None)
@given(key=KEYS, value=VALUES)
def test_every_python_value_survives_checkpoints_and_the_spill_store(spill, key, value):
    """Regression (issue 59, join checkpoint of timestamps): a state key and value of any kind an
    Arrow column gives to Python (datetimes naive and zoned, dates, times, durations, Decimal,
    bytes, lists, dicts, None, ints of any size, nested) comes back from a full and a delta checkpoint, and from
    the spill store, of the same type and value."""
    check_round_trips(spill, key, value)


@pytest.mark.parametrize("value", EXAMPLES, ids=lambda v: type(v).__name__)
def test_pandas_values_and_edge_cases_survive_checkpoints_and_the_spill_store(spill, value):
    """Regression (issue 59, join checkpoint of timestamps): pandas timestamps and durations (how
    pyarrow gives nanosecond columns), ``NaT``, a datetime's fold, extreme dates and exact
    Decimals come back with their type, unit, zone and value."""
    key = value if not isinstance(value, dict) else "k"
    check_round_trips(spill, key, value)


def test_numpy_scalars_are_stored_as_the_numbers_they_hold():
    assert codec.unpackb(codec.packb([np.int64(3), np.float32(0.5), np.bool_(True)])) == [3, 0.5, True]


@pytest.mark.parametrize("value", [{1, 2}, object(), np.datetime64("2020-01-01"), dt.timezone],
                         ids=["set", "object", "datetime64", "class"])
def test_a_value_the_codec_cannot_carry_is_a_project_error_naming_its_type(value):
    """Regression (issue 59, join checkpoint of timestamps): an unknown type is a
    ``StateEncodingError`` (a ``ChronoStreamError``) naming the type and the state, not a raw
    TypeError from msgpack; nothing is written to the spill store."""
    s = KeyValueState("seen")
    s.set("k", [value])
    with pytest.raises(StateEncodingError, match="state 'seen' holds a value a checkpoint cannot encode") as err:
        capture_kv(s, delta=False)
    assert isinstance(err.value, ChronoStreamError)
    assert type(value).__name__ in str(err.value)
    store = SpillStore()
    try:
        s = KeyValueState("cold", cold=store.tier(1, 1, "cold"), hot_limit=1)
        s.set("a", [value])
        with pytest.raises(StateEncodingError, match="state 'cold' holds a value the spill store cannot encode"):
            s.set("b", 1)  # evicts "a"
        assert store.entries() == 0 and s.get("a") == [value]
    finally:
        store.close()


# -- Arrow tables -------------------------------------------------------------------------


def every_type_table() -> pa.Table:
    """Three rows (the last all null) of a column of every Arrow type a stream may carry."""
    t0 = dt.datetime(2013, 1, 1, 5, 0, 0, 123456)
    cols = {
        "ts_s": pa.array([t0.replace(microsecond=0), dt.datetime(1969, 12, 31), None], pa.timestamp("s")),
        "ts_ms_tz": pa.array([t0, t0, None], pa.timestamp("ms", "UTC")),
        "ts_us_tz": pa.array([t0, dt.datetime(2021, 11, 7, 6, 30), None], pa.timestamp("us", "America/New_York")),
        "ts_ns_tz": pa.array([1_357_016_400_123_456_789, -1, None], pa.timestamp("ns", "+05:30")),
        "ts_ns": pa.array([1_357_016_400_123_456_789, 0, None], pa.timestamp("ns")),
        "date32": pa.array([dt.date(2013, 1, 1), dt.date(1, 1, 1), None], pa.date32()),
        "date64": pa.array([dt.date(2013, 1, 1), dt.date(1960, 6, 1), None], pa.date64()),
        "time32": pa.array([dt.time(5, 0, 1), dt.time(0), None], pa.time32("s")),
        "time64": pa.array([dt.time(23, 59, 59, 999999), dt.time(0), None], pa.time64("us")),
        "time64ns": pa.array([1, 86_399_999_999_999, None], pa.time64("ns")),
        "dur_s": pa.array([dt.timedelta(hours=1), dt.timedelta(seconds=-5), None], pa.duration("s")),
        "dur_us": pa.array([dt.timedelta(microseconds=7), dt.timedelta(days=-2), None], pa.duration("us")),
        "dur_ns": pa.array([7, -1, None], pa.duration("ns")),
        "dec": pa.array([Decimal("12.345"), Decimal("-0.001"), None], pa.decimal128(10, 3)),
        "dec_big": pa.array([Decimal("1234567890123456789012345678901234567.8"), Decimal("0.0"), None],
                            pa.decimal128(38, 1)),
        "dec256": pa.array([Decimal("1" * 60 + ".25"), Decimal("-1.00"), None], pa.decimal256(70, 2)),
        "bin": pa.array([b"\x00\xff", b"", None], pa.binary()),
        "lbin": pa.array([b"x" * 3, b"\x01", None], pa.large_binary()),
        "fbin": pa.array([b"ab", b"\x00\x00", None], pa.binary(2)),
        "str": pa.array(["JFK", "", None], pa.string()),
        "lstr": pa.array(["é", "x", None], pa.large_string()),
        "i8": pa.array([-128, 127, None], pa.int8()),
        "u64": pa.array([(1 << 64) - 1, 0, None], pa.uint64()),
        "f16": pa.array([np.float16(1.5), np.float16(-0.0), None], pa.float16()),
        "f64": pa.array([1.5, float("inf"), None], pa.float64()),
        "bool": pa.array([True, False, None]),
        "list": pa.array([[1, None, 3], [], None], pa.list_(pa.int64())),
        "llist": pa.array([[t0], [None], None], pa.large_list(pa.timestamp("us", "UTC"))),
        "flist": pa.array([[1.0, 2.0], [None, 0.5], None], pa.list_(pa.float32(), 2)),
        "struct": pa.array([{"a": 1, "when": t0, "p": Decimal("1.50")}, {"a": None, "when": None, "p": None}, None],
                           pa.struct([("a", pa.int32()), ("when", pa.timestamp("us", "Europe/Paris")),
                                      ("p", pa.decimal128(5, 2))])),
        "map": pa.array([[("a", 1), ("b", None)], [], None], pa.map_(pa.string(), pa.int64())),
        "null": pa.array([None, None, None], pa.null()),
        "dict": pa.array(["x", "y", None]).dictionary_encode(),
        "dict_ts": pa.DictionaryArray.from_arrays(pa.array([0, 0, None], pa.int8()),
                                                  pa.array([t0], pa.timestamp("us", "Asia/Tokyo"))),
    }
    return pa.table(cols)


def assert_same_table(got: pa.Table, want: pa.Table) -> None:
    assert got.schema == want.schema, got.schema
    assert got.equals(want)


TABLE_PATHS = ["codec", "checkpoint_table_part", "carried_outputs", "output_log", "backup_store"]


@pytest.mark.parametrize("path", TABLE_PATHS)
def test_tables_of_every_arrow_type_survive_every_store(path, tmp_path):
    """Regression (issue 59, join checkpoint of timestamps): a table with a column of every
    Arrow type (timestamps with and without zone in every unit, dates, times, durations,
    decimals, binaries, strings, lists, structs, maps, null, dictionaries), nulls included,
    comes back with the same schema and values through the codec (a table, record batch, array
    and chunked array held in state), a checkpoint's table part, carried outputs, the output log
    and a backup store (with the table's rows as Python values in a key-value state). The codec
    and backup-store cases failed before; the Arrow IPC ones guard what already held."""
    t = every_type_table()
    if path == "codec":
        chunked = pa.concat_tables([t, t])
        got = codec.unpackb(codec.packb({"t": chunked, "b": t.to_batches()[0], "a": t.column("dec").chunk(0),
                                         "c": chunked.column("ts_us_tz")}))
        assert_same_table(got["t"], chunked)
        assert got["b"].equals(t.to_batches()[0]) and got["b"].schema == t.schema
        assert got["a"].equals(t.column("dec").chunk(0)) and got["a"].type == pa.decimal128(10, 3)
        assert got["c"].equals(chunked.column("ts_us_tz")) and got["c"].num_chunks == 2
    elif path == "checkpoint_table_part":
        ckpt = SliceCheckpoint(1, 0, 5, "full", -1, {}, {}, {"__op__agg": frozen_table_part(t)})
        assert_same_table(read_table_part(decode(encode(ckpt)).state["__op__agg"]), t)
    elif path == "carried_outputs":
        got = decode_outputs(encode_outputs(CarriedOutputs(1, 0, 2, 5, True, {3: t})))
        assert_same_table(got.tables[3], t)
    elif path == "output_log":
        log = OutputLog(tmp_path / "log")
        try:
            rows = t.append_column("_seq", pa.array([0, 1, 2], pa.int64()))
            log.append_epoch({(0, 1): rows.slice(0, 2)})
            log.append_epoch({(0, 1): rows.slice(2)})
            assert_same_table(log.read(0, 1), rows)
            assert_same_table(log.read(0, 1, after_seq=0), rows.slice(1))
        finally:
            log.close()
    else:
        s = KeyValueState("rows")
        rows = t.drop_columns(["map"])  # (PYTHON_COLUMNS)
        s.set(("JFK", dt.datetime(2013, 1, 1, 5, tzinfo=NY)), rows.to_pylist())
        ckpt = SliceCheckpoint(1, 0, 5, "full", -1, {}, {}, {"__op__agg": frozen_table_part(t),
                                                             "rows": capture_kv(s, delta=False)})
        store = BackupStore(tmp_path / "backups")
        store.put(encode(ckpt))
        store.close()
        store = BackupStore(tmp_path / "backups")  # reopened: read back from lmdb
        try:
            got = store.latest(1, 0)
            assert_same_table(read_table_part(got.state["__op__agg"]), t)
            back = KeyValueState("rows")
            restore_kv(back, got.state["rows"])
            (_, got_rows), = back.items()
            assert same(got_rows, rows.to_pylist())
        finally:
            store.close()


#: pyarrow hands a map's entries to Python as (key, value) tuples, which come back from msgpack as
#: lists (as every tuple inside a state value does) and are refused by ``pa.array`` of a map type.
PYTHON_COLUMNS = [n for n in every_type_table().column_names if n != "map"]


@pytest.mark.parametrize("name", PYTHON_COLUMNS)
def test_a_columns_python_values_come_back_as_the_same_column(name, spill):
    """Regression (issue 59, join checkpoint of timestamps): a column's values as Python objects
    (what a per-event operator holds in state), through a checkpoint and the spill store, build
    the column the originals build, with the column's type and with the type inferred from them."""
    col = every_type_table().column(name).combine_chunks()
    values = col.to_pylist()
    target = col.type.value_type if pa.types.is_dictionary(col.type) else col.type  # (pyarrow builds no
    want = pa.array(values, target)                                                  # dictionary from Python)
    for _, back in (kv_round_trip(name, values), spill_round_trip(spill, name, values)):
        assert same(back, values)
        assert pa.array(back, target).equals(want)
        try:
            inferred = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):  # (no inference from these values)
            continue
        assert pa.array(back).equals(inferred) and pa.array(back).type == inferred.type


# -- the built-in join on a timestamp key ---------------------------------------------------


def flights_and_weather(n_flights: int = 400, n_hours: int = 48, seed: int = 13):
    """Flights and hourly weather keyed on (origin, time_hour), a zoned timestamp: the weather
    rows carry a column of most other types too, so the join's state holds them all."""
    rng = np.random.default_rng(seed)
    origins = np.array(["EWR", "JFK", "LGA"])
    base = dt.datetime(2013, 1, 1, 5, tzinfo=NY)
    hours = [base + dt.timedelta(hours=h) for h in range(n_hours)]
    hour_type = pa.timestamp("us", "America/New_York")
    w_hours = [hours[h] for h in range(n_hours) for _ in origins]
    weather = pa.table({
        "origin": pa.array(np.tile(origins, n_hours)),
        "time_hour": pa.array(w_hours, hour_type),
        "temp": pa.array(np.round(rng.normal(40, 10, len(w_hours)), 1)),
        "obs_ns": pa.array([int(h.timestamp() * 1e9) + i for i, h in enumerate(w_hours)], pa.timestamp("ns", "UTC")),
        "day": pa.array([h.date() for h in w_hours], pa.date32()),
        "gust": pa.array([dt.timedelta(seconds=int(s)) if s % 5 else None for s in rng.integers(0, 90, len(w_hours))],
                         pa.duration("s")),
        "precip": pa.array([Decimal(f"{x:.2f}") for x in rng.uniform(1, 9, len(w_hours))], pa.decimal128(6, 2)),
        "station": pa.array([o.encode() for o in np.tile(origins, n_hours)], pa.binary()),
        "readings": pa.array([[float(x), None] for x in rng.normal(0, 1, len(w_hours))], pa.list_(pa.float64())),
        "meta": pa.array([{"src": "noaa", "at": h} for h in w_hours],
                         pa.struct([("src", pa.string()), ("at", hour_type)])),
        "nothing": pa.nulls(len(w_hours)),
        "order_t": pa.array(np.arange(len(w_hours)) * 10, pa.int64()),
    })
    pick = np.sort(rng.integers(0, n_hours, n_flights))
    flights = pa.table({
        "flight": pa.array(np.arange(n_flights)),
        "origin": pa.array(rng.choice(origins, n_flights)),
        "time_hour": pa.array([hours[h] for h in pick], hour_type),
        "dep_delay": pa.array(rng.normal(5, 20, n_flights)),
        "order_t": pa.array(pick * 30 + 5, pa.int64()),
    })
    return flights, weather


def timestamp_join(slices: int = 3, epoch_events: int = 53) -> cs.Query:
    flights, weather = flights_and_weather()
    q = cs.Query(epoch_events=epoch_events)
    f = q.source("flights", flights, order_by="order_t").key_by(["origin", "time_hour"])
    w = q.source("weather", weather, order_by="order_t").key_by(["origin", "time_hour"])
    cs.join(f, w, slices=slices, name="join").sink(name="joined")
    return q


@pytest.fixture(scope="module")
def serial_joined() -> pa.Table:
    return cs.run_serial(timestamp_join()).results("joined")


def test_checkpointed_and_restored_timestamp_join_continues_like_the_uninterrupted_one(serial_joined, tmp_path):
    """Regression (issue 59, join checkpoint of timestamps): the built-in join keyed on (origin,
    zoned timestamp), its state holding rows with timestamps, dates, durations, decimals, binary,
    lists, structs and nulls, is checkpointed at every epoch (a full checkpoint, then deltas)
    through a backup store; each slice restored half-way into a fresh runtime consumes the rest
    of its input and produces exactly the rows, of the same schema, the uninterrupted slice
    produced; and the uninterrupted run's output equals the serial executor's. On the old
    codec the first checkpoint raised ``TypeError`` (datetime cannot be encoded)."""
    plan, sources = compile_query(timestamp_join())
    cores = build_cores(plan, initial_placement(plan, containers_per_stage(plan, 2)), sources)
    records, chains = defaultdict(list), defaultdict(list)
    for core in cores.values():
        core.group_slices = False  # one process() per slice, so each slice is recorded
        for rt in core.slices.values():
            if rt.op is None:
                continue

            def recorded(epoch, inputs, rt=rt, orig=rt.process):
                out = orig(epoch, inputs)
                key = (rt.stage.stage_id, rt.slice_id)
                records[key].append((epoch, inputs, out))
                chain = chains[key]
                chain.append(encode(capture(rt, delta=bool(chain), prev_epoch=decode(chain[-1]).epoch if chain else -1)))
                return out

            rt.process = recorded
    rng, pending = random.Random(5), []
    while not all(c.done for c in cores.values()):
        for cid in sorted(cores):
            if cores[cid].ready():
                e = cores[cid].next_epoch
                pending += [(d, e, cid, m) for d, m in cores[cid].step().items()]
        rng.shuffle(pending)
        while pending:
            d, e, cid, m = pending.pop()
            cores[d].deliver(e, cid, m)

    joined = [t for rs in records.values() for _, _, out in rs for t in out.values() if t.num_rows]
    assert sum(t.num_rows for t in joined) == serial_joined.num_rows > 300
    assert per_key_sequences(pa.concat_tables(joined, promote_options="permissive"), ["origin", "time_hour"]) == \
        per_key_sequences(serial_joined, ["origin", "time_hour"])

    store = BackupStore(tmp_path / "backups", merge_every=2)
    for chain in chains.values():
        for raw in chain[: len(chain) // 2]:  # the slice "dies" half-way
            store.put(raw)
    checked = 0
    for key, chain in chains.items():
        ckpt = store.latest(*key)
        assert ckpt.state["left"]["keys"] and ckpt.state["right"]["keys"]
        fresh = SliceRuntime(plan, *key)
        restore(fresh, ckpt)
        for epoch, inputs, expected in records[key]:
            if epoch <= ckpt.epoch:
                continue
            got = fresh.process(epoch, inputs)
            assert sorted(got) == sorted(expected)
            for sid, table in expected.items():
                assert got[sid].schema == table.schema
                assert got[sid].equals(table)
                checked += table.num_rows
    store.close()
    assert checked > 100


def test_a_local_cluster_killing_the_timestamp_joins_container_gives_the_serial_output(serial_joined):
    """Regression (issue 59, join checkpoint of timestamps): with a checkpoint every epoch, a
    container of the join (keyed on a zoned timestamp) killed mid-stream is restored from its
    backups (the containers' checkpointing, backup and output-log paths, without Ray) and the
    job's output equals the serial executor's, schema included."""
    plan, sources = compile_query(timestamp_join(epoch_events=31))
    cl = LocalCluster(plan, initial_placement(plan, containers_per_stage(plan, 3)), sources, checkpoint_every=1)
    victim = sorted({cl.hosts[c] for st_ in plan.stages if st_.kind == "operator"
                     for c in cl.placement.containers[st_.stage_id]})[0]
    cl.run(kills={6: [victim]})
    assert any(kind == "recovery_end" for _, kind, _ in cl.timeline)
    got = cl.results("joined")
    assert got.schema == serial_joined.schema
    assert got.to_pylist() == serial_joined.to_pylist()


class Remember(cs.Operator):
    """Keeps each event's ``v`` under its key (whatever type the test puts there)."""

    def setup(self) -> None:
        self.seen = self.register_state("seen")

    def consume(self, stream_id: str, event: dict) -> None:
        self.seen.set(event["k"], event["v"])
        self.produce("out", event)


def test_a_checkpoint_of_a_value_the_codec_cannot_carry_names_the_stage_and_slice():
    """Regression (issue 59, join checkpoint of timestamps): a checkpoint of a state holding a
    value of a type the codec does not carry fails with a ``StateEncodingError`` naming the
    stage, the slice, the state and the type (a raw TypeError before)."""
    q = cs.Query(epoch_events=4)
    q.source("s", [{"k": "a", "v": 1}]).key_by("k").apply(Remember, slices=2, name="remember").sink(name="out")
    plan, _ = compile_query(q)
    stage = next(s for s in plan.stages if s.name == "remember")
    rt = SliceRuntime(plan, stage.stage_id, 1)
    rt.ctx.states["seen"].set("a", frozenset({1}))
    with pytest.raises(StateEncodingError, match=r"stage 'remember' slice 1: checkpoint of state 'seen' holds a "
                                                 r"value a checkpoint cannot encode: .*frozenset"):
        capture(rt, delta=False)


def test_the_timestamp_join_checkpointed_every_epoch_on_ray_gives_the_serial_output(ray_session, serial_joined):
    """Regression (issue 59, join checkpoint of timestamps): on Ray, with a checkpoint every epoch,
    the join keyed on a zoned timestamp runs to the end (it failed at its first checkpoint) and
    its output equals the serial executor's, schema included."""
    job = cs.run(timestamp_join(epoch_events=200), containers=2, checkpoint_every=1)  # 3 epochs: 3 checkpoints
    try:
        job.wait(timeout_s=120)
        got = job.results("joined")
        assert got.schema == serial_joined.schema
        assert got.to_pylist() == serial_joined.to_pylist()
    finally:
        job.stop()
