"""Owns the shared ways this package writes to lmdb: a batch of puts in one transaction (growing the map
when full) behind a free-disk guard, deleting every key under a prefix, and handing written pages back
to the OS.

The guard (``ensure_room``): every store that writes through ``put_all`` first looks at its disk's
free space (one ``statvfs``) and refuses, with a ``StoreFullError`` naming the store and its path,
a transaction that would leave less than ``STORE_DISK_RESERVE`` after writing twice its bytes
(lmdb copies the pages a transaction touches before it frees the old ones). A store opened with
``writemap`` writes through a shared mapping of a sparse file: on a full disk a write there is a
SIGBUS that kills the process, so the check must come before the transaction, never after."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from pathlib import Path
from typing import Callable, Iterable

import lmdb

from chronostream.slices.errors import StoreFullError

#: Free disk every lmdb store leaves (``ensure_room``), above twice what a transaction writes.
STORE_DISK_RESERVE = 4 << 20


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged process may still write on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def ensure_room(store: str, path: str | os.PathLike, nbytes: int) -> None:
    """Raise ``StoreFullError`` (naming ``store`` and ``path``) unless writing ``nbytes`` through lmdb
    leaves ``STORE_DISK_RESERVE`` free on ``path``'s disk (see the module docstring)."""
    free = free_bytes(path)
    need = 2 * nbytes + STORE_DISK_RESERVE
    if free < need:
        raise StoreFullError(
            store, str(path),
            f"the {store} at {path} refuses a write of {nbytes} bytes: its disk has {free} bytes free, and it "
            f"keeps {need} (twice the write and {STORE_DISK_RESERVE >> 20} MB); free disk, or run the job "
            "with workdir= on a larger disk")


def put_all(env: lmdb.Environment, items: Iterable[tuple[bytes, bytes]],
            resize_lock: threading.Lock | None = None, store: str = "lmdb store") -> None:
    """Write every (key, value) in one transaction; double ``map_size`` and retry when the map is full.

    ``map_size`` is address space, not disk, so growing it is cheap. LMDB
    allows the resize only while no transaction is open in the process:
    readers in other threads hold ``resize_lock`` for their transactions.
    A write the disk has no room for is refused before it starts (``ensure_room``; ``store``
    names the store in the error), and a disk that fills meanwhile (lmdb's ``ENOSPC``, or ``EIO`` from its commit) raises
    the same ``StoreFullError``.
    """
    items = list(items)
    if not items:
        return
    path = env.path()
    ensure_room(store, path, sum(len(k) + len(v) for k, v in items))
    while True:
        try:
            with env.begin(write=True) as txn:
                for k, v in items:
                    txn.put(k, v)
            return
        except lmdb.MapFullError:
            with resize_lock if resize_lock is not None else contextlib.nullcontext():
                env.set_mapsize(env.info()["map_size"] * 2)
        except lmdb.Error as exc:
            # A disk that filled meanwhile (another process wrote to it) fails lmdb's commit
            # with ENOSPC or EIO: said as the store's full disk when it is one.
            if isinstance(exc, lmdb.DiskError) or free_bytes(path) < STORE_DISK_RESERVE:
                raise StoreFullError(store, path, f"the {store} at {path}: its disk is full ({exc})") from exc
            raise


def delete_prefix(txn: lmdb.Transaction, prefix: bytes) -> int:
    """Delete every key starting with ``prefix`` in the write transaction ``txn``; return how many."""
    cur = txn.cursor()
    dead = []
    if cur.set_range(prefix):
        for key in cur.iternext(keys=True, values=False):
            if not key.startswith(prefix):
                break
            dead.append(key)
    for key in dead:
        txn.delete(key)
    return len(dead)


def release_written_pages(env: lmdb.Environment, path: str | os.PathLike) -> None:
    """Write an environment's dirty pages to disk and drop the file's pages from the OS page cache.

    For stores whose contents are also held in memory (a backup store's
    replication buffer): without this, every byte written stayed in the
    page cache too until the kernel needed the memory, and at GB states it
    did, in every process's allocations (one 1 GB ``benchmarks.migration``
    run: 1,698 allocation stalls in direct reclaim, 4,010 compaction
    stalls; none with this). An environment opened with ``writemap`` has
    the pages it wrote mapped in this process, and the kernel keeps mapped
    pages: this process's mappings of the file are advised away first
    (``_unmap_file_pages``; a later read faults what it needs back from
    disk). ``path``: the environment's directory (``subdir=True``, as
    opened here). Where the OS has no ``posix_fadvise`` (macOS) it only
    syncs.
    """
    env.sync(True)  # dirty pages cannot be dropped; py-lmdb releases the GIL while syncing
    if not hasattr(os, "posix_fadvise"):
        return
    data = Path(path) / "data.mdb"
    if env.flags().get("writemap"):
        _unmap_file_pages(data)
    fd = os.open(data, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_MADV_DONTNEED = 4  # Linux


@functools.cache
def _madvise() -> Callable[[int, int, int], int]:
    """libc's ``madvise``, loaded once per process (a page release runs every 64 MB flushed)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def _unmap_file_pages(file: Path) -> int:
    """``madvise(MADV_DONTNEED)`` over every mapping of ``file`` in this process; returns how many.

    For a shared file mapping this only drops the page-table entries: the
    data stays in the file (synced before), and the next access faults it
    back in. Linux only (``/proc/self/maps``); elsewhere nothing is done.
    """
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return 0
    target = str(file.resolve())
    madvise = _madvise()
    done = 0
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].rstrip("\n") == target:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
                done += 1
    return done
