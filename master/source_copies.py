"""Owns the copies of a Ray job's in-memory source tables in its work directory.

A query's in-memory tables (``q.source(name, rows_or_table)``) live in Ray's
object store, which dies with the cluster. So that a job whose every process
died can go on (``cs.resume(workdir)``, ``chronostream resume WORKDIR``), the
client writes each table once, when the job starts, as an Arrow IPC file
``<workdir>/sources/stage-<stage id>.arrow`` (directory 0700, files 0600,
written under a temporary name and renamed); ``resume`` maps them back. The
names are made of stage ids, never read from the directory. Sources that read
files (Parquet, a source log) are read again from those files and are not
copied. A stop deletes the directory with the job's other files.

>>> import tempfile, shutil, pyarrow as pa
>>> d = tempfile.mkdtemp()
>>> save_source_tables(d, {0: pa.table({"w": ["a", "b"]})})
>>> load_source_tables(d, [0])[0]["w"].to_pylist()
['a', 'b']
>>> shutil.rmtree(d)
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa

from chronostream.slices.errors import WorkdirError

#: The directory, under a job's work directory, of its in-memory source tables.
SOURCES_DIR = "sources"


def source_table_path(workdir: str | os.PathLike, stage_id: int) -> Path:
    """Where the table of source stage ``stage_id`` is kept."""
    return Path(workdir) / SOURCES_DIR / f"stage-{int(stage_id)}.arrow"


def save_source_tables(workdir: str | os.PathLike, tables: dict[int, pa.Table]) -> None:
    """Write each stage's table (stage id -> table) under ``workdir``; a table already there is replaced."""
    if not tables:
        return
    folder = Path(workdir) / SOURCES_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    for stage_id, table in tables.items():
        path = source_table_path(workdir, stage_id)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        os.replace(tmp, path)


def load_source_tables(workdir: str | os.PathLike, stage_ids: list[int]) -> dict[int, pa.Table]:
    """Stage id -> its table, memory-mapped from ``workdir``; ``WorkdirError`` naming the file when
    one is missing or unreadable."""
    out = {}
    for stage_id in stage_ids:
        path = source_table_path(workdir, stage_id)
        try:
            # (the map stays open: the table's buffers are its pages)
            out[stage_id] = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
        except (OSError, pa.ArrowInvalid) as exc:
            raise WorkdirError(f"{workdir}: the in-memory source table of stage {stage_id} cannot be read from "
                               f"{path} ({exc}); the job cannot be resumed without it") from None
    return out
