"""Owns a container's output log: its slices' numbered outputs in a local lmdb store.

Every epoch's output of every (stream, producer slice) is appended in one
write transaction per epoch, keyed so that a scan from any out_seq returns
the rows after it in order: this is what recovery and migration replay from.
Knows nothing of Ray or of the slices' operators.
"""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path
from typing import Iterator

import lmdb
import numpy as np
import pyarrow as pa

from chronostream.slices.arrow_ipc import read_stream, stream_buffer
from chronostream.slices.types import ORDER, SEQ
from chronostream.containers.lmdb_store import delete_prefix, put_all

_KEY = struct.Struct(">IIq")  # stream id, producer slice, first out_seq (big-endian sorts right)
_INITIAL_MAP_SIZE = 1 << 30


class OutputLog:
    """Append-only log of (stream, slice) outputs, readable from any out_seq.

    >>> import tempfile
    >>> log = OutputLog(d := tempfile.mkdtemp())
    >>> log.append_epoch({(0, 3): pa.table({"x": [1, 2], "_seq": [0, 1]})})
    >>> log.append_epoch({(0, 3): pa.table({"x": [3], "_seq": [2]})})
    >>> log.read(0, 3, after_seq=0)["x"].to_pylist()
    [2, 3]
    >>> import shutil; log.close(); shutil.rmtree(d)
    """

    def __init__(self, path: str | os.PathLike, map_size: int = _INITIAL_MAP_SIZE) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(self.path), map_size=map_size, subdir=True, lock=True,
                             writemap=False, metasync=False, sync=False, max_dbs=1)
        self.rows_written = 0
        # A migration's replay reads from a worker thread while the container appends: a map
        # resize must not happen inside its read transaction (lmdb_store.put_all).
        self._resize_lock = threading.Lock()

    def append_epoch(self, outputs: dict[tuple[int, int], pa.Table]) -> None:
        """Persist one epoch's outputs ((stream, slice) -> rows with ``_seq``) in one transaction."""
        items = []
        for (stream_id, slice_id), table in sorted(outputs.items()):
            if table.num_rows == 0:
                continue
            first = int(table.column(SEQ)[0].as_py())
            items.append((_KEY.pack(stream_id, slice_id, first), stream_buffer(table)))
            self.rows_written += table.num_rows
        put_all(self.env, items, self._resize_lock, store="output log")

    def scan(self, stream_id: int, slice_id: int, after_seq: int = -1) -> Iterator[pa.Table]:
        """Yield the logged batches of (stream, slice) holding rows with out_seq > ``after_seq``."""
        prefix = struct.pack(">II", stream_id, slice_id)
        with self.env.begin() as txn:
            cur = txn.cursor()
            start_key = _KEY.pack(stream_id, slice_id, after_seq + 1)
            found = cur.set_range(start_key)
            if not (found and cur.key() == start_key):
                # The batch holding after_seq + 1 may begin earlier: step back one.
                moved = cur.prev() if found else cur.last()
                if not moved or not cur.key().startswith(prefix):
                    if not cur.set_range(start_key):
                        return
            for key, value in cur.iternext():
                if not key.startswith(prefix):
                    break
                table = read_stream(value)
                seq = np.asarray(table.column(SEQ))
                if seq[-1] <= after_seq:
                    continue
                start = int(np.searchsorted(seq, after_seq, side="right"))
                yield table.slice(start) if start else table

    def read(self, stream_id: int, slice_id: int, after_seq: int = -1) -> pa.Table:
        """All logged rows of (stream, slice) with out_seq > ``after_seq``, as one table."""
        with self._resize_lock:
            parts = list(self.scan(stream_id, slice_id, after_seq))
        if not parts:
            return pa.table({})
        return pa.concat_tables(parts, promote_options="permissive")

    def read_orders(self, stream_id: int, slice_id: int, lo: int, hi: int, after_seq: int = -1
                    ) -> tuple[pa.Table, int]:
        """The logged rows of (stream, slice) with ``lo <= _order < hi`` and out_seq >
        ``after_seq``, and the out_seq of the last row read before ``hi`` (the next call's
        ``after_seq`` when epochs are read one after the other: nothing is read twice).

        >>> import tempfile
        >>> log = OutputLog(d := tempfile.mkdtemp())
        >>> log.append_epoch({(0, 3): pa.table({"x": [1, 2], "_order": [0, 5], "_seq": [0, 1]})})
        >>> log.append_epoch({(0, 3): pa.table({"x": [3], "_order": [12], "_seq": [2]})})
        >>> t, last = log.read_orders(0, 3, 0, 10)
        >>> t["x"].to_pylist(), last
        ([1, 2], 1)
        >>> t, last = log.read_orders(0, 3, 10, 20, after_seq=last)
        >>> t["x"].to_pylist(), last
        ([3], 2)
        >>> import shutil; log.close(); shutil.rmtree(d)
        """
        parts = []
        with self._resize_lock:
            for table in self.scan(stream_id, slice_id, after_seq):
                order = np.asarray(table.column(ORDER))
                if order[0] >= hi:  # (batches are in epoch order: the rest is later)
                    break
                before = order < hi
                after_seq = int(np.asarray(table.column(SEQ))[before][-1])
                keep = before & (order >= lo)
                if keep.any():
                    parts.append(table if keep.all() else table.filter(pa.array(keep)))
        if not parts:
            return pa.table({}), after_seq
        return pa.concat_tables(parts, promote_options="permissive"), after_seq

    def drop(self, stream_id: int, slice_id: int) -> int:
        """Delete every logged batch of (stream, slice) (the slice migrated away); return how many."""
        prefix = struct.pack(">II", stream_id, slice_id)
        with self.env.begin(write=True) as txn:
            return delete_prefix(txn, prefix)

    def trim(self, stream_id: int, slice_id: int, before_order: int) -> int:
        """Delete the logged batches of (stream, slice) whose rows all have ``_order < before_order`` (GC).

        Batches are in out_seq order, and so in epoch order: the scan stops
        at the first batch that must stay. Returns how many were deleted.
        """
        prefix = struct.pack(">II", stream_id, slice_id)
        dead = []
        with self.env.begin() as txn:
            cur = txn.cursor()
            if cur.set_range(prefix):
                for key, value in cur:
                    if not key.startswith(prefix):
                        break
                    last = read_stream(value).column(ORDER)
                    if len(last) and int(np.max(np.asarray(last))) >= before_order:
                        break
                    dead.append(key)
        if dead:
            with self.env.begin(write=True) as txn:
                for key in dead:
                    txn.delete(key)
        return len(dead)

    def move_to(self, other: "OutputLog", stream_id: int, slice_id: int) -> int:
        """Move every logged batch of (stream, slice) into ``other`` as stored (no decoding): a
        compaction hands the slice to another container of the same process. Returns how many."""
        prefix = struct.pack(">II", stream_id, slice_id)
        with self._resize_lock, self.env.begin() as txn:
            cur = txn.cursor()
            items = []
            if cur.set_range(prefix):
                for key, value in cur:
                    if not key.startswith(prefix):
                        break
                    items.append((bytes(key), bytes(value)))
        if items:
            put_all(other.env, items, other._resize_lock, store="output log")
            self.drop(stream_id, slice_id)
        return len(items)

    def entries(self) -> int:
        """Number of logged batches (for GC statistics and tests)."""
        return int(self.env.stat()["entries"])

    def close(self) -> None:
        """Close the lmdb environment."""
        self.env.close()
