"""Owns a Parquet sink's staged parts and their commit into its final files (``ParquetSink``).

A sink's writers stage one part per slice and epoch under ``<path>/_staging/``
(``slice=NNNNN/epoch-NNNNNNNNNN.arrow``: an Arrow IPC file, cheap to write and
to map back, for the commit only); a part made again (a recovery, a
migration, a resume replaying an epoch) replaces itself with the same rows.
A commit merges the staged parts of epochs up to a bound into a few files of
about ``target_file_bytes`` (``part-NNNNN.parquet``, numbered on from the
files committed before), in identity order (slice, then epoch).

While the job runs, the master commits up to the newest epoch every slice of
the sink's stage has processed (``through``): those parts are all written,
and a part of such an epoch made again later holds the same rows, so the
next commit deletes it unread. When the job finished, the final commit takes
every part left (``through=None``) and removes the staging directory.

The record, ``_committed.json``, is the commit point: the merged files are
written under temporary names, the record names them (``pending``), then they
are renamed and the parts they took deleted, and the record is rewritten
without ``pending``. A commit stopped anywhere is finished by the next call:
before the record, its temporary files are written again; after it, only its
renames and deletions are done. Readers (pyarrow, pandas, Spark skip names
starting with ``_`` or ``.``) see committed files only, each row once.

Every committed file has one schema, the first commit's: a directory reader
(pyarrow, pandas, Spark) takes one file's schema for all. So a commit while
the job runs waits while a column has no type yet (all null so far) or its
parts do not fit that schema (ints become floats); the last commit, when the
types widened, writes the files committed before again in the wider schema
(``replaces``: deleted once the new files are in place).

Record: ``{"parts": [committed file names], "through": epoch (-1: none yet),
"final": whether the job's last commit was made, "staged_parts": parts taken
so far, "pending": {"parts", "through", "final", "replaces", "staged_parts"}
or null}``. Knows no Ray.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

#: The staging directory under a Parquet sink's path (hidden from readers: ``_`` first).
STAGING = "_staging"
#: The commit record.
COMMITTED = "_committed.json"
#: Committed files' names.
PART = "part-{:05d}.parquet"

_EPOCH = re.compile(r"epoch-(\d+)\.arrow$")


def stage_part(path: str | os.PathLike, epoch: int, slice_id: int, table: pa.Table) -> None:
    """Stage the rows slice ``slice_id`` made in ``epoch`` for the sink at ``path``: under a
    temporary name, then renamed over any earlier copy (a part made again holds the same rows).
    Empty parts are not staged."""
    if table.num_rows == 0:
        return
    d = Path(path) / STAGING / f"slice={slice_id:05d}"
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"epoch-{epoch:010d}.arrow"
    tmp = d / f".tmp-{uuid.uuid4().hex}"
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    os.replace(tmp, final)


def _open(part: Path) -> pa.ipc.RecordBatchFileReader:
    return pa.ipc.open_file(pa.memory_map(str(part)))


def _read(part: Path) -> pa.Table:
    return _open(part).read_all()

#: Staged parts read at once by the commit (on ``_READERS`` threads: reading a Parquet file
#: releases the GIL; a job's parts are small, and read one by one they were most of its time).
_READ_AHEAD, _READERS = 64, 4


def read_record(path: str | os.PathLike) -> dict[str, Any]:
    """The commit record of the sink at ``path`` (an empty one when none was written).

    >>> read_record("/nonexistent")
    {'parts': [], 'through': -1, 'final': False, 'pending': None, 'staged_parts': 0}
    """
    mark = Path(path) / COMMITTED
    record = {"parts": [], "through": -1, "final": False, "pending": None, "staged_parts": 0}
    if mark.exists():
        saved = json.loads(mark.read_text())
        record.update(saved)
        if "through" not in saved:  # (a record of a job's one commit, at its end)
            record["final"] = True
    return record


def commit_parquet_sink(path: str | os.PathLike, target_file_bytes: int = 128 << 20,
                        through: int | None = None) -> list[str]:
    """Commit the staged parts under ``path`` of epochs up to ``through`` (None: every part, the
    job's final commit) into files of about ``target_file_bytes`` of Arrow data each, typed as
    one with the files committed before (a column null in one part and typed in another, ints
    and floats: Arrow's permissive promotion). Parts of epochs at or below an earlier commit's
    bound are deleted unread (made again; their rows are committed). Idempotent; returns the
    names of every committed file.

    >>> import tempfile; root = Path(tempfile.mkdtemp())
    >>> stage_part(root, 0, 1, pa.table({"x": [1.5, 2.5]})); stage_part(root, 0, 0, pa.table({"x": [None]}))
    >>> stage_part(root, 1, 0, pa.table({"x": [0.5]}))
    >>> commit_parquet_sink(root, through=0)
    ['part-00000.parquet']
    >>> stage_part(root, 0, 1, pa.table({"x": [1.5, 2.5]}))  # (epoch 0 made again: committed, dropped unread)
    >>> commit_parquet_sink(root), sorted(p.name for p in root.iterdir())
    (['part-00000.parquet', 'part-00001.parquet'], ['_committed.json', 'part-00000.parquet', 'part-00001.parquet'])
    >>> pq.read_table(root / "part-00001.parquet").column("x").to_pylist(), commit_parquet_sink(root)
    ([0.5], ['part-00000.parquet', 'part-00001.parquet'])
    >>> shutil.rmtree(root)
    """
    root = Path(path)
    record = read_record(root)
    if record["pending"]:
        record = _finish(root, record)
    if record["final"]:
        return record["parts"]
    staged = _staged(root)
    done = record["through"]
    bound = float("inf") if through is None else through
    take = [f for f, e in staged if done < e <= bound]
    for f, e in staged:
        if e <= done:  # (made again after its epoch was committed: the same rows)
            f.unlink(missing_ok=True)
    if not take and through is not None:
        return record["parts"]
    # Every committed file has one schema (a directory reader takes one file's for all): the
    # first commit's. A commit while running waits until its columns are typed and fit it.
    committed = pq.read_schema(root / record["parts"][0]) if record["parts"] else None
    with ThreadPoolExecutor(_READERS) as pool:
        schemas = list(pool.map(lambda f: _open(f).schema, take))
    schema = pa.unify_schemas(([committed] if committed else []) + schemas, promote_options="permissive")
    if through is not None and (schema != committed if committed else _untyped(schema)):
        return record["parts"]
    # The last commit with a wider schema rewrites the files committed before into it.
    replaces = record["parts"] if committed is not None and schema != committed else []
    first = 1 + max([-1] + [int(n[5:10]) for n in record["parts"]])
    names = _merge(root, replaces, take, first, target_file_bytes, schema)
    new_through = through if through is not None else max([done] + [e for f, e in staged if e > done])
    record["pending"] = {"parts": names, "through": new_through, "final": through is None, "replaces": replaces,
                         "staged_parts": len(take)}
    _write_record(root, record)  # the commit point: from here on it only finishes
    return _finish(root, record)["parts"]


def _untyped(schema: pa.Schema) -> bool:
    """Whether a column of ``schema`` has no type yet (every value so far null)."""
    return any(pa.types.is_null(f.type) for f in schema)


def _staged(root: Path) -> list[tuple[Path, int]]:
    """(part, epoch) of every staged part, in identity order (slice, then epoch)."""
    return [(f, int(_EPOCH.search(f.name).group(1)))
            for f in sorted((root / STAGING).glob("slice=*/epoch-*.arrow"))]


def _merge(root: Path, replaces: list[str], parts: list[Path], first: int, target_file_bytes: int,
           schema: pa.Schema) -> list[str]:
    """Write the committed files ``replaces`` and then the staged ``parts`` merged into temporary
    files (``.part-NNNNN.parquet.tmp``, numbered from ``first``), typed as ``schema``; their names."""
    if not parts and not replaces:
        return []
    names: list[str] = []
    writer, size = None, 0
    tables = itertools.chain((pq.read_table(root / n) for n in replaces), _read_in_order(parts))
    # Parts are small (a slice's rows of one epoch): written one by one, each was a row group of
    # its own (38,400 of ~256 rows for 10^7 rows), slow to write and to read back.
    for group in _row_groups(tables, schema, min(ROW_GROUP_BYTES, target_file_bytes)):
        if writer is None or size >= target_file_bytes:
            if writer is not None:
                writer.close()
            names.append(PART.format(first + len(names)))
            writer, size = pq.ParquetWriter(root / f".{names[-1]}.tmp", schema), 0
        writer.write_table(group)
        size += group.nbytes
    assert writer is not None
    writer.close()
    return names


#: Rows and bytes a row group of a committed file gathers before it is written.
ROW_GROUP_ROWS, ROW_GROUP_BYTES = 1 << 20, 64 << 20


def _row_groups(tables: Iterable[pa.Table], schema: pa.Schema, max_bytes: int) -> Iterable[pa.Table]:
    """``tables`` conformed to ``schema`` and gathered, in order, into tables of about
    ``ROW_GROUP_ROWS`` rows or ``max_bytes`` (the last one smaller)."""
    held: list[pa.Table] = []
    rows = nbytes = 0
    for table in tables:
        held.append(_conform(table, schema))
        rows, nbytes = rows + table.num_rows, nbytes + table.nbytes
        if rows >= ROW_GROUP_ROWS or nbytes >= max_bytes:
            yield pa.concat_tables(held).combine_chunks()
            held, rows, nbytes = [], 0, 0
    if held:
        yield pa.concat_tables(held).combine_chunks()


def _finish(root: Path, record: dict[str, Any]) -> dict[str, Any]:
    """Carry out the pending commit the record names: rename its files into place, delete the
    parts it took (and any made again), rewrite the record without it."""
    pending = record["pending"]
    for name in pending["parts"]:
        if (root / f".{name}.tmp").exists():
            os.replace(root / f".{name}.tmp", root / name)
    replaces = pending.get("replaces", [])
    for name in replaces:
        (root / name).unlink(missing_ok=True)
    if pending["final"]:
        shutil.rmtree(root / STAGING, ignore_errors=True)
    else:
        for f, e in _staged(root):
            if e <= pending["through"]:
                f.unlink(missing_ok=True)
    record = {"parts": [n for n in record["parts"] if n not in replaces] + pending["parts"], "through": pending["through"],
              "final": pending["final"], "pending": None,
              "staged_parts": record.get("staged_parts", 0) + pending.get("staged_parts", 0)}
    _write_record(root, record)
    return record


def _write_record(root: Path, record: dict[str, Any]) -> None:
    tmp = root / f".{COMMITTED}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, root / COMMITTED)


def _read_in_order(files: list[Path]) -> Iterable[pa.Table]:
    """Each file's table, in ``files``' order, at most ``_READ_AHEAD`` of them in memory."""
    with ThreadPoolExecutor(_READERS) as pool:
        for i in range(0, len(files), _READ_AHEAD):
            yield from pool.map(_read, files[i:i + _READ_AHEAD])


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with ``schema``'s columns in its order and types (a missing one all null)."""
    if table.schema.equals(schema):
        return table
    cols = [table[f.name].cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
            for f in schema]
    return pa.table(cols, schema=schema)
