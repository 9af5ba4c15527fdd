"""In-memory sources and the global source order.

Owns: turning a user's Arrow table or iterable of dicts into a source table,
checking it against a declared schema (a row that does not fit is an error
naming the source and the row's sequence number, or a dead letter), and
assigning the dense global order over all sources of a job (by the
``order_by`` column, then source declaration index, then row). The
sequence-numbered source log on disk is a separate module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from chronostream.slices.errors import EventError, QueryError
from chronostream.slices.types import ORDER, SUB


@dataclass
class SourceData:
    """One source's rows (user columns only) and its optional event-time column."""

    name: str
    table: pa.Table
    order_by: str | None = None
    dead_letters: list[dict] = field(default_factory=list)


def to_table(name: str, data: Any, schema: pa.Schema | None, dead_letter: bool) -> tuple[pa.Table, list[dict]]:
    """Convert ``data`` to an Arrow table, validating rows against ``schema``.

    Rows that do not fit raise an ``EventError`` naming the source and the
    row's position (its sequence number in that source), or, when
    ``dead_letter`` is true, are returned as dead letters instead.
    """
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    if isinstance(data, pa.Table):
        if schema is not None:
            try:
                data = data.select(schema.names).cast(schema)
            except (pa.ArrowInvalid, KeyError, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                raise EventError(name, 0, -1, f"source table does not match the declared schema: {exc}") from None
        for col in data.schema.names:
            if col.startswith("_"):
                raise QueryError(f"source {name!r}: column {col!r} starts with '_', reserved for system columns")
        return data, []
    rows = list(data)
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            if dead_letter:
                continue
            raise EventError(name, 0, i, f"source rows must be dicts, got {type(r).__name__}", r)
    if schema is None:
        good = [r for r in rows if isinstance(r, dict)]
        dead = [_dead(name, i, r, "not a dict") for i, r in enumerate(rows) if not isinstance(r, dict)]
        try:
            return pa.Table.from_pylist(good), dead
        except UnicodeEncodeError:
            pass  # a row's text cannot be stored (a lone surrogate): that row's error, found below
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise QueryError(
                f"source {name!r}: rows have inconsistent types ({exc}); declare schema= to find the offending row"
            ) from None
        # Slow path, only when the bulk conversion failed: find each row that cannot be stored.
        good = []
        for i, r in enumerate(rows):
            if not isinstance(r, dict):
                continue
            try:
                pa.Table.from_pylist([r])
                good.append(r)
            except UnicodeEncodeError as exc:
                if not dead_letter:
                    raise EventError(name, 0, i, f"row cannot be stored: {exc}", r) from None
                dead.append(_dead(name, i, r, str(exc)))
        dead.sort(key=lambda d: d["source_row"])
        try:
            return pa.Table.from_pylist(good), dead
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise QueryError(
                f"source {name!r}: rows have inconsistent types ({exc}); declare schema= to find the offending row"
            ) from None
    try:
        return pa.Table.from_pylist(rows, schema=schema), []
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, AttributeError, UnicodeEncodeError):
        pass
    # Slow path, only when the bulk conversion failed: find each offending row.
    good_rows: list[dict] = []
    dead: list[dict] = []
    for i, r in enumerate(rows):
        try:
            if not isinstance(r, dict):
                raise TypeError(f"source rows must be dicts, got {type(r).__name__}")
            missing = [n for n in schema.names if n not in r]
            extra = [k for k in r if k not in schema.names]
            if missing or extra:
                raise TypeError(f"fields do not match the schema (missing {missing}, unexpected {extra})")
            pa.Table.from_pylist([r], schema=schema)
            good_rows.append(r)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, AttributeError, OverflowError,
                UnicodeEncodeError) as exc:
            if not dead_letter:
                raise EventError(name, 0, i, f"row violates the declared schema {schema}: {exc}", r) from None
            dead.append(_dead(name, i, r, str(exc)))
    return pa.Table.from_pylist(good_rows, schema=schema), dead


def _dead(source: str, row: int, event: Any, error: str) -> dict:
    return {"stage": source, "slice": 0, "order": -1, "source_row": row, "error": error, "event": repr(event)}


#: Schema metadata of a compiled source table that stores no ``_order`` column: its rows'
#: global order is dense, row ``i`` at ``start + i`` (the value, as ASCII digits). A job with
#: one in-memory source has it; readers make the column for the rows an epoch reads.
DENSE_ORDER_META = b"chronostream.dense_order_start"


def dense_order_start(table: pa.Table) -> int | None:
    """The ``_order`` of row 0 when ``table`` stores no ``_order`` (``DENSE_ORDER_META``), else None."""
    meta = table.schema.metadata
    raw = meta.get(DENSE_ORDER_META) if meta else None
    return None if raw is None else int(raw)


def without_order_meta(table: pa.Table) -> pa.Table:
    """``table`` without ``DENSE_ORDER_META`` (the user's own schema metadata stays)."""
    meta = table.schema.metadata
    if not meta or DENSE_ORDER_META not in meta:
        return table
    rest = {k: v for k, v in meta.items() if k != DENSE_ORDER_META}
    return table.replace_schema_metadata(rest or None)


def source_orders(table: pa.Table) -> np.ndarray:
    """Every row's global ``_order`` in a compiled source table (its column, or dense).

    >>> source_orders(assign_global_order([SourceData("a", pa.table({"x": [7, 8]}))])[0]).tolist()
    [0, 1]
    """
    start = dense_order_start(table)
    if start is None:
        return np.asarray(table.column(ORDER))
    return np.arange(start, start + table.num_rows, dtype=np.int64)


def with_system_columns(table: pa.Table, start: int) -> pa.Table:
    """Rows ``start..`` of a dense-order source table (a slice of it) with ``_order`` and ``_sub``.

    >>> t = assign_global_order([SourceData("a", pa.table({"x": [7, 8, 9]}))])[0]
    >>> with_system_columns(t.slice(1), 1).to_pydict()
    {'x': [8, 9], '_order': [1, 2], '_sub': [0, 0]}
    """
    n = table.num_rows
    return without_order_meta(table).append_column(ORDER, pa.array(np.arange(start, start + n, dtype=np.int64))) \
        .append_column(SUB, pa.array(np.zeros(n, dtype=np.int64)))


def assign_global_order(sources: Sequence[SourceData]) -> list[pa.Table]:
    """Give every row of every source a dense global order (``_order``).

    Order: the ``order_by`` value (event time) when sources declare one, else
    the row position; ties broken by source declaration index, then row.
    Returns each source's table in increasing global order. With several
    sources each gets an ``_order`` column. One source's order is its row
    number (after sorting by ``order_by``), so its table stores none: the
    column would double a narrow table (two int64 columns: 0.9 GB of a
    1.8 GB input, held in the object store for the job's life), and the
    lexsort of all rows took 5 s for 28 M rows; ``DENSE_ORDER_META`` marks
    it instead. ``_sub`` (0 at sources) is never stored: readers add it to
    the rows of an epoch (``chronostream.slices.readers``). Use ``source_orders``
    to read either form.

    >>> a = SourceData("a", pa.table({"t": [1, 3]}), "t")
    >>> b = SourceData("b", pa.table({"t": [2, 3]}), "t")
    >>> [t.column("_order").to_pylist() for t in assign_global_order([a, b])]
    [[0, 2], [1, 3]]
    >>> one = assign_global_order([SourceData("c", pa.table({"t": [5, 4]}), "t")])[0]
    >>> one.column_names, one["t"].to_pylist(), source_orders(one).tolist()
    (['t'], [4, 5], [0, 1])
    """
    with_col = [s.order_by is not None for s in sources]
    if any(with_col) and not all(with_col):
        raise QueryError("either every source declares order_by= or none does (the global order must be defined)")
    keys = [_order_keys(s) for s in sources]
    if len(sources) == 1:
        t = sources[0].table
        k = keys[0]
        if len(k) > 1 and not bool(np.all(k[1:] >= k[:-1])):
            t = t.take(pa.array(np.argsort(k, kind="stable")))  # ties keep row order
        meta = dict(t.schema.metadata or {})
        meta[DENSE_ORDER_META] = b"0"
        return [t.replace_schema_metadata(meta)]
    src_idx, rows = [], []
    for i, s in enumerate(sources):
        n = s.table.num_rows
        src_idx.append(np.full(n, i, dtype=np.int64))
        rows.append(np.arange(n, dtype=np.int64))
    all_keys = np.concatenate(keys) if keys else np.zeros(0)
    all_src = np.concatenate(src_idx) if src_idx else np.zeros(0, np.int64)
    all_rows = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    perm = np.lexsort((all_rows, all_src, all_keys))
    order = np.empty(len(perm), dtype=np.int64)
    order[perm] = np.arange(len(perm), dtype=np.int64)
    out: list[pa.Table] = []
    start = 0
    for s in sources:
        n = s.table.num_rows
        o = order[start : start + n]
        start += n
        # A source's own rows must be in increasing global order: sort them.
        local = np.argsort(o, kind="stable")
        t = s.table.take(pa.array(local)) if not np.all(local == np.arange(n)) else s.table
        out.append(t.append_column(ORDER, pa.array(o[local], pa.int64())))
    return out


def _order_keys(s: SourceData) -> np.ndarray:
    """A source's rows' primary order key: its ``order_by`` values, else the row position."""
    n = s.table.num_rows
    if s.order_by is None:
        return np.arange(n, dtype=np.int64)
    col = s.table.column(s.order_by)
    if col.null_count:
        raise QueryError(f"source {s.name!r}: order_by column {s.order_by!r} has nulls")
    if pa.types.is_temporal(col.type):
        vals = np.asarray(col.cast(pa.int64()))
    else:
        vals = np.asarray(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
    return vals.astype(np.float64) if vals.dtype.kind == "f" else vals.astype(np.int64)
