"""The ResourceContainer Ray actor: a thin async shell around one or more ``ContainerCore``s.

Owns the host's state (cores, peers, stores, windows) and the calls its
master and peers make; the work is done by one module per topic:
``containers.ray_joining`` (a spare's adoption, ``configure``),
``ray_epoch_loop`` (epoch loops, heartbeats, the master watch),
``ray_pushes`` (moving messages, replays), ``ray_shipping`` (the checkpoint
shipping machine's driver), ``ray_backup_host`` (the backup store's calls,
restores), ``ray_hosting`` (making containers, handovers) and ``ray_savepoints``. All state
changes happen in the cores. An actor is a *host*: it starts with one
container (same id) and adopts more when a recovery gives it a dead
container's slices; it keeps one ``BackupStore`` for the peers it backs up.

Backpressure: a container accepts a push for epoch ``e`` only when
``e < next_epoch + max_inflight_epochs`` (the push call waits otherwise),
and a sender keeps at most ``max_inflight_epochs`` unacknowledged pushes per
destination. A slow stage therefore slows its producers, and memory holds
at most that many epochs per channel.

Checkpoint shipping rule (``containers.shipping``): a checkpoint at epoch C
leaves only after every push of epochs <= C was accepted downstream, and
after the memory-sink rows up to C reached the master.

A push to a container that died raises; the sender then stops sending to it
(what it would have received is in the sender's output log, replayed when
its slices are re-hosted) and tells the master.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import ray

from chronostream.slices.plan import JobPlan
from chronostream.containers.logs import configure_from_env
from chronostream.containers.options import JobOptions
from chronostream.containers.stall_probe import start_from_env as start_stall_probe
from chronostream.containers.backup_store import BackupStore
from chronostream.containers.frame_assembly import FrameAssembly
from chronostream.containers.gc_pacing import CollectorPacing
from chronostream.containers.spill import SpillStore
from chronostream.containers.thread_priority import background_pool, thread_niceness
from chronostream.containers.core import ContainerCore, ContainerStatistics, add_sink_parts
from chronostream.containers.epoch_message import EpochMessage
from chronostream.containers.shm_transport import ShmSender
from chronostream.containers.ray_backup_host import HostBackups, to_wire
from chronostream.containers.ray_epoch_loop import EpochLoop
from chronostream.containers.ray_joining import HostJoining, SpareState
from chronostream.containers.ray_hosting import ContainerHosting, Handover
from chronostream.containers.ray_pushes import HostPushes
from chronostream.containers.routing import OutputRoute
from chronostream.containers.ray_shipping import CheckpointShipping
from chronostream.containers.ray_savepoints import HostSavepoints
from chronostream.containers.sink_parts import PackedSinkParts, pack_sink_parts
from chronostream.slices.checkpoint import capture, encode

log = logging.getLogger("chronostream.container")


@ray.remote(num_cpus=0)
class ResourceContainer:
    """Hosts containers (slices of one or more stages) on one Ray worker process."""

    #: Replay rounds a migration destination gets before it joins the live route anyway
    #: (then backpressure paces this container to it, as for any slow consumer).
    CATCH_UP_ROUNDS = 8
    #: Replayed epochs per ``push_many`` call.
    REPLAY_BATCH = 16

    def __init__(self, host_id: int | None, master: Any, workdir: str, heartbeat_s: float = 0.5) -> None:
        """``host_id`` None: a warm spare (``master.host_pool``), a host of no job until ``adopt``."""
        configure_from_env()
        # CHRONOSTREAM_STALL_MS: see chronostream.containers.stall_probe
        self._stall_probe = start_stall_probe("spare host" if host_id is None else f"host {host_id}")
        # The host's work by topic (one module each), over the state below.
        self.joining = HostJoining(self)
        self.pushes = HostPushes(self)
        self.loops = EpochLoop(self)
        self.shipping = CheckpointShipping(self)
        self.backups = HostBackups(self)
        self.hosting = ContainerHosting(self)
        self.savepoints = HostSavepoints(self)
        self.host_id: int | None = None
        self.container_id: int | None = None
        self.master: Any = None
        self.workdir = Path(workdir)
        self.heartbeat_s = heartbeat_s
        self._lease: asyncio.TimerHandle | None = None  # a spare handed out and not adopted yet
        if host_id is not None:
            self.joining.take_job(host_id, master, workdir, heartbeat_s)
        self.plan: JobPlan | None = None
        self.cores: dict[int, ContainerCore] = {}
        self.conds: dict[int, asyncio.Condition] = {}
        self.peers: dict[int, Any] = {}  # container id -> the actor hosting it
        self.hosts: dict[int, Any] = {}  # host id -> actor (backup peers)
        self.unreachable: set[int] = set()  # containers whose host died (pushes to them stop)
        self.window = 4
        self.extra_window: dict[int, int] = {}  # a catching-up migration destination buffers more epochs
        self.opts = JobOptions()
        # Stage id -> [reference of its in-memory table] (``configure``): a restarted master asks
        # for them (``source_refs``). Nested in a list, so Ray passes the reference, not the table.
        self._source_refs: dict[int, list] = {}
        self.backup_store: BackupStore | None = None
        self.spill_store: SpillStore | None = None  # cold chunks of long queues (JobOptions.spill_state)
        self.stopped = False
        self.failed: BaseException | None = None
        self.delay_s = 0.0  # failure injection: extra time per epoch
        self.frozen: set[int] = set()  # containers paused (the stop-copy baseline of benchmarks.migration)
        self._tasks: list[asyncio.Task] = []
        self._started: set[int] = set()  # containers whose epoch loop runs (start is idempotent)
        # add_container calls by container id: a restarted master runs a recovery's plan again,
        # and a container being restored or running already is not made twice.
        self._adding: dict[int, asyncio.Task] = {}
        # The backup store's heavy work (verify, merge, restore, lmdb) runs on this one thread,
        # in call order, so the event loop keeps serving pushes meanwhile (the store is not
        # thread-safe: one thread only). Like every worker thread of a host, it can run below the
        # epoch loops' priority (JobOptions.background_niceness; it starts on first use).
        self._store_thread = background_pool(1, "backup-store")
        self._piece_seq = 0  # frames this host shipped in pieces (CheckpointShipping.send_in_pieces)
        self._assembling = FrameAssembly()  # frames arriving in pieces (receive_backup_piece)
        self.gc_pacing: CollectorPacing | None = None
        # Compactions in progress here (containers.core.hand_over): new container -> its sources
        # and the handover epoch, and source -> new container.
        self._handovers: dict[int, Handover] = {}
        self._handover_of: dict[int, int] = {}
        # Shared-memory transport (JobOptions.shm_transport): the node of each peer host by actor
        # id (asked once, lazily: until it answers, pushes to it go through Ray), and the files
        # of each push in flight (unlinked when it is acknowledged or failed).
        self._shm: ShmSender | None = None
        self._node_id = ""
        self._peer_node: dict[str, str] = {}
        self._shm_files: dict[Any, list[str]] = {}
        self._store_full_said = False  # a backup flush refused for room was logged (once per episode)
        self._master_heard = time.monotonic()  # last sign of the master (``EpochLoop.watch_master``)

    async def source_refs(self) -> dict[int, list]:
        """The in-memory source tables' references ``configure`` gave (stage id -> [reference])."""
        return dict(self._source_refs)

    async def ready(self) -> str:
        """A spare's warm-up: pay the lazy imports now, before any job needs this process. Returns the node id."""
        return await self.joining.ready()

    async def lease(self, seconds: float) -> None:
        """A spare handed to a master: unless ``adopt`` follows within ``seconds``, the process exits."""
        await self.joining.lease(seconds)

    async def spare_state(self) -> SpareState | None:
        """None once adopted by a job; else a spare's node and whether a take leased it."""
        return await self.joining.spare_state()

    async def adopt(self, host_id: int, master: Any, workdir: str, heartbeat_s: float) -> None:
        """A spare becomes host ``host_id`` of the job ``master`` runs (idempotent for the same id)."""
        await self.joining.adopt(host_id, master, workdir, heartbeat_s)

    async def configure(self, plan: JobPlan, options: JobOptions, source_refs: dict[int, list] | None = None) -> str:
        """Set the job-wide parameters once and keep the source tables' references
        (``HostJoining.configure``). Returns the node id."""
        return await self.joining.configure(plan, options, source_refs)

    async def node(self) -> str:
        """The node this host runs on (a peer asks once before sending it parts in shared memory)."""
        return ray.get_runtime_context().get_node_id()

    async def push(self, container_id: int, epoch: int, sender: int, message: EpochMessage) -> bool:
        """Receive one epoch message for a hosted container (waits while its inbox is full)."""
        return await self.pushes.receive(container_id, epoch, sender, message)

    async def push_many(self, container_id: int, sender: int, messages: list[tuple[int, EpochMessage]]) -> int:
        """Receive a run of epoch messages (a replay) in one call, in order; returns how many were accepted."""
        return await self.pushes.receive_many(container_id, sender, messages)

    async def add_container(self, container_id: int, stage_id: int, slices: list[int],
                            routes: dict[int, OutputRoute], senders: dict[int, frozenset], peers: dict[int, Any],
                            hosts: dict[int, Any], source_table: pa.Table | None, output_log: bool,
                            backup_peers: dict[int, list[int]] | None = None,
                            restore_from: dict[int, list[tuple[int, Any]]] | None = None,
                            hand_over_from: list[int] | None = None) -> dict[str, Any]:
        """Create a container of ``stage_id`` here; with ``restore_from``, rebuild its slices from
        backups; with ``hand_over_from``, wait for a compaction's slices (``ContainerHosting.add``)."""
        return await self.hosting.add(container_id, stage_id, slices, routes, senders, peers, hosts, source_table,
                                      output_log, backup_peers, restore_from, hand_over_from)

    async def remove_container(self, container_id: int) -> None:
        """Drop a hosted container that never joined the placement (an aborted migration destination)."""
        await self.hosting.remove(container_id)

    async def start(self, container_ids: list[int] | None = None) -> None:
        """Start processing the given containers (default: all not started)."""
        loop = asyncio.get_running_loop()
        for c in container_ids if container_ids is not None else list(self.cores):
            if c not in self._started:
                self._started.add(c)
                self._tasks.append(loop.create_task(self.loops.run(c)))

    # -- recovery ------------------------------------------------------------------

    async def add_senders(self, container_id: int, coverage: dict[int, frozenset]) -> None:
        """A hosted container accepts new senders that re-host part of a dead sender's slices."""
        async with self.conds[container_id]:
            self.cores[container_id].add_senders(coverage)
            self.conds[container_id].notify_all()

    async def position(self, container_id: int) -> dict[str, Any] | None:
        """A hosted container's next epoch and its slices' progress vectors (what a recovered
        producer replays to it from: ``replay_to``); None when it is gone or done."""
        core, cond = self.cores.get(container_id), self.conds.get(container_id)
        if core is None or cond is None or core.done:
            return None
        async with cond:  # (between two steps)
            return {"next_epoch": core.next_epoch, "progress": {s: core.progress_of(s) for s in core.slices}}

    async def reroute(self, container_id: int, stage_id: int, slices: list[int], target: int, target_host: Any,
                      progress: dict[int, dict[int, list[int]]], resume: dict[int, int],
                      dual: bool = False) -> dict[str, int]:
        """Send ``slices`` of ``stage_id`` to ``target`` from now on and replay what it is owed;
        with ``dual`` (a migration) the new copy catches up before it joins (``HostPushes.reroute``)."""
        return await self.pushes.reroute(container_id, stage_id, slices, target, target_host, progress, resume, dual)

    async def replay_to(self, container_id: int, stage_id: int, target: int, target_host: Any, upto: int) -> int:
        """A recovered container replays its relogged outputs of epochs before ``upto`` to consumer
        ``target`` from where that consumer is; returns the epochs pushed."""
        return await self.pushes.replay_to(container_id, stage_id, target, target_host, upto)

    async def retarget_backups(self, container_id: int, backup_peers: dict[int, list[int]],
                               hosts: dict[int, Any]) -> None:
        """New backup hosts for a container's slices (the next checkpoints are full ones)."""
        self.hosts.update({h: a for h, a in hosts.items() if a is not None})
        core = self.cores[container_id]
        if core.checkpointer is not None:
            async with self.conds[container_id]:
                core.checkpointer.retarget(backup_peers)

    # -- migration (master.migration; docs/design.md section 7f) ----------------------------

    async def migration_snapshot(self, container_id: int, slices: list[int], to_host_id: int,
                                 to_host: Any) -> dict[str, Any]:
        """Warm-up: ship full checkpoints of a hosted container's ``slices`` to ``to_host``'s backup
        store, their sink rows to the master first (``CheckpointShipping.migration_snapshot``)."""
        return await self.shipping.migration_snapshot(container_id, slices, to_host_id, to_host)

    async def hand_over(self, container_id: int, sources: list[int], not_before: int) -> int:
        """Compaction: the slices of hosted containers ``sources`` go to ``container_id`` at one
        epoch at or after ``not_before``; returns it (``ContainerHosting.hand_over``)."""
        return await self.hosting.hand_over(container_id, sources, not_before)

    async def handover_state(self, container_id: int, cancel: bool = False) -> str:
        """``pending``, ``done`` or ``cancelled``; with ``cancel``, a pending handover is cancelled first."""
        return await self.hosting.handover_state(container_id, cancel)

    async def begin_dual(self, container_id: int, stage_id: int, slices: list[int], target: int,
                         target_host: Any) -> int:
        """A producer sends ``slices`` of ``stage_id`` to ``target`` besides their owner from its next
        epoch on, with no replay (a compaction: ``target`` takes the slices' state in process at
        an epoch at or after this one). Returns that epoch."""
        core, cond = self.cores[container_id], self.conds[container_id]
        await self.pushes.learn_nodes([target_host])  # (before the lock: the container steps on meanwhile)
        async with cond:  # between two steps: an epoch boundary
            self.peers[target] = target_host
            self.unreachable.discard(target)
            core.switch_route(stage_id, slices, target, dual=True)
            return core.next_epoch

    async def release_route(self, container_id: int, stage_id: int, slices: list[int], target: int) -> int:
        """End dual mode in a producer: the slices go to ``target`` only; returns the switch epoch."""
        async with self.conds[container_id]:
            return self.cores[container_id].release_route(stage_id, slices, target)

    async def drop_dual(self, container_id: int, stage_id: int, slices: list[int]) -> None:
        """Abort dual mode in a producer (the migration cannot finish)."""
        async with self.conds[container_id]:
            self.cores[container_id].drop_dual(stage_id, slices)

    async def forget_released(self, container_id: int, old: int, slices: list[int]) -> None:
        """A producer stops marking ``slices`` in its messages to ``old`` (it released them)."""
        async with self.conds[container_id]:
            self.cores[container_id].forget_released(old, slices)

    async def release_slices(self, container_id: int, slices: list[int]) -> None:
        """A source container releases ``slices`` before its next epoch (no upstream marker tells it)."""
        async with self.conds[container_id]:
            self.cores[container_id].request_release(slices)
            self.conds[container_id].notify_all()

    async def freeze(self, container_id: int, on: bool) -> int:
        """Pause (or resume) a hosted container between epochs; its next epoch (``containers.ray_savepoints``)."""
        return await self.savepoints.freeze(container_id, on)

    async def set_extra_window(self, container_id: int, epochs: int) -> None:
        """Let a catching-up migration destination buffer ``epochs`` more epochs (0: back to normal)."""
        self.extra_window[container_id] = epochs
        if container_id in self.conds:
            async with self.conds[container_id]:
                self.conds[container_id].notify_all()

    async def set_threads(self, container_id: int, threads: int) -> dict[str, int]:
        """Its slices run on ``threads`` threads from its next epoch (no state moves)."""
        core = self.cores[container_id]
        version = core.set_threads(threads)
        return {"container": container_id, "threads": threads, "version": version, "from_epoch": core.next_epoch}

    async def migration_state(self, container_ids: list[int], with_times: bool = False) -> dict[int, dict[str, Any]]:
        """Per hosted container: next epoch, done, released slices (and, ``with_times``, when its
        recent epochs finished: the pause measurement)."""
        return self.hosting.migration_state(container_ids, with_times)

    async def arm_savepoint(self, container_ids: list[int], epoch: int) -> dict[int, str]:
        """Capture the slices of ``container_ids`` at the end of ``epoch`` (``containers.ray_savepoints``)."""
        return await self.savepoints.arm(container_ids, epoch)

    async def savepoint_frames(self, container_ids: list[int], timeout_s: float) -> tuple[list[bytes], dict]:
        """The encoded full checkpoints captured for a savepoint, once captured, and the states' kinds."""
        return await self.savepoints.frames(container_ids, timeout_s)

    async def query_state(self, wanted: dict[int, dict[int, list[tuple]]]) -> dict[int, dict[str, Any]]:
        """Container -> slice -> keys: slice -> each state's values of those keys, read between epochs."""
        return await self.savepoints.query(wanted)

    async def drain_sink_parts(self) -> PackedSinkParts:
        """Every memory-sink and dead-letter part this host's containers hold, by sink id (the host is released)."""
        out: dict[int, dict[tuple[int, int], pa.Table]] = {}
        for core in self.cores.values():
            for k, w in core._all_writers().items():
                parts = getattr(w, "parts", None)
                if parts:
                    out.setdefault(k, {}).update(parts)
        return pack_sink_parts(out)

    async def ping(self) -> int:
        """Liveness probe of the master."""
        return self.host_id

    async def thread_priorities(self) -> dict[str, int]:
        """Niceness of the epoch loops' thread and of the background threads (diagnostics, tests):
        under Ray's workers (nice 15) with ``background_niceness=4``, ``{"epoch_loop": 15,
        "backup_store": 19, "worker": 19}``."""
        return {"epoch_loop": thread_niceness(),
                "backup_store": await self.backups.in_store_thread(thread_niceness),
                "worker": await asyncio.to_thread(thread_niceness)}

    async def inject_delay(self, seconds: float) -> float:
        """Failure injection: spend ``seconds`` more per epoch (a slow or overloaded container);
        returns the delay it replaces (the failure harness puts it back after slowing a source)."""
        before, self.delay_s = self.delay_s, seconds
        return before

    # -- backups and reading ------------------------------------------------------------

    async def receive_backups(self, blobs: list[bytes]) -> list[tuple[int, int]]:
        """Checkpoints of a peer's slices; returns the (stage, slice) pairs whose delta was refused."""
        return await self.backups.receive(blobs)

    async def receive_backup_piece(self, token: tuple[int, int], offset: int, total: int,
                                   piece: np.ndarray) -> list[tuple[int, int]]:
        """One piece of a frame shipped in pieces (``HostBackups.receive_piece``)."""
        return await self.backups.receive_piece(token, offset, total, piece)

    async def backup_catalog(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, str]]]:
        """Verified (stage, slice, epoch) of every backup held, and the damaged ones."""
        return await self.backups.catalog()

    async def backups_held(self) -> list[tuple[int, int, int]]:
        """(stage, slice, epoch) of every backup this host holds (after a flush to lmdb)."""
        return await self.backups.held()

    async def backup_bytes(self, stage_id: int, slice_id: int, with_outputs: bool = False):
        """The merged, verified full backup of a peer's slice, encoded (and its carried-outputs frames)."""
        return await self.backups.bytes_of(stage_id, slice_id, with_outputs)

    async def gc(self, low_water: dict[int, int]) -> int:
        """Drop outputs every consumer's checkpoint covers: stage id -> last such epoch."""
        return await self.backups.gc(low_water)

    async def drop_backups(self, keys: list[tuple[int, int]]) -> int:
        """Forget the backups of these (stage, slice) keys (stale copies off their chain)."""
        return await self.backups.drop(keys)

    async def corrupt_backup(self, stage_id: int, slice_id: int, truncate: bool = False) -> bool:
        """Failure injection: damage the backup this host holds of a slice (False when it holds none)."""
        return await self.backups.corrupt(stage_id, slice_id, truncate)

    async def backup_epochs(self) -> dict[tuple[int, int], int]:
        """(stage, slice) -> newest checkpoint epoch held, for the master's GC (``HostBackups.persisted_epochs``)."""
        return await self.backups.persisted_epochs()

    async def slice_snapshot(self, slice_id: int, container_id: int | None = None) -> bytes | np.ndarray:
        """A full checkpoint of a hosted slice now (does not start a new delta); ``from_wire`` reads it."""

        core = self.cores[self.container_id if container_id is None else container_id]
        return to_wire(encode(capture(core.slices[slice_id], delta=False, epoch=core.next_epoch - 1, clear=False)))

    async def statistics(self) -> dict[int, ContainerStatistics]:
        """Counters of every hosted container."""
        return {c: core.statistics() for c, core in self.cores.items()}

    async def metrics(self, container_ids: list[int]) -> dict[int, tuple[ContainerStatistics, list]]:
        """Per hosted container: its statistics and per-slice metrics (events, busy time, backlog, state size)."""
        return {c: (self.cores[c].statistics(), self.cores[c].slice_metrics())
                for c in container_ids if c in self.cores}

    async def recovery_info(self) -> dict[int, dict[str, Any]]:
        """Per hosted container: when each restored slice was restored and first produced output."""
        return {c: {"restored_at": dict(core.restored_at), "first_output_at": dict(core.first_output_at)}
                for c, core in self.cores.items() if core.restored_at}

    async def sink_parts(self, sink_ids: list[int]) -> list[Any]:
        """The (slice, epoch) parts of memory sinks (or dead letters) ``sink_ids`` the hosted
        containers hold, packed (``PackedSinkParts``) and put in the object store by this host:
        [its reference], [] when there are none. The master hands the reference to the reading
        client, so the rows go from here to the client without passing through the master."""
        out: dict[int, dict[tuple[int, int], pa.Table]] = {i: {} for i in sink_ids}
        for core in self.cores.values():
            add_sink_parts(out, core.sink_parts(sink_ids))
        packed = pack_sink_parts(out)
        return [ray.put(packed)] if len(packed) else []

    async def sink_write_times(self, sink_id: int) -> dict[tuple[int, int], float]:
        """(slice, epoch) -> when a memory sink of this host's containers first wrote it (wall time)."""
        out: dict[tuple[int, int], float] = {}
        for core in self.cores.values():
            w = core._all_writers().get(sink_id)
            for k, t in getattr(w, "written_at", {}).items():
                out[k] = min(t, out.get(k, t))
        return out

    async def read_output_log(self, stream_id: int, slice_id: int, after_seq: int = -1,
                              container_id: int | None = None) -> pa.Table:
        """Replay read: rows of (stream, slice) with out_seq > ``after_seq`` from the output log."""
        core = self.cores[self.container_id if container_id is None else container_id]
        if core.output_log is None:
            raise RuntimeError("this job runs without an output log")
        return core.output_log.read(stream_id, slice_id, after_seq)

    async def stop(self, cleanup: bool = False) -> None:
        """Stop processing; pending pushes are released. ``cleanup`` deletes the local store."""
        await self.joining.stop(cleanup)
