"""Sinks: where a job's output streams end up.

Owns: the sink specs users attach to streams (``MemorySink`` for tests and
notebooks, ``ParquetSink`` for a directory of Parquet files), their
per-container writers, and the commit of a Parquet sink's files. Writes are
keyed by (producer slice, epoch), so a replayed or dual-mode epoch
overwrites instead of duplicating: the sink is idempotent. A Parquet sink
writes these parts to a hidden staging directory and commits them, once the
job has made all of them, into a few large files (``commit_parquet_sink``).
Knows no Ray.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from chronostream.slices.parquet_commit import COMMITTED, STAGING, commit_parquet_sink, read_record, stage_part
from chronostream.slices.types import SEQ, SLICE


def sort_output(table: pa.Table) -> pa.Table:
    """Sort sink rows by their identity (producer slice, out_seq).

    Rows already in that order (a memory sink's parts joined in (slice, epoch)
    order: the usual case) are returned as they are, not copied: the sort is
    stable, so it would give the same rows in the same order.

    >>> t = pa.table({"_slice": [1, 0, 0], "_seq": [0, 1, 0], "x": ["c", "b", "a"]})
    >>> sort_output(t)["x"].to_pylist()
    ['a', 'b', 'c']
    >>> done = sort_output(t)
    >>> sort_output(done) is done
    True
    """
    if table.num_rows == 0 or SLICE not in table.schema.names:
        return table
    if SEQ in table.schema.names and _in_identity_order(table):
        return table
    return table.sort_by([(SLICE, "ascending"), (SEQ, "ascending")])


def _in_identity_order(table: pa.Table) -> bool:
    """Whether rows are sorted by (``_slice``, ``_seq``) (null-free integer columns; else False)."""
    cols = [table.column(c) for c in (SLICE, SEQ)]
    if any(c.null_count or not pa.types.is_integer(c.type) for c in cols):
        return False
    s, q = (np.asarray(c.to_numpy()) for c in cols)
    if len(s) < 2:
        return True
    return bool(np.all((s[1:] > s[:-1]) | ((s[1:] == s[:-1]) & (q[1:] >= q[:-1]))))


#: Columns the runtime's dead letters are sorted by, where present: the poison event's
#: source order and sub-order, then the stage and slice that refused it.
DEAD_LETTER_ORDER = ("order", "sub", "stage", "slice")


def dead_letter_table(tables: list[pa.Table], source_dead_letters: list[dict]) -> pa.Table:
    """A job's dead letters as one table: the source rows that broke the declared schema first
    (in source order), then the runtime's, sorted by ``DEAD_LETTER_ORDER`` so a run gives the
    same table however its containers wrote them.

    >>> t = pa.table({"stage": ["b", "a"], "slice": [0, 1], "order": [9, 3], "sub": [0, 0]})
    >>> dead_letter_table([t], [])["order"].to_pylist()
    [3, 9]
    """
    tables = [t for t in tables if t.num_rows]
    runtime = pa.concat_tables(tables, promote_options="permissive") if tables else None
    if runtime is not None:
        keys = [(c, "ascending") for c in DEAD_LETTER_ORDER if c in runtime.schema.names]
        runtime = runtime.sort_by(keys) if keys else runtime
    parts = ([pa.Table.from_pylist(source_dead_letters)] if source_dead_letters else []) + \
        ([runtime] if runtime is not None else [])
    return pa.concat_tables(parts, promote_options="permissive") if parts else pa.table({})


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

    def give_parts(self, slices: set[int]) -> Any:
        """Hand over what this writer holds of ``slices`` to another writer of the same sink in
        this process (a compaction moves the slices to another container: ``take_in`` there).
        Memory sinks move their parts; files already written stay where they are."""
        return None

    def take_in(self, given: Any) -> None:
        """Hold what another writer's ``give_parts`` handed over."""

    def take_parts_of(self, slices: set[int]) -> dict[tuple[int, int], pa.Table]:
        """Memory sinks: every (slice, epoch) part held of ``slices``, taken or not, now counted
        as taken (``take_parts`` does not offer them again). The runtime hands them to the
        master before a migration snapshot of the slices ships: what is restored from it
        re-makes none of them. Other sinks: nothing."""
        return {}

    def drop_handed(self, keys: Iterable[tuple[int, int]]) -> int:
        """Memory sinks: let go of the rows of these (slice, epoch) parts, taken before
        (``take_parts``) and now held by the master for good (it stored them in its catalog).
        Returns how many were dropped. Other sinks: nothing to drop."""
        return 0

    def close(self) -> None:
        """Flush and release resources."""


class Sink:
    """Base of sink specs. ``name`` identifies the sink in ``Job.results``."""

    name: str

    def writer(self, owner: str) -> SinkWriter:
        """Return a writer for one container (``owner`` names it, for file names)."""
        raise NotImplementedError

    def dead_letter_writer(self, owner: str, stage_id: int) -> SinkWriter:
        """A writer of the dead letters of one container of stage ``stage_id`` (this sink is the
        job's dead-letter sink, shared by every stage: parts must not collide across stages)."""
        return self.writer(owner)


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
        # Parts the master confirmed it holds (``drop_handed``): their rows are not kept here.
        self.handed: set[tuple[int, int]] = set()

    def write(self, epoch: int, slice_id: int, table: pa.Table) -> None:
        key = (slice_id, epoch)
        self.written_at.setdefault(key, time.time())
        if key in self.handed:
            return  # a rewrite (replay) of rows the master holds: the same rows (section 4)
        if key not in self.parts:  # a rewrite (replay) keeps the part's taken-or-not
            self.untaken[key] = None
        self.parts[key] = table  # idempotent on replay

    def drop_handed(self, keys: Iterable[tuple[int, int]]) -> int:
        dropped = 0
        for key in keys:  # (per part, not per row)
            if key in self.parts and key not in self.untaken:
                del self.parts[key]
                self.handed.add(key)
                dropped += 1
        return dropped

    def give_parts(self, slices: set[int]) -> tuple[dict, set, dict, set]:
        keys = [k for k in self.parts if k[0] in slices]
        handed = {k for k in self.handed if k[0] in slices}
        given = ({k: self.parts.pop(k) for k in keys}, {k for k in keys if k in self.untaken},
                 {k: self.written_at.pop(k) for k in [*keys, *handed] if k in self.written_at}, handed)
        for k in given[1]:
            del self.untaken[k]
        self.handed -= handed
        return given

    def take_in(self, given: tuple[dict, set, dict, set] | None) -> None:
        if given is None:
            return
        parts, untaken, written_at, handed = given
        self.parts.update(parts)
        self.untaken.update(dict.fromkeys(k for k in parts if k in untaken))
        self.written_at.update(written_at)
        self.handed |= handed

    def take_parts_of(self, slices: set[int]) -> dict[tuple[int, int], pa.Table]:
        out = {k: t for k, t in self.parts.items() if k[0] in slices}  # (per part, not per row)
        for k in out:
            self.untaken.pop(k, None)
        return out

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


#: The files and directories a ParquetSink writes under its path (a dead-letter sink's per stage).
_PARQUET_SINK_ENTRIES = ("part-*.parquet", STAGING, COMMITTED, "slice=*", "stage=*")


@dataclass
class ParquetSink(Sink):
    """Writes output as Parquet files under ``path``: a few files of about
    ``target_file_bytes`` each (``part-00000.parquet``, ...), rows in identity order.

    While the job runs, its writers put one part per slice and epoch in a
    hidden staging directory (``_staging/``): a replayed epoch replaces its
    part, so a recovery, a migration or a resume never writes a row twice.
    Every ``max_age_s`` seconds (on Ray), the master commits the parts of the
    epochs every slice of the sink's stage has processed and checkpointed:
    merged into new files, written under temporary names, recorded in
    ``_committed.json``, renamed into place; a part of a committed epoch made
    again later (a recovery) is deleted unread. When the job finished
    (``job.wait()`` returns after it), the last commit takes every part left
    and removes the staging directory. A reader of the directory (pyarrow,
    pandas, Spark: they skip names starting with ``_`` or ``.``) sees the
    committed files only, each row once, while the job runs too;
    ``read_parquet_sink(path)`` reads them back. A run refuses a directory
    that holds an earlier run's files, unless ``overwrite`` is set: then the
    run first deletes them (only the sink's own entries; other files are left
    alone). ``slices.parquet_commit`` has the commit's steps.

    >>> s = ParquetSink("/tmp/out", name="counts", overwrite=True)
    >>> s.target_file_bytes, s.max_age_s
    (134217728, 60.0)
    """

    path: str
    name: str = "out"
    overwrite: bool = False
    target_file_bytes: int = 128 << 20
    max_age_s: float = 60.0  # the longest a row waits in staging while the job runs (0: until it ends)

    def __post_init__(self) -> None:
        if not isinstance(self.target_file_bytes, int) or self.target_file_bytes < 1:
            raise ValueError(f"ParquetSink {self.name!r}: target_file_bytes must be a positive int, "
                             f"got {self.target_file_bytes!r}")
        if not isinstance(self.max_age_s, (int, float)) or self.max_age_s < 0:
            raise ValueError(f"ParquetSink {self.name!r}: max_age_s must be a number of seconds >= 0 "
                             f"(0: commit only when the job ends), got {self.max_age_s!r}")

    def prepare(self) -> None:
        """Before a run: refuse (``FileExistsError``) or, with ``overwrite``, delete an earlier
        run's files under ``path``."""
        root = Path(self.path)
        earlier = sorted(p for pattern in _PARQUET_SINK_ENTRIES for p in root.glob(pattern)) if root.is_dir() else []
        if not earlier:
            return
        if not self.overwrite:
            raise FileExistsError(
                f"ParquetSink {self.name!r}: {self.path} holds an earlier run's output ({earlier[0].name}, "
                f"{len(earlier)} entries); its files would be read back with this run's. Use an empty "
                f"directory, or ParquetSink(..., overwrite=True) to delete them first")
        for p in earlier:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()

    def committed(self) -> bool:
        """Whether the directory holds a finished run's files (a resume cannot add to them; it
        goes on from a stopped or dead run's commits)."""
        return bool(read_record(self.path)["final"])

    def commit(self, through: int | None = None) -> list[str]:
        """Commit the staged parts of epochs up to ``through`` (None: all, the job's last commit)
        into the final files (``commit_parquet_sink``); every committed file's name."""
        return commit_parquet_sink(self.path, self.target_file_bytes, through)

    def writer(self, owner: str) -> SinkWriter:
        return _StagingWriter(self.path)

    def dead_letter_writer(self, owner: str, stage_id: int) -> SinkWriter:
        # One directory per stage: two stages' dead letters of one slice id and epoch would
        # otherwise be one file, the later write replacing the earlier.
        return _ParquetWriter(Path(self.path) / f"stage={stage_id:04d}")


class _StagingWriter(SinkWriter):
    """A ParquetSink's writer: each part staged for the commit (``slices.parquet_commit``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def write(self, epoch: int, slice_id: int, table: pa.Table) -> None:
        stage_part(self.path, epoch, slice_id, table)


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


def commit_file_sinks(sinks: Iterable[Any]) -> None:
    """Commit every sink of ``sinks`` (``JobPlan.sinks`` entries or specs) that commits (Parquet)."""
    for sp in sinks:
        spec = getattr(sp, "sink", sp)
        if hasattr(spec, "commit"):
            spec.commit()


def read_parquet_sink(path: str | os.PathLike, pattern: str = "part-*.parquet") -> pa.Table:
    """Read a ParquetSink directory's committed files back as one table sorted by (slice, out_seq).

    ``pattern``: the files to read; a dead-letter sink's are ``stage=*/slice=*/epoch-*.parquet``.
    """
    files = sorted(Path(path).glob(pattern))
    if not files:
        return pa.table({})
    return sort_output(pa.concat_tables([pq.read_table(f) for f in files], promote_options="permissive"))
