"""Applies a physical stream's stateless chain (map, filter, flat_map...) to a batch.

Owns: running the fused transforms on the producer side, vectorized where the
transform is, one user call per event where the user asked for per-event
functions. Keeps the lineage columns right (fan-out extends the sub-order).
Knows no Ray.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import pyarrow as pa

from chronostream.slices.plan import (Filter, FilterBatches, FlatMap, FlatMapBatches, Map, MapBatches, batch_table,
                                      filter_rows, parent_rows)
from chronostream.slices.types import ORDER, SUB, extend_sub_order

log = logging.getLogger("chronostream.slices")

#: Called as on_error(row_index_in_table, exception); returns True to skip the
#: row (dead letter) or raises.
ErrorHandler = Callable[[pa.Table, int, BaseException], None]


def _user_columns(table: pa.Table) -> list[str]:
    return [c for c in table.schema.names if not c.startswith("_")]


def _with_lineage(out: pa.Table, order: np.ndarray, sub: np.ndarray,
                  carried: dict[str, np.ndarray] | None = None) -> pa.Table:
    out = out.drop_columns([c for c in (ORDER, SUB) if c in out.schema.names])
    out = out.append_column(ORDER, pa.array(order, pa.int64()))
    out = out.append_column(SUB, pa.array(sub, pa.int64()))
    for name, values in (carried or {}).items():
        out = out.append_column(name, pa.array(values))
    return out


def apply_chain(table: pa.Table, chain: tuple, on_error: ErrorHandler, carry: tuple[str, ...] = ()) -> pa.Table:
    """Run ``chain`` over ``table`` (user columns + ``_order``/``_sub``).

    ``carry``: hidden columns that follow their row through every step (an
    output row takes its parent row's value), as the lineage does; a slice
    group carries each row's owning slice this way (``slices/group.py``).
    """
    for step in chain:
        if table.num_rows == 0:
            # Keep going only to learn nothing; an empty batch stays empty.
            return table
        table = _apply_step(table, step, on_error, carry)
    return table


def _carried(table: pa.Table, carry: tuple[str, ...], rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The ``carry`` columns of ``table``, at ``rows`` (the parents of a step's output rows)."""
    cols = {c: np.asarray(table.column(c)) for c in carry if c in table.schema.names}
    return cols if rows is None else {c: v[rows] for c, v in cols.items()}


def _apply_step(table: pa.Table, step: object, on_error: ErrorHandler, carry: tuple[str, ...] = ()) -> pa.Table:
    order = np.asarray(table.column(ORDER))
    sub = np.asarray(table.column(SUB))
    if isinstance(step, (Map, Filter, FlatMap)):
        rows = table.select(_user_columns(table)).to_pylist()
        fn = step.fn
        if isinstance(step, Filter):
            keep = np.zeros(len(rows), dtype=bool)
            for i, r in enumerate(rows):
                try:
                    keep[i] = bool(fn(r))
                except Exception as exc:  # noqa: BLE001 - user code
                    on_error(table, i, exc)
            return table.filter(pa.array(keep))
        if isinstance(step, Map):
            out_rows, parents = [], []
            for i, r in enumerate(rows):
                try:
                    out_rows.append(fn(r))
                    parents.append(i)
                except Exception as exc:  # noqa: BLE001
                    on_error(table, i, exc)
            p = np.array(parents, dtype=np.int64)
            out, kept = _rows_table(out_rows, p, step.schema, table, on_error)
            p = p if kept is None else p[kept]
            return _with_lineage(out, order[p], sub[p], _carried(table, carry, p))
        out_rows, parents, ks = [], [], []
        for i, r in enumerate(rows):
            try:
                produced = list(fn(r))
            except Exception as exc:  # noqa: BLE001
                on_error(table, i, exc)
                continue
            out_rows.extend(produced)
            parents.extend([i] * len(produced))
            ks.extend(range(len(produced)))
        p = np.array(parents, dtype=np.int64)
        k = np.array(ks, dtype=np.int64)
        out, kept = _rows_table(out_rows, p, step.schema, table, on_error)
        if kept is not None:
            p, k = p[kept], k[kept]
        return _with_lineage(out, order[p], extend_sub_order(sub[p], k), _carried(table, carry, p))
    try:
        return _apply_batch_step(table, step, order, sub, carry)
    except Exception as exc:  # noqa: BLE001 - user code raises anything
        # Not lost: the rows run again one at a time below, and each row that fails there
        # goes to ``on_error`` with its own exception.
        log.debug("%s failed on a batch of %d rows (%s: %s); running them one by one",
                  type(step).__name__, table.num_rows, type(exc).__name__, exc)
    # Vectorized transforms are row-wise by contract, so running them on one
    # row at a time gives the same result and isolates the failing rows.
    parts = []
    for i in range(table.num_rows):
        row = table.slice(i, 1)
        try:
            parts.append(_apply_batch_step(row, step, order[i : i + 1], sub[i : i + 1], carry))
        except Exception as exc:  # noqa: BLE001
            on_error(table, i, exc)
    parts = [p for p in parts if p.num_rows]
    if not parts:
        return table.slice(0, 0)
    return pa.concat_tables(parts, promote_options="permissive")


def _apply_batch_step(table: pa.Table, step: object, order: np.ndarray, sub: np.ndarray,
                      carry: tuple[str, ...] = ()) -> pa.Table:
    user = table.select(_user_columns(table))
    if isinstance(step, MapBatches):
        out = batch_table(step, step.fn(user))
        if out.num_rows != table.num_rows:
            raise ValueError(f"map_batches returned {out.num_rows} rows for {table.num_rows}")
        return _with_lineage(out, order, sub, _carried(table, carry))
    if isinstance(step, FilterBatches):
        return filter_rows(table, step.fn(user))
    if isinstance(step, FlatMapBatches):
        out, parent = step.call(user)
        out = batch_table(step, out)
        p = parent_rows(parent, out.num_rows, table.num_rows)
        # k = position of each output row among its parent's outputs.
        starts = np.ones(len(p), dtype=bool)
        starts[1:] = p[1:] != p[:-1]
        start_pos = np.flatnonzero(starts)
        seg = np.cumsum(starts) - 1
        k = np.arange(len(p)) - start_pos[seg] if len(p) else np.zeros(0, np.int64)
        return _with_lineage(out, order[p], extend_sub_order(sub[p], k), _carried(table, carry, p))
    raise TypeError(f"unknown transform {step!r}")


#: What converting a user function's rows to Arrow raises for a row that cannot be stored (a
#: lone surrogate in a string is a ``UnicodeEncodeError``, a value of the wrong type for a
#: given schema an Arrow error).
_ROW_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, UnicodeEncodeError, TypeError, OverflowError)


def _rows_table(rows: list[dict], parents: np.ndarray, schema: pa.Schema | None, table: pa.Table,
                on_error: ErrorHandler) -> tuple[pa.Table, np.ndarray | None]:
    """The rows a per-event function made (row ``j`` from input row ``parents[j]``) as a table,
    and which rows it keeps (None: all).

    When the bulk conversion fails, each row is converted alone (only then, to find the
    culprits): an input event with a row that cannot be stored is in error (``on_error``
    once, as if the function had raised on it) and none of its rows is kept. A failure no
    single row explains (rows of mixed types) is raised as it is.
    """
    try:
        return pa.Table.from_pylist(rows, schema=schema), None
    except _ROW_ERRORS as exc:
        first = exc
    bad: dict[int, BaseException] = {}
    for r, parent in zip(rows, parents.tolist()):
        if parent in bad:
            continue
        try:
            pa.Table.from_pylist([r], schema=schema)
        except _ROW_ERRORS as exc:
            bad[parent] = exc
    if not bad:
        raise first
    for parent, exc in bad.items():
        on_error(table, parent, exc)
    kept = ~np.isin(parents, np.fromiter(bad, dtype=np.int64, count=len(bad)))
    return pa.Table.from_pylist([r for r, g in zip(rows, kept.tolist()) if g], schema=schema), kept

