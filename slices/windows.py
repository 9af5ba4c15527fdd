"""Per-key windows over event time or event count: accurate sliding, tumbling and hopping.

Owns: the window specs (``SlidingWindow``, ``CountWindow``, ``TumblingWindow``,
``HoppingWindow``), the ``WindowAggregate`` operator that keeps each key's
window contents and incremental aggregates in registered state (the state
library), the late-event policy, and the validation the builder
(``Stream.window`` in dag.py) runs. Must not touch: executors, slices,
checkpoints -- windows are a per-event operator like any user's, so the
runtime checkpoints, restores and migrates them with the slice.

**Sliding windows are exact** (Railgun's "real sliding windows"): at every
event of a key with (effective) time ``t``, the aggregates cover exactly the
events of that key, so far, whose effective time is in ``(t - size, t]``.
This is Railgun's ``T_eval - w_s <= t_i < T_eval`` with ``T_eval`` "the
moment right after the event arrived" (``t`` plus an infinitesimal): the
current event and every event at the same time are in, an event exactly
``size`` older is out. ``CountWindow(n)`` covers the key's last ``n`` events.

**Tumbling and hopping windows** are ``[start, start + size)`` with
``start = offset + k * hop`` (tumbling: ``hop = size``); an event belongs to
every window whose range holds its time (``ceil(size / hop)`` of them).
``emit="event"`` (default): every event emits one row per window holding it,
in start order, with that window's aggregates over its events so far.
``emit="close"``: a window emits one row when the first event of its key at
or past its end arrives (rows carry that event's lineage, and the key as
state holds it: -0.0 as 0.0, every NaN one NaN); windows still
open when the input ends are emitted then, by the end-of-input hook
(``ClosingWindowAggregate.on_end``: keys in the order of their encoding
(``chronostream.slices.codec``), each key's windows by start; lineage the end of the input). With
``clock="slice"`` the slice's event time closes windows instead of each
key's: at every event of the slice, every window of every key of the slice
that ends at or before the event's (effective) time is emitted, by start,
then keys in the order of their encoded bytes, with that event's lineage
(an idle key's window closes once any key of its slice passes its end);
lateness is then measured against the slice's latest time too, so no
event reopens an emitted window. Which event closes a window depends on
the keys that share its slice (fixed for the job's life, so the serial
run and the runtime agree); on input in time order both clocks emit the
same windows. With ``time=None`` they count events instead: the key's n-th
event (from 0) has "time" n.

**Aggregates** (``count``, ``sum``, ``mean``, ``min``, ``max``,
``distinct``) are incremental, never rescans: count/sum/mean add on arrival
and subtract on expiry; a float sum is kept as Shewchuk's exact partials
(the ``math.fsum`` algorithm, which also subtracts exactly), so it is the
correctly rounded sum of the window's values at every event, with no drift
however long the window lives; min/max use a monotonic deque of
``[position, value]`` (amortized O(1)); ``distinct`` keeps a value -> count
map and reports its size. Aggregated columns must be non-null, and float
values finite.

**Event time and lateness.** Events reach a key in the feeder's global
order (``order_by=`` the time column keeps them sorted). Each key remembers
its latest effective time. An event older than that by at most
``allowed_lateness`` (default 0) is processed with its time *clamped* to
the key's latest time (it joins the newest windows; nothing already emitted
is revised); one older by more raises ``LateEventError`` before touching
state, so it follows the bad-input path: the job fails naming the event,
or, with ``q.dead_letters()``, it becomes a dead letter. Output rows carry
the event's own time; the aggregates are at its effective time.

**State layout** (all registered, so checkpoints carry it as dirty keys):
``window.key`` (value: per key the latest time, each window's head position
and running aggregates, or the open hopping windows); with ``clock="slice"``,
``window.clock`` (value, one entry: the slice's latest time and its open
windows' starts) and ``window.closing`` (map: per start, the keys with
that window open); ``window.events``
(queue: per key ``[time, values...]`` of the events any sliding window still
holds, chunked so a delta checkpoint holds only the chunks touched);
``window.min.<col>.<w>`` / ``window.max.<col>.<w>`` (queues: the monotonic
deques); ``window.distinct.<col>.<w>`` (maps: value -> count). Several
sliding windows in one ``.window([...])`` share one event queue, each with
its own head position (Railgun's shared tail iterator).

**Long windows** keep their event queue's middle chunks in the host's lmdb
(Railgun's event reservoir: ``chronostream.slices.statelib``, on unless
``cs.run(..., spill_state=False)``); the distinct maps stay in memory.
**Not built:** timers and a watermark across slices: an idle key keeps its
last window's events until its next event or the end of the input, and an
open window emitted on close waits for its key's next event
(``clock="key"``) or for its slice's next event past its end
(``clock="slice"``) or for the end; a slice with no input never closes
anything before the end.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import Any, Sequence, Union

import pyarrow as pa

from chronostream.slices import codec
from chronostream.slices.errors import QueryError
from chronostream.slices.operators import Operator
from chronostream.slices.state import canonical_key

#: The aggregates a window computes.
WINDOW_AGGREGATES = ("count", "sum", "mean", "min", "max", "distinct")
#: Most windows an event may belong to (size / hop); beyond it, use a sliding window.
MAX_WINDOWS_PER_EVENT = 1000

_EPOCH_NAIVE = dt.datetime(1970, 1, 1)
_EPOCH_UTC = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_US = dt.timedelta(microseconds=1)

Size = Union[int, float, dt.timedelta]


class LateEventError(ValueError):
    """An event's time is older than its key's latest time by more than ``allowed_lateness``."""


# -- specs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlidingWindow:
    """Exact sliding window: at each event at time t, the key's events in ``(t - size, t]``.

    ``size`` is in the time column's units, or a ``datetime.timedelta`` for a
    timestamp column. ``name`` suffixes the output columns when one
    ``.window([...])`` computes several windows.
    """

    size: Size
    time: str
    name: str | None = None


@dataclass(frozen=True)
class CountWindow:
    """Sliding window over the key's last ``size`` events (the current one included)."""

    size: int
    name: str | None = None


@dataclass(frozen=True)
class HoppingWindow:
    """Windows ``[offset + k*hop, offset + k*hop + size)``; ``time=None`` counts the key's events."""

    size: Size
    hop: Size
    time: str | None = None
    offset: Size = 0
    emit: str = "event"  # "event": a row per event per window; "close": a row per window when it closes
    name: str | None = None
    clock: str = "key"  # with emit="close": whose event time closes a window, the key's or the slice's


@dataclass(frozen=True)
class TumblingWindow:
    """Non-overlapping windows ``[offset + k*size, offset + (k+1)*size)`` (a hopping window with hop = size)."""

    size: Size
    time: str | None = None
    offset: Size = 0
    emit: str = "event"
    name: str | None = None
    clock: str = "key"

    def as_hopping(self) -> HoppingWindow:
        """The same windows as a ``HoppingWindow``."""
        return HoppingWindow(self.size, self.size, self.time, self.offset, self.emit, self.name, self.clock)


WindowSpec = Union[SlidingWindow, CountWindow, HoppingWindow, TumblingWindow]


def _span(value: Size, what: str) -> tuple[int | float, bool]:
    """A size as a number, and whether it is temporal (a timedelta, taken in microseconds)."""
    if isinstance(value, dt.timedelta):
        return value // _US, True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise QueryError(f"{what} must be a number or a datetime.timedelta, got {value!r}")
    return value, False


@dataclass(frozen=True)
class _Window:
    """A validated window, as the operator uses it (sizes as numbers)."""

    kind: str  # "time" | "count" | "hopping"
    size: int | float
    hop: int | float
    offset: int | float
    temporal: bool  # sizes were timedeltas: the time column must hold datetimes
    time: str | None
    emit: str
    suffix: str  # "" or "_<name>"
    clock: str = "key"  # "key" | "slice": whose latest event time closes windows and measures lateness


def plan_windows(windows: WindowSpec | Sequence[WindowSpec], specs: Sequence[tuple[str, str | None]],
                 allowed_lateness: Size | None) -> tuple[list[_Window], Any]:
    """Validate what ``Stream.window`` was given; return the normalized windows and lateness.

    Either a list of sliding windows (``SlidingWindow`` on one time column
    and/or ``CountWindow``) sharing one event queue, or exactly one
    ``HoppingWindow``/``TumblingWindow``.
    """
    given = [windows] if not isinstance(windows, (list, tuple)) else list(windows)
    if not given:
        raise QueryError("window() needs at least one window")
    if not specs:
        raise QueryError(f"window() needs at least one aggregate of {WINDOW_AGGREGATES}")
    given = [w.as_hopping() if isinstance(w, TumblingWindow) else w for w in given]
    hopping = [w for w in given if isinstance(w, HoppingWindow)]
    if hopping and len(given) > 1:
        raise QueryError("a hopping or tumbling window must be alone in its window() call")
    for w in given:
        if not isinstance(w, (SlidingWindow, CountWindow, HoppingWindow)):
            raise QueryError(f"{w!r} is not a window spec (SlidingWindow, CountWindow, TumblingWindow, HoppingWindow)")
    names = [w.name for w in given]
    if len(given) > 1 and (None in names or len(set(names)) != len(names)):
        raise QueryError("several windows in one window() call need distinct names (they suffix the columns)")
    times = {w.time for w in given if isinstance(w, SlidingWindow)}
    if len(times) > 1:
        raise QueryError(f"sliding windows of one window() call share one time column, got {sorted(times)}")
    out: list[_Window] = []
    for w in given:
        suffix = f"_{w.name}" if len(given) > 1 else ""
        if isinstance(w, CountWindow):
            if isinstance(w.size, bool) or not isinstance(w.size, int) or w.size < 1:
                raise QueryError(f"CountWindow size must be a positive int, got {w.size!r}")
            out.append(_Window("count", w.size, 0, 0, False, None, "event", suffix))
            continue
        size, temporal = _span(w.size, "window size")
        if not size > 0:
            raise QueryError(f"window size must be > 0, got {w.size!r}")
        if isinstance(w, SlidingWindow):
            out.append(_Window("time", size, 0, 0, temporal, w.time, "event", suffix))
            continue
        hop, t2 = _span(w.hop, "hop")
        offset, t3 = _span(w.offset, "offset") if w.offset != 0 else (0, temporal)
        if len({temporal, t2, t3}) > 1:
            raise QueryError("size, hop and offset must all be timedeltas or all numbers")
        if w.time is None and (temporal or any(isinstance(x, float) for x in (size, hop, offset))):
            raise QueryError("a window over event counts (time=None) needs int size, hop and offset")
        if not 0 < hop <= size:
            raise QueryError(f"hop must be in (0, size], got hop={w.hop!r} size={w.size!r}")
        if math.ceil(size / hop) > MAX_WINDOWS_PER_EVENT:
            raise QueryError(f"size / hop > {MAX_WINDOWS_PER_EVENT} windows per event; use a SlidingWindow")
        if w.emit not in ("event", "close"):
            raise QueryError(f"emit must be 'event' or 'close', got {w.emit!r}")
        if w.clock not in ("key", "slice"):
            raise QueryError(f"clock must be 'key' or 'slice', got {w.clock!r}")
        if w.clock == "slice" and (w.emit != "close" or w.time is None):
            raise QueryError("clock='slice' closes windows by the slice's event time: it needs emit='close' "
                             "and a time column")
        out.append(_Window("hopping", size, hop, offset, temporal, w.time, w.emit, suffix, w.clock))
    for agg, col in specs:
        if agg not in WINDOW_AGGREGATES:
            raise QueryError(f"unknown window aggregate {agg!r}; choose from {WINDOW_AGGREGATES}")
        if agg != "count" and col is None:
            raise QueryError(f"aggregate {agg!r} needs a column")
    lateness = 0 if allowed_lateness is None else allowed_lateness
    if allowed_lateness is not None:
        lateness, lt = _span(allowed_lateness, "allowed_lateness")
        timed = [w for w in out if w.time is not None]
        if lateness < 0:
            raise QueryError("allowed_lateness must be >= 0")
        if timed and lt and not timed[0].temporal and lateness:
            raise QueryError("allowed_lateness is a timedelta but the window sizes are numbers")
    return out, lateness


# -- exact float sums (Shewchuk partials, as math.fsum) -------------------------------------


def _add_partial(partials: list[float], x: float) -> list[float]:
    """Add ``x`` exactly to non-overlapping ``partials`` (their exact sum grows by exactly ``x``)."""
    out: list[float] = []
    for y in partials:
        if abs(x) < abs(y):
            x, y = y, x
        hi = x + y
        lo = y - (hi - x)
        if lo:
            out.append(lo)
        x = hi
    if x or not out:
        out.append(x)
    return out


def _sum_add(acc: Any, v: Any, sign: int) -> Any:
    """A running sum plus ``sign * v``: exact ints, or exact float partials (a list)."""
    if acc is None:
        acc = [] if isinstance(v, float) else 0
    if isinstance(acc, list) or isinstance(v, float):
        parts = acc if isinstance(acc, list) else ([float(acc)] if acc else [])
        return _add_partial(parts, sign * float(v))
    return acc + sign * v


def _sum_value(acc: Any) -> Any:
    return math.fsum(acc) if isinstance(acc, list) else acc


# -- the operator ------------------------------------------------------------------------------


class WindowAggregate(Operator):
    """Per-key window aggregates, per event (see the module docstring for the exact semantics).

    Build it with ``stream.key_by(...).window(spec, count=True, sum="amount", ...)``.
    Output columns: the key columns; the time column (with a time window;
    the event's own time); ``window_start``/``window_end`` (hopping and
    tumbling); then ``count``, ``sum_<col>``, ``mean_<col>``, ``min_<col>``,
    ``max_<col>``, ``distinct_<col>`` as asked, each suffixed ``_<name>``
    when one call computes several windows. ``hot_entries``: each of its
    states keeps at most that many entries in memory, the rest in the
    host's spill store (``chronostream.slices.statelib``, *Hot limits*).
    """

    def __init__(self, key_columns: Sequence[str], windows: Sequence[_Window],
                 specs: Sequence[tuple[str, str | None]], allowed_lateness: int | float = 0,
                 hot_entries: int | None = None) -> None:
        self.key_columns = list(key_columns)
        self.hot_entries = hot_entries
        self.windows = list(windows)
        self.specs = list(specs)
        self.allowed_lateness = allowed_lateness
        self.hopping = self.windows[0].kind == "hopping"
        self.slice_clock = self.hopping and self.windows[0].clock == "slice"
        timed = [w for w in self.windows if w.time is not None]
        self.time_column = timed[0].time if timed else None
        self.temporal = bool(timed) and timed[0].temporal
        # Columns whose values the event queue keeps for retraction (sum/mean/distinct).
        self.sum_columns = sorted({c for a, c in self.specs if a in ("sum", "mean")})
        self.distinct_columns = sorted({c for a, c in self.specs if a == "distinct"})
        self.extreme_specs = sorted({(a, c) for a, c in self.specs if a in ("min", "max")})
        self.value_columns = sorted({c for a, c in self.specs if c is not None})
        self.queued_columns = sorted(set(self.sum_columns) | set(self.distinct_columns))

    def setup(self) -> None:
        hot = self.hot_entries  # per state: each of the window's states holds at most that many in memory
        self.keys = self.register_value("window.key", hot_entries=hot)
        if self.hopping:
            self.distinct = {c: self.register_map(f"window.distinct.{c}", hot_entries=hot)
                             for c in self.distinct_columns}
            if self.slice_clock:
                # The slice's latest time and its open windows' starts (one entry, key ""), and per
                # start the keys with that window open: what closes when the slice's time passes.
                self.clock = self.register_value("window.clock", hot_entries=hot)
                self.closing = self.register_map("window.closing", hot_entries=hot)
            return
        self.events = self.register_queue("window.events", hot_entries=hot)
        n = range(len(self.windows))
        self.extremes = {(a, c, w): self.register_queue(f"window.{a}.{c}.{w}", hot_entries=hot)
                         for a, c in self.extreme_specs for w in n}
        self.distinct = {(c, w): self.register_map(f"window.distinct.{c}.{w}", hot_entries=hot)
                         for c in self.distinct_columns for w in n}

    # -- per event ---------------------------------------------------------------------

    def _time(self, event: dict) -> int | float:
        v = event.get(self.time_column)
        if isinstance(v, dt.datetime):
            if not self.temporal:
                raise TypeError(f"time column {self.time_column!r} holds timestamps: give sizes as datetime.timedelta")
            return (v - (_EPOCH_NAIVE if v.tzinfo is None else _EPOCH_UTC)) // _US
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"time column {self.time_column!r} must hold numbers or timestamps, got {v!r}")
        if self.temporal:
            raise TypeError(f"time column {self.time_column!r} holds numbers: give sizes as numbers, not timedeltas")
        if v != v or v in (math.inf, -math.inf):
            raise ValueError(f"time column {self.time_column!r} has a non-finite value {v!r}")
        return v

    def _values(self, event: dict) -> dict[str, Any]:
        vals = {}
        for c in self.value_columns:
            v = event.get(c)
            if v is None:
                raise ValueError(f"column {c!r} has a null value; window aggregates need non-null values")
            if isinstance(v, float) and (v != v or v in (math.inf, -math.inf)):
                raise ValueError(f"column {c!r} has a non-finite value {v!r}; window aggregates need finite values")
            vals[c] = v
        return vals

    def _effective_time(self, key: Any, t: int | float, latest: int | float | None) -> int | float:
        if latest is None or t >= latest:
            return t
        if latest - t > self.allowed_lateness:
            whose = "the slice's" if self.slice_clock else "the key's"
            raise LateEventError(
                f"event time {t} of key {key!r} is {latest - t} older than {whose} latest time {latest} "
                f"(allowed_lateness {self.allowed_lateness}); feed the source in event-time order "
                "(order_by=...) or raise allowed_lateness")
        return latest  # clamped: it joins the newest windows

    def consume(self, stream_id: str, event: dict) -> None:
        key = tuple(canonical_key(event[c]) for c in self.key_columns)
        key = key[0] if len(key) == 1 else key
        if self.hopping:
            self._consume_hopping(key, event)
        else:
            self._consume_sliding(key, event)

    def _out_row(self, event: dict) -> dict:
        row = {c: event[c] for c in self.key_columns}
        if self.time_column is not None:
            row[self.time_column] = event[self.time_column]
        return row

    # -- sliding (time and count) ---------------------------------------------------------

    def _consume_sliding(self, key: Any, event: dict) -> None:
        # Phase 1 reads and checks only: an event that raises leaves state untouched.
        vals = self._values(event)
        st = self.keys.get(key)
        latest = None if st is None else st["t"]
        t = self._time(event) if self.time_column is not None else 0
        t_eff = self._effective_time(key, t, latest) if self.time_column is not None else None
        pos = self.events.index_range(key)[1]  # absolute position of this event in the key's queue
        heads = [pos] * len(self.windows) if st is None else list(st["heads"])
        aggs = [{"n": 0, "s": {}} for _ in self.windows] if st is None else st["agg"]
        new_heads, new_aggs, expired = [], [], []
        for w, win in enumerate(self.windows):
            h = heads[w]
            gone: list[list] = []  # the queued events leaving this window: [time, queued values...]
            if win.kind == "count":
                new_h = max(h, pos + 1 - win.size)
                if new_h > h:
                    for item in self.events.scan(key, h):
                        gone.append(item)
                        if len(gone) == new_h - h:
                            break
            else:
                cutoff = t_eff - win.size
                for item in self.events.scan(key, h):  # in time order: stop at the first one still in
                    if item[0] > cutoff:
                        break
                    gone.append(item)
                new_h = h + len(gone)
            expired.append(gone)
            sums = dict(aggs[w]["s"])
            for c in self.sum_columns:
                acc = _sum_add(sums.get(c), vals[c], +1)
                i = 1 + self.queued_columns.index(c)
                for item in gone:
                    acc = _sum_add(acc, item[i], -1)
                if isinstance(acc, int) and not -2**63 <= acc < 2**63:
                    raise OverflowError(f"windowed int64 sum of column {c!r} overflows")
                sums[c] = acc
            new_heads.append(new_h)
            new_aggs.append({"n": aggs[w]["n"] + 1 - (new_h - h), "s": sums})
        # Phase 2 writes.
        row = self._out_row(event)
        self.events.append(key, [t_eff] + [vals[c] for c in self.queued_columns])
        for w, win in enumerate(self.windows):
            new_h = new_heads[w]
            for c in self.distinct_columns:
                m = self.distinct[(c, w)]
                m.increment(key, vals[c], 1)
                i = 1 + self.queued_columns.index(c)
                for item in expired[w]:
                    m.increment(key, item[i], -1)
            for a, c in self.extreme_specs:
                dq = self.extremes[(a, c, w)]
                while dq.len(key) and dq.peekleft(key)[0] < new_h:
                    dq.popleft(key)  # expired
                v = vals[c]
                # Drop entries the new value dominates: they leave the window first and never win again.
                while dq.len(key) and (dq.peek(key)[1] <= v if a == "max" else dq.peek(key)[1] >= v):
                    dq.pop(key)
                dq.append(key, [pos, v])
            agg = new_aggs[w]
            for a, c in self.specs:
                name = (a if a == "count" else f"{a}_{c}") + win.suffix
                if a == "count":
                    row[name] = agg["n"]
                elif a == "sum":
                    row[name] = _sum_value(agg["s"][c])
                elif a == "mean":
                    row[name] = _sum_value(agg["s"][c]) / agg["n"]
                elif a == "distinct":
                    row[name] = self.distinct[(c, w)].len(key)
                else:
                    row[name] = self.extremes[(a, c, w)].peekleft(key)[1]
        # Events no window holds any more leave the shared queue.
        oldest = min(new_heads)
        head = self.events.index_range(key)[0]
        for _ in range(head, oldest):
            self.events.popleft(key)
        self.keys.set(key, {"t": t_eff, "heads": new_heads, "agg": new_aggs})
        self.produce_update("out", row)  # one row per event: keeps the event's lineage

    # -- hopping and tumbling ------------------------------------------------------------------

    def _consume_hopping(self, key: Any, event: dict) -> None:
        win = self.windows[0]
        vals = self._values(event)
        st = self.keys.get(key)
        clock = self.clock.get("") if self.slice_clock else None
        latest = (None if clock is None else clock["t"]) if self.slice_clock else (None if st is None else st["t"])
        seen = 0 if st is None else st["n"]
        t = self._time(event) if win.time is not None else seen
        t_eff = self._effective_time(key, t, latest)
        open_ = [] if st is None else st["open"]
        closed = [w for w in open_ if w["start"] + win.size <= t_eff]
        by_start = {w["start"]: w for w in open_ if w["start"] + win.size > t_eff}
        k = math.floor((t_eff - win.offset) / win.hop)
        while win.offset + k * win.hop > t_eff:  # float rounding may overshoot by one hop
            k -= 1
        starts = []
        while True:
            s = win.offset + k * win.hop
            if s + win.size <= t_eff:
                break
            starts.append(s)
            k -= 1
        starts.reverse()
        updated = []
        for s in starts:
            w = by_start.get(s) or {"start": s, "n": 0, "s": {}, "lo": {}, "hi": {}}
            w = {"start": s, "n": w["n"] + 1, "s": dict(w["s"]), "lo": dict(w["lo"]), "hi": dict(w["hi"])}
            for c in self.sum_columns:
                acc = _sum_add(w["s"].get(c), vals[c], +1)
                if isinstance(acc, int) and not -2**63 <= acc < 2**63:
                    raise OverflowError(f"windowed int64 sum of column {c!r} overflows")
                w["s"][c] = acc
            for _, c in self.extreme_specs:
                v = vals[c]
                w["lo"][c] = v if c not in w["lo"] else min(w["lo"][c], v)
                w["hi"][c] = v if c not in w["hi"] else max(w["hi"][c], v)
            by_start[s] = w
            updated.append(w)
        # Phase 2 writes. Closed windows are emitted (emit="close") before their distinct maps go.
        zone = _tz_name(event[win.time].tzinfo) if win.emit == "close" and self.temporal else None
        if self.slice_clock:
            self._close_slice_windows(key, closed, zone, t_eff, clock)
            starts = [] if clock is None else clock["starts"]
            opened = [w["start"] for w in updated if w["n"] == 1]  # windows this event opened for its key
            for s in opened:
                self.closing.set(s, key, True)
            if opened or (starts and starts[0] + win.size <= t_eff):  # (else the open starts are as they were)
                starts = sorted({x for x in starts if x + win.size > t_eff} | set(opened))
            # (a starts list is never changed in place: a new one is a new object)
            if clock is None or clock["t"] != t_eff or starts is not clock["starts"]:
                self.clock.set("", {"t": t_eff, "starts": starts})
        elif win.emit == "close":
            for w in closed:
                self.produce("out", self._closing_row(key, w, zone))
        for c, m in self.distinct.items():
            for w in closed:
                m.clear((key, w["start"]))
            for w in updated:
                m.set((key, w["start"]), vals[c], True)
        st_new = {"t": t_eff, "n": seen + 1, "open": [by_start[s] for s in sorted(by_start)]}
        if zone is not None:
            st_new["z"] = zone  # the end rows' bounds need the column's zone
        self.keys.set(key, st_new)
        if win.emit == "event":
            for w in updated:
                self.produce("out", self._window_row(key, event, w))

    def _close_slice_windows(self, key: Any, closed: list[dict], zone: str | None, t_eff: int | float,
                             clock: dict | None) -> None:
        """``clock="slice"``: emit every window of the slice that ends at or before ``t_eff``,
        by start, each start's keys in the order of their encoded bytes, and forget them. The
        event's own key's closing windows are ``closed`` (its state is written by the caller);
        another key's leave its state here."""
        size = self.windows[0].size
        due = [x for x in ([] if clock is None else clock["starts"]) if x + size <= t_eff]
        if not due:  # most events: nothing ends before them
            return
        mine = {w["start"]: w for w in closed}
        own = codec.packb(key)  # bytes compare a NaN key equal to itself
        for start in due:
            for kb, k in sorted((codec.packb(k), k) for k in self.closing.keys(start)):
                if kb == own:
                    self.produce("out", self._closing_row(k, mine[start], zone))
                    continue
                st = self.keys.get(k)
                (w,) = [w for w in st["open"] if w["start"] == start]
                self.produce("out", self._closing_row(k, w, st.get("z")))
                self.keys.set(k, {**st, "open": [x for x in st["open"] if x["start"] != start]})
                for m in self.distinct.values():
                    m.clear((k, start))
            self.closing.clear(start)

    def _closing_row(self, key: Any, w: dict, zone: str | None) -> dict:
        """A closed window's row from its key (the canonical key values) and the time column's zone."""
        win = self.windows[0]
        row = dict(zip(self.key_columns, key if len(self.key_columns) > 1 else (key,)))
        row["window_start"] = self._time_at(w["start"], zone)
        row["window_end"] = self._time_at(w["start"] + win.size, zone)
        row.update(self._aggregates(key, w))
        return row

    def _window_row(self, key: Any, event: dict, w: dict) -> dict:
        """An open window's row at an event (``emit="event"``): the event's key and time."""
        win = self.windows[0]
        row = {c: event[c] for c in self.key_columns}
        if win.time is not None:
            row[win.time] = event[win.time]
        row["window_start"] = self._time_out(event, w["start"])
        row["window_end"] = self._time_out(event, w["start"] + win.size)
        row.update(self._aggregates(key, w))
        return row

    def _aggregates(self, key: Any, w: dict) -> dict:
        """One hopping window's aggregate columns."""
        row: dict = {}
        n = w["n"]
        for a, c in self.specs:
            name = a if a == "count" else f"{a}_{c}"
            if a == "count":
                row[name] = n
            elif a == "sum":
                row[name] = _sum_value(w["s"][c])
            elif a == "mean":
                row[name] = _sum_value(w["s"][c]) / n
            elif a == "distinct":
                row[name] = self.distinct[c].len((key, w["start"]))
            else:
                row[name] = (w["lo"] if a == "min" else w["hi"])[c]
        return row

    def _time_at(self, t: int | float, zone: str | None) -> Any:
        """A window bound in the time column's type, from its zone (``_tz_name``) alone."""
        if not self.temporal:
            return t
        if zone is None:
            return _EPOCH_NAIVE + dt.timedelta(microseconds=t)
        return pa.scalar(int(t), type=pa.timestamp("us", tz=zone)).as_py()

    def _time_out(self, event: dict, t: int | float) -> Any:
        """A window bound in the time column's type (datetimes keep the event's time zone)."""
        if not self.temporal:
            return t
        v = event[self.windows[0].time]
        if v.tzinfo is None:
            return _EPOCH_NAIVE + dt.timedelta(microseconds=t)
        # The instant in UTC, then shown in the event's zone: adding to the zone's 1970 wall time
        # would apply its 1970 offset to today's instant (wrong wherever the offset changed since,
        # or across a daylight-saving change).
        return (_EPOCH_UTC + dt.timedelta(microseconds=t)).astimezone(v.tzinfo)


class ClosingWindowAggregate(WindowAggregate):
    """Hopping or tumbling windows with ``emit="close"``: at the end of the input every window
    still open is emitted too (``Operator.on_end``), keys in a fixed order (their encoded bytes),
    each key's windows by start, as if an event past their end had closed them. The rows carry
    the key columns and the bounds; their lineage is the end of the input."""

    def on_end(self) -> None:
        for key, st in sorted(self.keys.state.items(), key=lambda kv: codec.packb(kv[0])):
            for w in st["open"]:
                self.produce("out", self._closing_row(key, w, st.get("z")))


def _tz_name(tz: Any) -> str | None:
    """The Arrow time zone string of a ``datetime``'s ``tzinfo`` (None: naive): a zone name
    (zoneinfo's ``key``, pytz's ``zone``, ``UTC``) or a fixed offset ``+HH:MM``.

    >>> _tz_name(None), _tz_name(dt.timezone.utc), _tz_name(dt.timezone(dt.timedelta(hours=-5, minutes=-30)))
    (None, 'UTC', '-05:30')
    """
    if tz is None:
        return None
    name = getattr(tz, "key", None) or getattr(tz, "zone", None)
    if name:
        return name
    off = tz.utcoffset(None)
    if off is None or off == dt.timedelta(0):
        return "UTC"
    minutes = int(off.total_seconds() // 60)
    sign = "-" if minutes < 0 else "+"
    return f"{sign}{abs(minutes) // 60:02d}:{abs(minutes) % 60:02d}"
