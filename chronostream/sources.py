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

from chronostream.errors import EventError, QueryError
from chronostream.types import ORDER, SUB


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
        try:
            table = pa.Table.from_pylist(good)
            return table, [_dead(name, i, r, "not a dict") for i, r in enumerate(rows) if not isinstance(r, dict)]
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise QueryError(
                f"source {name!r}: rows have inconsistent types ({exc}); declare schema= to find the offending row"
            ) from None
    try:
        return pa.Table.from_pylist(rows, schema=schema), []
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, AttributeError):
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
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, AttributeError, OverflowError) as exc:
            if not dead_letter:
                raise EventError(name, 0, i, f"row violates the declared schema {schema}: {exc}", r) from None
            dead.append(_dead(name, i, r, str(exc)))
    return pa.Table.from_pylist(good_rows, schema=schema), dead


def _dead(source: str, row: int, event: Any, error: str) -> dict:
    return {"stage": source, "slice": 0, "order": -1, "source_row": row, "error": error, "event": repr(event)}


def assign_global_order(sources: Sequence[SourceData]) -> list[pa.Table]:
    """Give every row of every source a dense global ``_order`` (and ``_sub`` = 0).

    Order: the ``order_by`` value (event time) when sources declare one, else
    the row position; ties broken by source declaration index, then row.
    Returns each source's table with the two system columns appended (each
    source's rows stay in their own order, which is increasing ``_order``).

    >>> a = SourceData("a", pa.table({"t": [1, 3]}), "t")
    >>> b = SourceData("b", pa.table({"t": [2, 3]}), "t")
    >>> [t.column("_order").to_pylist() for t in assign_global_order([a, b])]
    [[0, 2], [1, 3]]
    """
    with_col = [s.order_by is not None for s in sources]
    if any(with_col) and not all(with_col):
        raise QueryError("either every source declares order_by= or none does (the global order must be defined)")
    keys, src_idx, rows = [], [], []
    for i, s in enumerate(sources):
        n = s.table.num_rows
        if s.order_by is not None:
            col = s.table.column(s.order_by)
            if col.null_count:
                raise QueryError(f"source {s.name!r}: order_by column {s.order_by!r} has nulls")
            if pa.types.is_temporal(col.type):
                vals = np.asarray(col.cast(pa.int64()))
            else:
                vals = np.asarray(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
            vals = vals.astype(np.float64) if vals.dtype.kind == "f" else vals.astype(np.int64)
        else:
            vals = np.arange(n, dtype=np.int64)
        keys.append(vals)
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
        t = t.append_column(ORDER, pa.array(o[local], pa.int64()))
        t = t.append_column(SUB, pa.array(np.zeros(n, dtype=np.int64)))
        out.append(t)
    return out
