"""A host's side of the backup chains: receiving peers' checkpoints, answering reads, GC, restores.

Owns the calls on this host's ``BackupStore`` (all on its one store thread,
in call order), frames arriving in pieces, and fetching a slice's newest
verified restore point from its holders (own store first) for a restore.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, NamedTuple

import numpy as np
from ray.exceptions import RayActorError

from chronostream.containers.backup_store import BackupStore
from chronostream.slices.checkpoint import CheckpointCorrupt, RestorePoint, decode, decode_outputs, encode
from chronostream.slices.errors import RecoveryError, StoreFullError

log = logging.getLogger("chronostream.container")


def to_wire(frame: bytes | memoryview) -> bytes | np.ndarray:
    """A frame as a Ray argument or result: bytes as they are; a large frame (a memoryview,
    which does not pickle) as a uint8 array, which Ray moves out of band, without copying."""
    return frame if isinstance(frame, bytes) else np.frombuffer(frame, np.uint8)


def from_wire(frame: bytes | np.ndarray) -> bytes | memoryview:
    """A frame received from Ray: arrays (read-only, in the object store) viewed in place."""
    return memoryview(frame) if isinstance(frame, np.ndarray) else frame


class Fetched(NamedTuple):
    """A slice's restore point as ``HostBackups.fetch`` found it."""

    point: RestorePoint
    rejected: list[tuple[int, str]]  # (holder, why) of each copy refused
    nbytes: int  # bytes read (checkpoint and carried outputs)
    holder: int | None  # the host whose copy was restored (None: rebuilt from the start)


class HostBackups:
    """The backup store calls of one ``ResourceContainer`` host (``host``)."""

    def __init__(self, host: Any) -> None:
        self.h = host

    async def receive(self, blobs: list[bytes]) -> list[tuple[int, int]]:
        """Checkpoints of a peer's slices (kept in the replication buffer, flushed lazily).

        Returns the (stage, slice) pairs whose delta was refused (no sound
        chain to extend here): their sender's next checkpoint is a full one.
        A host of a job without checkpoints opens its store on the first
        migration snapshot it receives.
        """
        h = self.h
        if h.backup_store is None:
            h.backup_store = BackupStore(h.workdir / "backups")
        store = h.backup_store
        # Large checkpoints arrive as read-only uint8 arrays in the object store (``CheckpointShipping.send_backups``):
        # kept as views, not copied (the store takes any bytes-like frame).
        blobs = [from_wire(b) for b in blobs]
        refused = await self.in_store_thread(lambda: {store.put(b) for b in blobs})
        return sorted(k for k in refused if k is not None)

    async def receive_piece(self, token: tuple[int, int], offset: int, total: int,
                            piece: np.ndarray) -> list[tuple[int, int]]:
        """One piece of a frame shipped in pieces (``CheckpointShipping.send_in_pieces``): copied into the frame's
        buffer here; once the last piece is in, the frame is received like any other.

        ``token`` is (sender host, frame number). Each of a sender's containers ships one
        frame at a time; a frame whose sender died half-way is dropped once it got no piece
        for ``FrameAssembly.IDLE_S`` (``containers/frame_assembly.py``).
        """
        h = self.h
        token = (int(token[0]), int(token[1]))
        buf = h._assembling.buffer_for(token, offset, total, time.monotonic())
        # A copy out of the object store (numpy copies without the GIL): the piece is freed there.
        await asyncio.to_thread(np.copyto, buf[offset:offset + len(piece)], piece)
        whole = h._assembling.filled(token, offset + len(piece), time.monotonic())
        return [] if whole is None else await self.receive([whole])

    async def in_store_thread(self, fn):
        h = self.h
        return await asyncio.get_running_loop().run_in_executor(h._store_thread, fn)

    async def catalog(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, str]]]:
        """Verified (stage, slice, epoch) of every backup held, and the damaged ones.

        What the replication buffer holds now: a recovery restores from
        memory, so it does not wait for a flush to lmdb.
        """
        h = self.h
        if h.backup_store is None:
            return [], []
        store = h.backup_store
        return await self.in_store_thread(store.catalog)

    async def persisted_epochs(self) -> dict[tuple[int, int], int]:
        """(stage, slice) -> newest checkpoint epoch held, for the master's GC: flushed to lmdb first,
        so the store on disk covers every epoch the GC trims output logs by (a job whose every
        process died goes on from the stores on disk: ``master.ray_disk_copies``). A store that
        cannot be written (full) reports nothing: the GC must not trim by copies only in memory
        (the heartbeats say why and flush again)."""
        store = self.h.backup_store
        if store is None:
            return {}

        def flushed() -> dict[tuple[int, int], int]:
            try:
                store.flush()
            except StoreFullError:
                return {}
            return store.epochs()
        return await self.in_store_thread(flushed)

    async def held(self) -> list[tuple[int, int, int]]:
        """(stage, slice, epoch) of every backup this host holds (after a flush to lmdb)."""
        h = self.h
        if h.backup_store is None:
            return []
        store = h.backup_store
        return await self.in_store_thread(lambda: (store.flush(), store.catalog())[1][0])

    async def bytes_of(self, stage_id: int, slice_id: int, with_outputs: bool = False):
        """The merged, verified full backup of a peer's slice, encoded (and its carried-outputs frames)."""
        h = self.h

        store = h.backup_store
        data, outs = await self.in_store_thread(
            lambda: (encode(store.latest(stage_id, slice_id)), store.carried_outputs(stage_id, slice_id)))
        data, outs = to_wire(data), [to_wire(b) for b in outs]
        return (data, outs) if with_outputs else data

    async def gc(self, low_water: dict[int, int]) -> int:
        """Drop outputs every consumer's checkpoint covers: stage id -> last such epoch."""
        h = self.h
        dropped = 0
        for cid, core in list(h.cores.items()):
            lw = low_water.get(core.stage.stage_id, -1)
            if lw >= 0:
                async with h.conds[cid]:
                    if h.stopped:  # stop() may have closed the logs while this waited
                        return dropped
                    dropped += core.gc(lw)
        if h.backup_store is not None and not h.stopped:
            store = h.backup_store
            dropped += await self.in_store_thread(
                lambda: sum(store.trim_outputs(stage_id, lw) for stage_id, lw in low_water.items() if lw >= 0))
        return dropped

    async def drop(self, keys: list[tuple[int, int]]) -> int:
        """Forget the backups of these (stage, slice) keys: copies off their slice's chain that the
        master's GC found stale (``master.backups.stale_backups``). Returns how many were held."""
        h = self.h
        if h.backup_store is None or h.stopped:
            return 0
        store = h.backup_store
        return await self.in_store_thread(lambda: sum(store.drop(stage_id, slice_id) for stage_id, slice_id in keys))

    async def fetch(self, stage_id: int, slice_id: int, holders: list[tuple[int, Any]]) -> Fetched:
        """The ``RestorePoint`` of the newest verified checkpoint of a slice among ``holders``
        (own store first, no transfer), with the holders refused and the bytes read."""
        h = self.h
        rejected = []
        for holder, actor in holders:
            if actor is None and holder != h.host_id:  # (a holder the master found dead since it planned)
                rejected.append((holder, "the host is dead"))
                continue
            try:
                if holder == h.host_id and h.backup_store is not None:
                    store = h.backup_store

                    def local():
                        ckpt, outs, seed = store.restore_point(stage_id, slice_id)
                        return ckpt, [decode_outputs(b) for b in outs], store.size(stage_id, slice_id), seed
                    ckpt, carried, size, seed = await self.in_store_thread(local)
                    return Fetched(RestorePoint(ckpt, carried, seed), rejected, size, holder)
                data, outs = await actor.backup_bytes.remote(stage_id, slice_id, with_outputs=True)
                data, outs = from_wire(data), [from_wire(b) for b in outs]
                decoded = await asyncio.to_thread(lambda: (decode(data, "backup"), [decode_outputs(b) for b in outs]))
                return Fetched(RestorePoint(decoded[0], decoded[1], [data, *outs]), rejected,
                               len(data) + sum(len(b) for b in outs), holder)
            except (CheckpointCorrupt, KeyError, RayActorError) as exc:
                rejected.append((holder, str(exc)))
        if holders:
            name = h.plan.stages[stage_id].name if h.plan else stage_id
            raise RecoveryError(f"no usable backup of stage {name!r} slice {slice_id}: "
                                + "; ".join(f"on host {holder}: {why}" for holder, why in rejected))
        return Fetched(RestorePoint(None, [], []), rejected, 0, None)

    async def corrupt(self, stage_id: int, slice_id: int, truncate: bool = False) -> bool:
        """Failure injection: damage the backup this host holds of a slice (False when it holds none)."""
        h = self.h
        if h.backup_store is None or (stage_id, slice_id) not in h.backup_store.holds():
            return False
        store = h.backup_store
        await self.in_store_thread(lambda: store.corrupt(stage_id, slice_id, truncate))
        return True
