"""The host's spill store: cold chunks of slice state on local disk (lmdb), Railgun's event reservoir.

Owns: one lmdb environment per host process (``<workdir>/spill``) and the
per-state ``SpillTier`` views a ``KeyValueState`` spills its cold values to
(``chronostream.slices.state``: ``spill``/``promote``). Which values go cold is the
state library's call (a long queue's middle chunks: immutable, read only
when a window's head reaches them); this module only stores bytes under
``<stage>/<slice>/<state>/`` + the key's encoding, values encoded alike
(``chronostream.slices.codec``: plain data, dates and times, Decimal, Arrow values).

Must not touch: checkpoints. The spill store is a cache of the slice's own
memory, never a source of truth across processes: a checkpoint reads every
cold value back (``KeyValueState.items``), a restore loads everything hot and
the state library re-spills. So the environment is opened without fsync
(``sync=False``): after a crash its contents are discarded (``clear`` of the
slice's prefix when a slice is created here, and the whole directory is per
job and host). It is written through its memory map (``writemap=True``:
writes cost 40% less than through ``write``; the hot-limit jobs of
``benchmarks.spill`` ran 12-13% faster), which makes its file as large as
the map (``SPILL_MAP_SIZE``, sparse: only written pages take disk) and
turns a full disk into a SIGBUS that kills the process. So the store
looks at the free disk every ``DISK_CHECK_BYTES`` it writes and, below
``SPILL_DISK_FLOOR``, refuses the write with a ``StoreFullError`` (a ``RuntimeFault``) that fails
the job naming the directory.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any, Iterable, Iterator

import lmdb

from chronostream.slices import codec
from chronostream.slices.errors import StateEncodingError, StoreFullError

#: Virtual size reserved for the map (sparse: only written pages use disk).
SPILL_MAP_SIZE = 1 << 36
#: Free disk a spill store leaves: a write that would leave less fails the job (``StoreFullError``, a ``RuntimeFault``).
SPILL_DISK_FLOOR = 256 << 20
#: Bytes written between two looks at the free disk (one ``statvfs`` each).
DISK_CHECK_BYTES = 16 << 20


_packers = threading.local()


def _pack(obj: Any) -> bytes:
    # One Packer per thread, reused: msgpack.packb builds one per call, which cost two thirds
    # of a key's encoding (0.42 against 0.15 us for a window's chunk key), and every read of
    # a key not in memory encodes it. Per thread: slices of one host run on several (scale-up).
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = codec.packer()
    try:
        return packer.pack(obj)
    except StateEncodingError:
        raise
    except (TypeError, OverflowError, ValueError):  # an int beyond 64 bits, a cycle: the codec says which
        return codec.packb(obj)


def _unpack(raw: bytes) -> Any:
    return codec.unpackb(raw, use_list=True)


class SpillStore:
    """One lmdb environment holding the cold values of every slice on this host.

    >>> store = SpillStore()  # a temporary directory, opened on the first spill
    >>> tier = store.tier(1, 3, "window.events")
    >>> tier.put(("c", "card1", 4), [[1, 2.5], [3, 1.0]])
    >>> tier.get(("c", "card1", 4)), store.entries()
    ([[1, 2.5], [3, 1.0]], 1)
    >>> tier.pop(("c", "card1", 4)), store.entries()
    ([[1, 2.5], [3, 1.0]], 0)
    """

    def __init__(self, path: str | Path | None = None) -> None:
        # Opened on the first spill: a job whose queues never grow long writes nothing.
        # Without a path, a temporary directory, removed with the store.
        self.path = Path(path) if path is not None else None
        self.env: Any = None
        self._write = threading.RLock()  # slices of one host run on several threads (scale-up)
        self._unchecked = DISK_CHECK_BYTES  # bytes written since the free disk was last seen (the first write looks)

    def opened(self) -> Any:
        """The lmdb environment, opened (and its directory made) on first use."""
        return self.env if self.env is not None else self._open()

    def _open(self) -> Any:
        with self._write:
            if self.env is None:
                if self.path is None:
                    self.path = Path(tempfile.mkdtemp(prefix="chronostream-spill-"))
                    weakref.finalize(self, shutil.rmtree, str(self.path), True)
                self.path.mkdir(parents=True, exist_ok=True)
                self.env = lmdb.open(str(self.path), map_size=SPILL_MAP_SIZE, sync=False, metasync=False,
                                     max_readers=256, lock=True, writemap=True)
        return self.env

    def reserve(self, nbytes: int) -> None:
        """About to write ``nbytes``: every ``DISK_CHECK_BYTES``, a look at the free disk; a
        ``StoreFullError`` when the write would leave less than ``SPILL_DISK_FLOOR``. Called
        under the write lock, after ``opened``."""
        self._unchecked += nbytes
        if self._unchecked < DISK_CHECK_BYTES:
            return
        free = shutil.disk_usage(self.path).free
        if free - self._unchecked < SPILL_DISK_FLOOR:
            raise StoreFullError(
                "spill store", str(self.path),
                f"the spill store at {self.path} would leave {max(free - self._unchecked, 0) >> 20} MB free on its "
                f"disk, below the {SPILL_DISK_FLOOR >> 20} MB it keeps: give the states larger hot_entries, free "
                "disk, or run the job with workdir= on a larger disk")
        self._unchecked = 0

    def tier(self, stage_id: int, slice_id: int, state: str) -> SpillTier:
        """The view of one slice's state ``state``."""
        # ('/' escaped: a state "a/b" must not fall under the prefix of a state "a")
        return SpillTier(self, f"{stage_id}/{slice_id}/{state.replace('%', '%25').replace('/', '%2F')}/".encode())

    def tiers_for(self, stage_id: int, slice_id: int) -> Any:
        """A factory ``state name -> SpillTier`` for one slice; drops what an earlier run of it left."""
        self.clear_prefix(f"{stage_id}/{slice_id}/".encode())
        return lambda state: self.tier(stage_id, slice_id, state)

    def clear_prefix(self, prefix: bytes) -> int:
        """Delete every entry under ``prefix``; returns how many."""
        if self.env is None and (self.path is None or not (self.path / "data.mdb").exists()):
            return 0  # nothing was ever spilled here
        env, n = self.opened(), 0
        with self._write, env.begin(write=True) as txn:
            cur = txn.cursor()
            if cur.set_range(prefix):
                while cur.key().startswith(prefix):
                    n += 1
                    if not cur.delete():
                        break
        return n

    def entries(self) -> int:
        """How many values are spilled on this host."""
        return 0 if self.env is None else int(self.env.stat()["entries"])

    def disk_bytes(self) -> int:
        """Bytes of the pages in use (leaf + branch + overflow), for metrics."""
        if self.env is None:
            return 0
        st = self.env.stat()
        return int(st["psize"] * (st["leaf_pages"] + st["branch_pages"] + st["overflow_pages"]))

    def close(self) -> None:
        """Close the environment (the directory stays; the next run clears its prefixes)."""
        if self.env is not None:
            self.env.close()
            self.env = None


class SpillTier:
    """One state's cold values: ``put``/``get``/``pop``/``write_many``/``items`` of ``codec``-encoded values."""

    __slots__ = ("prefix", "store")

    def __init__(self, store: SpillStore, prefix: bytes) -> None:
        self.store = store
        self.prefix = prefix

    def _key(self, key: Any) -> bytes:
        return self.prefix + _pack(key)

    def put(self, key: Any, value: Any) -> None:
        """Store ``value`` under ``key`` (replacing any)."""
        self.write_many(((key, value),))

    def get(self, key: Any) -> Any:
        """The value of ``key``; KeyError when absent (a state never asks for a key it did not spill)."""
        with self.store.opened().begin() as txn:
            raw = txn.get(self._key(key))
        if raw is None:
            raise KeyError(f"spilled value {key!r} missing under {self.prefix!r}")
        return _unpack(raw)

    def pop(self, key: Any) -> Any:
        """Read and delete ``key``'s value (a value coming back to memory)."""
        k = self._key(key)
        with self.store._write, self.store.opened().begin(write=True) as txn:
            raw = txn.pop(k)
        if raw is None:
            raise KeyError(f"spilled value {key!r} missing under {self.prefix!r}")
        return _unpack(raw)

    def write_many(self, pairs: Iterable[tuple[Any, Any]], deleted: Iterable[Any] = ()) -> None:
        """Store every (key, value) of ``pairs`` and forget every key of ``deleted`` (absent ones
        are no error), in one transaction: a state's eviction of many values at once. Encoded
        first: a value msgpack refuses, or a disk too full (``reserve``), writes nothing."""
        dead = [self._key(key) for key in deleted]
        packed = [(self._key(key), _pack(value)) for key, value in pairs]
        env = self.store.opened()
        with self.store._write:
            self.store.reserve(sum(len(k) + len(v) for k, v in packed))
            with env.begin(write=True) as txn:
                for k in dead:
                    txn.delete(k)
                for k, v in packed:
                    txn.put(k, v)

    def get_or(self, key: Any, default: Any) -> Any:
        """The value of ``key``, or ``default`` when absent (a state asking whether a key is cold)."""
        with self.store.opened().begin() as txn:
            raw = txn.get(self._key(key))
        return default if raw is None else _unpack(raw)

    def contains(self, key: Any) -> bool:
        """Whether ``key`` has a value here."""
        with self.store.opened().begin() as txn:
            return txn.get(self._key(key)) is not None

    def items(self, batch: int = 4096) -> Iterator[tuple[Any, Any]]:
        """Every (key, value) of this state, in key-bytes order (keys decoded with tuples for
        arrays, as state keys are), read ``batch`` entries per transaction: no transaction is
        open while the caller holds an entry, so it may write to the store meanwhile (what it
        writes behind the cursor is not seen, what it writes ahead may be)."""
        p, n = self.prefix, len(self.prefix)
        start, skip = p, False
        while True:
            rows: list[tuple[bytes, bytes]] = []
            with self.store.opened().begin() as txn:
                cur = txn.cursor()
                if cur.set_range(start):
                    for k, raw in cur:
                        if not k.startswith(p):
                            break
                        if skip and k == start:
                            continue
                        rows.append((k, raw))
                        if len(rows) == batch:
                            break
            for k, raw in rows:
                yield codec.unpackb(k[n:], use_list=False), _unpack(raw)
            if len(rows) < batch:
                return
            start, skip = rows[-1][0], True

    def clear(self) -> int:
        """Forget every value of this state; returns how many."""
        return self.store.clear_prefix(self.prefix)
