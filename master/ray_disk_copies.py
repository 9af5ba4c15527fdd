"""Owns the backup copies a restarted master finds on disk: the stores of the hosts it found dead.

A host keeps its peers' checkpoints in an lmdb store under the job's work
directory (``host-<id>/backups``, ``containers.backup_store``). When every
process of a job died (the driver, the master, every host, Ray itself), those
files are all that is left of the slices' state. A master restarted on the
job's catalog (``chronostream resume WORKDIR``) opens the store of each host it
did not find, once, at the first recovery it plans, with one
``DiskBackupReader`` actor on its own node, and offers each slice's newest copy
among them to the recovery as one holder, ``DISK_HOLDER`` (-2): like a
savepoint (``SAVEPOINT_HOLDER``, -1), it hands its copies over and adopts
nothing (``master.recovery.plan_recovery``).

Why the copies on disk are recent enough: a host flushes its replication
buffer to lmdb before it reports the epochs the GC trims output logs by
(``ResourceContainer.backup_epochs``), so each store on disk holds every
slice's copy at least as new as the GC relied on; the planner refuses a copy
older than its producers' trimmed logs all the same (``restore_floor``).

The reader stays for the job's life (the restored slices' only copies until
their first checkpoints reach live peers); ``release`` ends it at the stop.
Reads only: nothing here writes to a dead host's store.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from chronostream.containers.backup_store import BackupStore
from chronostream.containers.ray_backup_host import to_wire
from chronostream.slices.checkpoint import CheckpointCorrupt, encode

SliceKey = tuple[int, int]  # (stage id, slice id)

#: The holder id of the stores on disk (below ``SAVEPOINT_HOLDER``, -1): one holder for them all.
DISK_HOLDER = -2


def store_path(workdir: str, host_id: int) -> Path:
    """Where host ``host_id`` of the job in ``workdir`` keeps its backup store
    (``ResourceContainer``'s ``host-<id>/backups``; made of a number, never of a name read from disk)."""
    return Path(workdir) / f"host-{int(host_id)}" / "backups"


class DiskStores:
    """Dead hosts' backup stores, read back from their lmdb files, handing each slice's newest
    verified copy among them to the hosts that restore it (``HostBackups.fetch`` calls
    ``backup_bytes``) as a live holder would. Knows no Ray: ``DiskBackupReader`` is its actor,
    one process for every store (a resume starts it once, not once per dead host).

    >>> import tempfile, shutil
    >>> from chronostream.slices.checkpoint import SliceCheckpoint
    >>> a, b = BackupStore(da := tempfile.mkdtemp()), BackupStore(db := tempfile.mkdtemp())
    >>> a.put(encode(SliceCheckpoint(1, 0, 4, "full", -1, {}, {0: 9}))); a.close()
    >>> b.put(encode(SliceCheckpoint(1, 0, 6, "full", -1, {}, {0: 13}))); b.close()
    >>> stores = DiskStores({0: da, 1: db})
    >>> stores.catalog()
    ([(1, 0, 6)], [])
    >>> from chronostream.slices.checkpoint import decode
    >>> decode(stores.backup_bytes(1, 0)).next_seq
    {0: 13}
    >>> stores.close(); shutil.rmtree(da); shutil.rmtree(db)
    """

    def __init__(self, paths: dict[int, str]) -> None:
        self.stores = {h: BackupStore(p) for h, p in sorted(paths.items())}

    def catalog(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, str]]]:
        """(stage, slice, epoch) of each slice's newest verified copy among the stores, and the
        damaged ones (``BackupStore.catalog``, naming the host)."""
        newest: dict[SliceKey, int] = {}
        bad = []
        for h, store in self.stores.items():
            good, damaged = store.catalog()
            for st, sl, epoch in good:
                newest[(st, sl)] = max(epoch, newest.get((st, sl), -1))
            bad += [(st, sl, f"host {h}'s store on disk: {error}") for st, sl, error in damaged]
        return [(st, sl, e) for (st, sl), e in sorted(newest.items())], bad

    def backup_bytes(self, stage_id: int, slice_id: int, with_outputs: bool = False) -> Any:
        """The newest merged, verified full copy of a slice among the stores, encoded (and its
        carried-outputs frames); a copy found damaged now gives way to the next newest."""
        held = [s for s in self.stores.values() if (stage_id, slice_id) in s.chains]
        errors = []
        for store in sorted(held, key=lambda s: -s.newest.get((stage_id, slice_id), -1)):
            try:
                data = to_wire(encode(store.latest(stage_id, slice_id)))
            except CheckpointCorrupt as exc:
                errors.append(str(exc))
                continue
            outs = [to_wire(b) for b in store.carried_outputs(stage_id, slice_id)]
            return (data, outs) if with_outputs else data
        raise KeyError(f"no sound copy of stage {stage_id} slice {slice_id} on disk" +
                       (f" ({'; '.join(errors)})" if errors else ""))

    def close(self) -> None:
        """Close the stores without writing to them."""
        for store in self.stores.values():
            store.close(flush=False)


#: ``DiskStores`` as a Ray actor, on the restarted master's node (where the work directory is).
DiskBackupReader = ray.remote(num_cpus=0)(DiskStores)


class DiskCopies:
    """The on-disk copies of one restarted ``JobMaster`` (``master``)."""

    def __init__(self, master: Any) -> None:
        self.m = master
        self.found_dead: set[int] = set()  # hosts of the catalog a restarted master did not find
        self.reader: Any = None  # the DiskBackupReader of their stores
        self.copies: dict[SliceKey, int] | None = None  # (once read) -> epoch of the newest copy
        self.damaged: dict[SliceKey, list[str]] = {}

    async def open(self) -> None:
        """Open the store of every host found dead (once, with one reader) and read its catalog."""
        m = self.m
        if self.copies is not None:
            return
        self.copies = {}
        stores = {h: store_path(m.workdir, h) for h in sorted(self.found_dead)}
        paths = {h: str(p) for h, p in stores.items() if (p / "data.mdb").exists()}
        if not paths:
            return
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.reader = DiskBackupReader.options(scheduling_strategy=here).remote(paths)
        good, bad = await self.reader.catalog.remote()
        self.copies = {(st, sl): epoch for st, sl, epoch in good}
        for st, sl, error in bad:
            self.damaged.setdefault((st, sl), []).append(error)
        m._event("disk_copies_opened", hosts=sorted(paths), slices=len(self.copies))

    async def recovery_copies(self, lost: dict[int, tuple[int, list[int]]]
                              ) -> tuple[dict[SliceKey, tuple[int, int]], dict[SliceKey, list[str]]]:
        """(stage, slice) -> (``DISK_HOLDER``, epoch) of every lost slice some store on disk
        holds, and the damaged copies found there."""
        if not self.found_dead:
            return {}, {}
        await self.open()
        assert self.copies is not None
        keys = {(st, s) for st, slices in lost.values() for s in slices}
        return ({k: (DISK_HOLDER, e) for k, e in self.copies.items() if k in keys},
                {k: v for k, v in self.damaged.items() if k in keys})

    def holder(self, holder: int) -> Any:
        """The handle of a backup holder: a host's, the stores on disk's, or the savepoint's."""
        if holder == DISK_HOLDER:
            return self.reader
        return self.m.savepoints.holder(holder)

    async def release(self) -> None:
        """The job stops: the reader closes the stores and goes."""
        reader, self.reader = self.reader, None
        if reader is not None:  # (one that does not answer is killed all the same)
            await asyncio.wait([asyncio.ensure_future(reader.close.remote())], timeout=10)
            ray.kill(reader)
