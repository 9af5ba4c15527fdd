"""The source log: the durable, sequence-numbered root every job reads its input from.

Owns: an append-only directory of Arrow IPC segment files, one stream per
segment, and the manifest that says which segments are complete. Every row
carries ``_order`` (its dense global sequence over all streams of the log)
and ``_stream_seq`` (its dense sequence within its stream). Knows no Spark
and no Ray: the feeder writes through ``SourceLogWriter``; sources read
through ``SourceLog``.

Layout::

    log_dir/manifest.json                       # small; replaced atomically
    log_dir/segments.jsonl                      # the segment index: one line per segment, append-only
                                                # (compacted: segments-<hex>.jsonl, named by the manifest)
    log_dir/segments/<stream>/<first_order>-<id>.arrow

Crash safety: a segment is written and fsynced under a temporary name and
renamed; its index line is appended to ``segments.jsonl`` and fsynced; only
then does the manifest (written to a temporary file, fsynced and renamed)
publish it, by the index's new length and CRC-32 (``index_bytes``,
``index_crc32``). Readers read the index only up to ``index_bytes``: a
segment or index line the manifest does not cover does not exist for them
(a reopening writer cuts such a tail off). Every listed segment carries its
size and CRC-32; a segment that does not match (torn, truncated,
corrupted) raises ``SourceLogError`` naming it and is never read as valid,
and an index that does not match its CRC-32 is refused the same way. The
manifest carries its own CRC-32 (``manifest_crc32``, over its canonical
JSON without that field): a manifest that fails it, or is not the JSON it
should be, is refused. Every damage a reader or writer meets is a
``SourceLogError`` naming the file.

Confinement: every segment file the index names must lie under the log's
``segments/`` directory (resolved, symbolic links followed); an entry that
points anywhere else (``../victim.txt``, an absolute path) makes the index
damaged, so neither a read nor a trim ever touches a file outside the log.
A writer that cannot write (a full disk: ``ENOSPC``) removes the temporary
and segment files of the append that failed, cuts the index back to what
the manifest publishes, and raises ``SourceLogError`` naming the file; the
log stays as it was before that append.

Cost: an append writes its segments, one index line per segment and the
small manifest, and a tailing reader parses only the index lines it has not
seen, so both stay O(new data) however long the log grows (version 1 kept
every segment in the manifest: each append rewrote it and each refresh
parsed it whole; such logs are still read, and a writer reopening one
moves its list to the index).

The manifest's ``high_water`` is the global order below which the log is
complete (every row with a smaller ``_order`` is in a listed segment);
``sealed`` says no row will ever be added.

Retention: ``SourceLogWriter.trim(order)`` raises the manifest's
``low_water`` (it never falls) and then deletes the segments whose rows
are all below it; a reader asked for rows below ``low_water`` raises
``SourceLogError`` naming both orders, never a silently shorter input.
A reader forgets trimmed segments, and ``trim`` compacts the index on disk
(``compact_index``) once its trimmed lines reach ``COMPACT_MIN_LINES`` and
outnumber the live ones: both stay proportional to the live segments. A
running job says how far its log may be trimmed (``Job.source_log_floor``:
the first order a recovery or migration of its source slices could read
again).
"""

from __future__ import annotations

import bisect
import collections
import copy
import dataclasses
import json
import os
import re
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from chronostream.slices.errors import ChronoStreamError

ORDER = "_order"
STREAM_SEQ = "_stream_seq"
MANIFEST = "manifest.json"
INDEX = "segments.jsonl"
#: The manifest's field holding the CRC-32 of the rest of it (``_manifest_crc``).
MANIFEST_CRC = "manifest_crc32"
#: The manifest format written (3: with ``MANIFEST_CRC``; 1 and 2, without, are still read).
VERSION = 3
#: A compacted index is ``segments-<hex>.jsonl``; the manifest's ``index_file`` names the current one.
_INDEX_NAME = re.compile(r"segments(-[0-9a-f]{1,32})?\.jsonl")
#: ``trim`` compacts the index once its trimmed lines reach this many and outnumber the live
#: ones: the index on disk then holds at most about twice the live segments' lines (and
#: this many more), each compaction costs O(live segments), paid for by as many trims.
COMPACT_MIN_LINES = 4096


class SourceLogError(ChronoStreamError):
    """The source log is malformed: a torn or corrupt segment, index or manifest, a path that
    leaves the log's directory, a bad append, or a write the disk refused."""


@dataclass(frozen=True)
class Segment:
    """One listed segment of one stream."""

    file: str
    stream: str
    first_order: int
    last_order: int
    first_seq: int
    rows: int
    bytes: int
    crc32: int


def _fsync_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)  # (a full disk: no temporary file is left behind)
        raise SourceLogError(f"cannot write {path}: {exc.strerror or exc}") from exc
    # The rename is done: a directory that cannot be synced loses at most its durability, so
    # this is not undone (a caller that sees the error sees the new file).
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    except OSError as exc:
        err = SourceLogError(f"wrote {path}, but cannot sync its directory: {exc.strerror or exc}")
        err.published = True  # type: ignore[attr-defined]  # (SourceLogWriter.append keeps what it wrote)
        raise err from exc
    finally:
        os.close(dfd)


def _manifest_crc(m: dict) -> int:
    """CRC-32 of the manifest ``m`` without its own checksum field, as canonical JSON."""
    body = {k: v for k, v in m.items() if k != MANIFEST_CRC}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _manifest_bytes(m: dict) -> bytes:
    """The manifest ``m`` as written: its fields and their checksum."""
    return json.dumps({**{k: v for k, v in m.items() if k != MANIFEST_CRC}, MANIFEST_CRC: _manifest_crc(m)}).encode()


def _parse_manifest(path: Path, raw: bytes) -> dict:
    """The manifest read from ``path`` (without its checksum field), checked; ``SourceLogError``
    when it is not JSON, fails its checksum or lacks what a reader needs."""
    try:
        m = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise SourceLogError(f"{path} is damaged: not a JSON manifest") from None
    if not isinstance(m, dict):
        raise SourceLogError(f"{path} is damaged: not a JSON object")
    if m.get("version", 1) in (1, 2):  # (written before the manifest had a checksum)
        m.pop(MANIFEST_CRC, None)
    elif m.get(MANIFEST_CRC) != _manifest_crc(m):
        raise SourceLogError(f"{path} is damaged: it fails its CRC-32 check ({MANIFEST_CRC})")
    else:
        m.pop(MANIFEST_CRC)
    need = {"sealed": bool, "high_water": int, "streams": dict}
    need.update({"segments": list} if "segments" in m else {"index_bytes": int, "index_crc32": int})
    bad = [k for k, t in need.items() if not isinstance(m.get(k), t)]
    if bad or not isinstance(m.get("low_water", 0), int) or any(
            not (isinstance(v, dict) and isinstance(v.get("schema"), str) and isinstance(v.get("rows"), int))
            for v in m["streams"].values()):
        raise SourceLogError(f"{path} is damaged: fields {bad or ['streams']} are missing or malformed")
    return m


def _segment(log_dir: Path, where: str, d: object) -> Segment:
    """A segment entry of the index (or of a version-1 manifest) as a ``Segment``, its file
    confined to the log's ``segments/`` directory; ``SourceLogError`` otherwise."""
    try:
        if not (isinstance(d["file"], str) and isinstance(d["stream"], str)
                and all(type(v) is int for k, v in d.items() if k != "file" and k != "stream")):
            raise TypeError
        seg = Segment(**d)  # (a missing or unknown field: TypeError)
    except (TypeError, KeyError):
        raise SourceLogError(f"{where} is damaged: a segment entry is malformed ({d!r:.200})") from None
    parts = os.path.normpath(seg.file).split(os.sep)
    if os.path.isabs(seg.file) or parts[0] != "segments" or ".." in parts or len(parts) < 2:
        # (by its name alone: cheap for a long index; the files are resolved when used, _confined)
        raise SourceLogError(f"{where} is damaged: segment file {seg.file!r} lies outside {log_dir / 'segments'}")
    return seg


def _confined(log_dir: Path, file: str, where: str) -> Path:
    """``log_dir / file`` when, resolved (symbolic links followed), it lies under
    ``log_dir/segments``; ``SourceLogError`` naming ``where`` otherwise: no entry of the log
    reaches a file outside it, whatever its name says."""
    root = os.path.realpath(log_dir / "segments")
    path = os.path.realpath(log_dir / file)
    if os.path.isabs(file) or os.path.commonpath([root, path]) != root or path == root:
        raise SourceLogError(f"{where} is damaged: segment file {file!r} lies outside {log_dir / 'segments'}")
    return Path(path)


def _index_line(seg: Segment) -> bytes:
    return (json.dumps(dataclasses.asdict(seg), separators=(",", ":")) + "\n").encode()


def _schema_to_str(schema: pa.Schema) -> str:
    return schema.serialize().to_pybytes().hex()


def _schema_from_str(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(text)))


def rows_in_order_range(table: pa.Table, lo: int, hi: int | None) -> pa.Table:
    """The rows of an ``_order``-sorted table with ``lo <= _order < hi`` (``hi`` None: no upper bound)."""
    order = np.asarray(table.column(ORDER))
    a = int(np.searchsorted(order, lo, side="left"))
    b = len(order) if hi is None else int(np.searchsorted(order, hi, side="left"))
    return table.slice(a, max(0, b - a))


class SourceLog:
    """Reader of a source log. ``refresh()`` re-reads the manifest (for tailing).

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> w = SourceLogWriter(d)
    >>> w.append({"s": pa.table({"x": [1, 2], "_order": [0, 1], "_stream_seq": [0, 1]})}, high_water=2)
    >>> w.seal()
    >>> log = SourceLog(d)
    >>> log.read("s", from_order=1)["x"].to_pylist(), log.sealed, log.high_water
    ([2], True, 2)
    >>> import shutil; shutil.rmtree(d)
    """

    def __init__(self, log_dir: str | os.PathLike, keep_trimmed: bool = False) -> None:
        """``keep_trimmed``: list the segments below ``low_water`` too (the writer's view, which
        deletes their files); a reader forgets them, so its index holds the live segments only."""
        self.dir = Path(log_dir)
        self._keep_trimmed = keep_trimmed
        self._seen: tuple[int, int, int] | None = None  # (inode, mtime, size) of the manifest last parsed
        self.segments: list[Segment] = []
        self._by_stream: dict[str, list[Segment]] = {}
        self._last_orders: dict[str, list[int]] = {}  # per stream, its segments' last orders (for bisect)
        self._index_file = INDEX  # the index file parsed (a compaction names a new one)
        self._index_bytes = 0  # how much of it is parsed
        self._index_crc = 0
        self.refresh()

    def refresh(self, _retry: bool = True) -> None:
        """Re-read the manifest (a consistent snapshot: it is replaced atomically).

        A tailing source calls this every few milliseconds, so an unchanged
        manifest (same inode, mtime and size: the writer replaces it by a
        rename) costs an ``open`` and ``fstat`` and is not parsed again.
        """
        try:
            f = open(self.dir / MANIFEST, "rb")
        except FileNotFoundError:
            raise SourceLogError(f"{self.dir} is not a source log (no {MANIFEST})") from None
        with f:
            st = os.fstat(f.fileno())  # of the file read below, even if a rename replaces it meanwhile
            seen = (st.st_ino, st.st_mtime_ns, st.st_size)
            if seen == self._seen:
                return
            m = _parse_manifest(self.dir / MANIFEST, f.read())
        if "segments" in m:  # version 1: the whole list in the manifest
            self.segments, self._by_stream, self._last_orders = [], {}, {}
            self._add_segments([_segment(self.dir, str(self.dir / MANIFEST), s) for s in m["segments"]])
        else:
            name = m.get("index_file", INDEX)
            if not isinstance(name, str) or not _INDEX_NAME.fullmatch(name):
                raise SourceLogError(f"{self.dir / MANIFEST} names an invalid segment index {name!r}")
            if name != self._index_file:  # compacted: read the new index from its start
                self.segments, self._by_stream, self._last_orders = [], {}, {}
                self._index_file, self._index_bytes, self._index_crc = name, 0, 0
            try:
                self._read_index(m["index_bytes"], m["index_crc32"])
            except FileNotFoundError:
                if not _retry:  # (a compaction replaced it since the manifest was read: once more)
                    raise SourceLogError(f"{self.dir / name}, the segment index, is missing") from None
                return self.refresh(_retry=False)
        self._seen = seen
        self.sealed: bool = m["sealed"]
        self.high_water: int = m["high_water"]
        self.low_water: int = m.get("low_water", 0)  # rows below it may be trimmed
        if not self._keep_trimmed:
            self._forget_trimmed()
        try:
            self._schemas = {k: _schema_from_str(v["schema"]) for k, v in m["streams"].items()}
        except (ValueError, pa.ArrowException):
            raise SourceLogError(f"{self.dir / MANIFEST} is damaged: a stream's schema cannot be read") from None
        self.stream_rows: dict[str, int] = {k: v["rows"] for k, v in m["streams"].items()}

    def _read_index(self, upto: int, crc: int) -> None:
        """Parse the index lines the manifest now covers and this reader has not seen."""
        if upto == self._index_bytes:
            return
        if upto < self._index_bytes:
            raise SourceLogError(f"{self.dir}: the segment index shrank ({self._index_bytes} -> {upto} bytes)")
        # (a missing file raises FileNotFoundError: ``refresh`` reads the manifest once more, as a
        # compaction may have replaced the index since, then says the index is missing)
        with open(self.dir / self._index_file, "rb") as f:
            f.seek(self._index_bytes)
            data = f.read(upto - self._index_bytes)
        running = zlib.crc32(data, self._index_crc)
        if len(data) != upto - self._index_bytes or running != crc:
            raise SourceLogError(f"{self.dir / self._index_file} is torn or corrupt: it does not match the manifest's "
                                 f"length and CRC-32 ({upto} bytes)")
        where = str(self.dir / self._index_file)
        try:
            entries = [json.loads(line) for line in data.splitlines()]
        except ValueError:
            raise SourceLogError(f"{where} is damaged: a line is not JSON") from None
        self._add_segments([_segment(self.dir, where, d) for d in entries])
        self._index_bytes, self._index_crc = upto, running

    def _forget_trimmed(self) -> None:
        """Drop the segments wholly below ``low_water`` from this reader's index (they are never
        read again, and their files go): a long-lived reader holds the live segments only."""
        cut = {st: bisect.bisect_left(lasts, self.low_water) for st, lasts in self._last_orders.items()}
        if not any(cut.values()):
            return
        for st, n in cut.items():
            if n:
                del self._by_stream[st][:n], self._last_orders[st][:n]
        self.segments = [seg for seg in self.segments if seg.last_order >= self.low_water]

    def _add_segments(self, new: list[Segment]) -> None:
        self.segments.extend(new)
        for seg in new:
            self._by_stream.setdefault(seg.stream, []).append(seg)
            self._last_orders.setdefault(seg.stream, []).append(seg.last_order)

    def streams(self) -> list[str]:
        """Stream names, in the order they were first written."""
        return list(self._schemas)

    def schema(self, stream: str) -> pa.Schema:
        """Schema of a stream's rows (payload and system columns)."""
        if stream not in self._schemas:
            raise SourceLogError(f"stream {stream!r} not in the log {self.dir}; streams: {self.streams()}")
        return self._schemas[stream]

    def total_rows(self) -> int:
        """Rows over all streams."""
        return sum(self.stream_rows.values())

    def segment_table(self, seg: Segment) -> pa.Table:
        """The rows of one listed segment, verified against the manifest (size, CRC-32, rows)."""
        path = _confined(self.dir, seg.file, str(self.dir / INDEX))
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise SourceLogError(f"segment {seg.file} listed in the manifest is missing") from None
        if len(data) != seg.bytes:
            raise SourceLogError(
                f"segment {seg.file} is torn: {len(data)} bytes on disk, {seg.bytes} in the manifest")
        if zlib.crc32(data) != seg.crc32:
            raise SourceLogError(f"segment {seg.file} is corrupt: CRC-32 does not match the manifest")
        table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
        if table.num_rows != seg.rows:
            raise SourceLogError(f"segment {seg.file} holds {table.num_rows} rows, manifest says {seg.rows}")
        return table

    def segments_of(self, stream: str, from_order: int = 0, to_order: int | None = None) -> Iterator[Segment]:
        """Listed segments of ``stream`` overlapping [from_order, to_order); ``SourceLogError``
        when ``from_order`` is below the log's ``low_water`` (those rows may be trimmed)."""
        self.schema(stream)
        self._check_not_trimmed(stream, from_order)
        segs = self._by_stream.get(stream, [])
        # A stream's segments are in order: skip those ending before from_order by bisection.
        for seg in segs[bisect.bisect_left(self._last_orders.get(stream, []), from_order):]:
            if to_order is not None and seg.first_order >= to_order:
                break
            yield seg

    def read(self, stream: str, from_order: int = 0, to_order: int | None = None) -> pa.Table:
        """Rows of ``stream`` with ``from_order <= _order < to_order``, verified, in order."""
        parts = []
        for seg in self.segments_of(stream, from_order, to_order):
            part = rows_in_order_range(self.segment_table(seg), from_order, to_order)
            if part.num_rows:
                parts.append(part)
        if not parts:
            return self.schema(stream).empty_table()
        return pa.concat_tables(parts)

    def _check_not_trimmed(self, stream: str, from_order: int) -> None:
        if from_order < self.low_water:
            raise SourceLogError(
                f"stream {stream!r} of the source log {self.dir}: rows from order {from_order} were asked for, "
                f"but the log was trimmed below order {self.low_water} (retention: SourceLogWriter.trim)")

    def read_from_seq(self, stream: str, from_seq: int) -> pa.Table:
        """Replay: rows of ``stream`` with ``_stream_seq >= from_seq`` (``SourceLogError`` when
        some of them were trimmed)."""
        self.schema(stream)
        kept = [seg for seg in self._by_stream.get(stream, []) if seg.last_order >= self.low_water]
        first = kept[0].first_seq if kept else self.stream_rows.get(stream, 0)
        if from_seq < first and self.low_water:
            raise SourceLogError(
                f"stream {stream!r} of the source log {self.dir}: rows from _stream_seq {from_seq} were asked "
                f"for, but the log was trimmed below order {self.low_water} (retention: SourceLogWriter.trim)")
        parts = []
        for seg in kept:
            if seg.first_seq + seg.rows <= from_seq:
                continue
            t = self.segment_table(seg)
            skip = max(0, from_seq - seg.first_seq)
            parts.append(t.slice(skip))
        return pa.concat_tables(parts) if parts else self.schema(stream).empty_table()

    def verify(self) -> list[str]:
        """Check every listed segment; return the problems found (empty = sound)."""
        problems = []
        for seg in self.segments:
            if seg.last_order < self.low_water:
                continue  # trimmed
            try:
                self.segment_table(seg)
            except SourceLogError as exc:
                problems.append(str(exc))
        return problems


class SourceLogWriter:
    """The single writer of a source log: appends segments, advances the high water, seals.

    Rows given to ``append`` must carry ``_order`` (increasing, above every
    order already written to that stream) and ``_stream_seq`` (continuing the
    stream's dense sequence); this is checked.
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._kept: dict[str, collections.deque[Segment]] = {}  # per stream, segments not yet trimmed, in order
        path = self.dir / MANIFEST
        self._trimmed_lines = 0  # lines of the index file for segments below low_water (compact_index)
        if path.exists():
            log = SourceLog(self.dir, keep_trimmed=True)  # verifies the index against the manifest
            if log.sealed:
                raise SourceLogError(f"the source log {self.dir} is sealed; it takes no more rows")
            m = _parse_manifest(path, path.read_bytes())
            if "segments" in m:  # version 1: its list moves to the index
                index = b"".join(_index_line(s) for s in log.segments)
                _fsync_write(self.dir / INDEX, index)
                del m["segments"]
                m.update(version=VERSION, index_bytes=len(index), index_crc32=zlib.crc32(index))
                _fsync_write(path, _manifest_bytes(m))
            else:
                # Keep exactly what the manifest published: an index tail written by a writer
                # that crashed before publishing is cut off.
                with open(self.dir / m.get("index_file", INDEX), "r+b") as f:
                    f.truncate(m["index_bytes"])
                    os.fsync(f.fileno())
                for stale in self.dir.glob("segments*.jsonl"):  # (a compaction cut short)
                    if stale.name != m.get("index_file", INDEX):
                        stale.unlink(missing_ok=True)
            self._last_order = {s.stream: s.last_order for s in log.segments}
            low = m.get("low_water", 0)
            for seg in log.segments:  # (their files are confined to the log: _segment)
                if seg.last_order >= low or (self.dir / seg.file).exists():  # (a trim may have been cut short)
                    self._kept.setdefault(seg.stream, collections.deque()).append(seg)
            self._trimmed_lines = sum(1 for seg in log.segments if seg.last_order < low)
        else:
            m = {"version": VERSION, "sealed": False, "high_water": 0, "streams": {}, "index_bytes": 0,
                 "index_crc32": 0}
            _fsync_write(self.dir / INDEX, b"")
            _fsync_write(path, _manifest_bytes(m))
            self._last_order = {}
        self.manifest = m

    def _check(self, stream: str, table: pa.Table) -> None:
        for col in (ORDER, STREAM_SEQ):
            if col not in table.schema.names:
                raise SourceLogError(f"rows for stream {stream!r} lack the {col!r} column")
        order = np.asarray(table.column(ORDER))
        seq = np.asarray(table.column(STREAM_SEQ))
        if np.any(order[1:] <= order[:-1]):
            raise SourceLogError(f"stream {stream!r}: _order must increase within an append")
        if order[0] <= self._last_order.get(stream, -1):
            raise SourceLogError(f"stream {stream!r}: _order {order[0]} is not above what the log holds")
        if order[0] < self.manifest["high_water"]:
            raise SourceLogError(f"stream {stream!r}: _order {order[0]} is below the high water mark")
        expected = self.manifest["streams"].get(stream, {}).get("rows", 0)
        if seq[0] != expected or np.any(np.diff(seq) != 1):
            raise SourceLogError(f"stream {stream!r}: _stream_seq must continue densely from {expected}")
        known = self.manifest["streams"].get(stream)
        if known is not None and _schema_from_str(known["schema"]) != table.schema:
            raise SourceLogError(f"stream {stream!r}: schema changed: {table.schema} vs the log's")

    def _as_logged(self, stream: str, table: pa.Table) -> pa.Table:
        """``table`` in the stream's logged schema when they differ only in which fields may be
        null (a micro-batch a filter made non-null, say): rows with nulls are refused where the
        log's field is non-null; any other difference is left for ``_check`` to refuse."""
        known = self.manifest["streams"].get(stream)
        if known is None:
            return table
        schema = _schema_from_str(known["schema"])
        if schema == table.schema or schema.names != table.schema.names or \
                any(a.type != b.type for a, b in zip(schema, table.schema)):
            return table
        for f in schema:
            if not f.nullable and table.column(f.name).null_count:
                raise SourceLogError(f"stream {stream!r}: column {f.name!r} holds nulls; the log's is non-null")
        return table.cast(schema)

    def append(self, tables: dict[str, pa.Table], high_water: int | None = None) -> None:
        """Write one segment per non-empty table, then publish them (and ``high_water``) atomically.

        A write that fails (``SourceLogError``: a full disk, say) leaves the log and this writer
        as they were before the call: its segment files are removed and the index cut back.
        """
        before = (copy.deepcopy(self.manifest), dict(self._last_order),
                  {k: len(v) for k, v in self._kept.items()})
        written: list[Path] = []
        try:
            self._append(tables, high_water, written)
        except BaseException as exc:
            if not getattr(exc, "published", False):
                self._undo_append(before, written)
            raise

    def _undo_append(self, before: tuple, written: list[Path]) -> None:
        """Put the log and this writer back as they were before a failed ``append``."""
        self.manifest, self._last_order, kept = before
        for stream in list(self._kept):
            while len(self._kept[stream]) > kept.get(stream, 0):
                self._kept[stream].pop()
        for path in written:
            path.unlink(missing_ok=True)
        try:
            with open(self.dir / INDEX, "r+b") as f:
                f.truncate(self.manifest["index_bytes"])
        except OSError:
            pass  # (a reopening writer cuts the unpublished tail off)

    def _append(self, tables: dict[str, pa.Table], high_water: int | None, written: list[Path]) -> None:
        new_segments = []
        for stream, table in tables.items():
            if table.num_rows == 0:
                continue
            if "/" in stream or stream.startswith("."):
                raise SourceLogError(f"invalid stream name {stream!r}")
            table = self._as_logged(stream, table)
            self._check(stream, table)
            order = np.asarray(table.column(ORDER))
            seg_dir = self.dir / "segments" / stream
            seg_dir.mkdir(parents=True, exist_ok=True)
            name = f"{int(order[0]):012d}-{uuid.uuid4().hex[:8]}.arrow"
            sink = pa.BufferOutputStream()
            with pa.ipc.new_file(sink, table.schema) as w:
                w.write_table(table)
            data = sink.getvalue().to_pybytes()
            _fsync_write(seg_dir / name, data)
            written.append(seg_dir / name)
            new_segments.append(Segment(
                file=f"segments/{stream}/{name}", stream=stream, first_order=int(order[0]),
                last_order=int(order[-1]), first_seq=int(table.column(STREAM_SEQ)[0].as_py()),
                rows=table.num_rows, bytes=len(data), crc32=zlib.crc32(data)))
            self._kept.setdefault(stream, collections.deque()).append(new_segments[-1])
            entry = self.manifest["streams"].setdefault(stream, {"schema": _schema_to_str(table.schema), "rows": 0})
            entry["rows"] += table.num_rows
            self._last_order[stream] = int(order[-1])
        if new_segments:
            lines = b"".join(_index_line(s) for s in new_segments)
            try:
                with open(self.dir / self.manifest.get("index_file", INDEX), "ab") as f:
                    f.write(lines)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                raise SourceLogError(f"cannot write {self.dir / self.manifest.get('index_file', INDEX)}: {exc.strerror or exc}") from exc
            self.manifest["index_bytes"] += len(lines)
            self.manifest["index_crc32"] = zlib.crc32(lines, self.manifest["index_crc32"])
        if high_water is not None:
            if high_water < self.manifest["high_water"]:
                raise SourceLogError("the high water mark only grows")
            self.manifest["high_water"] = high_water
        self._publish()

    @property
    def next_order(self) -> int:
        """The smallest global order the next appended row may take (above every row and the
        high water mark)."""
        return max(self.manifest["high_water"], max(self._last_order.values(), default=-1) + 1)

    def trim(self, before_order: int) -> int:
        """Retention: rows below ``before_order`` will not be read again (a running job's
        ``Job.source_log_floor()``). Raises the manifest's ``low_water`` to it (never lowers it,
        never above the high water mark), publishes that, then deletes the segment files whose
        rows are all below it. Returns how many files it deleted.

        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> w = SourceLogWriter(d)
        >>> for lo in (0, 2, 4):
        ...     w.append({"s": pa.table({"_order": [lo, lo + 1], "_stream_seq": [lo, lo + 1]})}, high_water=lo + 2)
        >>> w.trim(3), SourceLog(d).read("s", 3)["_order"].to_pylist()
        (1, [3, 4, 5])
        >>> import shutil; shutil.rmtree(d)
        """
        if before_order > self.manifest["high_water"]:
            raise SourceLogError(f"cannot trim {self.dir} below order {before_order}: above its high water mark "
                                 f"{self.manifest['high_water']}")
        low = max(self.manifest.get("low_water", 0), int(before_order))
        if low != self.manifest.get("low_water", 0):
            self.manifest["low_water"] = low
            self._publish()  # first: no reader trusts a segment about to go
        deleted = 0
        for segs in self._kept.values():  # O(segments deleted): each stream's are in order
            while segs and segs[0].last_order < low:
                _confined(self.dir, segs[0].file, str(self.dir / INDEX)).unlink(missing_ok=True)
                segs.popleft()
                deleted += 1
        self._trimmed_lines += deleted
        if self._trimmed_lines >= max(COMPACT_MIN_LINES, sum(len(q) for q in self._kept.values())):
            self.compact_index()
        return deleted

    def compact_index(self) -> None:
        """Rewrite the segment index without the trimmed segments' lines (``trim`` calls this
        when they reach ``COMPACT_MIN_LINES`` and outnumber the live ones). The new index gets
        a new name and is fsynced before the manifest names it: a crash leaves the old index
        or the new one published, never a mix; a reader that read the old manifest reads it
        again (``SourceLog.refresh``). The old file goes after the publication."""
        live = sorted((seg for segs in self._kept.values() for seg in segs), key=lambda seg: seg.first_order)
        data = b"".join(_index_line(seg) for seg in live)
        old = self.manifest.get("index_file", INDEX)
        name = f"segments-{uuid.uuid4().hex[:16]}.jsonl"
        _fsync_write(self.dir / name, data)
        self.manifest.update(index_file=name, index_bytes=len(data), index_crc32=zlib.crc32(data))
        self._publish()
        (self.dir / old).unlink(missing_ok=True)
        self._trimmed_lines = 0

    def seal(self) -> None:
        """Mark the log complete: its high water becomes one past its largest order."""
        last = max(self._last_order.values(), default=-1)
        self.manifest["high_water"] = max(self.manifest["high_water"], last + 1)
        self.manifest["sealed"] = True
        self._publish()

    def _publish(self) -> None:
        self.manifest["version"] = VERSION
        _fsync_write(self.dir / MANIFEST, _manifest_bytes(self.manifest))
