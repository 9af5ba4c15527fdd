"""Windows: every aggregate at every event equals a brute-force recomputation over the window's exact contents.

Method: the window operator is driven event by event (an ``OperatorContext``,
no executor) over random keys, event times (some out of order, within and
beyond the allowed lateness), values and window sizes, for every window
type; a brute-force model keeps each key's whole history and recomputes
every aggregate from scratch from the window's definition (see
slices/windows.py). Float sums are compared exactly: the operator's
sums are correctly rounded (``math.fsum``) at every event. The same runs are
repeated with the operator's state checkpointed and restored into a fresh
operator at a random event. Then scenarios: Railgun's "five payments in five
minutes" (a sliding window fires, 1-minute hopping windows do not), the
late-event policy through the dead-letter path, timestamps, a slice
restored half-way, and the in-process runtime equal to the serial oracle row
for row.
"""

from __future__ import annotations

import datetime as dt
import math

import msgpack
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import chronostream as cs
from chronostream.dag import compile_query
from chronostream.slices.operators import OperatorContext
from chronostream.datasets import payments
from chronostream.slices.state import KeyValueState
from chronostream.slices.windows import ClosingWindowAggregate, LateEventError, WindowAggregate, plan_windows
from chronostream.slices.checkpoint import capture_kv, decode, encode, restore_kv, SliceCheckpoint

SPECS = [("count", None), ("sum", "v"), ("mean", "v"), ("min", "v"), ("max", "v"), ("distinct", "shop")]

# name -> (windows given to .window(), builds the brute-force model's window list)
CONFIGS = {
    "sliding": lambda size: [cs.SlidingWindow(size, time="t")],
    "count": lambda size: [cs.CountWindow(1 + size // 10)],
    "sliding+count (one shared event queue)": lambda size: [
        cs.SlidingWindow(size, time="t", name="long"), cs.SlidingWindow(1 + size // 3, time="t", name="short"),
        cs.CountWindow(3, name="last3")],
    "tumbling, per event": lambda size: [cs.TumblingWindow(size, time="t")],
    "hopping, per event": lambda size: [cs.HoppingWindow(size, max(1, size // 3), time="t", offset=7)],
    "hopping, on close": lambda size: [cs.HoppingWindow(size, max(1, size // 2), time="t", emit="close")],
    "tumbling over event counts": lambda size: [cs.TumblingWindow(1 + size // 10)],
}


# -- the brute-force model -----------------------------------------------------------------


def aggregates(events: list[dict], suffix: str = "") -> dict:
    """Every aggregate of SPECS over ``events``, from scratch."""
    vs = [e["v"] for e in events]
    total = math.fsum(vs) if isinstance(vs[0], float) else sum(vs)
    return {"count" + suffix: len(events), "sum_v" + suffix: total, "mean_v" + suffix: total / len(vs),
            "min_v" + suffix: min(vs), "max_v" + suffix: max(vs), "distinct_shop" + suffix: len({e["shop"] for e in events})}


def brute_force(windows: list, events: list[dict], lateness, end: bool = False) -> list:
    """The rows the window definitions ask for, recomputed over each key's full history ("late" for
    rejects); with ``end``, then the windows emitted on close that are still open, per key (in
    the order of their msgpack bytes) by start."""
    history: dict = {}  # key -> [(effective time, event)]
    latest: dict = {}
    emitted: dict = {}  # key -> window starts already emitted (emit="close")
    out: list = []
    for e in events:
        k = e["k"]
        hist = history.setdefault(k, [])
        if any(getattr(w, "time", None) for w in windows):
            t = e["t"]
            if k in latest and t < latest[k]:
                if latest[k] - t > lateness:
                    out.append("late")
                    continue
                t = latest[k]
        else:
            t = len(hist)  # windows over event counts: the key's n-th event has time n
        latest[k] = t
        prior = list(hist)
        hist.append((t, e))
        w0 = windows[0]
        if isinstance(w0, (cs.TumblingWindow, cs.HoppingWindow)):
            hw = w0.as_hopping() if isinstance(w0, cs.TumblingWindow) else w0

            def starts_of(x):  # every grid start s with s <= x < s + size
                return [s for s in range(x - hw.size + 1, x + 1) if (s - hw.offset) % hw.hop == 0]

            if hw.emit == "close":
                done = emitted.setdefault(k, set())
                candidates = sorted({s for ti, _ in prior for s in starts_of(ti)})
                for s in candidates:
                    if s + hw.size <= t and s not in done:
                        done.add(s)
                        win = [x for ti, x in prior if s <= ti < s + hw.size]
                        out.append({"k": k, "window_start": s, "window_end": s + hw.size, **aggregates(win)})
                continue
            for s in starts_of(t):
                win = [x for ti, x in hist if s <= ti < s + hw.size]
                row = {"k": k}
                if hw.time:
                    row["t"] = e["t"]
                out.append({**row, "window_start": s, "window_end": s + hw.size, **aggregates(win)})
            continue
        row = {"k": k}
        if any(isinstance(w, cs.SlidingWindow) for w in windows):
            row["t"] = e["t"]  # the event's own time
        for w in windows:
            suffix = f"_{w.name}" if len(windows) > 1 else ""
            if isinstance(w, cs.CountWindow):
                win = [x for _, x in hist[-w.size:]]
            else:
                win = [x for ti, x in hist if t - w.size < ti <= t]  # (t - size, t]
            row.update(aggregates(win, suffix))
        out.append(row)
    w0 = windows[0]
    if end and getattr(w0, "emit", "event") == "close":
        hw = w0.as_hopping() if isinstance(w0, cs.TumblingWindow) else w0
        for k in sorted(history, key=lambda k: msgpack.packb(k)):
            starts = {s for ti, _ in history[k] for s in range(ti - hw.size + 1, ti + 1) if (s - hw.offset) % hw.hop == 0}
            for s in sorted(starts - emitted.get(k, set())):
                win = [x for ti, x in history[k] if s <= ti < s + hw.size]
                out.append({"k": k, "window_start": s, "window_end": s + hw.size, **aggregates(win)})
    return out


# -- driving the operator directly -----------------------------------------------------------


def make_operator(windows, lateness) -> tuple[WindowAggregate, OperatorContext]:
    normalized, late = plan_windows(windows, SPECS, lateness)
    closing = normalized[0].kind == "hopping" and normalized[0].emit == "close"
    op = (ClosingWindowAggregate if closing else WindowAggregate)(["k"], normalized, SPECS, late)
    ctx = OperatorContext("w", 0, ("out",))
    op.bind(ctx)
    op.setup()
    return op, ctx


def restore_into_fresh(op: WindowAggregate, ctx: OperatorContext, windows, lateness):
    """Checkpoint every registered state of ``op`` (through the codec) and load it into a fresh operator."""
    ckpt = SliceCheckpoint(0, 0, 0, "full", -1, {}, {}, {n: capture_kv(s, False) for n, s in ctx.states.items()})
    ckpt = decode(encode(ckpt))
    op2, ctx2 = make_operator(windows, lateness)
    for name, part in ckpt.state.items():
        restore_kv(ctx2.states.setdefault(name, KeyValueState(name)), part)
    return op2, ctx2


def drive(windows, events: list[dict], lateness, restore_at: int = -1, end: bool = False) -> list:
    """The operator's rows for ``events`` (restored from a checkpoint before event ``restore_at``);
    with ``end``, then its end-of-input hook's rows."""
    op, ctx = make_operator(windows, lateness)
    out: list = []
    for i, e in enumerate(events):
        if i == restore_at:
            op, ctx = restore_into_fresh(op, ctx, windows, lateness)
        ctx.begin_event(i, 0)
        try:
            op.consume("in", dict(e))
        except LateEventError:
            out.append("late")
            assert not ctx.events["out"]
            continue
        out.extend(ctx.events["out"])
        ctx.reset()
    if end:
        if restore_at == len(events):
            op, ctx = restore_into_fresh(op, ctx, windows, lateness)
        ctx.begin_event(len(events), 0)
        if op.has_end_hook():
            op.on_end()
        out.extend(ctx.events["out"])
    return out


@st.composite
def event_streams(draw):
    """Events of 1-3 keys with non-decreasing base times, jittered backwards (out of order), int or float values."""
    n = draw(st.integers(1, 60))
    floats = draw(st.booleans())
    value = st.floats(-1e9, 1e9, allow_nan=False, allow_infinity=False) if floats else st.integers(-10**6, 10**6)
    base, events = 0, []
    for _ in range(n):
        base += draw(st.integers(0, 25))
        jitter = draw(st.sampled_from([0, 0, 0, 0, 1, 5, 20]))
        events.append({"k": draw(st.sampled_from(["a", "b", "c"])), "t": base - jitter, "v": draw(value),
                       "shop": draw(st.sampled_from(["s1", "s2", "s3", "s4"]))})
    return events


@pytest.mark.parametrize("config", sorted(CONFIGS))
@settings(max_examples=60, deadline=None)
@given(events=event_streams(), size=st.integers(1, 80), lateness=st.sampled_from([0, 5, 10]))
def test_every_aggregate_equals_brute_force_at_every_event(config, events, size, lateness):
    """For each window type: each output row equals a recomputation over the window's exact contents."""
    windows = CONFIGS[config](size)
    assert drive(windows, events, lateness) == brute_force(windows, events, lateness)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@settings(max_examples=25, deadline=None)
@given(events=event_streams(), size=st.integers(1, 80), data=st.data())
def test_window_state_restored_at_any_event_continues_identically(config, events, size, data):
    """Checkpointing the window state at a random event and restoring it into a fresh operator changes nothing."""
    windows = CONFIGS[config](size)
    cut = data.draw(st.integers(0, len(events)))
    assert drive(windows, events, 10, restore_at=cut) == drive(windows, events, 10)


CLOSING = {name: c for name, c in CONFIGS.items() if "on close" in name}
CLOSING["tumbling, on close"] = lambda size: [cs.TumblingWindow(size, time="t", emit="close")]
CLOSING["tumbling over event counts, on close"] = lambda size: [cs.TumblingWindow(1 + size // 10, emit="close")]

SLICE_CLOCK = {
    "tumbling, slice clock": lambda size: [cs.TumblingWindow(size, time="t", emit="close", clock="slice")],
    "hopping, slice clock": lambda size: [cs.HoppingWindow(size, max(1, size // 2), time="t", offset=3,
                                                           emit="close", clock="slice")],
}


@pytest.mark.parametrize("config", sorted(CLOSING))
@settings(max_examples=40, deadline=None)
@given(events=event_streams(), size=st.integers(1, 80), lateness=st.sampled_from([0, 10]))
def test_windows_emitted_on_close_emit_the_ones_still_open_when_the_input_ends(config, events, size, lateness):
    windows = CLOSING[config](size)
    assert drive(windows, events, lateness, end=True) == brute_force(windows, events, lateness, end=True)


@pytest.mark.parametrize("config", sorted(CLOSING) + sorted(SLICE_CLOCK))
@settings(max_examples=25, deadline=None)
@given(events=event_streams(), size=st.integers(1, 80), data=st.data())
def test_the_end_rows_of_a_restored_window_state_are_the_same(config, events, size, data):
    """Restored at any event (or right before the end): the rows, the end's included, do not
    depend on it (either clock)."""
    windows = {**CLOSING, **SLICE_CLOCK}[config](size)
    cut = data.draw(st.integers(0, len(events)))
    assert drive(windows, events, 10, restore_at=cut, end=True) == drive(windows, events, 10, end=True)


# -- windows closed by the slice's clock ---------------------------------------------------------------


def brute_force_slice_clock(window, events: list[dict], lateness) -> list:
    """``clock="slice"`` from scratch: one clock for all keys (the latest effective time; lateness
    against it, a late-within event clamped to it); at each event, every window of every key
    that ends at or before its time and is not out yet, by start, then key bytes; at the end
    the rest, per key (in the order of their bytes) by start."""
    hw = window.as_hopping() if isinstance(window, cs.TumblingWindow) else window
    history: dict = {}  # key -> [(effective time, event)]
    emitted: set = set()  # (key, start)
    latest = None
    out: list = []

    def starts_of(x):
        return [s for s in range(x - hw.size + 1, x + 1) if (s - hw.offset) % hw.hop == 0]

    def row(k, s):
        win = [x for ti, x in history[k] if s <= ti < s + hw.size]
        return {"k": k, "window_start": s, "window_end": s + hw.size, **aggregates(win)}

    for e in events:
        t = e["t"]
        if latest is not None and t < latest:
            if latest - t > lateness:
                out.append("late")
                continue
            t = latest
        latest = t
        due = {(s, k) for k, h in history.items() for ti, _ in h for s in starts_of(ti)
               if s + hw.size <= t and (k, s) not in emitted}
        for s, k in sorted(due, key=lambda sk: (sk[0], msgpack.packb(sk[1]))):
            emitted.add((k, s))
            out.append(row(k, s))
        history.setdefault(e["k"], []).append((t, e))
    for k in sorted(history, key=lambda k: msgpack.packb(k)):
        for s in sorted({s for ti, _ in history[k] for s in starts_of(ti)} - {s for kk, s in emitted if kk == k}):
            out.append(row(k, s))
    return out


@pytest.mark.parametrize("config", sorted(SLICE_CLOCK))
@settings(max_examples=60, deadline=None)
@given(events=event_streams(), size=st.integers(1, 80), lateness=st.sampled_from([0, 5, 10]))
def test_the_slice_clock_closes_every_keys_windows_as_brute_force_says(config, events, size, lateness):
    windows = SLICE_CLOCK[config](size)
    assert drive(windows, events, lateness, end=True) == brute_force_slice_clock(windows[0], events, lateness)


@settings(max_examples=40, deadline=None)
@given(events=event_streams(), size=st.integers(1, 80))
def test_on_time_ordered_input_both_clocks_emit_the_same_windows(events, size):
    """Only when they close differs: on input in time order no event is late for either clock."""
    events = sorted(events, key=lambda e: e["t"])
    by_key = drive([cs.TumblingWindow(size, time="t", emit="close")], events, 0, end=True)
    by_slice = drive([cs.TumblingWindow(size, time="t", emit="close", clock="slice")], events, 0, end=True)
    assert "late" not in by_slice
    key = lambda r: (r["k"], r["window_start"])  # noqa: E731
    assert sorted(by_slice, key=key) == sorted(by_key, key=key)


def test_the_slice_clock_closes_nan_and_signed_zero_keys_once_each_through_restores():
    """A NaN key is one key, -0.0 and 0.0 are one key, also after a restore (keys come back as
    new float objects): each closes each of its windows once."""
    events = [{"k": k, "t": t, "v": 1, "shop": "s"} for t, k in enumerate([math.nan, 1.0, -0.0, math.nan, 0.0, 1.0] * 4)]
    windows = [cs.TumblingWindow(3, time="t", emit="close", clock="slice")]
    rows = drive(windows, events, 0, end=True)
    assert sorted((repr(r["k"]), r["window_start"]) for r in rows) == \
        sorted((repr(k), s) for k in (math.nan, 1.0, 0.0) for s in range(0, 24, 3))
    for cut in range(len(events) + 1):
        assert repr(drive(windows, events, 0, restore_at=cut, end=True)) == repr(rows), cut


def test_an_idle_keys_window_closes_when_another_key_of_its_slice_passes_its_end():
    rows = [{"k": k, "t": t} for t, k in [(0, "a"), (1, "b"), (6, "a"), (12, "a")]]
    q = cs.Query(epoch_events=3)
    q.source("s", rows, order_by="t").key_by("k").window(
        cs.TumblingWindow(5, time="t", emit="close", clock="slice"), count=True, slices=1).sink(name="out")
    got = [(r["k"], r["window_start"], r["count"], r["_order"], r["_sub"])
           for r in cs.run_serial(q).results("out").to_pylist()]
    assert got == [("a", 0, 1, 2, 0), ("b", 0, 1, 2, 1),  # at t=6: both keys' [0, 5), by key
                   ("a", 5, 1, 3, 0),                     # at t=12
                   ("a", 10, 1, 5, 0)], got               # the end (order 5: the extra epoch's last)


def test_with_the_slice_clock_lateness_is_measured_against_the_slices_time():
    rows = [{"k": "a", "t": 10}, {"k": "b", "t": 4}]  # b's first event, 6 behind a's
    for lateness, expect in [(5, "LateEventError"), (6, None)]:
        q = cs.Query()
        q.source("s", rows).key_by("k").window(cs.TumblingWindow(5, time="t", emit="close", clock="slice"),
                                               count=True, allowed_lateness=lateness, slices=1).sink(name="out")
        if expect:
            with pytest.raises(cs.EventError, match="older than the slice's latest time 10"):
                cs.run_serial(q)
        else:  # clamped to 10: b joins [10, 15)
            assert [(r["k"], r["window_start"]) for r in cs.run_serial(q).results("out").to_pylist()] == \
                [("a", 10), ("b", 10)]


@pytest.mark.parametrize("window, message", [
    (cs.TumblingWindow(5, time="t", clock="slice"), "needs emit='close'"),
    (cs.TumblingWindow(5, emit="close", clock="slice"), "and a time column"),
    (cs.TumblingWindow(5, time="t", emit="close", clock="global"), "clock must be"),
])
def test_a_slice_clock_without_closing_time_windows_is_refused(window, message):
    q = cs.Query()
    with pytest.raises(cs.QueryError, match=message):
        q.source("s", [{"k": 1, "t": 0}]).key_by("k").window(window, count=True)


def slice_clock_query(slices: int = 5, n: int = 1500) -> cs.Query:
    """Payments: 10-minute tumbling windows closed by the slice's clock, with a distinct count."""
    from queries import EPOCH

    q = cs.Query(epoch_events=EPOCH)
    q.source("payments", payments(n, cards=40, seed=9, span_s=3600), order_by="ts").key_by("card").window(
        cs.TumblingWindow(600, time="ts", emit="close", clock="slice"), count=True, sum="amount",
        distinct="merchant", slices=slices, name="tumbling").sink(name="tumbling")
    return q


@pytest.mark.parametrize("containers, seed", [(1, 0), (2, 5), (3, 11)])
def test_slice_clock_windows_on_the_runtime_equal_the_serial_oracle(containers, seed):
    expected = cs.run(slice_clock_query(), executor="serial").results("tumbling").to_pylist()
    assert expected and cs.run(slice_clock_query(), executor="local", containers=containers, seed=seed
                               ).results("tumbling").to_pylist() == expected


def test_only_windows_emitted_on_close_have_an_end_hook():
    q = cs.Query()
    s = q.source("p", [{"k": "a", "t": 1}]).key_by("k")
    for name, spec in [("slide", cs.SlidingWindow(5, time="t")), ("tumble", cs.TumblingWindow(5, time="t")),
                       ("close", cs.TumblingWindow(5, time="t", emit="close"))]:
        s.window(spec, count=True, name=name).sink(name=name)
    plan, _ = compile_query(q)
    assert {st.name: st.ends for st in plan.stages if st.kind == "operator"} == \
        {"slide": False, "tumble": False, "close": True}


def test_float_sums_do_not_drift_over_a_long_sliding_window():
    """30,000 add/expire steps with values of mixed magnitude: every sum is still the exact (fsum) one."""
    events = [{"k": "a", "t": i, "v": (1e15 if i % 3 == 0 else 0.1) * (-1) ** i, "shop": "s"} for i in range(30_000)]
    got = drive([cs.SlidingWindow(7, time="t")], events, 0)
    for i in (6, 999, 15_000, 29_999):
        assert got[i]["sum_v"] == math.fsum(e["v"] for e in events[i - 6:i + 1])


# -- Railgun: five payments in five minutes ------------------------------------------------------

#: Five payments of one card within 4 min 20 s (minutes 0:50 .. 5:10): no 1-minute-aligned
#: 5-minute window holds all five (Railgun, Figure 1).
FIVE_IN_FIVE = [50, 110, 170, 250, 310]


def five_in_five_query(window: cs.Stream) -> cs.Query:
    q = cs.Query()
    pay = q.source("payments", [{"card": "c1", "ts": s, "amount": 10} for s in FIVE_IN_FIVE], order_by="ts")
    pay.key_by("card").window(window, count=True, slices=2).sink(name="out")
    return q


def test_railgun_five_payments_in_five_minutes_fire_a_real_sliding_window():
    """The rule "more than 4 payments in 5 minutes" fires on the fifth payment with a sliding window."""
    rows = cs.run(five_in_five_query(cs.SlidingWindow(300, time="ts")), executor="serial").results("out").to_pylist()
    assert [r["count"] for r in rows] == [1, 2, 3, 4, 5]


def test_railgun_five_payments_in_five_minutes_escape_1_minute_hopping_windows():
    """The same rule over 5-minute windows hopping by 1 minute never sees more than 4 payments."""
    rows = cs.run(five_in_five_query(cs.HoppingWindow(300, 60, time="ts")), executor="serial").results("out")
    assert max(rows["count"].to_pylist()) == 4


# -- the late-event policy ------------------------------------------------------------------------


def late_query(lateness=None, dead_letters: bool = False) -> cs.Query:
    q = cs.Query(epoch_events=2)
    if dead_letters:
        q.dead_letters()
    rows = [{"card": "c", "ts": t, "amount": 1} for t in (10, 20, 30, 18, 40)]  # 18 is 12 late
    q.source("p", rows).key_by("card").window(cs.SlidingWindow(15, time="ts"), count=True,
                                               allowed_lateness=lateness, slices=2).sink(name="out")
    return q


def test_an_event_later_than_allowed_fails_the_job_naming_it():
    """By default (allowed_lateness 0) an out-of-order event is a bad input: EventError with a clear cause."""
    with pytest.raises(cs.EventError, match="LateEventError.*12 older than the key's latest time 30"):
        cs.run(late_query(), executor="serial")


def test_an_event_later_than_allowed_becomes_a_dead_letter_and_the_rest_goes_on():
    """With dead letters the late event is set aside, the other events are processed: same on local and serial."""
    serial = cs.run(late_query(dead_letters=True), executor="serial")
    local = cs.run(late_query(dead_letters=True), executor="local", containers=2)
    assert [r["count"] for r in serial.results("out").to_pylist()] == [1, 2, 2, 2]
    assert local.results("out").to_pylist() == serial.results("out").to_pylist()
    assert [d["order"] for d in serial.dead_letters().to_pylist()] == [3]
    assert [d["order"] for d in local.dead_letters().to_pylist()] == [3]


def test_an_event_late_within_allowed_lateness_is_clamped_to_the_keys_latest_time():
    """Within allowed_lateness, the event at 18 counts as if at its key's latest time, 30.

    Its window is (15, 30] (20, 30 and itself); and at 40 it is still in (25, 40].
    """
    rows = cs.run(late_query(lateness=15), executor="serial").results("out").to_pylist()
    assert [(r["ts"], r["count"]) for r in rows] == [(10, 1), (20, 2), (30, 2), (18, 3), (40, 3)]


# -- timestamps, builder checks ---------------------------------------------------------------------


def test_timestamp_columns_take_timedelta_sizes():
    """A timestamp time column: sizes are timedeltas; hopping bounds come back as timestamps."""
    t0 = dt.datetime(2024, 1, 1, 12, 0, 0)
    ts = [t0 + dt.timedelta(seconds=s) for s in (0, 100, 299, 300, 301)]
    q = cs.Query()
    pay = q.source("p", pa.table({"card": ["c"] * 5, "ts": pa.array(ts, pa.timestamp("us")), "amount": [1] * 5}),
                   order_by="ts").key_by("card")
    pay.window(cs.SlidingWindow(dt.timedelta(minutes=5), time="ts"), count=True, slices=1).sink(name="s")
    pay.window(cs.TumblingWindow(dt.timedelta(minutes=5), time="ts"), count=True, slices=1).sink(name="h")
    res = cs.run(q, executor="serial")
    assert res.results("s")["count"].to_pylist() == [1, 2, 3, 3, 4]  # at 300 s: (0, 300]; at 301 s: (1, 301]
    starts = res.results("h")["window_start"].to_pylist()
    assert starts == [dt.datetime(2024, 1, 1, 12, 0)] * 3 + [dt.datetime(2024, 1, 1, 12, 5)] * 2


@pytest.mark.parametrize("build, message", [
    (lambda s: s.window(cs.SlidingWindow(5, time="t"), count=True), "keyed stream"),
    (lambda s: s.key_by("k").window(cs.SlidingWindow(5, time="t")), "at least one aggregate"),
    (lambda s: s.key_by("k").window([cs.TumblingWindow(5, time="t"), cs.SlidingWindow(5, time="t")], count=True),
     "alone"),
    (lambda s: s.key_by("k").window([cs.SlidingWindow(5, time="t"), cs.CountWindow(3)], count=True), "names"),
    (lambda s: s.key_by("k").window(cs.HoppingWindow(5, 10, time="t"), count=True), "hop must be"),
    (lambda s: s.key_by("k").window(cs.HoppingWindow(10**6, 1, time="t"), count=True), "SlidingWindow"),
    (lambda s: s.key_by("k").window(cs.TumblingWindow(5, time="t", emit="never"), count=True), "emit"),
    (lambda s: s.key_by("k").window(cs.SlidingWindow(0, time="t"), count=True), "> 0"),
])
def test_malformed_windows_are_refused_when_the_query_is_built(build, message):
    """Window specs are checked by the builder, with a QueryError saying what is wrong."""
    q = cs.Query()
    with pytest.raises(cs.QueryError, match=message):
        build(q.source("s", [{"k": 1, "t": 0}]))


def test_a_long_window_checkpoints_as_a_small_delta():
    """A key holding 20,000 events in its window: one more event dirties a handful of state keys, not the window."""
    op, ctx = make_operator([cs.SlidingWindow(10**9, time="t")], 0)
    for i in range(20_000):
        ctx.begin_event(i, 0)
        op.consume("in", {"k": "a", "t": i, "v": i % 97, "shop": f"s{i % 13}"})
    for s in ctx.states.values():
        s.clear_dirty()
    op.consume("in", {"k": "a", "t": 20_000, "v": 1, "shop": "s1"})
    dirty = sum(len(s.dirty_keys()) for s in ctx.states.values())
    assert dirty <= 12
    assert sum(len(s) for s in ctx.states.values()) > 300  # the window itself spans hundreds of chunks


# -- the runtime: restore half-way, local == serial ------------------------------------------------------


def windowed_query(slices: int, n: int = 1500) -> cs.Query:
    """Payments with event times: exact sliding windows (two, sharing one queue) and hopping windows."""
    from queries import EPOCH

    pay = payments(n, cards=25, seed=8, span_s=3600)
    q = cs.Query(epoch_events=EPOCH)
    s = q.source("payments", pay, order_by="ts").key_by("card")
    s.window([cs.SlidingWindow(300, time="ts", name="5m"), cs.CountWindow(4, name="last4")], count=True,
             sum="amount", max="amount", distinct="merchant", slices=slices, name="sliding").sink(name="sliding")
    s.window(cs.HoppingWindow(600, 120, time="ts"), count=True, mean="amount", min="amount",
             slices=slices, name="hopping").sink(name="hopping")
    return q


def test_windowed_slice_restored_half_way_continues_exactly(monkeypatch, tmp_path):
    """A window slice restored from its backup chain (full + deltas) reproduces the original's outputs."""
    import queries
    from test_checkpoint import test_restored_slice_continues_exactly_like_the_original as restored_half_way

    monkeypatch.setitem(queries.QUERIES, "windowed", (windowed_query, ["sliding", "hopping"], ["card"]))
    restored_half_way("windowed", tmp_path)


@pytest.mark.parametrize("containers, seed", [(1, 0), (2, 5), (3, 11)])
def test_windowed_query_on_the_runtime_equals_the_serial_oracle(containers, seed):
    """executor="local" (the container cores, shuffled delivery) gives the oracle's rows, _slice/_seq included."""
    expected = cs.run(windowed_query(5), executor="serial")
    got = cs.run(windowed_query(5), executor="local", containers=containers, seed=seed)
    for sink in ("sliding", "hopping"):
        assert got.results(sink).to_pylist() == expected.results(sink).to_pylist()


@pytest.mark.parametrize("zone", ["Asia/Kathmandu", "America/St_Johns", "UTC"])
@pytest.mark.parametrize("emit", ["event", "close"])
def test_window_bounds_over_zoned_timestamps_are_the_instants_of_the_window(zone, emit):
    """Regression (found by the simulator's pandas oracle): with ``emit="event"`` a window's bounds
    were the zone's 1970 wall time plus the window start, so in a zone whose offset changed since
    (Asia/Kathmandu: +05:30 then, +05:45 now) or changes that day (St John's, 2024-03-10) the
    event fell outside its own window. Both emit modes give the UTC instants of the window."""
    t = pa.array([dt.datetime(2024, 3, 10, 0, 0, 30, tzinfo=dt.timezone.utc),
                  dt.datetime(2024, 3, 10, 12, 0, 5, tzinfo=dt.timezone.utc)]).cast(pa.timestamp("us", tz=zone))
    q = cs.Query()
    q.source("s", pa.table({"k": ["a", "a"], "t": t})).key_by("k") \
        .window(cs.TumblingWindow(dt.timedelta(minutes=1), time="t", emit=emit), count=True, slices=1).sink(name="w")
    rows = cs.run(q, executor="serial").results("w").to_pylist()
    starts = sorted(r["window_start"].astimezone(dt.timezone.utc).replace(tzinfo=None) for r in rows)
    assert starts == [dt.datetime(2024, 3, 10, 0, 0), dt.datetime(2024, 3, 10, 12, 0)]
    for r in rows:
        assert r["window_end"] - r["window_start"] == dt.timedelta(minutes=1)
