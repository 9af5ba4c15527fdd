"""The ResourceContainer Ray actor: a thin async shell around ``ContainerCore``.

Owns: moving messages (non-blocking pushes to downstream containers, one per
container pair per epoch), the backpressure bounds, heartbeats and progress
reports to the master. All state changes happen in the core.

Backpressure: a container accepts a push for epoch ``e`` only when
``e < next_epoch + max_inflight_epochs`` (the push call waits otherwise),
and a sender keeps at most ``max_inflight_epochs`` unacknowledged pushes per
destination. A slow stage therefore slows its producers, and memory holds
at most that many epochs per channel.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray

from chronostream.dag import JobPlan
from containers.backup_store import BackupStore
from containers.core import ContainerCore, ContainerStatistics, Message
from containers.output_log import OutputLog
from containers.routing import OutputRoute

log = logging.getLogger("chronostream.container")


def _warm_up() -> None:
    """Pay lazy imports now, not in the first epoch: pyarrow imports pandas
    (when installed) on its first numpy conversion, which takes about a second."""
    import numpy as np
    import pyarrow.compute as pc

    arr = pa.array(["a", "b", "a"])
    np.asarray(pc.dictionary_encode(arr).indices)
    np.asarray(pa.chunked_array([pa.array([1, 2])]))
    pa.Table.from_pylist([{"a": 1}]).to_pylist()


@ray.remote(num_cpus=0)
class ResourceContainer:
    """Hosts the slices of one stage on one Ray worker process."""

    def __init__(self, container_id: int, master: Any, workdir: str, heartbeat_s: float = 0.5) -> None:
        self.container_id = container_id
        self.master = master
        self.workdir = Path(workdir) / f"container-{container_id}"
        self.heartbeat_s = heartbeat_s
        self.core: ContainerCore | None = None
        self.peers: dict[int, Any] = {}
        self.window = 4
        self.cond: asyncio.Condition | None = None
        self.stopped = False
        self.failed: BaseException | None = None
        self._tasks: list[asyncio.Task] = []
        self.poll_s = 0.05

    async def configure(self, plan: JobPlan, stage_id: int, local_slices: list[int],
                        routes: dict[int, OutputRoute], senders: set[int], peers: dict[int, Any],
                        source_table: pa.Table | None, max_inflight_epochs: int, output_log: bool,
                        backup_peers: dict[int, list[int]] | None = None, checkpoint_every: int = 0,
                        full_checkpoint_every: int = 8) -> str:
        """Build the core: slices, routing tables, output log and sink writers. Returns the node id."""
        writers = {s.sink_id: s.sink.writer(f"c{self.container_id}") for s in plan.sinks
                   if plan.streams[s.stream_id].stage_id == stage_id}
        dl = plan.dead_letter_sink.writer(f"c{self.container_id}") if plan.dead_letter_sink is not None else None
        olog = OutputLog(self.workdir / "output-log") if output_log else None
        store = BackupStore(self.workdir / "backups") if checkpoint_every else None
        self.core = ContainerCore(plan, stage_id, self.container_id, local_slices, routes, senders,
                                  source_table=source_table, output_log=olog, sink_writers=writers,
                                  dead_letter_writer=dl, backup_peers=backup_peers,
                                  checkpoint_every=checkpoint_every, full_checkpoint_every=full_checkpoint_every,
                                  backup_store=store)
        self.peers = peers
        self.window = max_inflight_epochs
        self.cond = asyncio.Condition()
        _warm_up()
        return ray.get_runtime_context().get_node_id()

    async def start(self) -> None:
        """Start processing (and heartbeats)."""
        self._tasks.append(asyncio.get_running_loop().create_task(self._run()))
        self._tasks.append(asyncio.get_running_loop().create_task(self._heartbeats()))

    async def push(self, epoch: int, sender: int, message: Message) -> bool:
        """Receive one epoch message from an upstream container (waits while the inbox is full)."""
        core, cond = self.core, self.cond
        assert core is not None and cond is not None
        async with cond:
            await cond.wait_for(lambda: epoch < core.next_epoch + self.window or self.stopped)
            accepted = core.deliver(epoch, sender, message)
            cond.notify_all()
        return accepted

    async def _run(self) -> None:
        core, cond = self.core, self.cond
        assert core is not None and cond is not None
        inflight: dict[int, collections.deque] = {c: collections.deque() for c in core.destinations}
        try:
            while not core.done and not self.stopped:
                async with cond:
                    while not (core.ready() or self.stopped):
                        if core.reader is not None:
                            # A followed source log: nothing will notify; poll it.
                            core.poll_source()
                            try:
                                await asyncio.wait_for(cond.wait(), self.poll_s)
                            except asyncio.TimeoutError:
                                pass
                        else:
                            await cond.wait()
                    if self.stopped:
                        break
                    epoch = core.next_epoch
                    t0 = time.perf_counter()
                    messages = core.step()
                    core.busy_s += time.perf_counter() - t0
                    cond.notify_all()  # next_epoch moved: blocked pushes may proceed
                for dst, msg in messages.items():
                    inflight[dst].append(self.peers[dst].push.remote(epoch, self.container_id, msg))
                for peer, blobs in core.take_backups().items():
                    inflight.setdefault(peer, collections.deque()).append(
                        self.peers[peer].receive_backups.remote(blobs))
                for dq in inflight.values():
                    while len(dq) > self.window:
                        await dq.popleft()
                await asyncio.sleep(0)
            for dq in inflight.values():
                while dq:
                    await dq.popleft()
            if not self.stopped:
                await self.master.container_done.remote(self.container_id, core.statistics())
        except Exception as exc:  # noqa: BLE001 - report every failure to the master
            self.failed = exc
            log.error("container %s failed: %s", self.container_id, exc)
            try:
                await self.master.container_failed.remote(self.container_id, exc)
            except Exception:  # noqa: BLE001
                pass

    async def _heartbeats(self) -> None:
        while not self.stopped:
            try:
                if self.core.backup_store is not None:
                    self.core.backup_store.flush()  # lazy persistence of the replication buffer
                self.master.heartbeat.remote(self.container_id, self.core.statistics())
            except Exception:  # noqa: BLE001 - the master may be restarting
                pass
            await asyncio.sleep(self.heartbeat_s)

    async def receive_backups(self, blobs: list[bytes]) -> None:
        """Checkpoints of a peer's slices (kept in the replication buffer, flushed lazily)."""
        self.core.receive_backups(blobs)

    async def backups_held(self) -> list[tuple[int, int, int]]:
        """(stage, slice, epoch) of every backup this container holds (after a flush to lmdb)."""
        store = self.core.backup_store
        if store is None:
            return []
        store.flush()
        return [(st, sl, store.latest_epoch(st, sl)) for st, sl in store.holds()]

    async def backup_bytes(self, stage_id: int, slice_id: int) -> bytes:
        """The merged, verified full backup of a peer's slice, encoded."""
        from slices.checkpoint import encode

        return encode(self.core.backup_store.latest(stage_id, slice_id))

    async def slice_snapshot(self, slice_id: int) -> bytes:
        """A full checkpoint of a local slice now (does not start a new delta)."""
        from slices.checkpoint import capture, encode

        core = self.core
        return encode(capture(core.slices[slice_id], delta=False, epoch=core.next_epoch - 1, clear=False))

    async def statistics(self) -> ContainerStatistics:
        """Counters of this container."""
        return self.core.statistics()

    async def collect(self, sink_id: int) -> pa.Table | None:
        """Rows a memory sink of this container holds."""
        writer = self.core.sink_writers.get(sink_id)
        return writer.collect() if writer is not None else None

    async def collect_dead_letters(self) -> pa.Table | None:
        """Dead letters held by this container's memory dead-letter sink."""
        w = self.core.dead_letter_writer
        return w.collect() if w is not None else None

    async def read_output_log(self, stream_id: int, slice_id: int, after_seq: int = -1) -> pa.Table:
        """Replay read: rows of (stream, slice) with out_seq > ``after_seq`` from the output log."""
        if self.core.output_log is None:
            raise RuntimeError("this job runs without an output log")
        return self.core.output_log.read(stream_id, slice_id, after_seq)

    async def stop(self, cleanup: bool = False) -> None:
        """Stop processing; pending pushes are released. ``cleanup`` deletes the local store."""
        self.stopped = True
        if self.cond is not None:
            async with self.cond:
                self.cond.notify_all()
        if cleanup:
            for t in self._tasks:
                t.cancel()
            if self.core is not None and self.core.output_log is not None:
                self.core.output_log.close()
            if self.core is not None and self.core.backup_store is not None:
                self.core.backup_store.close(flush=False)
            shutil.rmtree(self.workdir, ignore_errors=True)
