"""Source readers: how a source slice gets the rows of an epoch. No Ray here.

Owns: one interface over the two kinds of source: an in-memory table
(bounded, every row known up front) and a source log (bounded at a given
high water mark, or followed live until it is sealed). Epoch ``e`` holds
the rows with ``e * E <= _order < (e + 1) * E``; it is *available* once
the source is complete below ``(e + 1) * E``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from chronostream.slices.sourcelog import STREAM_SEQ, SourceLog, rows_in_order_range
from chronostream.slices.sources import dense_order_start, with_system_columns
from chronostream.slices.types import SUB


@dataclass(frozen=True)
class LogSource:
    """A source stage reading one stream of a source log.

    ``end_order``: read up to this global order (bounded run); None to
    follow the log until it is sealed.
    """

    log_dir: str
    stream: str
    end_order: int | None


class SourceReader:
    """Rows of one source by global-order range."""

    def end_order(self) -> int | None:
        """One past the last global order, once known (None while the source may grow)."""
        raise NotImplementedError

    def available_order(self) -> int:
        """Every row with a smaller global order is readable now."""
        raise NotImplementedError

    def rows(self, lo: int, hi: int) -> pa.Table:
        """Rows with ``lo <= _order < hi`` (payload, ``_order``, ``_sub``)."""
        raise NotImplementedError

    def refresh(self) -> None:
        """Look for new input (followed logs)."""


class TableReader(SourceReader):
    """A compiled in-memory source table (``chronostream.slices.sources.assign_global_order``): with an
    ``_order`` column, or dense (one source: the column is made for the rows an epoch reads).
    ``_sub`` (0) is added to the rows read."""

    def __init__(self, table: pa.Table, end_order: int) -> None:
        self.table = table
        self._end = end_order
        self._dense_start = dense_order_start(table)

    def end_order(self) -> int | None:
        return self._end

    def available_order(self) -> int:
        return self._end

    def rows(self, lo: int, hi: int) -> pa.Table:
        start = self._dense_start
        if start is not None:
            n = self.table.num_rows
            a = min(max(lo - start, 0), n)
            b = min(max(hi - start, a), n)
            return with_system_columns(self.table.slice(a, b - a), start + a)
        t = rows_in_order_range(self.table, lo, hi)
        return t.append_column(SUB, pa.array(np.zeros(t.num_rows, dtype=np.int64)))


class LogReader(SourceReader):
    """One stream of a source log, bounded or followed."""

    def __init__(self, spec: LogSource) -> None:
        self.spec = spec
        self.log = SourceLog(spec.log_dir)
        # Verified segments still needed (epochs advance in order, so a
        # segment is read and checksummed once, then dropped when passed).
        self._segments: dict[str, pa.Table] = {}

    def refresh(self) -> None:
        if self.spec.end_order is None and not self.log.sealed:
            self.log.refresh()

    def end_order(self) -> int | None:
        if self.spec.end_order is not None:
            return self.spec.end_order
        return self.log.high_water if self.log.sealed else None

    def available_order(self) -> int:
        end = self.end_order()
        return end if end is not None else self.log.high_water

    def rows(self, lo: int, hi: int) -> pa.Table:
        parts = []
        wanted = list(self.log.segments_of(self.spec.stream, lo, hi))
        names = {seg.file for seg in wanted}
        for name in [n for n in self._segments if n not in names]:
            del self._segments[name]
        for seg in wanted:
            table = self._segments.get(seg.file)
            if table is None:
                table = self._segments[seg.file] = self.log.segment_table(seg)
            part = rows_in_order_range(table, lo, hi)
            if part.num_rows:
                parts.append(part)
        t = pa.concat_tables(parts) if parts else self.log.schema(self.spec.stream).empty_table()
        t = t.drop_columns([STREAM_SEQ]) if STREAM_SEQ in t.schema.names else t
        return t.append_column(SUB, pa.array(np.zeros(t.num_rows, dtype=np.int64)))


def make_reader(source: pa.Table | LogSource, end_order: int | None) -> SourceReader:
    """The reader of a compiled source (a table from ``assign_global_order``, or a log spec)."""
    if isinstance(source, LogSource):
        return LogReader(source)
    assert end_order is not None
    return TableReader(source, end_order)
