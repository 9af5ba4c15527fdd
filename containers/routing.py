"""Owns a container's routing tables and the vectorized split of outputs by destination.

Input routing table: slice id -> the local slice runtime (a dict in the core).
Output routing table: per downstream stage, an array slice -> container id.
``route`` turns a produced stream's rows into one part per destination
container, each sorted by consumer slice, with one hash pass and one sort
per (stream, consumer stage): never per row. Knows no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from chronostream.slices.hashing import binary_fingerprint, slices_codes_and_hashes
from chronostream.slices.sorting import packed_merge_key, stable_argsort, take_permuted, tie_free_argsort
from chronostream.slices.types import KEY_HASHES_META, ORDER, SUB, key_codes_column

#: A part sent to one container: rows sorted by consumer slice, and that slice per row.
RoutedPart = tuple[pa.Table, np.ndarray]


@dataclass
class OutputRoute:
    """Where one downstream stage's slices live: ``slice_to_container[slice]``.

    ``dual`` maps a slice in migration (dual mode, paper III-C phase 2) to
    a second container that gets a copy of its rows besides its owner.
    """

    stage_id: int
    slice_to_container: np.ndarray
    dual: dict[int, int] = field(default_factory=dict)

    @property
    def num_slices(self) -> int:
        """Slice count of the downstream stage."""
        return len(self.slice_to_container)

    def containers(self) -> list[int]:
        """Distinct containers of the downstream stage (sorted), dual copies included."""
        return sorted(set(self.slice_to_container.tolist()) | set(self.dual.values()))


def consumer_slices(table: pa.Table, key: tuple[str, ...] | None, num_slices: int) -> np.ndarray:
    """Consumer slice of every row: hash of the key columns, or of ``_order`` when unkeyed."""
    return _slices_and_codes(table, key, num_slices)[0]


def _slices_and_codes(table: pa.Table, key: tuple[str, ...] | None, num_slices: int
                      ) -> tuple[np.ndarray, pa.DictionaryArray | None, np.ndarray | None]:
    if num_slices == 1:
        return np.zeros(table.num_rows, dtype=np.int64), None, None
    if key is None:
        return slices_codes_and_hashes([table.column(ORDER)], num_slices)
    missing = [k for k in key if k not in table.schema.names]
    if missing:
        raise KeyError(f"key column(s) {missing} not in the stream's columns {table.schema.names}")
    return slices_codes_and_hashes([table.column(k) for k in key], num_slices)


def route(table: pa.Table, key: tuple[str, ...] | None, out: OutputRoute,
          key_codes: bool = False) -> dict[int, RoutedPart]:
    """Split ``table`` into per-container parts for one downstream stage.

    Within a part, rows are ordered by consumer slice and keep their
    original relative order (producer slice, then out_seq) inside a slice,
    except when ``table``'s rows are not in source order (the outputs of a
    producer's many slices, one slice after another): then each consumer
    slice's rows are in (``_order``, ``_sub``) order, ties kept as they came
    (``by_consumer_slice``). Rows of a slice in dual mode go to its owner
    and to its dual container.
    ``key_codes``: the consumer groups by the stream's key; when hashing
    dictionary-encoded it (one string key whose values repeat), the parts
    carry those codes as column ``key_codes_column(key)`` (a dictionary
    column: its indices cost 4 bytes a row, the dictionary once a part),
    with the hash of each dictionary value in the field's metadata
    (``KEY_HASHES_META``: the dictionary's ``binary_fingerprint``, then 8
    bytes a distinct key): the consumer's key index looks keys up by those
    hashes and would otherwise compute them again.
    """
    dst, codes, code_hashes = _slices_and_codes(table, key, out.num_slices)
    if key_codes and codes is not None and key is not None:
        tagged = np.concatenate((np.array([binary_fingerprint(codes.dictionary)], np.uint64), code_hashes))
        field = pa.field(key_codes_column(key[0]), codes.type, metadata={KEY_HASHES_META: tagged.tobytes()})
        table = table.append_column(field, codes)
    targets = out.slice_to_container
    if not out.dual and len(targets) and bool(np.all(targets == targets[0])):
        # One destination container: its part is every row, by slice (by_consumer_slice); rows
        # already in that order are not copied at all.
        if not len(dst):
            return {}
        order = by_consumer_slice(dst, table)
        if order is None:
            return {int(targets[0]): (table, dst)}
        # dst[order], without a gather: each slice's number as often as it has rows.
        dst_sorted = np.repeat(np.arange(out.num_slices, dtype=np.int64), np.bincount(dst, minlength=out.num_slices))
        return {int(targets[0]): (take_permuted(table, order), dst_sorted)}
    cont = targets[dst]
    rows = None  # row index per routed row (None: every row once, in order)
    if out.dual:
        alt = np.full(out.num_slices, -1, dtype=np.int64)
        for s, c in out.dual.items():
            alt[s] = c
        copies = np.flatnonzero(alt[dst] >= 0)
        if len(copies):
            rows = np.concatenate((np.arange(len(dst)), copies))
            cont = np.concatenate((cont, alt[dst[copies]]))
            dst = dst[rows]
    # One sort on (container, slice) (by_consumer_slice), then each container's rows a slice of them.
    order = by_consumer_slice(cont * out.num_slices + dst, table, rows)
    if order is None:
        cont_sorted, dst_sorted, taken = cont, dst, table
    else:
        cont_sorted, dst_sorted = cont[order], dst[order]
        take = order if rows is None else rows[order]
        taken = take_permuted(table, take)
    bounds = np.flatnonzero(np.diff(cont_sorted)) + 1
    starts = np.concatenate(([0], bounds))
    ends = np.concatenate((bounds, [len(cont_sorted)]))
    parts: dict[int, RoutedPart] = {}
    for s, e in zip(starts.tolist(), ends.tolist()):
        if e > s:
            parts[int(cont_sorted[s])] = (taken.slice(s, e - s), dst_sorted[s:e])
    return parts


def by_consumer_slice(slot: np.ndarray, table: pa.Table, rows: np.ndarray | None = None) -> np.ndarray | None:
    """Permutation grouping rows by ``slot`` (consumer slice, or container and slice): stable
    (each slot's rows as they came), unless ``table``'s rows are not in source order; then each
    slot's rows in (``_order``, ``_sub``) order when no two of a slot are equal in both. None
    when the rows are in that order already (nothing to copy). ``rows``: the table row of each
    ``slot`` entry (dual copies), None for one each.

    Why: a keyed stage fed by a stage of many slices (a count after a count) gets each source
    event's rows from several producer slices, and the producer's output holds its slices'
    rows one slice after another; kept as they came, every consumer slice's rows would need
    the merge's sort and a second copy of every column (``slices.group``). Sorted here, in
    the one copy routing makes anyway, the merge finds them in order. Ties (rows of one event
    and sub-order from two producers) keep arrival order, where the merge sorts them.

    >>> t = pa.table({"_order": [4, 2, 3, 1], "_sub": [0, 0, 0, 0]})
    >>> by_consumer_slice(np.array([0, 0, 1, 0]), t).tolist()
    [3, 1, 0, 2]
    >>> by_consumer_slice(np.array([0, 0, 1, 1]), t.sort_by("_order")) is None
    True
    """
    names = table.schema.names
    if len(slot) > 1 and ORDER in names and SUB in names:
        order = np.asarray(table.column(ORDER))
        if not bool(np.all(order[1:] >= order[:-1])):
            sub = np.asarray(table.column(SUB))
            if rows is not None:
                order, sub = order[rows], sub[rows]
            perm = tie_free_argsort(packed_merge_key(slot, order, sub))
            if perm is not None:
                return perm
    if rows is None and (len(slot) < 2 or bool(np.all(slot[1:] >= slot[:-1]))):
        return None
    return stable_argsort(slot)


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
