"""Owns the master's durable catalog: what a restarted master needs to resume a job.

Stored in one lmdb environment under the job's work directory: the
placement (containers per stage, slice -> container, stage of each
container), which host runs each container, the live hosts and their
nodes, the next free id, the containers that finished, the memory-sink rows
handed over at checkpoints, the GC marks, the job's state and its timeline, and the job's launch (plan,
options, policy: ``master.launch``, checksummed). Values are
msgpack (sink rows: one key per packed group, ``containers.sink_parts``, its
rows as Arrow IPC). Each ``save_*`` call is one lmdb
transaction. Knows no Ray.

>>> import tempfile, numpy as np
>>> from master.placement import Placement
>>> cat = MasterCatalog(d := tempfile.mkdtemp())
>>> p = Placement({0: [0, 1]}, {0: np.array([0, 1, 0])}, {0: 0, 1: 0})
>>> cat.save_layout(p, {0: 0, 1: 1}, {0, 1}, {0: "n", 1: "n"}, 2)
>>> cat.load_layout()[0].slices_of(0)
[0, 2]
>>> import shutil; cat.close(); shutil.rmtree(d)
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import numpy as np
import pyarrow as pa

from chronostream.arrow_ipc import read_stream, stream_buffer
from containers.lmdb_store import put_all
from containers.sink_parts import PackedSinkParts
from master.placement import Placement


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class CatalogError(RuntimeError):
    """The catalog lacks, or holds a corrupt copy of, what a restarted master needs."""


class MasterCatalog:
    """The master's state in lmdb (``exists()`` tells a restarted master to resume)."""

    def __init__(self, path: str | os.PathLike, map_size: int = 1 << 30) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        # sync=True: the catalog is small and must survive the master's process.
        self.env = lmdb.open(str(self.path), map_size=map_size, max_dbs=0)
        self.closed = False
        self.sink_keys: int | None = None  # sink-part keys stored (counted on the first add)

    def exists(self) -> bool:
        """True when a layout was saved (the job was deployed)."""
        with self.env.begin() as txn:
            return txn.get(b"layout") is not None

    def _get(self, key: bytes, default: Any = None) -> Any:
        with self.env.begin() as txn:
            v = txn.get(key)
        return default if v is None else _unpack(v)

    def save_layout(self, placement: Placement, host_of: dict[int, int], alive: set[int],
                    nodes: dict[int, str], next_id: int, recovery: Any = ...) -> None:
        """Placement, container -> host, live hosts, host -> node and the next free id.

        ``recovery``, when given, is saved in the same transaction: the
        recovery in progress (a plain dict, see ``master.actor``), or None
        once it ended, so a restarted master never sees a layout and a
        recovery record that disagree.
        """
        if self.closed:
            return  # the job was stopped: late reports are not kept
        layout = {"containers": {str(k): v for k, v in placement.containers.items()},
                  "slices": {str(k): v.tolist() for k, v in placement.slice_to_container.items()},
                  "stage_of": {str(k): v for k, v in placement.stage_of.items()},
                  "host_of": {str(k): v for k, v in host_of.items()}, "alive": sorted(alive),
                  "nodes": {str(k): v for k, v in nodes.items()}, "next_id": next_id}
        items = [(b"layout", _pack(layout))]
        if recovery is not ...:
            items.append((b"recovery", _pack(recovery)))
        put_all(self.env, items)

    def save_launch(self, launch: bytes) -> None:
        """The job's launch (``master.launch.JobLaunch.pack``), with its CRC-32: saved by
        ``deploy`` before any host exists, read back by a restarted master."""
        put_all(self.env, [(b"launch", _pack({"bytes": launch, "crc32": zlib.crc32(launch)}))])

    def load_launch(self) -> bytes:
        """The saved launch; ``CatalogError`` when it is missing or its checksum fails."""
        d = self._get(b"launch")
        if d is None:
            raise CatalogError(f"{self.path}: no job launch saved; the master cannot resume the job")
        if zlib.crc32(d["bytes"]) != d["crc32"]:
            raise CatalogError(f"{self.path}: the saved job launch fails its CRC-32 check")
        return d["bytes"]

    def load_recovery(self) -> dict[str, Any] | None:
        """The recovery a dead master left in progress (see ``save_layout``), or None."""
        return self._get(b"recovery", None)

    def load_layout(self) -> tuple[Placement, dict[int, int], set[int], dict[int, str], int]:
        """The saved layout (see ``save_layout``)."""
        d = self._get(b"layout")
        placement = Placement({int(k): list(v) for k, v in d["containers"].items()},
                              {int(k): np.array(v, dtype=np.int64) for k, v in d["slices"].items()},
                              {int(k): v for k, v in d["stage_of"].items()})
        return (placement, {int(k): v for k, v in d["host_of"].items()}, set(d["alive"]),
                {int(k): v for k, v in d["nodes"].items()}, d["next_id"])

    def save_host_name(self, host_id: int, name: str | None) -> None:
        """The actor name of host ``host_id`` when it is not the job's own naming (a warm spare the
        master adopted, ``master.host_pool``): saved before the adoption, so a restarted master
        finds the host by it.

        >>> import tempfile, shutil
        >>> cat = MasterCatalog(d := tempfile.mkdtemp())
        >>> cat.save_host_name(3, "chronostream-spare-ab12")
        >>> cat.load_host_names()
        {3: 'chronostream-spare-ab12'}
        >>> cat.close(); shutil.rmtree(d)
        """
        if self.closed:
            return
        names = self._get(b"host_names", {})
        if name is None:  # (the host has the job's naming after all)
            names.pop(host_id, None)
        else:
            names[host_id] = name
        put_all(self.env, [(b"host_names", _pack(names))])

    def load_host_names(self) -> dict[int, str]:
        """Host id -> actor name of every host saved with ``save_host_name``."""
        return {int(k): v for k, v in self._get(b"host_names", {}).items()}

    def save_progress(self, state: str, done: set[int], started_at: float, finished_at: float) -> None:
        """Job state, finished containers and times."""
        if self.closed:
            return  # the job was stopped: late reports are not kept
        put_all(self.env, [(b"progress", _pack({"state": state, "done": sorted(done), "started_at": started_at,
                                                "finished_at": finished_at}))])

    def load_progress(self) -> dict[str, Any]:
        """The saved job state (see ``save_progress``)."""
        return self._get(b"progress", {"state": "running", "done": [], "started_at": 0.0, "finished_at": 0.0})

    def save_gc_marks(self, marks: dict[int, int]) -> None:
        """The highest GC mark per producer stage, saved *before* the hosts are told to trim to
        it: a saved mark is never below one applied, so a restarted master that trusts it may
        think logs trimmed that are not (and refuse a rebuild from the start), never the reverse."""
        if self.closed:
            return
        put_all(self.env, [(b"gc_marks", _pack({str(k): int(v) for k, v in marks.items()}))])

    def load_gc_marks(self) -> dict[int, int]:
        """The marks ``save_gc_marks`` saved last; none (no log trimmed yet) when never saved.

        >>> import tempfile, shutil
        >>> cat = MasterCatalog(d := tempfile.mkdtemp())
        >>> before = cat.load_gc_marks()
        >>> cat.save_gc_marks({0: 4, 2: -1})
        >>> before, cat.load_gc_marks()
        ({}, {0: 4, 2: -1})
        >>> cat.close(); shutil.rmtree(d)
        """
        return {int(k): int(v) for k, v in self._get(b"gc_marks", {}).items()}

    def save_migration(self, request: str | None, transfers: list[dict[str, Any]]) -> None:
        """The migration in progress: the request that started it and one record per transfer
        (with its phase); ``[]`` when none."""
        if self.closed:
            return
        put_all(self.env, [(b"migration", _pack({"request": request, "transfers": transfers}))])

    def load_migration(self) -> tuple[str | None, list[dict[str, Any]]]:
        """The migration a dead master left in progress (see ``save_migration``)."""
        d = self._get(b"migration", {"request": None, "transfers": []})
        return d["request"], d["transfers"]

    def save_request(self, request: str, result: Any) -> None:
        """The result of a control request, so a retried call (the master restarted) returns it."""
        if self.closed or not request:
            return
        put_all(self.env, [(b"request:" + request.encode(), _pack(result))])

    def load_request(self, request: str | None) -> Any:
        """The saved result of a control request (None: not done)."""
        return self._get(b"request:" + request.encode(), None) if request else None

    def add_sink_parts(self, packed: PackedSinkParts) -> None:
        """Memory-sink rows (sink id -> (slice, epoch) -> rows), one key per packed group,
        numbered in the order they came (a part stored again replaces the earlier copy)."""
        if self.closed:
            return  # the job was stopped: late reports are not kept
        if self.sink_keys is None:
            self.sink_keys = self._count_sink_keys()
        items = []
        for sink_id, table, index in packed.groups:
            ipc = stream_buffer(table).to_pybytes()  # (msgpack takes bytes)
            items.append((b"sink:%012d" % self.sink_keys, _pack([sink_id, index.tobytes(), ipc])))
            self.sink_keys += 1
        put_all(self.env, items)

    def _count_sink_keys(self) -> int:
        with self.env.begin() as txn:
            cur = txn.cursor()
            n = 0
            if cur.set_range(b"sink:"):
                for key in cur.iternext(keys=True, values=False):
                    if not key.startswith(b"sink:"):
                        break
                    n += 1
            return n

    def load_sink_groups(self) -> list[tuple[int, pa.Table, np.ndarray]]:
        """The saved memory-sink rows as they were packed (``PackedSinkParts.groups``), in the
        order stored: where two hold a part, the later one's copy is the part."""
        groups = []
        with self.env.begin() as txn:
            cur = txn.cursor()
            if cur.set_range(b"sink:"):
                for key, value in cur:
                    if not key.startswith(b"sink:"):
                        break
                    sink_id, index, ipc = _unpack(value)
                    groups.append((sink_id, read_stream(ipc),
                                   np.frombuffer(index, dtype=np.int64).reshape(-1, 3)))
        return groups

    def add_event(self, seq: int, event: tuple[float, str, dict[str, Any]]) -> None:
        """One timeline event (kept in order by ``seq``)."""
        if self.closed:
            return  # the job was stopped: late reports are not kept
        put_all(self.env, [(b"event:%012d" % seq, _pack(list(event)))])

    def load_events(self) -> list[tuple[float, str, dict[str, Any]]]:
        """The saved timeline."""
        out = []
        with self.env.begin() as txn:
            cur = txn.cursor()
            if cur.set_range(b"event:"):
                for key, value in cur:
                    if not key.startswith(b"event:"):
                        break
                    t, kind, info = _unpack(value)
                    out.append((t, kind, info))
        return out

    def close(self) -> None:
        """Close the environment (later saves are ignored)."""
        self.closed = True
        self.env.close()
