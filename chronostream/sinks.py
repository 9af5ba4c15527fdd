"""Sinks: where a job's output streams end up.

Owns: the sink specs users attach to streams (``MemorySink`` for tests and
notebooks, ``ParquetSink`` for a directory of Parquet files) and their
per-container writers. Writes are keyed by (producer slice, epoch), so a
replayed or dual-mode epoch overwrites instead of duplicating: the sink is
idempotent. Knows no Ray.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from chronostream.types import SEQ, SLICE


def sort_output(table: pa.Table) -> pa.Table:
    """Sort sink rows by their identity (producer slice, out_seq)."""
    if table.num_rows == 0 or SLICE not in table.schema.names:
        return table
    return table.sort_by([(SLICE, "ascending"), (SEQ, "ascending")])


class SinkWriter:
    """Writes one sink's rows inside one container (or the serial executor)."""

    def write(self, epoch: int, slice_id: int, table: pa.Table) -> None:
        """Store the rows one slice produced for this sink in one epoch."""
        raise NotImplementedError

    def collect(self) -> pa.Table | None:
        """Rows held in memory (memory sinks), else None."""
        return None

    def take_parts(self, upto_epoch: int) -> dict[tuple[int, int], pa.Table]:
        """Memory sinks: the (slice, epoch) parts up to ``upto_epoch`` not taken before.

        The runtime hands them to the master before a checkpoint at that
        epoch is shipped, so rows held only by a container that dies are
        always re-produced by its recovered slices. Other sinks: nothing.
        """
        return {}

    def close(self) -> None:
        """Flush and release resources."""


class Sink:
    """Base of sink specs. ``name`` identifies the sink in ``Job.results``."""

    name: str

    def writer(self, owner: str) -> SinkWriter:
        """Return a writer for one container (``owner`` names it, for file names)."""
        raise NotImplementedError


@dataclass
class MemorySink(Sink):
    """Collects output in memory; ``job.results(name)`` returns it as one Arrow table.

    >>> MemorySink("counts").name
    'counts'
    """

    name: str = "out"

    def writer(self, owner: str) -> SinkWriter:
        return _MemoryWriter()


class _MemoryWriter(SinkWriter):
    def __init__(self) -> None:
        self.parts: dict[tuple[int, int], pa.Table] = {}
        # Parts written and not taken yet (insertion order; a part held and not in it was
        # taken): a checkpoint looks at these only, not at every part the sink ever held
        # (that scan grew with the run, twice an epoch).
        self.untaken: dict[tuple[int, int], None] = {}
        self.written_at: dict[tuple[int, int], float] = {}  # (slice, epoch) -> first write (wall time)

    def write(self, epoch: int, slice_id: int, table: pa.Table) -> None:
        key = (slice_id, epoch)
        if key not in self.parts:  # a rewrite (replay) keeps the part's taken-or-not
            self.untaken[key] = None
        self.parts[key] = table  # idempotent on replay
        self.written_at.setdefault(key, time.time())

    def take_parts(self, upto_epoch: int) -> dict[tuple[int, int], pa.Table]:
        due = [k for k in self.untaken if k[1] <= upto_epoch]
        for k in due:
            del self.untaken[k]
        return {k: self.parts[k] for k in due}

    def collect(self) -> pa.Table | None:
        tables = [t for _, t in sorted(self.parts.items()) if t.num_rows]
        if not tables:
            return None
        return pa.concat_tables(tables, promote_options="permissive")


@dataclass
class ParquetSink(Sink):
    """Writes output as Parquet files under ``path`` (one file per slice and epoch).

    Files are written to a temporary name and renamed, so a reader never sees
    a half-written file; ``read_parquet_sink(path)`` reads them back in
    identity order.
    """

    path: str
    name: str = "out"

    def writer(self, owner: str) -> SinkWriter:
        return _ParquetWriter(Path(self.path))


class _ParquetWriter(SinkWriter):
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def write(self, epoch: int, slice_id: int, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        d = self.root / f"slice={slice_id:05d}"
        d.mkdir(parents=True, exist_ok=True)
        final = d / f"epoch-{epoch:010d}.parquet"
        tmp = d / f".tmp-{uuid.uuid4().hex}"
        pq.write_table(table, tmp)
        os.replace(tmp, final)


def read_parquet_sink(path: str | os.PathLike) -> pa.Table:
    """Read a ParquetSink directory back as one table sorted by (slice, out_seq)."""
    files = sorted(Path(path).glob("slice=*/epoch-*.parquet"))
    if not files:
        return pa.table({})
    return sort_output(pa.concat_tables([pq.read_table(f) for f in files], promote_options="permissive"))
