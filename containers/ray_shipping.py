"""A host's checkpoint shipments on Ray: the driver of ``containers.shipping.ShippingProtocol``.

Owns carrying out the shipping machine's commands for each hosted container
(the rule itself, in order and after the pushes and the rows, is the
machine's): handing memory-sink rows to the master, sending frames to the
backup peers (large shipments as arrays out of band or in pieces), and
feeding back pushes acknowledged, rows stored, frames taken or refused.
Also the warm-up snapshot of a migration, which follows the same rule.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from ray.exceptions import RayActorError

from chronostream.containers.core import encode_snapshot
from chronostream.containers.shipping import (ForceFull, PartsFailed, PartsStored, PeerFailed, PeerShipped,
                                              RoundEnded, RoundTaken, Settled, ShippingProtocol, StoreRows)
from chronostream.containers.sink_parts import pack_sink_parts

log = logging.getLogger("chronostream.container")


#: Piece size of a shipment above ``JobOptions.ship_piece_bytes`` (see ``send_in_pieces``).
PIECE_BYTES = 64 << 20


class CheckpointShipping:
    """Checkpoint shipments of one ``ResourceContainer`` host (``host``): the Ray driver of one
    ``ShippingProtocol`` per container.

    The epoch loop hands each round over (``take_round``) and goes on stepping; the machine says
    when its rows go to the master and its frames to the peers, and each answer is fed back.
    """

    def __init__(self, host: Any) -> None:
        self.h = host
        self.machines: dict[int, ShippingProtocol] = {}
        self._payload: dict[tuple[int, int], tuple[dict, dict[int, list[bytes]]]] = {}  # (cid, round) ->
        self._drained: dict[int, asyncio.Event] = {}  # set while a container has no open round
        self._running: set[asyncio.Task] = set()  # (kept: the loop holds only weak references)

    def take_round(self, cid: int, epoch: int, pushes: list[tuple[int, Any]], parts: dict,
                   backups: dict[int, list[bytes]], after: list[int] = ()) -> None:
        """Round of container ``cid`` taken after ``epoch``: its memory-sink ``parts``, its frames
        per peer (``backups``), the pushes of its epochs still unacknowledged (``pushes``: (dst,
        reference)) and containers whose open rounds go first (``after``: a compaction's sources)."""
        h = self.h
        machine = self.machines.setdefault(cid, ShippingProtocol(cid))
        number = machine.next_round
        core = h.cores.get(cid)
        if backups and core is not None and core.checkpointer is not None:
            core.checkpointer.unshipped += 1  # (counted down when the round ends)
        self._payload[(cid, number)] = (parts, backups)
        self._drained.setdefault(cid, asyncio.Event()).clear()
        waits = {("push", number, i): self._acknowledged(dst, ref) for i, (dst, ref) in enumerate(pushes)}
        waits.update({("drained", number, c): self.drained(c) for c in after if not self.idle(c)})
        slices = tuple(sorted(core.slices)) if core is not None else ()
        self._feed(cid, RoundTaken(epoch, frozenset(waits), bool(parts), tuple(sorted(backups)), slices))
        for token, wait in waits.items():
            self._spawn(self._settle(cid, token, wait))

    def after(self, cid: int, sources: list[int]) -> None:
        """Container ``cid``'s next rounds go after ``sources``' open rounds (a compaction's receiver:
        the rounds it took over, then its own, reach the peers after the sources' deltas)."""
        if any(not self.idle(c) for c in sources):
            self.take_round(cid, -1, [], {}, {}, after=sources)

    def idle(self, cid: int) -> bool:
        machine = self.machines.get(cid)
        return machine is None or machine.idle

    async def drained(self, cid: int) -> None:
        """Return once container ``cid`` has no open round."""
        while not self.idle(cid):
            await self._drained[cid].wait()

    # -- the machine's commands ----------------------------------------------------------

    def _feed(self, cid: int, event: Any) -> None:
        h = self.h
        for cmd in self.machines[cid].handle(event):
            core = h.cores.get(cid)
            if isinstance(cmd, ForceFull):
                if core is not None and core.checkpointer is not None:
                    core.checkpointer.force_full(list(cmd.slices))
            elif isinstance(cmd, RoundEnded):
                _parts, backups = self._payload.pop((cid, cmd.round))
                if backups and core is not None and core.checkpointer is not None:
                    core.checkpointer.unshipped -= 1
                if self.machines[cid].idle:
                    self._drained[cid].set()
            elif isinstance(cmd, StoreRows):
                self._spawn(self._store_rows(cid, cmd.round))
            else:
                self._spawn(self._ship(cid, cmd.round, cmd.peer))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._running.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        if not task.cancelled() and task.exception() is not None:  # (a broken invariant: a defect)
            log.error("host %s: checkpoint shipping failed: %r", self.h.host_id, task.exception(),
                      exc_info=task.exception())

    async def _acknowledged(self, dst: int, ref: Any) -> None:
        await self.h.pushes.acknowledged(dst, ref)  # (a dead receiver too: its replay covers the push)

    async def _settle(self, cid: int, token: Any, wait: Any) -> None:
        await wait
        self._feed(cid, Settled(token))

    async def _store_rows(self, cid: int, number: int) -> None:
        h = self.h
        parts, _ = self._payload[(cid, number)]
        try:
            await h.master.store_sink_parts.remote(pack_sink_parts(parts))
        except Exception as exc:  # noqa: BLE001 - fed back: the round's frames do not leave
            log.error("host %s: container %s: memory-sink rows of a checkpoint round not stored (%s: %s)",
                      h.host_id, cid, type(exc).__name__, exc)
            self._feed(cid, PartsFailed(number, f"{type(exc).__name__}: {exc}"))
            return
        self.drop_handed_sink_parts(parts)
        self._feed(cid, PartsStored(number))

    async def _ship(self, cid: int, number: int, peer: int) -> None:
        h = self.h
        blobs = self._payload[(cid, number)][1][peer]
        actor = h.hosts.get(peer)
        if actor is None:
            self._feed(cid, PeerFailed(number, peer, dead=True, error="no such host"))
            return
        try:
            refused = await self.send_backups(actor, blobs)
        except RayActorError:
            self._feed(cid, PeerFailed(number, peer, dead=True))
            return
        except Exception as exc:  # noqa: BLE001 - one peer's failure must not stop the others' or later rounds
            log.error("host %s: container %s: %d backup frames to host %s failed (%s: %s)", h.host_id, cid,
                      len(blobs), peer, type(exc).__name__, exc)
            self._feed(cid, PeerFailed(number, peer, dead=False, error=f"{type(exc).__name__}: {exc}"))
            return
        self._feed(cid, PeerShipped(number, peer, tuple(s for _, s in refused)))

    async def send_backups(self, actor: Any, blobs: list[bytes]) -> list[tuple[int, int]]:
        """``actor.receive_backups(blobs)``; large ones go through the object store as arrays,
        and shipments above ``ship_piece_bytes`` in pieces (``send_in_pieces``).

        A list of bytes is pickled in band: putting a 500 MB checkpoint held the GIL for
        about 1 s (every slice of this host stalled) and the receiver copied it out again.
        uint8 arrays (zero-copy views of the bytes) are written out of band in 0.25 s,
        from a worker thread, and the receiver reads them in place.
        """
        h = self.h
        size = sum(len(b) for b in blobs)
        if size > h.opts.ship_piece_bytes:
            return await self.send_in_pieces(actor, blobs, size)
        return await self.send_frames(actor, blobs)

    async def send_frames(self, actor: Any, blobs: list) -> list[tuple[int, int]]:
        h = self.h
        if sum(len(b) for b in blobs) > h.opts.ship_by_reference_bytes or not all(isinstance(b, bytes)
                                                                                  for b in blobs):
            arrays = [np.frombuffer(b, np.uint8) for b in blobs]
            return await actor.receive_backups.remote(await asyncio.to_thread(ray.put, arrays))
        return await actor.receive_backups.remote(blobs)

    async def send_in_pieces(self, actor: Any, blobs: list, size: int) -> list[tuple[int, int]]:
        """Ship ``blobs`` in order, at most ``PIECE_BYTES`` (64 MB) at a time, each awaited: frames
        together up to that size, a larger frame cut into pieces the peer assembles in its own
        memory (``receive_backup_piece``).

        A migrated slice's seed (the frames it was restored from, 1 GB for a 1 GB slice) put
        whole into Ray's 1 GB object store spilled it to disk and stalled every container of
        the job for about 2 s; the peer also kept the frame as a view, pinning it there. Only
        shipments above ``ship_piece_bytes`` (768 MB) take this way: a 500 MB seed in pieces
        took 5.9 s instead of 0.7 s (every piece a round trip, and one more copy at the peer),
        and those runs' delays were worse (370, 100, 484 ms against 79, 101, 76 whole).
        """
        h = self.h
        limit = min(h.opts.ship_piece_bytes, PIECE_BYTES)
        t0 = time.perf_counter()
        refused: set[tuple[int, int]] = set()
        batch: list = []
        batch_bytes = pieces = 0
        for frame in [*blobs, None]:
            if batch and (frame is None or batch_bytes + len(frame) > limit):
                refused.update(tuple(k) for k in await self.send_frames(actor, batch))
                batch, batch_bytes = [], 0
            if frame is None:
                break
            if len(frame) <= limit:
                batch.append(frame)
                batch_bytes += len(frame)
                continue
            h._piece_seq += 1
            token, view = (h.host_id, h._piece_seq), memoryview(frame).cast("B")
            for at in range(0, len(view), limit):
                ref = await asyncio.to_thread(ray.put, np.frombuffer(view[at:at + limit], np.uint8))
                refused.update(tuple(k) for k in await actor.receive_backup_piece.remote(token, at, len(view), ref))
                pieces += 1
        log.info("host %s: shipped %d backup frames, %.0f MB, in %d pieces and shipments of at most %.0f MB "
                 "(%.2f s)", h.host_id, len(blobs), size / 1e6, pieces, limit / 1e6, time.perf_counter() - t0)
        return sorted(refused)

    def drop_handed_sink_parts(self, parts: dict[int, dict[tuple[int, int], pa.Table]]) -> None:
        """The master stored these parts in its catalog: no container here needs their rows any
        more (reads take the master's copy), so they are not held twice. Every container of the
        host is asked: a compaction since the take may have moved the parts to another one."""
        h = self.h
        dropped = sum(core.drop_handed_sink_parts(parts) for core in h.cores.values())
        log.debug("host %s: dropped %d memory-sink parts the master holds", h.host_id, dropped)

    async def migration_snapshot(self, container_id: int, slices: list[int], to_host_id: int,
                                 to_host: Any) -> dict[str, Any]:
        """Warm-up: ship full checkpoints of a hosted container's ``slices`` (and their carried
        outputs) to ``to_host``'s backup store. Taken between two epochs.

        As for a checkpoint round, the slices' memory-sink and dead-letter
        parts up to the snapshot's epoch go to the master before it ships: whatever is restored
        from it (the migration's destination, or a recovery that finds it in that store) makes
        only the epochs after, so those rows must not live only in this process."""
        h = self.h
        core = h.cores[container_id]
        async with h.conds[container_id]:  # captured between two epochs
            captured = core.migration_capture(slices)
            epoch = core.next_epoch - 1
            parts = core.take_sink_parts_of(slices)
        if parts:
            await h.master.store_sink_parts.remote(pack_sink_parts(parts))
            self.drop_handed_sink_parts(parts)
        blobs = await asyncio.to_thread(encode_snapshot, captured)
        if to_host_id == h.host_id:
            await h.backups.receive(blobs)
        else:
            await self.send_backups(to_host, blobs)
        return {"epoch": epoch, "bytes": sum(len(b) for b in blobs)}
