"""Owns the master's durable catalog: what a restarted master needs to resume a job.

Stored in one lmdb environment under the job's work directory: the
placement (containers per stage, slice -> container, stage of each
container), which host runs each container, the live hosts and their
nodes, the next free id, the containers that finished, the memory-sink rows
handed over at checkpoints, the GC marks, the job's state and its timeline, the job's identity
(its key and plan fingerprint: ``run(..., resume=True)`` checks it) and the job's launch (plan,
options, policy: ``master.launch``). Values are msgpack (sink rows: one key per packed group,
``containers.sink_parts``, its rows as Arrow IPC under a key of their own): nothing executes
when they are read, except the launch, which is a pickle (it carries the user's code). So the launch is stored with an
HMAC-SHA256 under a random per-job key kept next to the catalog (``launch.key``: created
exclusively, mode 0600, in the catalog's 0700 directory), and ``load_launch`` verifies it before
anything unpickles the bytes: whoever can forge a launch must already be able to read that file.
Each ``save_*`` call is one lmdb transaction. Knows no Ray.

>>> import tempfile, numpy as np
>>> from chronostream.master.placement import Placement
>>> cat = MasterCatalog(d := tempfile.mkdtemp())
>>> p = Placement({0: [0, 1]}, {0: np.array([0, 1, 0])}, {0: 0, 1: 0})
>>> cat.save_layout(p, {0: 0, 1: 1}, {0, 1}, {0: "n", 1: "n"}, 2)
>>> cat.load_layout()[0].slices_of(0)
[0, 2]
>>> import shutil; cat.close(); shutil.rmtree(d)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path
from collections.abc import Iterable
from typing import Any

import lmdb
import msgpack
import numpy as np
import pyarrow as pa

from chronostream.slices.arrow_ipc import read_stream, stream_buffer
from chronostream.slices.errors import ChronoStreamError
from chronostream.containers.lmdb_store import put_all
from chronostream.containers.sink_parts import PackedSinkParts
from chronostream.master.job_state import JobState
from chronostream.master.placement import Placement


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class CatalogError(ChronoStreamError, RuntimeError):
    """The catalog lacks, or holds a corrupt or unauthenticated copy of, what a restarted master needs."""


#: The file holding the catalog's launch key (in the catalog's directory).
LAUNCH_KEY = "launch.key"


def catalog_identity(path: str | os.PathLike) -> dict[str, Any] | None:
    """The identity (``{"job_key", "fingerprint"}``) of the catalog at ``path``; ``{}`` for a
    catalog that holds none; None where there is no catalog. Opened read-only and closed again
    (the client looks before it starts a master there).

    >>> import tempfile, shutil
    >>> d = tempfile.mkdtemp()
    >>> before = catalog_identity(d)
    >>> cat = MasterCatalog(d); cat.save_identity("job-1", "ab12"); cat.close()
    >>> before, catalog_identity(d)
    (None, {'job_key': 'job-1', 'fingerprint': 'ab12'})
    >>> shutil.rmtree(d)
    """
    if not (Path(path) / "data.mdb").exists():
        return None
    try:
        env = lmdb.open(str(path), readonly=True, max_dbs=0)
        try:
            with env.begin() as txn:
                v = txn.get(b"identity")
        finally:
            env.close()
        identity = {} if v is None else _unpack(v)
    except (lmdb.Error, ValueError) as exc:
        raise CatalogError(f"{path}: a job catalog that cannot be read ({exc})") from exc
    if not isinstance(identity, dict):
        raise CatalogError(f"{path}: a job catalog whose identity is damaged")
    return identity


def saved_launch(path: str | os.PathLike) -> bytes:
    """The launch saved in the catalog at ``path``, verified (``MasterCatalog.load_launch``); the
    catalog is closed again (a client reads it before it starts the master that resumes the job)."""
    cat = MasterCatalog(path)
    try:
        return cat.load_launch()
    finally:
        cat.close()


class MasterCatalog:
    """The master's state in lmdb (``exists()`` tells a restarted master to resume)."""

    def __init__(self, path: str | os.PathLike, map_size: int = 1 << 30, sync: bool = True) -> None:
        """``sync``: each save reaches the disk before it returns (the catalog is small and must
        survive the master's process and its machine); the in-process driver's catalog, whose
        master dies only in simulation, skips it."""
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.env = lmdb.open(str(self.path), map_size=map_size, max_dbs=0, sync=sync, metasync=sync)
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
        put_all(self.env, items, store="master catalog")

    def save_identity(self, job_key: str, fingerprint: str, made_workdir: bool = False) -> None:
        """Which job this catalog is: its key on the cluster, its plan's fingerprint
        (``master.launch.plan_fingerprint``) and whether ``run`` made its work directory for it
        (a stop with cleanup then removes the directory; otherwise only what the job put in it).
        Saved by ``deploy`` before the launch."""
        record = {"job_key": job_key, "fingerprint": fingerprint}
        if made_workdir:
            record["made_workdir"] = True
        put_all(self.env, [(b"identity", _pack(record))], store="master catalog")

    def load_identity(self) -> dict[str, Any]:
        """The saved identity (see ``save_identity``); ``{}`` when none was saved."""
        return self._get(b"identity", {})

    def _launch_key(self, create: bool) -> bytes:
        """The catalog's launch key (32 random bytes in ``launch.key``), made when ``create`` and
        missing. A key file another user owns, or that others may read or write, is refused."""
        path = self.path / LAUNCH_KEY
        if create:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                pass  # (a master restarted between making the key and saving the launch)
            else:
                with os.fdopen(fd, "wb") as f:
                    f.write(secrets.token_bytes(32))
                    f.flush()
                    os.fsync(f.fileno())
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise CatalogError(f"{path}: the catalog's launch key cannot be read ({exc}); the saved job "
                               "launch cannot be authenticated") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
                raise CatalogError(f"{path}: the launch key must be owned by this user with mode 0600 "
                                   f"(it has uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
            key = f.read()
        if len(key) != 32:
            raise CatalogError(f"{path}: the launch key is damaged ({len(key)} bytes, not 32)")
        return key

    def save_launch(self, launch: bytes) -> None:
        """The job's launch (``master.launch.JobLaunch.pack``) with its HMAC-SHA256 under the
        catalog's launch key (made now): saved by ``deploy`` before any host exists, read back
        by a restarted master."""
        mac = hmac.new(self._launch_key(create=True), launch, hashlib.sha256).digest()
        put_all(self.env, [(b"launch", _pack({"bytes": launch, "hmac_sha256": mac}))], store="master catalog")

    def load_launch(self) -> bytes:
        """The saved launch, verified; ``CatalogError`` when it is missing, carries no HMAC, or its
        HMAC does not match the launch key: those bytes are never handed on to be unpickled.

        >>> import tempfile, shutil
        >>> cat = MasterCatalog(d := tempfile.mkdtemp())
        >>> cat.save_launch(b"launch bytes"); cat.load_launch()
        b'launch bytes'
        >>> oct(os.stat(os.path.join(d, LAUNCH_KEY)).st_mode & 0o777)
        '0o600'
        >>> cat.close(); shutil.rmtree(d)
        """
        d = self._get(b"launch")
        if d is None:
            raise CatalogError(f"{self.path}: no job launch saved; the master cannot resume the job")
        if not (isinstance(d, dict) and isinstance(d.get("bytes"), bytes) and isinstance(d.get("hmac_sha256"), bytes)):
            raise CatalogError(f"{self.path}: the saved job launch carries no HMAC; it is not unpickled")
        mac = hmac.new(self._launch_key(create=False), d["bytes"], hashlib.sha256).digest()
        if not hmac.compare_digest(mac, d["hmac_sha256"]):
            raise CatalogError(f"{self.path}: the saved job launch fails its HMAC-SHA256 check against "
                               f"{self.path / LAUNCH_KEY}; it is not unpickled")
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
        put_all(self.env, [(b"host_names", _pack(names))], store="master catalog")

    def load_host_names(self) -> dict[int, str]:
        """Host id -> actor name of every host saved with ``save_host_name``."""
        return {int(k): v for k, v in self._get(b"host_names", {}).items()}

    def save_progress(self, state: JobState, done: set[int], started_at: float, finished_at: float) -> None:
        """Job state (stored as its plain value), finished containers and times."""
        if self.closed:
            return  # the job was stopped: late reports are not kept
        put_all(self.env, [(b"progress", _pack({"state": state.value, "done": sorted(done), "started_at": started_at,
                                                "finished_at": finished_at}))], store="master catalog")

    def load_progress(self) -> dict[str, Any]:
        """The saved job state (see ``save_progress``), its ``state`` read back as a ``JobState``.

        >>> import tempfile, shutil
        >>> cat = MasterCatalog(d := tempfile.mkdtemp())
        >>> cat.save_progress(JobState.FINISHED, {1, 0}, 1.0, 2.0)
        >>> prog = cat.load_progress()
        >>> prog["state"] is JobState.FINISHED, prog["done"]
        (True, [0, 1])
        >>> cat.close(); shutil.rmtree(d)
        """
        prog = self._get(b"progress", {"state": "running", "done": [], "started_at": 0.0, "finished_at": 0.0})
        return {**prog, "state": JobState(prog["state"])}

    def save_gc_marks(self, marks: dict[int, int]) -> None:
        """The highest GC mark per producer stage, saved *before* the hosts are told to trim to
        it: a saved mark is never below one applied, so a restarted master that trusts it may
        think logs trimmed that are not (and refuse a rebuild from the start), never the reverse."""
        if self.closed:
            return
        put_all(self.env, [(b"gc_marks", _pack({str(k): int(v) for k, v in marks.items()}))], store="master catalog")

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
        put_all(self.env, [(b"migration", _pack({"request": request, "transfers": transfers}))],
                store="master catalog")

    def load_migration(self) -> tuple[str | None, list[dict[str, Any]]]:
        """The migration a dead master left in progress (see ``save_migration``)."""
        d = self._get(b"migration", {"request": None, "transfers": []})
        return d["request"], d["transfers"]

    def save_request(self, request: str, result: Any) -> None:
        """The result of a control request, so a retried call (the master restarted) returns it."""
        if self.closed or not request:
            return
        put_all(self.env, [(b"request:" + request.encode(), _pack(result))], store="master catalog")

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
        items: list[tuple[bytes, Any]] = []
        for sink_id, table, index in packed.groups:
            # The rows go to lmdb as the IPC buffer is written (lmdb copies it into its page):
            # their own key, beside a small msgpack header, so no copy into bytes comes first.
            items.append((b"sink:%012d" % self.sink_keys, _pack([sink_id, index.tobytes()])))
            items.append((b"sinkrows:%012d" % self.sink_keys, stream_buffer(table)))
            self.sink_keys += 1
        put_all(self.env, items, store="master catalog")

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
                    sink_id, index = _unpack(value)
                    rows = txn.get(b"sinkrows:" + key[len(b"sink:"):])
                    if rows is None:
                        raise CatalogError(f"{self.path}: memory-sink part {key.decode()} has no rows")
                    groups.append((sink_id, read_stream(rows),
                                   np.frombuffer(index, dtype=np.int64).reshape(-1, 3)))
        return groups

    def add_event(self, seq: int, event: tuple[float, str, dict[str, Any]], forget: Iterable[int] = ()) -> None:
        """One timeline event (kept in order by ``seq``); the events numbered ``forget`` go
        (the timeline's bound, ``master.timeline``)."""
        if self.closed:
            return  # the job was stopped: late reports are not kept
        put_all(self.env, [(b"event:%012d" % seq, _pack(list(event)))], store="master catalog")
        self.forget_events(forget)

    def forget_events(self, seqs: Iterable[int]) -> None:
        """Delete the timeline events numbered ``seqs``."""
        seqs = list(seqs)
        if seqs and not self.closed:
            with self.env.begin(write=True) as txn:
                for seq in seqs:
                    txn.delete(b"event:%012d" % seq)

    def load_events(self) -> list[tuple[float, str, dict[str, Any]]]:
        """The saved timeline."""
        return [event for _, event in self.load_numbered_events()]

    def load_numbered_events(self) -> list[tuple[int, tuple[float, str, dict[str, Any]]]]:
        """The saved timeline, each event with its number."""
        out = []
        with self.env.begin() as txn:
            cur = txn.cursor()
            if cur.set_range(b"event:"):
                for key, value in cur:
                    if not key.startswith(b"event:"):
                        break
                    t, kind, info = _unpack(value)
                    out.append((int(key[len(b"event:"):]), (t, kind, info)))
        return out

    def close(self) -> None:
        """Close the environment (later saves are ignored)."""
        self.closed = True
        self.env.close()
