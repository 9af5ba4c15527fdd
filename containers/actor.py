"""The ResourceContainer Ray actor: a thin async shell around one or more ``ContainerCore``s.

Owns: moving messages (non-blocking pushes to downstream containers, one per
container pair per epoch), the backpressure bounds, shipping checkpoints to
backup hosts, heartbeats and reports to the master. All state changes
happen in the cores. An actor is a *host*: it starts with one container
(same id) and adopts more when a recovery gives it a dead container's
slices; it keeps one ``BackupStore`` for the peers it backs up.

Backpressure: a container accepts a push for epoch ``e`` only when
``e < next_epoch + max_inflight_epochs`` (the push call waits otherwise),
and a sender keeps at most ``max_inflight_epochs`` unacknowledged pushes per
destination. A slow stage therefore slows its producers, and memory holds
at most that many epochs per channel.

Checkpoint shipping rule: a checkpoint at epoch C leaves only after every
push of epochs <= C was accepted downstream, and after the memory-sink rows
up to C reached the master. A recovered slice therefore never has to
re-produce an epoch at or before its checkpoint for anyone.

A push to a container that died raises; the sender then stops sending to it
(what it would have received is in the sender's output log, replayed when
its slices are re-hosted) and tells the master.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import ray
from ray.exceptions import ActorDiedError, RayActorError, RayError

from chronostream.slices.plan import JobPlan
from chronostream.containers.logs import configure_from_env
from chronostream.containers.options import JobOptions
from chronostream.containers.stall_probe import start_from_env as start_stall_probe
from chronostream.containers.backup_store import BackupStore
from chronostream.containers.frame_assembly import FrameAssembly
from chronostream.containers.gc_pacing import CollectorPacing
from chronostream.containers.spill import SpillStore
from chronostream.containers.thread_priority import background_pool, set_background_niceness, thread_niceness
from chronostream.containers.core import (ContainerCore, ContainerStatistics, add_sink_parts, encode_snapshot,
                                          hand_over)
from chronostream.containers.epoch_message import EpochMessage
from chronostream.containers.output_log import OutputLog
from chronostream.containers.routing import OutputRoute
from chronostream.containers.shm_transport import ShmSender, discard, shm_available, shm_paths, unpack
from chronostream.containers.sink_parts import PackedSinkParts, pack_sink_parts
from chronostream.slices.checkpoint import CheckpointCorrupt, RestorePoint, capture, decode, decode_outputs, encode
from chronostream.slices.errors import ChronoStreamError, RecoveryError, StoreFullError

log = logging.getLogger("chronostream.container")


def to_wire(frame: bytes | memoryview) -> bytes | np.ndarray:
    """A frame as a Ray argument or result: bytes as they are; a large frame (a memoryview,
    which does not pickle) as a uint8 array, which Ray moves out of band, without copying."""
    return frame if isinstance(frame, bytes) else np.frombuffer(frame, np.uint8)


def from_wire(frame: bytes | np.ndarray) -> bytes | memoryview:
    """A frame received from Ray: arrays (read-only, in the object store) viewed in place."""
    return memoryview(frame) if isinstance(frame, np.ndarray) else frame


#: Piece size of a shipment above ``JobOptions.ship_piece_bytes`` (see ``_send_in_pieces``).
PIECE_BYTES = 64 << 20
#: How long making a peer known waits for its node (``_learn_nodes``): its parts can then go
#: through shared memory from the first one.
LEARN_NODE_WAIT_S = 1.0
#: Threads of the pool ``asyncio.to_thread`` uses in a host (asyncio's own default).
HOST_WORKER_THREADS = min(32, (os.cpu_count() or 1) + 4)


async def _all_of(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        await t


class _Handover:
    """A compaction in progress on this host: its sources, the epoch, and whether it happened."""

    def __init__(self, sources: list[int], epoch: int) -> None:
        self.sources = sources
        self.epoch = epoch
        self.state = "pending"  # then "done" or "cancelled"


class _Fetched(NamedTuple):
    """A slice's restore point as ``_fetch_backup`` found it."""

    point: RestorePoint
    rejected: list[tuple[int, str]]  # (holder, why) of each copy refused
    nbytes: int  # bytes read (checkpoint and carried outputs)
    holder: int | None  # the host whose copy was restored (None: rebuilt from the start)


@dataclass(frozen=True)
class SpareState:
    """A spare host no job adopted yet, as it reports itself (``ResourceContainer.spare_state``)."""

    node: str  # the Ray node it runs on
    leased: bool  # a pool handed it to a master, which is about to adopt it


def shm_job_tag(master: Any) -> str:
    """The tag in a job's shared-memory file names (``containers.shm_transport``): its master
    actor's id, which a restarted master keeps."""
    return master._actor_id.hex()


def _warm_up() -> None:
    """Pay lazy imports now, not in the first epoch: pyarrow imports pandas
    (when installed) on its first numpy conversion, which takes about a second."""
    import numpy as np
    import pyarrow.compute as pc

    arr = pa.array(["a", "b", "a"])
    np.asarray(pc.dictionary_encode(arr).indices)
    np.asarray(pa.chunked_array([pa.array([1, 2])]))
    pa.Table.from_pylist([{"a": 1}]).to_pylist()


def _progress_info(core: ContainerCore) -> dict[str, dict[int, Any]]:
    """Where each of a container's slices stands: the epoch it resumes at, its progress vector
    and its last epoch (what producers rerouting to it replay from)."""
    return {"resume": {s: core.slices[s].last_epoch + 1 for s in core.slices},
            "progress": {s: core.progress_of(s) for s in core.slices},
            "epochs": {s: core.slices[s].last_epoch for s in core.slices}}

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
        self.host_id: int | None = None
        self.container_id: int | None = None
        self.master: Any = None
        self.workdir = Path(workdir)
        self.heartbeat_s = heartbeat_s
        self._lease: asyncio.TimerHandle | None = None  # a spare handed out and not adopted yet
        if host_id is not None:
            self._take_job(host_id, master, workdir, heartbeat_s)
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
        self._ship: dict[int, asyncio.Task] = {}  # container -> its latest checkpoint-shipping task
        # The backup store's heavy work (verify, merge, restore, lmdb) runs on this one thread,
        # in call order, so the event loop keeps serving pushes meanwhile (the store is not
        # thread-safe: one thread only). Like every worker thread of a host, it can run below the
        # epoch loops' priority (JobOptions.background_niceness; it starts on first use).
        self._store_thread = background_pool(1, "backup-store")
        self._piece_seq = 0  # frames this host shipped in pieces (_send_in_pieces)
        self._assembling = FrameAssembly()  # frames arriving in pieces (receive_backup_piece)
        self.gc_pacing: CollectorPacing | None = None
        # Compactions in progress here (containers.core.hand_over): new container -> its sources
        # and the handover epoch, and source -> new container.
        self._handovers: dict[int, _Handover] = {}
        self._handover_of: dict[int, int] = {}
        # Shared-memory transport (JobOptions.shm_transport): the node of each peer host by actor
        # id (asked once, lazily: until it answers, pushes to it go through Ray), and the files
        # of each push in flight (unlinked when it is acknowledged or failed).
        self._shm: ShmSender | None = None
        self._node_id = ""
        self._peer_node: dict[str, str] = {}
        self._shm_files: dict[Any, list[str]] = {}
        self._store_full_said = False  # a backup flush refused for room was logged (once per episode)
        self._master_heard = time.monotonic()  # last sign of the master (``_watch_master``)

    def _take_job(self, host_id: int, master: Any, workdir: str, heartbeat_s: float) -> None:
        self.host_id = host_id
        self.container_id = host_id  # the container it starts with
        self.master = master
        self.workdir = Path(workdir) / f"host-{host_id}"
        self.heartbeat_s = heartbeat_s
        if self._stall_probe is not None:
            self._stall_probe.name = f"host {host_id}"

    async def ready(self) -> str:
        """A spare's warm-up: pay the lazy imports now (``_warm_up``), before any job needs this
        process. Returns the node id."""
        _warm_up()
        return ray.get_runtime_context().get_node_id()

    async def lease(self, seconds: float) -> None:
        """A spare handed to a master (``HostPool.take``): unless ``adopt`` follows within
        ``seconds``, the process exits, so a master that died in between leaks no host."""
        if self.host_id is None and self._lease is None:
            self._lease = asyncio.get_running_loop().call_later(seconds, self._expire_lease)

    async def spare_state(self) -> SpareState | None:
        """For a host pool that lost track of this spare (a pool that died, then made anew):
        None once adopted by a job; else its node and whether a take leased it (a master is
        about to adopt it)."""
        if self.host_id is not None:
            return None
        return SpareState(node=ray.get_runtime_context().get_node_id(), leased=self._lease is not None)

    def _expire_lease(self) -> None:
        if self.host_id is None:
            log.warning("spare host: not adopted within its lease; exiting")
            os._exit(0)

    async def adopt(self, host_id: int, master: Any, workdir: str, heartbeat_s: float) -> None:
        """A spare becomes host ``host_id`` of the job ``master`` runs: what the constructor of a
        host made for a job sets. Idempotent for the same ``host_id`` (a restarted master adopts
        again the hosts it finds by name); another id raises ``ValueError``."""
        if self.host_id is not None:
            if self.host_id != host_id:
                raise ValueError(f"host {self.host_id} cannot be adopted again as host {host_id}")
            return
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None
        self._take_job(host_id, master, workdir, heartbeat_s)

    async def source_refs(self) -> dict[int, list]:
        """The in-memory source tables' references ``configure`` gave (stage id -> [reference])."""
        return dict(self._source_refs)

    async def configure(self, plan: JobPlan, options: JobOptions, source_refs: dict[int, list] | None = None) -> str:
        """Set the job-wide parameters and open the backup store. Returns the node id.
        ``source_refs``: stage id -> [reference of its in-memory table], kept for a restarted
        master (``source_refs``); a later call adds the ones this host lacks.

        Once only: a second call (a restarted master runs a recovery's plan
        again) returns the node id and changes nothing else."""
        for stage_id, refs in (source_refs or {}).items():
            self._source_refs.setdefault(stage_id, refs)
        if self.plan is not None:
            return ray.get_runtime_context().get_node_id()
        if self.host_id is None:
            raise RuntimeError("a spare host runs no job: adopt() it first (master.host_pool)")
        self.plan = plan
        self.opts = options
        self.window = options.max_inflight_epochs
        # Before any work: pools start their threads on first use, at the priority set now.
        set_background_niceness(options.background_niceness)
        # asyncio.to_thread (restores, decoding, replays, ray.put of shipments) runs on it.
        asyncio.get_running_loop().set_default_executor(background_pool(HOST_WORKER_THREADS, "host-worker"))
        # This host's stores live under it, readable by the job's user only (docs/guide.md,
        # "Security and safety"); on a node where the job's work directory does not exist
        # yet, its parents are made here too.
        self.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if options.checkpointing:
            self.backup_store = BackupStore(self.workdir / "backups")
        if options.spill_state:
            self.spill_store = SpillStore(self.workdir / "spill")
        _warm_up()
        # After the warm-up, so what it made is frozen too (containers/gc_pacing.py).
        self.gc_pacing = CollectorPacing(options.full_gc_interval_s)
        self.gc_pacing.install()
        self._tasks.append(asyncio.get_running_loop().create_task(self._heartbeats()))
        self._tasks.append(asyncio.get_running_loop().create_task(self._watch_master()))
        self._node_id = ray.get_runtime_context().get_node_id()
        if options.shm_transport and shm_available():
            self._shm = ShmSender(shm_job_tag(self.master), self.host_id or 0)
        return self._node_id

    async def node(self) -> str:
        """The node this host runs on (a peer asks once before sending it parts in shared memory)."""
        return ray.get_runtime_context().get_node_id()

    def _wire(self, handle: Any, message: EpochMessage, core: ContainerCore | None
              ) -> tuple[EpochMessage, list[str]]:
        """``message`` as it travels to the host ``handle``: its large parts as files in shared
        memory when that host is on this node and says so (``containers.shm_transport``).
        ``core``: the sending container, which counts the files (``shm_parts``) and the parts
        sent before the receiver's node was known (``parts_node_unknown``)."""
        if self._shm is None:
            return message, []
        node = self._peer_node.get(handle._actor_id.hex())
        if not node:  # (not asked yet, or no answer yet: Ray carries its pushes until the answer)
            self._ask_nodes([handle])
            if core is not None:
                core.parts_node_unknown += len(message.parts)
            return message, []
        if node != self._node_id:
            return message, []
        wire, files = self._shm.pack(message)
        if core is not None:
            core.shm_parts += len(files)
        return wire, files

    async def _learn_nodes(self, handles: Iterable[Any], wait_s: float = LEARN_NODE_WAIT_S) -> None:
        """Ask the hosts ``handles`` which node they run on (once each) and wait up to ``wait_s``
        for the answers: done when a peer is made known (``add_container``, ``reroute``), so the
        first part sent to it can go through shared memory. A slow or dead peer's answer is
        left to come in the background."""
        asks = self._ask_nodes(handles)
        if asks:
            await asyncio.wait(asks, timeout=wait_s)

    def _ask_nodes(self, handles: Iterable[Any]) -> list[asyncio.Task]:
        if self._shm is None:
            return []
        asks = []
        for handle in handles:
            aid = handle._actor_id.hex()
            if aid not in self._peer_node:
                self._peer_node[aid] = ""  # asked
                asks.append(asyncio.get_running_loop().create_task(self._ask_node(aid, handle)))
        return asks

    async def _ask_node(self, aid: str, handle: Any) -> None:
        try:
            self._peer_node[aid] = await handle.node.remote()
        except RayError:
            # A dead or unreachable peer: its node stays unknown (parts to it go through Ray),
            # its pushes fail and recovery takes over.
            pass

    async def add_container(self, container_id: int, stage_id: int, slices: list[int],
                            routes: dict[int, OutputRoute], senders: dict[int, frozenset], peers: dict[int, Any],
                            hosts: dict[int, Any], source_table: pa.Table | None, output_log: bool,
                            backup_peers: dict[int, list[int]] | None = None,
                            restore_from: dict[int, list[tuple[int, Any]]] | None = None,
                            hand_over_from: list[int] | None = None) -> dict[str, Any]:
        """Create a container of ``stage_id`` here; with ``restore_from``, rebuild its slices from backups.

        Idempotent by ``container_id``: a second call (a restarted master
        running a recovery's plan again) waits for the first and returns
        its answer, with the container's progress as it is now (a
        producer rerouted again replays from there).

        ``restore_from[s]`` lists (host id, actor) holding a backup of slice
        ``s``, best first; an empty list rebuilds the slice from the start.
        Returns the restored progress vectors and resume epochs (and when
        each slice's restore began and ended). With ``hand_over_from`` (a
        compaction: containers of the stage hosted here) it starts with no
        slice and waits for theirs (``hand_over``).
        """
        first = self._adding.get(container_id)
        if first is None or (first.done() and first.exception() is not None):
            first = self._adding[container_id] = asyncio.get_running_loop().create_task(self._make_container(
                container_id, stage_id, slices, routes, senders, peers, hosts, source_table, output_log,
                backup_peers, restore_from, hand_over_from))
            return await asyncio.shield(first)
        info = dict(await asyncio.shield(first))
        core = self.cores.get(container_id)
        if core is not None and "resume" in info:
            async with self.conds[container_id]:  # (between two epochs)
                info.update(_progress_info(core))
        return info

    async def _make_container(self, container_id: int, stage_id: int, slices: list[int],
                              routes: dict[int, OutputRoute], senders: dict[int, frozenset],
                              peers: dict[int, Any], hosts: dict[int, Any], source_table: pa.Table | None,
                              output_log: bool, backup_peers: dict[int, list[int]] | None,
                              restore_from: dict[int, list[tuple[int, Any]]] | None,
                              hand_over_from: list[int] | None) -> dict[str, Any]:
        plan = self.plan
        assert plan is not None, "configure() first"
        writers = {s.sink_id: s.sink.writer(f"c{container_id}") for s in plan.sinks
                   if plan.streams[s.stream_id].stage_id == stage_id}
        dl = plan.dead_letter_sink.dead_letter_writer(f"c{container_id}", stage_id) \
            if plan.dead_letter_sink is not None else None
        olog = OutputLog(self.workdir / f"container-{container_id}" / "output-log") if output_log else None
        core = ContainerCore(plan, stage_id, container_id, slices, routes, senders, source_table=source_table,
                             output_log=olog, sink_writers=writers, dead_letter_writer=dl,
                             backup_peers=backup_peers, checkpoint_every=self.opts.checkpoint_every,
                             full_checkpoint_every=self.opts.full_checkpoint_every, backup_store=self.backup_store,
                             checkpoint_interval_s=self.opts.checkpoint_interval_s, spill=self.spill_store)
        # (None: a host the master found dead and is about to recover; pushes to it stop, as for
        # any unreachable container, until a reroute names its replacement.)
        self.peers.update({c: a for c, a in peers.items() if a is not None})
        await self._learn_nodes(a for a in peers.values() if a is not None)
        self.unreachable.update(c for c, a in peers.items() if a is None)
        self.hosts.update({h: a for h, a in hosts.items() if a is not None})
        info: dict[str, Any] = {"container": container_id, "host": self.host_id}
        if restore_from is not None:
            t0 = time.time()
            fetched = {s: await self._fetch_backup(stage_id, s, restore_from.get(s, [])) for s in slices}
            t1 = time.time()
            # Off the event loop: a large state takes a while to load, and this host's other
            # containers keep processing meanwhile (the new core is not running yet).
            await asyncio.to_thread(core.restore_slices, {s: f.point for s, f in fetched.items()})
            info.update(restore_start=t0, restore_end=time.time(), fetch_s=t1 - t0,
                        bytes=sum(f.nbytes for f in fetched.values()),
                        rejected=[(s, h, why) for s, f in fetched.items() for h, why in f.rejected],
                        restored_from={s: f.holder for s, f in fetched.items()}, **_progress_info(core))
        if hand_over_from is not None:
            core.awaiting_handover = True
            # (its inbox window starts where its sources are: producers may send it their rows now)
            core.next_epoch = min(self.cores[c].next_epoch for c in hand_over_from)
        core.gc_pacing = self.gc_pacing
        self.cores[container_id] = core
        self.conds[container_id] = asyncio.Condition()
        return info

    async def _fetch_backup(self, stage_id: int, slice_id: int, holders: list[tuple[int, Any]]) -> "_Fetched":
        """The ``RestorePoint`` of the newest verified checkpoint of a slice among ``holders``
        (own store first, no transfer), with the holders refused and the bytes read."""

        rejected = []
        for h, actor in holders:
            if actor is None and h != self.host_id:  # (a holder the master found dead since it planned)
                rejected.append((h, "the host is dead"))
                continue
            try:
                if h == self.host_id and self.backup_store is not None:
                    store = self.backup_store

                    def local():
                        ckpt, outs, seed = store.restore_point(stage_id, slice_id)
                        return ckpt, [decode_outputs(b) for b in outs], store.size(stage_id, slice_id), seed
                    ckpt, carried, size, seed = await self._in_store_thread(local)
                    return _Fetched(RestorePoint(ckpt, carried, seed), rejected, size, h)
                data, outs = await actor.backup_bytes.remote(stage_id, slice_id, with_outputs=True)
                data, outs = from_wire(data), [from_wire(b) for b in outs]
                decoded = await asyncio.to_thread(lambda: (decode(data, "backup"), [decode_outputs(b) for b in outs]))
                return _Fetched(RestorePoint(decoded[0], decoded[1], [data, *outs]), rejected,
                                len(data) + sum(len(b) for b in outs), h)
            except (CheckpointCorrupt, KeyError, RayActorError) as exc:
                rejected.append((h, str(exc)))
        if holders:
            name = self.plan.stages[stage_id].name if self.plan else stage_id
            raise RecoveryError(f"no usable backup of stage {name!r} slice {slice_id}: "
                                + "; ".join(f"on host {h}: {why}" for h, why in rejected))
        return _Fetched(RestorePoint(None, [], []), rejected, 0, None)

    async def start(self, container_ids: list[int] | None = None) -> None:
        """Start processing the given containers (default: all not started)."""
        loop = asyncio.get_running_loop()
        for c in container_ids if container_ids is not None else list(self.cores):
            if c not in self._started:
                self._started.add(c)
                self._tasks.append(loop.create_task(self._run(c)))

    async def push(self, container_id: int, epoch: int, sender: int, message: EpochMessage) -> bool:
        """Receive one epoch message for a hosted container (waits while its inbox is full)."""
        if self.stopped:  # (its files unlinked unread: a stopped host takes no message)
            discard(shm_paths(message))
            return False
        message = unpack(message)  # first: a refused message's files are unlinked too
        core, cond = self.cores.get(container_id), self.conds.get(container_id)
        if core is None or cond is None or core.retired:
            return False  # removed, or every slice migrated away: nothing needs it
        async with cond:
            await cond.wait_for(lambda: epoch < core.next_epoch + self.window + self.extra_window.get(container_id, 0)
                                or self.stopped or core.retired)
            accepted = core.deliver(epoch, sender, message)
            cond.notify_all()
        return accepted

    async def push_many(self, container_id: int, sender: int, messages: list[tuple[int, EpochMessage]]) -> int:
        """Receive a run of epoch messages (a replay) in one call, in order, each waiting for room
        in the inbox as ``push`` does; returns how many were accepted.

        One awaited call per replayed epoch made a catch-up as slow as the
        call's round trip (tens of ms on a busy host), barely faster than
        the epochs a producer makes meanwhile.
        """
        accepted = 0
        for epoch, message in messages:
            accepted += bool(await self.push(container_id, epoch, sender, message))
        return accepted

    async def _push_replay(self, target: int, target_host: Any, sender: int, replay: dict[int, EpochMessage]
                           ) -> None:
        """Push a replay in epoch order, ``REPLAY_BATCH`` epochs per call (large parts through
        shared memory as live pushes: ``_wire``)."""
        epochs = sorted(replay)
        for i in range(0, len(epochs), self.REPLAY_BATCH):
            run, files = [], []
            for e in epochs[i:i + self.REPLAY_BATCH]:
                wire, written = self._wire(target_host, replay[e], self.cores.get(sender))
                run.append((e, wire))
                files += written
            try:
                await target_host.push_many.remote(target, sender, run)
            except asyncio.CancelledError:
                files = []  # (the call may still run: its receiver unlinks them, as in _acknowledged)
                raise
            finally:
                discard(files)  # (each push unlinked its own; what is left never ran)

    # -- the loop ------------------------------------------------------------------

    async def _run(self, cid: int) -> None:
        core, cond = self.cores[cid], self.conds[cid]
        inflight: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        try:
            while not core.done and not self.stopped:
                async with cond:
                    while not ((core.ready() and cid not in self.frozen) or self.stopped or core.done):
                        if core.reader is not None:
                            # A followed source log: nothing will notify; poll it, and take
                            # what the poll found at once (waiting first would add a period).
                            core.poll_source()
                            if core.ready() and cid not in self.frozen:
                                break
                            try:
                                await asyncio.wait_for(cond.wait(), self.opts.source_poll_s)
                            except asyncio.TimeoutError:
                                pass
                        else:
                            await cond.wait()
                    if self.stopped or core.done:
                        break
                    epoch = core.next_epoch
                    t0 = time.perf_counter()
                    messages = core.step()
                    core.busy_s += time.perf_counter() - t0
                    cond.notify_all()  # next_epoch moved: blocked pushes may proceed
                if cid in self._handover_of:  # a compaction's source: at the handover epoch now?
                    await self._try_hand_over(self._handover_of[cid])
                pause = self.delay_s or (self.opts.source_pace_s if core.reader is not None else 0.0)
                if pause:
                    await asyncio.sleep(pause)
                if messages:
                    t0 = time.perf_counter()
                    for dst, msg in messages.items():
                        if dst not in self.unreachable:
                            wire, files = self._wire(self.peers[dst], msg, core)
                            ref = self.peers[dst].push.remote(dst, epoch, cid, wire)
                            if files:
                                self._shm_files[ref] = files
                            inflight[dst].append((dst, ref))
                    core.send_s += time.perf_counter() - t0
                parts, backups = core.take_sink_parts(), core.take_backups()
                if parts or backups:
                    refs = [r for dq in inflight.values() for r in dq]
                    if backups and core.checkpointer is not None:
                        core.checkpointer.unshipped += 1  # (the task counts it down)
                    self._ship[cid] = asyncio.get_running_loop().create_task(
                        self._ship_checkpoint(cid, self._ship.get(cid), refs, parts, backups))
                for dq in inflight.values():
                    while len(dq) > self.window:
                        await self._acknowledged(*dq.popleft())
                await asyncio.sleep(0)
            notice = core.take_end_notice()
            if notice is not None and not self.stopped:  # the input was sealed after its last epoch
                epoch, messages = notice
                for dst, msg in messages.items():
                    if dst not in self.unreachable:
                        inflight[dst].append((dst, self.peers[dst].push.remote(dst, epoch, cid, msg)))
            for dq in inflight.values():
                while dq:
                    await self._acknowledged(*dq.popleft())
            if not self.stopped and cid in self.cores and core.checkpointer is not None:
                # The master gets the rows not handed over yet before it hears "done" (without
                # checkpoints the container keeps them: handing every row over cost a 2 M-row
                # word count a quarter of its throughput).
                core.hand_over_last_sink_parts()
                parts = core.take_sink_parts()
                if parts:
                    self._ship[cid] = asyncio.get_running_loop().create_task(
                        self._ship_checkpoint(cid, self._ship.get(cid), [], parts, {}))
            if cid in self._ship:
                await self._ship[cid]
            if cid not in self.cores:
                return  # removed (an aborted migration destination): nothing to report
            if not self.stopped:
                await self.master.container_done.remote(cid, core.statistics())
        except Exception as exc:  # noqa: BLE001 - report every failure to the master
            self.failed = exc
            for dq in inflight.values():  # (never acknowledged now: their receivers unlink the files)
                for _dst, ref in dq:
                    self._shm_files.pop(ref, None)
            # The runtime's own errors (a poison event, a lost backup) reach the user whole, as
            # the job's ``JobFailed``: their traceback only at INFO (``CHRONOSTREAM_LOG``), so the
            # driver shows the error once. Anything else is a fault of the runtime: its traceback
            # is all there is to go on, the master only gets the message.
            log.log(logging.INFO if isinstance(exc, ChronoStreamError) else logging.ERROR,
                    "container %s failed: %s", cid, exc, exc_info=exc)
            try:
                await self.master.container_failed.remote(cid, exc)
            except Exception as report_exc:  # noqa: BLE001 - the epoch loop ends here either way
                # A master dead for good cannot be told (``_watch_master`` ends this host); an
                # error Ray cannot carry leaves the failure only in this host's log, so say it.
                log.warning("container %s: its failure was not reported to the master: %s", cid, report_exc)

    async def _acknowledged(self, dst: int, ref: Any) -> bool:
        """Wait for one push; False (and the master told) when its receiver died."""
        try:
            await ref
            return True
        except RayActorError:
            if dst not in self.unreachable:
                self.unreachable.add(dst)
                log.warning("host %s: container %s is unreachable; stop sending to it", self.host_id, dst)
                self.master.container_unreachable.remote(dst, self.host_id)
            return False
        except asyncio.CancelledError:
            # This host is stopping; the push may still run, and its receiver unlinks the files
            # (unlinked here, a live receiver would find them gone). The job's stop removes the rest.
            self._shm_files.pop(ref, None)
            raise
        finally:
            # The receiver unlinked them when the push ran; one that never ran left them.
            discard(self._shm_files.pop(ref, []))

    async def _ship_checkpoint(self, cid: int, previous: asyncio.Task | None, pushes: list, parts: dict,
                               backups: dict[int, list[bytes]]) -> None:
        try:
            await self._ship_in_order(cid, previous, pushes, parts, backups)
        except Exception as exc:  # noqa: BLE001 - the container's next ship awaits this one: it must not fail too
            log.error("host %s: container %s: a checkpoint round's shipment failed (%s: %s)", self.host_id, cid,
                      type(exc).__name__, exc)
        finally:
            core = self.cores.get(cid)
            if backups and core is not None and core.checkpointer is not None:
                core.checkpointer.unshipped -= 1

    async def _ship_in_order(self, cid: int, previous: asyncio.Task | None, pushes: list, parts: dict,
                             backups: dict[int, list[bytes]]) -> None:
        if previous is not None:
            await previous  # deltas must reach a peer in order
        for dst, ref in pushes:
            await self._acknowledged(dst, ref)
        if parts:
            await self.master.store_sink_parts.remote(pack_sink_parts(parts))
            self._drop_handed_sink_parts(parts)
        for peer, blobs in backups.items():
            actor = self.hosts.get(peer)
            if actor is None:
                continue
            try:
                refused = await self._send_backups(actor, blobs)
            except RayActorError:
                continue  # the peer died: recovery re-plans the chain, a full checkpoint follows
            except Exception as exc:  # noqa: BLE001 - one peer's failure must not stop the others' or later rounds
                # The peer misses these frames: it refuses the next delta (a gap in its chain),
                # which makes the next checkpoint of the slice a full one, and the chain heals.
                log.error("host %s: container %s: %d backup frames to host %s failed (%s: %s)", self.host_id, cid,
                          len(blobs), peer, type(exc).__name__, exc)
                continue
            core = self.cores.get(cid)
            if refused and core is not None and core.checkpointer is not None:
                core.checkpointer.force_full([s for _, s in refused])

    async def _send_backups(self, actor: Any, blobs: list[bytes]) -> list[tuple[int, int]]:
        """``actor.receive_backups(blobs)``; large ones go through the object store as arrays,
        and shipments above ``ship_piece_bytes`` in pieces (``_send_in_pieces``).

        A list of bytes is pickled in band: putting a 500 MB checkpoint held the GIL for
        about 1 s (every slice of this host stalled) and the receiver copied it out again.
        uint8 arrays (zero-copy views of the bytes) are written out of band in 0.25 s,
        from a worker thread, and the receiver reads them in place.
        """
        size = sum(len(b) for b in blobs)
        if size > self.opts.ship_piece_bytes:
            return await self._send_in_pieces(actor, blobs, size)
        return await self._send_frames(actor, blobs)

    async def _send_frames(self, actor: Any, blobs: list) -> list[tuple[int, int]]:
        if sum(len(b) for b in blobs) > self.opts.ship_by_reference_bytes or not all(isinstance(b, bytes)
                                                                                  for b in blobs):
            arrays = [np.frombuffer(b, np.uint8) for b in blobs]
            return await actor.receive_backups.remote(await asyncio.to_thread(ray.put, arrays))
        return await actor.receive_backups.remote(blobs)

    async def _send_in_pieces(self, actor: Any, blobs: list, size: int) -> list[tuple[int, int]]:
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
        limit = min(self.opts.ship_piece_bytes, PIECE_BYTES)
        t0 = time.perf_counter()
        refused: set[tuple[int, int]] = set()
        batch: list = []
        batch_bytes = pieces = 0
        for frame in [*blobs, None]:
            if batch and (frame is None or batch_bytes + len(frame) > limit):
                refused.update(tuple(k) for k in await self._send_frames(actor, batch))
                batch, batch_bytes = [], 0
            if frame is None:
                break
            if len(frame) <= limit:
                batch.append(frame)
                batch_bytes += len(frame)
                continue
            self._piece_seq += 1
            token, view = (self.host_id, self._piece_seq), memoryview(frame).cast("B")
            for at in range(0, len(view), limit):
                ref = await asyncio.to_thread(ray.put, np.frombuffer(view[at:at + limit], np.uint8))
                refused.update(tuple(k) for k in await actor.receive_backup_piece.remote(token, at, len(view), ref))
                pieces += 1
        log.info("host %s: shipped %d backup frames, %.0f MB, in %d pieces and shipments of at most %.0f MB "
                 "(%.2f s)", self.host_id, len(blobs), size / 1e6, pieces, limit / 1e6, time.perf_counter() - t0)
        return sorted(refused)

    async def _heartbeats(self) -> None:
        while not self.stopped:
            if self.gc_pacing is not None:
                # On the event loop, so between two epochs of every hosted container.
                self.gc_pacing.collect_if_due()
            try:
                if self.backup_store is not None:  # lazy persistence of the replication buffer
                    await self._in_store_thread(self.backup_store.flush)
                    self._store_full_said = False
            except StoreFullError as exc:
                # The chains stay in the replication buffer (memory) and the next flush tries
                # again; said once per episode, not every heartbeat.
                if not self._store_full_said:
                    log.warning("host %s: %s", self.host_id, exc)
                    self._store_full_said = True
            except Exception as exc:  # noqa: BLE001 - the heartbeats must go on
                # A stop closes the store between two heartbeats (lmdb raises then): nothing is
                # left to persist. Otherwise the chains stay in memory, where restores read
                # them; the failure is said and the next heartbeat tries again.
                if not self.stopped:
                    log.warning("host %s: backup store flush failed: %s", self.host_id, exc)
            try:
                self.master.heartbeat.remote(self.host_id, {c: core.statistics() for c, core in self.cores.items()})
            except Exception as exc:  # noqa: BLE001 - the heartbeats must go on
                # (A restarting master's calls wait; they do not raise.) A heartbeat not sent is
                # one missed: the next follows in heartbeat_s, and the master declares a host
                # dead only after heartbeat_timeout_s of silence.
                log.warning("host %s: heartbeat not sent: %s", self.host_id, exc)
            await asyncio.sleep(self.heartbeat_s)

    async def _watch_master(self) -> None:
        """Exit when the master is gone for good. A host is a detached actor: nothing else ends
        it when the driver that owned the master dies (``kill -9``) or the master is killed.
        The host pings the master; once a ping says its actor is dead (``ActorDiedError``: a
        restarting master's calls wait, an unreachable one's raise ``ActorUnavailableError``)
        and nothing was heard from it for ``JobOptions.master_lost_after_s``, the host
        releases its stores and exits."""
        bound = self.opts.master_lost_after_s
        every = min(max(self.heartbeat_s, 0.1), bound / 4)
        self._master_heard = time.monotonic()
        while True:
            await asyncio.sleep(every)
            try:
                await asyncio.wait_for(self.master.ping.remote(), timeout=bound)
                self._master_heard = time.monotonic()
                continue
            except ActorDiedError:
                pass  # dead for good
            except Exception:  # noqa: BLE001 - slow, restarting or unreachable for now: not gone
                continue
            silent = time.monotonic() - self._master_heard
            if silent >= bound:
                log.warning("host %s: its master is dead and silent for %.0f s; exiting", self.host_id, silent)
                try:
                    await asyncio.wait_for(self.stop(cleanup=True), timeout=10)
                finally:
                    os._exit(0)

    # -- recovery ------------------------------------------------------------------

    async def add_senders(self, container_id: int, coverage: dict[int, frozenset]) -> None:
        """A hosted container accepts new senders that re-host part of a dead sender's slices."""
        async with self.conds[container_id]:
            self.cores[container_id].add_senders(coverage)
            self.conds[container_id].notify_all()

    async def reroute(self, container_id: int, stage_id: int, slices: list[int], target: int, target_host: Any,
                      progress: dict[int, dict[int, list[int]]], resume: dict[int, int],
                      dual: bool = False) -> dict[str, int]:
        """Send ``slices`` of ``stage_id`` to ``target`` from now on and replay what it is owed.

        Returns ``{"epochs": replayed, "rounds": catch-up rounds}``. The replay messages are
        pushed in epoch order and awaited (the receiver's window paces them).

        With ``dual`` (migration phase 2) the slices' owner keeps getting
        them too, and the new copy catches up *before* it joins the live
        route: rounds of replay, each read from the output log in a worker
        thread while this container keeps stepping, until the gap is at most
        one window (or after ``CATCH_UP_ROUNDS``); only then does the route
        switch, at an epoch boundary, and the last gap is replayed. So this
        container never waits on a copy that is still far behind (its other
        destinations, the slices' owner among them, keep their pace), and
        it is never blocked while the replay is read.
        """
        core, cond = self.cores[container_id], self.conds[container_id]
        await self._learn_nodes([target_host])  # (before the lock: the container steps on meanwhile)
        async with cond:
            self.peers[target] = target_host
            self.unreachable.discard(target)
            if not dual:
                replay = core.reroute(stage_id, slices, target, progress, resume)
        if not dual:
            await self._push_replay(target, target_host, container_id, replay)
            await self._tell_end(core, target, target_host, container_id)
            return {"epochs": len(replay), "rounds": 1}
        since, pushed, round_ = 0, 0, 0
        cursor: dict[tuple[int, int], int] = {}  # each round reads only the log after the last one
        for round_ in range(1, self.CATCH_UP_ROUNDS + 1):
            async with cond:  # between two steps: an epoch boundary
                upto = core.next_epoch
                joining = upto - max(since, min(resume[s] for s in slices)) <= self.window \
                    or round_ == self.CATCH_UP_ROUNDS
                if joining:
                    core.switch_route(stage_id, slices, target, dual=True)
            replay = await asyncio.to_thread(core.replay_epochs, stage_id, slices, target, progress, resume,
                                             upto, since, cursor)
            log.info("host %s: container %s replays epochs %s..%s of stage %s slices %s to container %s "
                     "(catch-up round %d%s)", self.host_id, container_id, since, upto - 1, stage_id, slices,
                     target, round_, ", then live" if joining else "")
            await self._push_replay(target, target_host, container_id, replay)
            pushed += len(replay)
            since = upto
            if joining:
                break
        await self._tell_end(core, target, target_host, container_id)
        return {"epochs": pushed, "rounds": round_}

    async def position(self, container_id: int) -> dict[str, Any] | None:
        """A hosted container's next epoch and its slices' progress vectors (what a recovered
        producer replays to it from: ``replay_to``); None when it is gone or done."""
        core, cond = self.cores.get(container_id), self.conds.get(container_id)
        if core is None or cond is None or core.done:
            return None
        async with cond:  # (between two steps)
            return {"next_epoch": core.next_epoch, "progress": {s: core.progress_of(s) for s in core.slices}}

    async def replay_to(self, container_id: int, stage_id: int, target: int, target_host: Any, upto: int) -> int:
        """A recovered container replays its relogged outputs of epochs before ``upto`` (its
        resume epoch) to consumer ``target`` from where that consumer is: the dead container's
        messages of those epochs may never have reached it (a replay it owed a migration's
        destination is covered by no checkpoint). Returns the epochs pushed."""
        core = self.cores[container_id]
        pos = await target_host.position.remote(target)
        if pos is None:
            return 0
        replay = await asyncio.to_thread(core.replay_behind, stage_id, target, pos["next_epoch"],
                                         pos["progress"], upto)
        if not replay:
            return 0
        await self._learn_nodes([target_host])
        await self._push_replay(target, target_host, container_id, replay)
        return len(replay)

    async def _tell_end(self, core: ContainerCore, target: int, target_host: Any, sender: int) -> None:
        """Tell a rerouted-to container where a sealed followed input ends.

        This container may have announced the end before ``target`` became a
        destination (``take_end_notice`` goes out once), and a replay that was
        empty carries nothing. Epoch -1 is below every container's next epoch:
        ``deliver`` records the end and keeps nothing in the inbox.
        """
        if core.num_epochs is not None and core.plan.num_epochs is None:
            await target_host.push.remote(target, -1, sender, EpochMessage(end=core.num_epochs))

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
        """Warm-up: ship full checkpoints of a hosted container's ``slices`` (and their carried
        outputs) to ``to_host``'s backup store. Taken between two epochs.

        As for a checkpoint (``_ship_checkpoint``), the slices' memory-sink and dead-letter
        parts up to the snapshot's epoch go to the master before it ships: whatever is restored
        from it (the migration's destination, or a recovery that finds it in that store) makes
        only the epochs after, so those rows must not live only in this process."""
        core = self.cores[container_id]
        async with self.conds[container_id]:  # captured between two epochs
            captured = core.migration_capture(slices)
            epoch = core.next_epoch - 1
            parts = core.take_sink_parts_of(slices)
        if parts:
            await self.master.store_sink_parts.remote(pack_sink_parts(parts))
            self._drop_handed_sink_parts(parts)
        blobs = await asyncio.to_thread(encode_snapshot, captured)
        if to_host_id == self.host_id:
            await self.receive_backups(blobs)
        else:
            await self._send_backups(to_host, blobs)
        return {"epoch": epoch, "bytes": sum(len(b) for b in blobs)}

    async def begin_dual(self, container_id: int, stage_id: int, slices: list[int], target: int,
                         target_host: Any) -> int:
        """A producer sends ``slices`` of ``stage_id`` to ``target`` besides their owner from its next
        epoch on, with no replay (a compaction: ``target`` takes the slices' state in process at
        an epoch at or after this one). Returns that epoch."""
        core, cond = self.cores[container_id], self.conds[container_id]
        await self._learn_nodes([target_host])  # (before the lock: the container steps on meanwhile)
        async with cond:  # between two steps: an epoch boundary
            self.peers[target] = target_host
            self.unreachable.discard(target)
            core.switch_route(stage_id, slices, target, dual=True)
            return core.next_epoch

    async def hand_over(self, container_id: int, sources: list[int], not_before: int) -> int:
        """Compaction: every slice of the hosted containers ``sources`` goes to the hosted container
        ``container_id`` (made with ``hand_over_from``) at one epoch, the first at or after
        ``not_before`` that no source has reached; each source stops before it. Returns the epoch;
        the handover itself happens once every source is there (``handover_state``)."""
        epoch = max([not_before] + [self.cores[c].next_epoch for c in sources])
        self._handovers[container_id] = _Handover(list(sources), epoch)
        for c in sources:
            self.cores[c].stop_before = epoch
            self._handover_of[c] = container_id
        log.info("host %s: containers %s hand their slices to container %s at epoch %s", self.host_id, sources,
                 container_id, epoch)
        await self._try_hand_over(container_id)
        return epoch

    async def _try_hand_over(self, container_id: int) -> None:
        """Hand over once every source stands at the epoch; give up if one finished first (the
        input ended before it). Synchronous up to the notifications: no step runs in between."""
        plan = self._handovers.get(container_id)
        if plan is None or plan.state != "pending":
            return
        sources = [self.cores[c] for c in plan.sources]
        if any(src.done for src in sources):
            self._cancel_handover(container_id, "a source finished before the handover epoch")
        elif all(src.next_epoch >= plan.epoch for src in sources):
            hand_over(sources, self.cores[container_id], plan.epoch)
            plan.state = "done"
            # The receiver's first shipment (the rounds it took over, then its own) waits for the
            # sources' shipments in flight: deltas must reach a peer in order.
            shipping = [self._ship[c] for c in plan.sources if c in self._ship]
            if shipping:
                self._ship[container_id] = asyncio.get_running_loop().create_task(_all_of(shipping))
        else:
            return
        for c in [*plan.sources, container_id]:
            if c in self.conds:
                async with self.conds[c]:
                    self.conds[c].notify_all()

    def _cancel_handover(self, container_id: int, why: str) -> None:
        plan = self._handovers[container_id]
        plan.state = "cancelled"
        for c in plan.sources:
            if c in self.cores:
                self.cores[c].stop_before = None
        log.info("host %s: handover to container %s cancelled: %s", self.host_id, container_id, why)

    async def handover_state(self, container_id: int, cancel: bool = False) -> str:
        """``pending``, ``done`` or ``cancelled``; with ``cancel``, a pending handover is cancelled
        first (its sources go on with their slices). Atomic against the handover itself."""
        plan = self._handovers.get(container_id)
        if plan is None:
            return "cancelled"
        if cancel and plan.state == "pending":
            self._cancel_handover(container_id, "the master undid the compaction")
            for c in plan.sources:
                if c in self.conds:
                    async with self.conds[c]:
                        self.conds[c].notify_all()
        return plan.state

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
        """Pause (or resume) a hosted container between epochs; returns its next epoch.

        Only the stop-copy-restart baseline of ``benchmarks.migration`` uses it."""
        async with self.conds[container_id]:
            (self.frozen.add if on else self.frozen.discard)(container_id)
            self.conds[container_id].notify_all()
            return self.cores[container_id].next_epoch

    async def set_extra_window(self, container_id: int, epochs: int) -> None:
        """Let a catching-up migration destination buffer ``epochs`` more epochs (0: back to normal)."""
        self.extra_window[container_id] = epochs
        if container_id in self.conds:
            async with self.conds[container_id]:
                self.conds[container_id].notify_all()

    async def set_threads(self, container_id: int, threads: int) -> dict[str, int]:
        """Scale a hosted container up/down: its slices run on ``threads`` threads from its next
        epoch (a new thread-control table; no state moves)."""
        core = self.cores[container_id]
        version = core.set_threads(threads)
        return {"container": container_id, "threads": threads, "version": version, "from_epoch": core.next_epoch}

    async def migration_state(self, container_ids: list[int], with_times: bool = False) -> dict[int, dict[str, Any]]:
        """Per hosted container: next epoch, done, released slices (and, ``with_times``, when its
        recent epochs finished: the pause measurement)."""
        out = {}
        for c in container_ids:
            core = self.cores.get(c)
            if core is not None:
                out[c] = {"next_epoch": core.next_epoch, "done": core.done, "released": dict(core.released),
                          "awaiting_handover": core.awaiting_handover,
                          "epoch_done_at": dict(core.epoch_done_at) if with_times else {}}
        return out

    async def remove_container(self, container_id: int) -> None:
        """Drop a hosted container that never joined the placement (an aborted migration destination)."""
        core = self.cores.pop(container_id, None)
        cond = self.conds.pop(container_id, None)
        if core is None:
            return
        core.retire()  # its loop ends, pushes are refused
        if cond is not None:
            async with cond:
                cond.notify_all()
        core.close()

    def _drop_handed_sink_parts(self, parts: dict[int, dict[tuple[int, int], pa.Table]]) -> None:
        """The master stored these parts in its catalog: no container here needs their rows any
        more (reads take the master's copy), so they are not held twice. Every container of the
        host is asked: a compaction since the take may have moved the parts to another one."""
        dropped = sum(core.drop_handed_sink_parts(parts) for core in self.cores.values())
        log.debug("host %s: dropped %d memory-sink parts the master holds", self.host_id, dropped)

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
                "backup_store": await self._in_store_thread(thread_niceness),
                "worker": await asyncio.to_thread(thread_niceness)}

    async def inject_delay(self, seconds: float) -> float:
        """Failure injection: spend ``seconds`` more per epoch (a slow or overloaded container);
        returns the delay it replaces (the failure harness puts it back after slowing a source)."""
        before, self.delay_s = self.delay_s, seconds
        return before

    async def corrupt_backup(self, stage_id: int, slice_id: int, truncate: bool = False) -> bool:
        """Failure injection: damage the backup this host holds of a slice (False when it holds none)."""
        if self.backup_store is None or (stage_id, slice_id) not in self.backup_store.holds():
            return False
        store = self.backup_store
        await self._in_store_thread(lambda: store.corrupt(stage_id, slice_id, truncate))
        return True

    # -- backups and reading ------------------------------------------------------------

    async def receive_backups(self, blobs: list[bytes]) -> list[tuple[int, int]]:
        """Checkpoints of a peer's slices (kept in the replication buffer, flushed lazily).

        Returns the (stage, slice) pairs whose delta was refused (no sound
        chain to extend here): their sender's next checkpoint is a full one.
        A host of a job without checkpoints opens its store on the first
        migration snapshot it receives.
        """
        if self.backup_store is None:
            self.backup_store = BackupStore(self.workdir / "backups")
        store = self.backup_store
        # Large checkpoints arrive as read-only uint8 arrays in the object store (_send_backups):
        # kept as views, not copied (the store takes any bytes-like frame).
        blobs = [from_wire(b) for b in blobs]
        refused = await self._in_store_thread(lambda: {store.put(b) for b in blobs})
        return sorted(k for k in refused if k is not None)

    async def receive_backup_piece(self, token: tuple[int, int], offset: int, total: int,
                                   piece: np.ndarray) -> list[tuple[int, int]]:
        """One piece of a frame shipped in pieces (``_send_in_pieces``): copied into the frame's
        buffer here; once the last piece is in, the frame is received like any other.

        ``token`` is (sender host, frame number). Each of a sender's containers ships one
        frame at a time; a frame whose sender died half-way is dropped once it got no piece
        for ``FrameAssembly.IDLE_S`` (``containers/frame_assembly.py``).
        """
        token = (int(token[0]), int(token[1]))
        buf = self._assembling.buffer_for(token, offset, total, time.monotonic())
        # A copy out of the object store (numpy copies without the GIL): the piece is freed there.
        await asyncio.to_thread(np.copyto, buf[offset:offset + len(piece)], piece)
        whole = self._assembling.filled(token, offset + len(piece), time.monotonic())
        return [] if whole is None else await self.receive_backups([whole])

    async def _in_store_thread(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self._store_thread, fn)

    async def backup_catalog(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, str]]]:
        """Verified (stage, slice, epoch) of every backup held, and the damaged ones.

        What the replication buffer holds now: a recovery restores from
        memory, so it does not wait for a flush to lmdb.
        """
        if self.backup_store is None:
            return [], []
        store = self.backup_store
        return await self._in_store_thread(store.catalog)

    async def backups_held(self) -> list[tuple[int, int, int]]:
        """(stage, slice, epoch) of every backup this host holds (after a flush to lmdb)."""
        if self.backup_store is None:
            return []
        store = self.backup_store
        return await self._in_store_thread(lambda: (store.flush(), store.catalog())[1][0])

    async def backup_bytes(self, stage_id: int, slice_id: int, with_outputs: bool = False):
        """The merged, verified full backup of a peer's slice, encoded (and its carried-outputs frames)."""

        store = self.backup_store
        data, outs = await self._in_store_thread(
            lambda: (encode(store.latest(stage_id, slice_id)), store.carried_outputs(stage_id, slice_id)))
        data, outs = to_wire(data), [to_wire(b) for b in outs]
        return (data, outs) if with_outputs else data

    async def backup_epochs(self) -> dict[tuple[int, int], int]:
        """(stage, slice) -> newest checkpoint epoch held (cheap: for the master's GC)."""
        return self.backup_store.epochs() if self.backup_store is not None else {}

    async def gc(self, low_water: dict[int, int]) -> int:
        """Drop outputs every consumer's checkpoint covers: stage id -> last such epoch."""
        dropped = 0
        for cid, core in list(self.cores.items()):
            lw = low_water.get(core.stage.stage_id, -1)
            if lw >= 0:
                async with self.conds[cid]:
                    if self.stopped:  # stop() may have closed the logs while this waited
                        return dropped
                    dropped += core.gc(lw)
        if self.backup_store is not None and not self.stopped:
            store = self.backup_store
            dropped += await self._in_store_thread(
                lambda: sum(store.trim_outputs(stage_id, lw) for stage_id, lw in low_water.items() if lw >= 0))
        return dropped

    async def drop_backups(self, keys: list[tuple[int, int]]) -> int:
        """Forget the backups of these (stage, slice) keys: copies off their slice's chain that the
        master's GC found stale (``master.backups.stale_backups``). Returns how many were held."""
        if self.backup_store is None or self.stopped:
            return 0
        store = self.backup_store
        return await self._in_store_thread(lambda: sum(store.drop(stage_id, slice_id) for stage_id, slice_id in keys))

    async def slice_snapshot(self, slice_id: int, container_id: int | None = None) -> bytes | np.ndarray:
        """A full checkpoint of a hosted slice now (does not start a new delta); ``from_wire`` reads it."""

        core = self.cores[self.container_id if container_id is None else container_id]
        return to_wire(encode(capture(core.slices[slice_id], delta=False, epoch=core.next_epoch - 1, clear=False)))

    async def statistics(self) -> dict[int, ContainerStatistics]:
        """Counters of every hosted container."""
        return {c: core.statistics() for c, core in self.cores.items()}

    async def metrics(self, container_ids: list[int]) -> dict[int, tuple[ContainerStatistics, list]]:
        """Per hosted container: its statistics and per-slice metrics (events, busy time, backlog, state size)."""
        return {c: (self.cores[c].statistics(), self.cores[c].slice_metrics()) for c in container_ids if c in self.cores}

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
        self.stopped = True
        if self.gc_pacing is not None:
            self.gc_pacing.uninstall()
        for cond in self.conds.values():
            async with cond:
                cond.notify_all()
        if cleanup:
            for t in self._tasks:
                t.cancel()
            for core in self.cores.values():
                core.close()
            if self.backup_store is not None:
                store = self.backup_store
                await self._in_store_thread(lambda: store.close(flush=False))
            shutil.rmtree(self.workdir, ignore_errors=True)
