"""The simulator's independent oracle: what a random query's operators must output, computed
with pandas from the source tables, and the comparison of a run's sink with it.

Owns: model frames (a stream's rows as a pandas ``DataFrame``: its user columns, ``_o`` the
global order of the source event each row derives from, ``_p`` the lineage path below it, a
tuple), the models of the built-in operators (running aggregates, sliding, count, tumbling and
hopping windows, the keyed join) and of the simulator's own operators
(``chronostream.sim.operators``), and ``compare`` (an expected frame against a sink's table).
Written from the documented semantics (docs/guide.md, the operators' docstrings), never from
the runtime's code: it imports nothing of chronostream, so an error in the runtime cannot
hide in it.

An expected frame says how it is compared in its ``attrs``: ``level`` ``"final"`` (one row per
key, ``attrs["key"]``: the sink's last row per key, by ``(_order, _sub)``, must equal it) or
``"rows"`` (the sink's rows as a multiset, on the frame's columns, ``_order`` included when
the frame has it); ``rows``: how many rows the sink has, when known.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
from collections import Counter, defaultdict
from typing import Any, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

_EPOCH_UTC = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_EPOCH_NAIVE = dt.datetime(1970, 1, 1)
_US = dt.timedelta(microseconds=1)
#: Significant digits two numbers must share to be equal (the model sums in another order).
DIGITS = 12


# --- values -----------------------------------------------------------------------------------


def freeze(value: Any) -> Any:
    """A hashable, comparable form of a value from Arrow or pandas: ints as they are (equal to
    the floats equal to them, as Python has it), floats rounded to ``DIGITS`` significant
    digits, timestamps as microseconds (aware ones since the Unix epoch, whatever their zone),
    decimals normalized, lists as tuples, structs as sorted items, a missing value (None, NaN,
    NaT) as None, booleans tagged (True is not the number 1 here).

    >>> freeze(5) == freeze(5.0), freeze([1, None]), freeze(decimal.Decimal("1.50")) == freeze(decimal.Decimal("1.5"))
    (True, (1, None), True)
    """
    kind = type(value)
    if kind is str or kind is int or value is None:
        return value
    if kind is float:
        return None if value != value else float(f"{value:.{DIGITS}g}")
    if isinstance(value, (bool, np.bool_)):
        return ("bool", bool(value))
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return freeze(float(value))
    if value is pd.NaT:
        return None
    if isinstance(value, decimal.Decimal):
        return ("dec", value.normalize())
    if isinstance(value, pd.Timestamp):
        value = value.to_pydatetime()
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            return ("naive", (value - _EPOCH_NAIVE) // _US)
        return ("ts", (value - _EPOCH_UTC) // _US)
    if isinstance(value, (list, tuple, np.ndarray)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, freeze(v)) for k, v in value.items()))
    return value


def time_number(value: Any) -> int | float:
    """An event time as a number: a timestamp in microseconds since the Unix epoch."""
    if isinstance(value, pd.Timestamp):
        value = value.to_pydatetime()
    if isinstance(value, dt.datetime):
        return (value - (_EPOCH_NAIVE if value.tzinfo is None else _EPOCH_UTC)) // _US
    return value


def time_value(number: int | float, like: Any) -> Any:
    """A window bound ``number`` in the type of the event time ``like``: a timestamp in its zone."""
    if isinstance(like, pd.Timestamp):
        like = like.to_pydatetime()
    if isinstance(like, dt.datetime):
        if like.tzinfo is None:
            return _EPOCH_NAIVE + dt.timedelta(microseconds=int(number))
        # The instant first (UTC arithmetic), then its wall time in the zone: adding to a
        # wall time would keep the zone's 1970 offset.
        return (_EPOCH_UTC + dt.timedelta(microseconds=int(number))).astimezone(like.tzinfo)
    return number


# --- model frames ---------------------------------------------------------------------------


def frame_of(table: pa.Table) -> pd.DataFrame:
    """A table's columns as a frame: non-null ints and floats as numpy columns, anything else
    as Python objects (the values Arrow's ``to_pylist`` gives)."""
    cols: dict[str, Any] = {}
    for name in table.schema.names:
        col = table.column(name)
        if col.null_count == 0 and (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
            cols[name] = col.to_numpy()
        else:
            cols[name] = pd.Series(col.to_pylist(), dtype=object)
    return pd.DataFrame(cols)


def source_frames(tables: Sequence[pa.Table], order_by: str | None) -> list[pd.DataFrame]:
    """Each source's model frame, in declaration order: ``_o`` the global order the guide
    defines (sorted by ``order_by`` over every source when declared, else by row position;
    ties by declaration index, then row), ``_p`` the empty path."""
    parts = []
    for src, table in enumerate(tables):
        sort_time = [time_number(v) for v in table.column(order_by).to_pylist()] if order_by else [0] * table.num_rows
        parts.append(pd.DataFrame({"time": sort_time, "src": src, "row": np.arange(table.num_rows)}))
    every = pd.concat(parts, ignore_index=True)
    by = ["time", "src", "row"] if order_by else ["row", "src"]
    every = every.sort_values(by, kind="stable").reset_index(drop=True)
    every["order"] = np.arange(len(every))
    out = []
    for src, table in enumerate(tables):
        mine = every[every["src"] == src].sort_values("row")
        df = frame_of(table)
        df["_o"] = mine["order"].to_numpy()
        df["_p"] = [()] * len(df)
        out.append(df)
    return out


def in_order(df: pd.DataFrame) -> pd.DataFrame:
    """The frame's rows in lineage order, ``(_o, _p)`` (the order a stage consumes one stream in)."""
    o, p = df["_o"].tolist(), df["_p"].tolist()
    idx = sorted(range(len(df)), key=lambda i: (o[i], p[i]))
    return df.iloc[idx].reset_index(drop=True)


def key_tuples(df: pd.DataFrame, key: Sequence[str]) -> list[tuple]:
    """Each row's key as a tuple of its values (a null key is a key; NFC and NFD spellings
    are two; an int and the float equal to it are one, as in a Python dict)."""
    return list(zip(*(_python(df[c].tolist()) for c in key))) if len(df) else []


def _groups(df: pd.DataFrame, key: Sequence[str]) -> dict[tuple, list[int]]:
    """Row positions per key, in row order."""
    out: dict[tuple, list[int]] = defaultdict(list)
    for i, k in enumerate(key_tuples(df, key)):
        out[k].append(i)
    return out


def _numbers(col: pd.Series) -> pd.Series:
    """A numeric column as numpy numbers (a column of Python objects as float64: pandas does
    not scan objects)."""
    return col.astype(np.float64) if col.dtype == object else col


def _column(values: list, index: pd.Index) -> pd.Series:
    return pd.Series(values, index=index, dtype=object)


def _finish(df: pd.DataFrame, level: str, key: Sequence[str] = (), rows: int | None = None) -> pd.DataFrame:
    df.attrs.update(level=level, key=list(key), rows=rows)
    return df


def last_per_key(model: pd.DataFrame, key: Sequence[str], rows: int | None) -> pd.DataFrame:
    """The expected frame of a running operator: each key's last row of ``model`` (in lineage
    order), compared with the sink's last row per key; ``rows`` the sink's row count."""
    ordered = in_order(model)
    keep = sorted({positions[-1] for positions in _groups(ordered, key).values()})
    out = ordered.iloc[keep].drop(columns=["_o", "_p"]).reset_index(drop=True)
    return _finish(out, "final", key, rows)


def every_row(model: pd.DataFrame, with_order: bool) -> pd.DataFrame:
    """The expected frame of the sink's rows as a multiset; ``with_order``: ``_order`` too."""
    out = model.drop(columns=["_p"]).rename(columns={"_o": "_order"})
    if not with_order:
        out = out.drop(columns=["_order"])
    return _finish(out.reset_index(drop=True), "rows", rows=len(out))


# --- the built-in operators ----------------------------------------------------------------


def running_aggregate(df: pd.DataFrame, key: Sequence[str], specs: Sequence[tuple[str, str | None]]) -> pd.DataFrame:
    """``key_by(key).aggregate(...)``: one row per input row, the key and its running values
    (``count``, ``sum_<c>``, ``min_<c>``, ``max_<c>``, ``mean_<c>``) including that row."""
    df = in_order(df)
    out = df[list(key) + ["_o", "_p"]].copy()
    group = pd.Series(key_tuples(df, key), index=df.index, dtype=object)
    g = df.groupby(group, sort=False)
    count = g.cumcount() + 1
    for agg, col in specs:
        if agg == "count":
            out["count"] = count
            continue
        gv = _numbers(df[col]).groupby(group, sort=False)
        if agg == "sum":
            out[f"sum_{col}"] = gv.cumsum()
        elif agg == "min":
            out[f"min_{col}"] = gv.cummin()
        elif agg == "max":
            out[f"max_{col}"] = gv.cummax()
        else:
            out[f"mean_{col}"] = gv.cumsum().astype(np.float64) / count
    return out


def _window_values(values: list, agg: str) -> Any:
    if agg == "count":
        return len(values)
    if agg == "sum":
        return math.fsum(values) if any(isinstance(v, float) for v in values) else sum(values)
    if agg == "mean":
        total = math.fsum(values) if any(isinstance(v, float) for v in values) else sum(values)
        return total / len(values)
    if agg == "min":
        return min(values)
    if agg == "max":
        return max(values)
    return len(set(values))


def _agg_name(agg: str, col: str | None, suffix: str = "") -> str:
    return (agg if agg == "count" else f"{agg}_{col}") + suffix


def _python(values: Sequence) -> list:
    """Numpy numbers as Python ones, and NaN as None (the data holds no NaN: pandas made it of a
    missing value)."""
    out = [v.item() if isinstance(v, np.generic) else v for v in values]
    return [None if isinstance(v, float) and v != v else v for v in out]


def sliding_windows(df: pd.DataFrame, key: Sequence[str], windows: Sequence[tuple[str, int | float, str]],
                    specs: Sequence[tuple[str, str | None]], time: str | None) -> pd.DataFrame:
    """Sliding windows (``("time", size, suffix)``: the key's events so far with time in
    ``(t - size, t]``; ``("count", n, suffix)``: its last ``n`` events): one row per input row,
    the key, the time column (when a window has one) and each aggregate per window."""
    df = in_order(df)
    times = [time_number(v) for v in df[time].tolist()] if time else [0] * len(df)
    cols = {c: _python(df[c].tolist()) for _, c in specs if c is not None}
    results: dict[str, list] = {_agg_name(a, c, s): [None] * len(df) for _, _, s in windows for a, c in specs}
    for rows in _groups(df, key).values():
        t = np.array([times[i] for i in rows])
        for pos, i in enumerate(rows):
            for kind, size, suffix in windows:
                lo = max(0, pos + 1 - int(size)) if kind == "count" else \
                    int(np.searchsorted(t[:pos + 1], t[pos] - size, side="right"))
                for agg, c in specs:
                    values = [1] * (pos + 1 - lo) if c is None else [cols[c][j] for j in rows[lo:pos + 1]]
                    results[_agg_name(agg, c, suffix)][i] = _window_values(values, agg)
    out = df[list(key) + ([time] if time else []) + ["_o", "_p"]].copy()
    for name, values in results.items():
        out[name] = _column(values, out.index)
    return out


def _window_starts(t: int | float, size: int | float, hop: int | float, offset: int | float) -> list:
    """The starts ``offset + k * hop`` of the windows ``[s, s + size)`` holding ``t``, ascending."""
    k = math.floor((t - offset) / hop)
    starts = []
    while offset + k * hop + size > t:
        starts.append(offset + k * hop)
        k -= 1
    return starts[::-1]


def hopping_windows(df: pd.DataFrame, key: Sequence[str], size: int | float, hop: int | float,
                    offset: int | float, time: str | None, specs: Sequence[tuple[str, str | None]],
                    emit: str) -> pd.DataFrame:
    """Tumbling and hopping windows ``[offset + k * hop, ... + size)`` over the time column, or
    over the key's event count (``time`` None). ``emit="event"``: per input row, a row per window
    holding it (by start) with that window's aggregates so far (the key, the time, the bounds,
    the aggregates; lineage: the row's, extended); ``emit="close"``: a row per window with its
    aggregates over all its rows (no time column; lineage unknown: ``_o`` is -1)."""
    df = in_order(df)
    times = [time_number(v) for v in df[time].tolist()] if time else None
    like = df[time].tolist() if time else None
    cols = {c: _python(df[c].tolist()) for _, c in specs if c is not None}
    keys = df[list(key)].to_dict("records")
    event_rows: list[dict] = []
    contents: dict[tuple, dict] = {}  # (key, start) -> {"row": key values, "values": {col: [...]}, "like": t}
    for rows in _groups(df, key).values():
        for n, i in enumerate(rows):
            t = times[i] if times is not None else n
            for j, s in enumerate(_window_starts(t, size, hop, offset)):
                frozen = (tuple(_python(keys[i].values())), s)
                w = contents.setdefault(frozen, {"row": keys[i], "n": 0, "values": defaultdict(list),
                                                 "like": like[i] if like else None})
                w["n"] += 1
                for c, vals in cols.items():
                    w["values"][c].append(vals[i])
                if emit == "event":
                    row = dict(keys[i])
                    if time:
                        row[time] = like[i]  # type: ignore[index]
                    row.update(_hopping_row(w, s, size, specs, like[i] if like else None))
                    row["_o"], row["_p"] = df["_o"].iat[i], df["_p"].iat[i] + (j,)
                    event_rows.append(row)
    if emit == "event":
        names = list(key) + ([time] if time else []) + ["window_start", "window_end"] + \
            [_agg_name(a, c) for a, c in specs] + ["_o", "_p"]
        return pd.DataFrame(event_rows, columns=names, dtype=object)
    closed = [{**w["row"], **_hopping_row(w, s, size, specs, w["like"]), "_o": -1, "_p": ()}
              for (_, s), w in contents.items()]
    names = list(key) + ["window_start", "window_end"] + [_agg_name(a, c) for a, c in specs] + ["_o", "_p"]
    return pd.DataFrame(closed, columns=names, dtype=object)


def _hopping_row(w: dict, start: int | float, size: int | float, specs: Sequence[tuple[str, str | None]],
                 like: Any) -> dict:
    row = {"window_start": time_value(start, like), "window_end": time_value(start + size, like)}
    for agg, c in specs:
        row[_agg_name(agg, c)] = _window_values([1] * w["n"] if c is None else w["values"][c], agg)
    return row


def join(left: pd.DataFrame, right: pd.DataFrame, left_key: Sequence[str], right_key: Sequence[str]) -> pd.DataFrame:
    """The keyed inner join: every pair of a left and a right row with equal keys (a null key
    equal to a null key), the left columns then the right ones (``right_<name>`` where a name
    clashes, ``right_right_<name>`` where that one is taken too...); ``_o`` the later row's."""
    lcols = [c for c in left.columns if c not in ("_o", "_p")]
    rcols = [c for c in right.columns if c not in ("_o", "_p")]
    renamed: dict[str, str] = {}
    taken = set(lcols) | {"_o", "_p", "_ro", "_rp"}
    for c in rcols:
        name = c
        while name in taken:
            name = "right_" + name
        renamed[c] = name
        taken.add(name)
    lk = left.assign(__key=pd.Series(key_tuples(left, left_key), index=left.index, dtype=object))
    rk = right.rename(columns={**renamed, "_o": "_ro", "_p": "_rp"})
    rk = rk.assign(__key=pd.Series(key_tuples(right, right_key), index=right.index, dtype=object))
    out = lk.merge(rk, on="__key", how="inner")
    out["_o"] = np.maximum(out["_o"].to_numpy(dtype=np.int64), out["_ro"].to_numpy(dtype=np.int64))
    out["_p"] = [()] * len(out)
    return out[lcols + [renamed[c] for c in rcols] + ["_o", "_p"]]


# --- the simulator's operators -----------------------------------------------------------------


def _per_key_rows(df: pd.DataFrame, key: Sequence[str], carry: Sequence[str]) -> pd.DataFrame:
    df = in_order(df)
    return df[list(dict.fromkeys([*key, *carry])) + ["_o", "_p"]].copy()


def running_total(df: pd.DataFrame, key: Sequence[str], col: str, carry: Sequence[str]) -> pd.DataFrame:
    """``RunningTotal``: per row, its key's count ``n`` and ``total`` of ``col`` so far."""
    out = _per_key_rows(df, key, carry)
    ordered = in_order(df)
    group = pd.Series(key_tuples(ordered, key), index=ordered.index, dtype=object)
    out["n"] = ordered.groupby(group, sort=False).cumcount().to_numpy() + 1
    out["total"] = _numbers(ordered[col]).groupby(group, sort=False).cumsum().to_numpy()
    return out


def recent_list(df: pd.DataFrame, key: Sequence[str], col: str, carry: Sequence[str]) -> pd.DataFrame:
    """``RecentList``: per row, its key's value count ``size`` and the last three values."""
    out = _per_key_rows(df, key, carry)
    values = _python(in_order(df)[col].tolist())
    size, last = [0] * len(out), [None] * len(out)
    for rows in _groups(out, key).values():
        for pos, i in enumerate(rows):
            size[i] = pos + 1
            last[i] = [values[j] for j in rows[max(0, pos - 2):pos + 1]]
    out["size"] = size
    out["last3"] = _column(last, out.index)
    return out


def moving_sum(df: pd.DataFrame, key: Sequence[str], col: str, carry: Sequence[str], width: int) -> pd.DataFrame:
    """``MovingSum``: per row, the sum and count of its key's last ``width`` values."""
    out = _per_key_rows(df, key, carry)
    values = _python(in_order(df)[col].tolist())
    qsum, qlen = [0] * len(out), [0] * len(out)
    for rows in _groups(out, key).values():
        for pos, i in enumerate(rows):
            last = [values[j] for j in rows[max(0, pos + 1 - width):pos + 1]]
            qsum[i], qlen[i] = sum(last), len(last)
    out["qsum"] = _column(qsum, out.index)
    out["qlen"] = qlen
    return out


def value_counts(df: pd.DataFrame, key: Sequence[str], col: str, carry: Sequence[str]) -> pd.DataFrame:
    """``ValueCounts``: per row, its value, how often its key saw it so far (``seen``) and how
    many distinct values its key saw (``distinct``)."""
    out = _per_key_rows(df, key, carry)
    values = _python(in_order(df)[col].tolist())
    seen, distinct = [0] * len(out), [0] * len(out)
    for rows in _groups(out, key).values():
        counts: Counter = Counter()
        for i in rows:
            counts[values[i]] += 1
            seen[i], distinct[i] = counts[values[i]], len(counts)
    out[col] = _column(values, out.index)
    out["seen"] = seen
    out["distinct"] = distinct
    return out


def top_items(df: pd.DataFrame, key: Sequence[str], col: str, carry: Sequence[str], item: str, k: int) -> pd.DataFrame:
    """``TopItems``: per row, the items of its key's ``k`` largest values so far, largest
    first (a tie: the earlier row first)."""
    out = _per_key_rows(df, key, carry)
    ordered = in_order(df)
    scores, items = _python(ordered[col].tolist()), _python(ordered[item].tolist())
    top: list = [None] * len(out)
    for rows in _groups(out, key).values():
        best: list[tuple] = []
        for pos, i in enumerate(rows):
            best = sorted(best + [(-scores[i], pos, items[i])])[:k]
            top[i] = [it for _, _, it in best]
    out["top"] = _column(top, out.index)
    return out


def end_totals(df: pd.DataFrame, key: Sequence[str], col: str) -> pd.DataFrame:
    """``EndTotals``: a row per key, its count ``n`` and ``total`` of ``col`` (lineage: the end
    of the input, ``_o`` -1)."""
    ordered = in_order(df)
    values = _python(ordered[col].tolist())
    keys = ordered[list(key)].to_dict("records")
    rows = []
    for positions in _groups(ordered, key).values():
        rows.append({**keys[positions[0]], "n": len(positions), "total": sum(values[i] for i in positions),
                     "_o": -1, "_p": ()})
    return pd.DataFrame(rows, columns=list(key) + ["n", "total", "_o", "_p"], dtype=object)


def batch_count(df: pd.DataFrame, key: Sequence[str], carry: Sequence[str]) -> pd.DataFrame:
    """``BatchCount``: per row, how many rows its key has had so far (``seen``)."""
    out = _per_key_rows(df, key, carry)
    group = pd.Series(key_tuples(out, key), index=out.index, dtype=object)
    out["seen"] = out.groupby(group, sort=False).cumcount() + 1
    return out


def enrich(facts: pd.DataFrame, dims: pd.DataFrame, fact_key: Sequence[str], dim_key: Sequence[str], col: str,
           value: str, carry: Sequence[str]) -> pd.DataFrame:
    """``Enrich`` of inputs whose rows never share a source event: per fact row, its key
    columns, ``value``, the carried columns and ``dim``, the ``col`` of the last dims row of
    its key before it (None before the first)."""
    f = in_order(facts)
    d = in_order(dims)
    events = sorted([(o, p, 1, i) for i, (o, p) in enumerate(zip(f["_o"].tolist(), f["_p"].tolist()))]
                    + [(o, p, 0, i) for i, (o, p) in enumerate(zip(d["_o"].tolist(), d["_p"].tolist()))])
    fk, dk = key_tuples(f, fact_key), key_tuples(d, dim_key)
    dim_values = d[col].tolist()
    latest: dict[tuple, Any] = {}
    dim: list = [None] * len(f)
    for _, _, is_fact, i in events:
        if is_fact:
            dim[i] = latest.get(fk[i])
        else:
            latest[dk[i]] = dim_values[i]
    out = f[list(dict.fromkeys([*fact_key, value, *carry])) + ["_o", "_p"]].copy()
    out["dim"] = _column(dim, out.index)
    return out


# --- comparison -----------------------------------------------------------------------------


def _rows_of(table: pa.Table, columns: Sequence[str]) -> list[tuple] | str:
    missing = [c for c in columns if c not in table.schema.names]
    if missing:
        return f"columns {missing} missing (it has {table.schema.names})"
    values = [table.column(c).to_pylist() for c in columns]
    return [tuple(freeze(v) for v in row) for row in zip(*values)]


def _counter_difference(want: Counter, got: Counter, columns: Sequence[str]) -> list[str]:
    missing, extra = want - got, got - want
    if not missing and not extra:
        return []
    show = lambda c: [dict(zip(columns, r)) for r in list(c.elements())[:2]]  # noqa: E731
    return [f"{sum(missing.values())} expected rows missing (first {show(missing)}), "
            f"{sum(extra.values())} rows not expected (first {show(extra)})"]


def compare(expected: pd.DataFrame, table: pa.Table) -> list[str]:
    """How a sink's ``table`` differs from the ``expected`` frame (empty when it does not), at
    the frame's level (the module docstring)."""
    problems = []
    rows = expected.attrs.get("rows")
    if rows is not None and rows != table.num_rows:
        problems.append(f"{table.num_rows} rows, expected {rows}")
    if table.num_rows == 0:  # (a sink without rows has no columns either)
        return problems + ([f"no rows, expected {len(expected)}"] if len(expected) and rows is None else [])
    if expected.attrs.get("level") == "final":
        key = list(expected.attrs["key"])
        columns = key + [c for c in expected.columns if c not in key]
        ordered = table.sort_by([("_order", "ascending"), ("_sub", "ascending")])
        got_rows = _rows_of(ordered, columns)
        if isinstance(got_rows, str):
            return problems + [got_rows]
        n = len(key)
        got = {r[:n]: r[n:] for r in got_rows}  # the last row per key wins
        want = {tuple(freeze(v) for v in r[:n]): tuple(freeze(v) for v in r[n:])
                for r in expected[columns].itertuples(index=False)}
        missing, extra = sorted(set(want) - set(got), key=repr), sorted(set(got) - set(want), key=repr)
        if missing or extra:
            problems.append(f"keys differ: {len(missing)} missing (first {missing[:2]}), "
                            f"{len(extra)} not expected (first {extra[:2]})")
        differ = [k for k in want if k in got and got[k] != want[k]]
        if differ:
            k = differ[0]
            problems.append(f"{len(differ)} keys' last rows differ (first: key {k}: got "
                            f"{dict(zip(columns[n:], got[k]))}, expected {dict(zip(columns[n:], want[k]))})")
        return problems
    columns = [c for c in expected.columns]
    got_rows = _rows_of(table, columns)
    if isinstance(got_rows, str):
        return problems + [got_rows]
    want_rows = [tuple(freeze(v) for v in r) for r in expected[columns].itertuples(index=False)]
    return problems + _counter_difference(Counter(want_rows), Counter(got_rows), columns)
