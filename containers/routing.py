"""Owns a container's routing tables and the vectorized split of outputs by destination.

Input routing table: slice id -> the local slice runtime (a dict in the core).
Output routing table: per downstream stage, an array slice -> container id.
``route`` turns a produced stream's rows into one part per destination
container, each sorted by consumer slice, with one hash pass and one sort
per (stream, consumer stage): never per row. Knows no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from chronostream.hashing import slice_of
from chronostream.types import ORDER

#: A part sent to one container: rows sorted by consumer slice, and that slice per row.
RoutedPart = tuple[pa.Table, np.ndarray]


@dataclass
class OutputRoute:
    """Where one downstream stage's slices live: ``slice_to_container[slice]``."""

    stage_id: int
    slice_to_container: np.ndarray

    @property
    def num_slices(self) -> int:
        """Slice count of the downstream stage."""
        return len(self.slice_to_container)

    def containers(self) -> list[int]:
        """Distinct containers of the downstream stage (sorted)."""
        return sorted(set(self.slice_to_container.tolist()))


def consumer_slices(table: pa.Table, key: tuple[str, ...] | None, num_slices: int) -> np.ndarray:
    """Consumer slice of every row: hash of the key columns, or of ``_order`` when unkeyed."""
    if num_slices == 1:
        return np.zeros(table.num_rows, dtype=np.int64)
    if key is None:
        return slice_of([table.column(ORDER)], num_slices)
    missing = [k for k in key if k not in table.schema.names]
    if missing:
        raise KeyError(f"key column(s) {missing} not in the stream's columns {table.schema.names}")
    return slice_of([table.column(k) for k in key], num_slices)


def route(table: pa.Table, key: tuple[str, ...] | None, out: OutputRoute) -> dict[int, RoutedPart]:
    """Split ``table`` into per-container parts for one downstream stage.

    Within a part, rows are ordered by consumer slice and keep their
    original relative order (producer slice, then out_seq) inside a slice.
    """
    dst = consumer_slices(table, key, out.num_slices)
    cont = out.slice_to_container[dst]
    # One stable sort on (container, slice): keeps producer order within a slice.
    order = np.argsort(cont * out.num_slices + dst, kind="stable")
    cont_sorted = cont[order]
    bounds = np.flatnonzero(np.diff(cont_sorted)) + 1
    starts = np.concatenate(([0], bounds))
    ends = np.concatenate((bounds, [len(order)]))
    parts: dict[int, RoutedPart] = {}
    taken = table.take(pa.array(order)) if len(order) else table
    dst_sorted = dst[order]
    for s, e in zip(starts.tolist(), ends.tolist()):
        if e > s:
            parts[int(cont_sorted[s])] = (taken.slice(s, e - s), dst_sorted[s:e])
    return parts


def rows_of_slice(part: RoutedPart, slice_id: int) -> pa.Table | None:
    """The rows of a routed part destined to ``slice_id`` (None when none)."""
    table, dst = part
    lo = int(np.searchsorted(dst, slice_id, side="left"))
    hi = int(np.searchsorted(dst, slice_id, side="right"))
    return table.slice(lo, hi - lo) if hi > lo else None


def place_slices_evenly(num_slices: int, containers: list[int]) -> np.ndarray:
    """Initial placement: slice ``s`` on ``containers[s % len(containers)]``.

    >>> place_slices_evenly(5, [10, 11]).tolist()
    [10, 11, 10, 11, 10]
    """
    if not containers:
        raise ValueError("a stage needs at least one container")
    c = np.array(containers, dtype=np.int64)
    return c[np.arange(num_slices) % len(c)]
