"""Memory-sink parts: the (slice, epoch) tables of a sink, held, merged and sent in bulk.

Owns: the shape of a memory sink's rows between the container that wrote
them and ``job.results`` (sink id -> (slice, epoch) -> rows), merging two
such maps, and the packed form they travel and are stored in
(``PackedSinkParts``): one table per sink and schema, with an index of
(slice, epoch, rows) per part.

Why packed: a job of 200 epochs over 6 slices holds 1,200 parts per sink.
Pickled one table at a time (a Ray call's return, a hand-over at a
checkpoint) or written to lmdb one key per part, each costs about half a
millisecond: reading 8,000 rows back took 1-1.5 s. One concatenated table
and an index cost one table's worth. Unpacking gives zero-copy slices.

Knows nothing of writers, containers or Ray.

>>> parts = {0: {(0, 1): pa.table({"x": [1, 2]}), (1, 1): pa.table({"x": [3]})}}
>>> packed = pack_sink_parts(parts)
>>> len(packed), [t.num_rows for _, t, _ in packed.groups]
(2, [3])
>>> {k: t["x"].to_pylist() for k, t in packed.unpack()[0].items()}
{(0, 1): [1, 2], (1, 1): [3]}
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

SinkParts = dict[tuple[int, int], pa.Table]  # (slice, epoch) -> the rows that slice wrote in that epoch


def add_sink_parts(into: dict[int, SinkParts], more: dict[int, SinkParts]) -> None:
    """Merge memory-sink parts by sink id (a part held twice, by a migrated slice's source and
    destination, is the same rows: kept once).

    >>> held = {0: {(0, 1): "a"}}
    >>> add_sink_parts(held, {0: {(1, 1): "b"}, -1: {(0, 1): "c"}}); sorted(held[0]), held[-1]
    ([(0, 1), (1, 1)], {(0, 1): 'c'})
    """
    for sink_id, parts in more.items():
        into.setdefault(sink_id, {}).update(parts)


@dataclass(frozen=True)
class PackedSinkParts:
    """Sink parts as a few large tables: ``groups`` holds (sink id, the rows of that sink's
    parts of one schema, back to back, and an int64 index of shape (parts, 3): slice, epoch,
    rows). A sink's (slice, epoch) keys are distinct, as in the map it was packed from."""

    groups: list[tuple[int, pa.Table, np.ndarray]] = field(default_factory=list)

    def __len__(self) -> int:
        """The number of parts."""
        return sum(len(index) for _, _, index in self.groups)

    def unpack(self) -> dict[int, SinkParts]:
        """Sink id -> (slice, epoch) -> rows (zero-copy slices of the packed tables)."""
        out: dict[int, SinkParts] = {}
        for sink_id, table, index in self.groups:
            parts = out.setdefault(sink_id, {})
            starts = np.cumsum(index[:, 2]) - index[:, 2]
            for (s, e, n), start in zip(index.tolist(), starts.tolist()):
                parts[(s, e)] = table.slice(start, n)
        return out


def pack_sink_parts(parts: dict[int, SinkParts]) -> PackedSinkParts:
    """Pack sink id -> (slice, epoch) -> rows into ``PackedSinkParts``: per sink, the parts of
    each distinct schema joined into one contiguous table (types are never promoted: a slice
    that inferred int64 and one that inferred double stay two groups)."""
    groups: list[tuple[int, pa.Table, np.ndarray]] = []
    for sink_id, per in parts.items():
        by_schema: list[tuple[pa.Schema, list[pa.Table], list[tuple[int, int, int]]]] = []
        for (s, e), t in per.items():
            group = next((g for g in reversed(by_schema) if g[0].equals(t.schema, check_metadata=True)), None)
            if group is None:
                group = (t.schema, [], [])
                by_schema.append(group)
            group[1].append(t)
            group[2].append((s, e, t.num_rows))
        for _schema, tables, index in by_schema:
            # Fresh buffers either way: a part is often a zero-copy slice of a larger
            # table, and pickling a slice writes the whole buffer under it.
            joined = (pa.concat_tables(tables).combine_chunks() if len(tables) > 1
                      else tables[0].take(np.arange(tables[0].num_rows)))
            groups.append((sink_id, joined, np.array(index, dtype=np.int64).reshape(-1, 3)))
    return PackedSinkParts(groups)
