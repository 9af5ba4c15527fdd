"""The JobMaster Ray actor: deploys the stages, owns the placement, watches hosts, recovers lost slices.

Owns: creating the ResourceContainer actors (hosts, spread over the
cluster's nodes; warm spares adopted when the cluster keeps some,
``master.host_pool``), wiring their routing tables from the placement,
collecting heartbeats, progress and completion, detecting dead hosts, and
running the recovery plan (``master.recovery``) when one dies. The data
plane never waits on the master. Every recovery step is logged and kept in
``timeline`` with the containers and slices it concerns.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import shutil
import time
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from ray.exceptions import RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from chronostream.slices.plan import JobPlan
from chronostream.slices.errors import SinkRowsLost
from chronostream.containers.logs import configure_from_env
from chronostream.containers.stall_probe import start_from_env as start_stall_probe
from chronostream.containers.actor import ResourceContainer, shm_job_tag
from chronostream.containers.shm_transport import remove_job_files
from chronostream.containers.core import ContainerStatistics
from chronostream.containers.sink_parts import PackedSinkParts
from chronostream.master.policies import Decision, ScalingAction
from chronostream.containers.metrics import LatencyHistogram, MetricsSnapshot
from chronostream.containers.options import JobOptions
from chronostream.master.autoscaler import Counters, build_snapshot
from chronostream.master.backups import chains_by_slice, fewest_backup_copies
from chronostream.master.catalog import CatalogError, MasterCatalog
from chronostream.master.host_pool import take_spare
from chronostream.master.job_state import JobState
from chronostream.master.launch import JobLaunch, plan_fingerprint
from chronostream.master.migration import (MigrationError, Transfer, balanced_moves, compaction_moves,
                                           container_of_slices, group_transfers, resume_transfers, stage_hosts,
                                           stage_id_of)
from chronostream.master.ray_migration import RayMigration
from chronostream.master.ray_recovery import RayRecovery, kill_host
from chronostream.master.protocols.gc import ChainsRead, GcProtocol, HeldRead, SaveMarks, Trim
from chronostream.master.protocols.job import (ContainerDone, ContainerFailed, Deployed, Enter, JobLifecycle, Kept,
                                               Settled, StopAsked, StopHosts)
from chronostream.master.protocols.recovery import HostsDied, PlanRecord, RecoveryProtocol
from chronostream.master.placement import Placement, initial_placement
from chronostream.master.results import SinkPartRefs, memory_sink_ids
from chronostream.master.rpc_results import MasterStatus, PlacementView
from chronostream.master.timeline import Timeline
from chronostream.master.recovery import (RECOVERY_ROLES, RECOVERY_STEPS, host_backup_peers, floors_of_sources,
                                          off_stage_backup_stages, recovery_slack)

log = logging.getLogger("chronostream.master")

#: How long a restarted master that found a source table's reference on no live host waits for
#: the client's ``Job`` handle to hand it back before the recovery fails naming the stage.
SOURCE_REFS_CLIENT_WAIT_S = 30.0

#: Autoscaler ticks the master keeps (``autoscale_trace``): each holds a full per-slice
#: snapshot, so a long job keeps only the latest ones (an hour at the 2 s default interval).
DECISIONS_KEPT = 1800


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class JobMaster:
    """One per job. Created by ``chronostream.run``.

    Restartable: Ray re-runs the constructor after the master's process
    dies; it finds its catalog (``master.catalog``) and resumes: hosts are
    detached named actors, so they outlived it and kept processing; calls
    they made meanwhile are retried until the master answers again.
    """

    def __init__(self, workdir: str, job_key: str = "job") -> None:
        # Nothing large and no object reference among the arguments: Ray restarts the actor with
        # them, and restarts fail when an argument held in the object store is gone
        # (ray-project/ray#53727; Ray logs an error for every such actor). The job itself comes
        # with ``deploy`` and is kept in the catalog (``JobLaunch``); the source tables'
        # references are kept by the hosts too (``_source_ref``).
        configure_from_env()
        self._stall_probe = start_stall_probe("master")  # CHRONOSTREAM_STALL_MS: see chronostream.containers.stall_probe
        self.job_key = job_key
        self.workdir = workdir
        self.plan: JobPlan = None  # type: ignore[assignment]  # (set by deploy, or from the catalog)
        self.opts = JobOptions()
        self.placement: Placement = None  # type: ignore[assignment]
        self.source_stages: set[int] = set()  # stages reading in-memory tables (their refs: source_refs)
        self.host_of: dict[int, int] = {}  # container id -> host id
        self.handles: dict[int, Any] = {}  # host id -> actor
        self.alive: set[int] = set()  # live host ids
        self._copies_said: dict[str, int] = {}  # stage -> the fewest backup copies last reported
        self.nodes: dict[int, str] = {}  # host id -> node id
        self.last_seen: dict[int, float] = {}
        self.stats: dict[int, ContainerStatistics] = {}
        self.source_refs: dict[int, list] = {}
        # Stages whose table reference a restarted master found on no live host (every host
        # died with it): ``status`` asks the client's ``Job`` handle for them (``give_source_refs``).
        self.source_refs_wanted: set[int] = set()
        # Memory-sink rows handed over (``store_sink_parts``), as they were packed, in the order
        # they came: a read hands them on as they are (``sink_part_refs``), no copy joins them.
        self.sink_groups: list[tuple[int, pa.Table, np.ndarray]] = []
        self.job = JobLifecycle()  # the job's state (``master.protocols.job``; changed only by ``_job``)
        self.error: BaseException | None = None
        self.started_at = 0.0
        self.finished_at = 0.0
        self.timeline = Timeline()  # bounded per kind (master.timeline), as is its catalog copy
        # Serializes every control operation that reads the placement or the backup chains and
        # changes them across awaits: recovery (a resumed one too), migration, scale-out and
        # scale-in, compaction, the settling of a migration a previous master left, the drop of
        # stale backups, and the autoscaler's snapshot. Interleaved at their awaits, one would
        # plan from a placement another is half-way through changing. GC and the finish check
        # skip their turn while it is held instead of waiting for it.
        self.control_lock = asyncio.Lock()
        self.next_id = 0
        self.threads_asked: dict[int, int] = {}  # container -> threads last asked for (set_threads)
        self._watching = False
        # The master's own loops (watch, autoscaler, a resumed recovery or migration): cancelled
        # first at the stop, so none is left waiting on a host the stop kills.
        self._background: list[asyncio.Task] = []
        self.gc_dropped = 0
        self.stale_backups_dropped = 0  # backup copies off their slice's chain, dropped by GC
        self.policy: Any = None  # an autoscaling policy (chronostream.master.policies), or None
        # The latest autoscaler ticks (snapshot and actions), at most DECISIONS_KEPT.
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=DECISIONS_KEPT)
        self.decisions_made = 0  # every tick since this master process started
        self._unsettled: list[dict[str, Any]] = []  # a migration a previous master left (its record)
        self._unsettled_request: str | None = None
        self._unfinished_recovery: dict[str, Any] | None = None  # a recovery a previous master left
        self._crash_at: str | None = None  # failure injection: exit at this recovery step (crash_in_recovery)
        self._kill_at: tuple[str, str] | None = None  # failure injection: (step, role) (kill_in_recovery)
        self._kill_spare = False  # failure injection: the next spare taken dies before its adoption
        self._counters: Counters | None = None
        # Garbage collection (``master.protocols.gc``, made with the plan): its marks, saved in the
        # catalog before any host applies them, are read back by a restarted master.
        self.gc: GcProtocol | None = None
        self.catalog = MasterCatalog(f"{workdir}/master")
        # Host id -> actor name of the warm spares adopted (master.host_pool), read back also
        # after a restart in the middle of a deploy.
        self.host_names: dict[int, str] = self.catalog.load_host_names()
        self.identity = self.catalog.load_identity()  # (see MasterCatalog.save_identity)
        self.resumed = self.catalog.exists()
        if self.resumed and self.identity.get("job_key") != job_key:
            # Another job's catalog (``run`` checks first; this is the master's own word): its
            # launch is neither unpickled nor resumed under this job's name.
            raise CatalogError(f"{workdir}: the catalog there belongs to job {self.identity.get('job_key')!r}, "
                               f"not {job_key!r}; the master does not resume another job")
        if self.resumed:
            self._launch(JobLaunch.unpack(self.catalog.load_launch()), self.catalog.load_gc_marks())
            self._resume()

    def _launch(self, launch: JobLaunch, gc_marks: dict[int, int] | None = None) -> None:
        """Take the job's plan, options and policy (``deploy``'s, or a restarted master's from the
        catalog, with its saved GC marks)."""
        self.plan = launch.plan
        self.opts = launch.options or JobOptions()
        self.gc = GcProtocol(self.plan, recovery_slack(self.opts), gc_marks)
        self.heartbeat_s = self.opts.heartbeat_s
        self.gc_every_ticks = max(1, round(self.opts.gc_interval_s / self.heartbeat_s))
        self.policy = launch.policy
        self.source_stages = set(launch.source_stages)

    def _host_name(self, host_id: int) -> str:
        """The host's actor name: a warm spare's own (``master.host_pool``), else the job's naming."""
        return self.host_names.get(host_id) or f"chronostream-{self.job_key}-host-{host_id}"

    def _resume(self) -> None:
        """A restarted master: reload the catalog and find the hosts again."""
        self.placement, self.host_of, self.alive, self.nodes, self.next_id = self.catalog.load_layout()
        prog = self.catalog.load_progress()
        self.job = JobLifecycle(prog["state"], set(prog["done"]))
        self.started_at, self.finished_at = prog["started_at"], prog["finished_at"]
        self.sink_groups = self.catalog.load_sink_groups()
        self.catalog.forget_events(self.timeline.extend(self.catalog.load_numbered_events()))
        now = time.monotonic()
        for h in sorted(self.alive):
            try:
                self.handles[h] = ray.get_actor(self._host_name(h))
                self.last_seen[h] = now
            except ValueError:  # it died while the master was away: recovered by the watch loop
                self.handles[h] = None
                self.last_seen[h] = now - 2 * self.opts.heartbeat_timeout_s
        self._event("master_restarted", hosts=sorted(self.alive), containers=len(self.host_of),
                    gc_marks={str(k): v for k, v in sorted(self.gc_marks.items())})
        self._unsettled_request, left = self.catalog.load_migration()
        self._unsettled = left
        self._unfinished_recovery = self.catalog.load_recovery()

    def _ensure_watching(self) -> None:
        if not self._watching and self.state is JobState.RUNNING:
            self._watching = True
            if self._unfinished_recovery is not None:  # (first: it takes the lock before the watch loop looks)
                self._in_background(self._resume_recovery())
            self._in_background(self._watch())
            if self._unsettled:
                self._in_background(self._settle_left_over())

    def _in_background(self, coro: Any) -> None:
        self._background.append(asyncio.get_running_loop().create_task(coro))

    async def _settle_left_over(self) -> None:
        async with self.control_lock:
            await self._settle_pending()

    async def _settle_pending(self) -> None:
        """A master restarted in the middle of a migration: finish or undo it (``RayMigration.settle``)
        before anything else changes the placement. Called under the control lock."""
        if not self._unsettled:
            return
        left, self._unsettled = self._unsettled, []
        transfers, rehosted = resume_transfers(left, self.placement, self.host_of)
        self._event("migration_resumed", transfers=list(left))
        for t in rehosted:
            self._event("migration_rehosted", container=t.new_id, slices=t.slices)
        await RayMigration(self, transfers[0].stage_id, transfers).settle("the master restarted")
        released = await self._release_idle_hosts()
        await self._retarget_backups({t.stage_id for t in transfers} | self._off_stage_backup_stages())
        self._save_layout()
        summary = {"transfers": [{**t.to_plain(), "pause_ms": {}, "released_at": {}} for t in transfers],
                   "released_hosts": released, "seconds": 0.0, "reason": "settled by a restarted master"}
        self.catalog.save_request(self._unsettled_request or "", summary)
        self.catalog.save_migration(None, [])
        self._event("migration_end", **summary)

    def _save_layout(self, recovery: Any = ...) -> None:
        self.catalog.save_layout(self.placement, self.host_of, self.alive, self.nodes, self.next_id, recovery)

    def _save_progress(self) -> None:
        self.catalog.save_progress(self.state, self.done, self.started_at, self.finished_at)

    @property
    def gc_marks(self) -> dict[int, int]:
        """Highest GC mark saved per producer stage (logs trimmed up to it)."""
        return self.gc.marks if self.gc is not None else {}

    @property
    def state(self) -> JobState:
        return self.job.state

    @property
    def done(self) -> set[int]:
        """Containers that processed their last epoch."""
        return self.job.done

    def _live(self) -> frozenset[int]:
        return frozenset(c for ids in self.placement.containers.values() for c in ids)

    def _job(self, event: Any) -> None:
        """The one place the job's state changes (``master.protocols.job``): each change is saved
        and kept in the timeline (``job_<state>``); a change refused after the end is kept as
        ``state_kept``; a failure stops the hosts."""
        for cmd in self.job.handle(event):
            if isinstance(cmd, Enter):
                if cmd.state.terminal:
                    self.finished_at = time.time()
                self._save_progress()
                self._event(f"job_{cmd.state}", **cmd.info)
            elif isinstance(cmd, Kept):
                self._event("state_kept", state=cmd.state.value, refused=cmd.refused.value)
            elif isinstance(cmd, StopHosts):
                for h in self.alive:
                    if self.handles.get(h) is not None:
                        self.handles[h].stop.remote()

    def _event(self, kind: str, **info: Any) -> None:
        event = (time.time(), kind, info)
        seq, dropped = self.timeline.add(event)
        self.catalog.add_event(seq, event, () if dropped is None else (dropped,))
        log.info("%s %s", kind, info)

    async def _new_or_found_host(self, host_id: int, node: str | None = None) -> Any:
        """Host ``host_id`` (a deploy's, a recovery's or a scale-out's new one): found by name when
        a previous master process created or adopted it already (and died before it saved its
        layout, or in a recovery), else made now on ``node``."""
        try:
            h = ray.get_actor(self._host_name(host_id))
            if host_id in self.host_names:  # a spare: its adoption may not have happened
                await h.adopt.remote(host_id, ray.get_runtime_context().current_actor, self.workdir,
                                     self.heartbeat_s)
        except (ValueError, RayActorError):
            return await self._new_host(host_id, node)
        self.handles[host_id] = h
        self.alive.add(host_id)
        self.last_seen[host_id] = time.monotonic()
        return h

    async def _new_host(self, host_id: int, node: str | None) -> Any:
        """Host ``host_id`` on ``node`` (None: any): a warm spare when the cluster keeps some
        (``master.host_pool``), else a new process."""
        me = ray.get_runtime_context().current_actor
        h = await self._adopted_spare(host_id, node, me)
        if h is None:
            strategy: Any = "SPREAD" if node is None else NodeAffinitySchedulingStrategy(node, soft=False)
            if self.host_names.pop(host_id, None) is not None:
                self.catalog.save_host_name(host_id, None)
            # Detached and named: a host outlives a master restart and is found again by name.
            h = ResourceContainer.options(scheduling_strategy=strategy, max_concurrency=1000, lifetime="detached",
                                          name=self._host_name(host_id)).remote(
                host_id, me, self.workdir, self.heartbeat_s)
        self.handles[host_id] = h
        self.alive.add(host_id)
        self.last_seen[host_id] = time.monotonic()
        return h

    async def _adopted_spare(self, host_id: int, node: str | None, me: Any) -> Any:
        """A warm spare adopted as host ``host_id``, or None when the pool had none ready."""
        spare = await take_spare(node)
        if spare is None:
            return None
        name, h = spare
        # Named in the catalog before the adoption: a restarted master finds and adopts it.
        self.host_names[host_id] = name
        self.catalog.save_host_name(host_id, name)
        try:
            if self._kill_spare:
                self._kill_spare = False
                await self._kill_spare_now(h, host_id, name)
            await h.adopt.remote(host_id, me, self.workdir, self.heartbeat_s)
        except RayActorError:
            # It died after the pool leased it to us (its process or node): the caller starts the
            # host itself. (Its name in the catalog is dropped there.)
            log.warning("master: spare %s died before its adoption as host %s; starting the host", name, host_id)
            self._event("spare_lost", host=host_id, spare=name)
            return None
        self._event("spare_adopted", host=host_id, spare=name)
        return h

    async def kill_next_spare(self) -> None:
        """Failure injection (``chronostream.chaos``, kind ``kill_spare``): the next warm spare this
        master takes dies before it is adopted (``_adopted_spare``). Once only."""
        self._kill_spare = True

    async def _kill_spare_now(self, h: Any, host_id: int, name: str, timeout_s: float = 30.0) -> None:
        """Kill spare ``h`` and return once it no longer answers (``ray.kill`` only asks: until the
        process is gone it could still be adopted)."""
        log.warning("master: killing spare %s before its adoption as host %s (failure injection)", name, host_id)
        self._event("spare_kill_injected", host=host_id, spare=name)
        ray.kill(h, no_restart=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(h.ready.remote(), timeout=5)
            except RayActorError:
                return
            except asyncio.TimeoutError:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError(f"spare {name} still answers {timeout_s:.0f} s after it was killed")

    def _stage_hosts(self, stage_id: int) -> dict[int, Any]:
        return {self.host_of[c]: self.handles[self.host_of[c]] for c in self.placement.containers[stage_id]}

    def _peers_of(self, stage_id: int) -> dict[int, Any]:
        """Actors hosting the containers a container of ``stage_id`` sends to."""
        return {c: self.handles[self.host_of[c]] for d in self.plan.downstream_stages(stage_id)
                for c in self.placement.containers[d]}

    async def deploy(self, launch: bytes, source_refs: dict[int, list], made_workdir: bool = False) -> dict[str, Any]:
        """Create, configure and start every container of the job ``launch`` describes
        (``JobLaunch.pack``); ``source_refs``: stage id -> [object reference of its in-memory
        table]; ``made_workdir``: ``run`` made the work directory for this job (a stop with
        cleanup removes it whole). Returns the placement.

        The job's identity and launch are saved in the catalog first, so a master restarted
        from here on knows the job; a call Ray retries after a restart finds it deployed (or
        deploys it)."""
        self.source_refs = dict(source_refs)
        if self.resumed or self.handles:  # a retried call after a restart: already deployed
            self._ensure_watching()
            return self.placement.as_dict(self.plan)
        job = JobLaunch.unpack(launch)
        self._launch(job)
        self.placement = initial_placement(job.plan, job.containers_per_stage)
        self.catalog.save_identity(self.job_key, plan_fingerprint(job.plan), made_workdir)
        self.identity = self.catalog.load_identity()
        self.catalog.save_launch(launch)
        # Spread each stage's containers over the alive nodes round-robin. SPREAD
        # and soft node affinity are best-effort and were seen stacking a stage on
        # one node; hard affinity to a node alive now is exact (a node that dies
        # before its container starts fails the deploy with Ray's error).
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        for stage_id, ids in self.placement.containers.items():
            for i, c in enumerate(ids):
                self.host_of[c] = c
                await self._new_or_found_host(c, nodes[(i + stage_id) % len(nodes)] if len(nodes) > 1 else None)
        self.next_id = max(self.host_of) + 1
        await asyncio.gather(*[self._configure(h) for h in self.handles])
        added = []
        for stage_id, ids in self.placement.containers.items():
            chain = self._backup_chain(stage_id)
            for c in ids:
                added.append(self._add_container(c, stage_id, self.placement.slices_of(c), chain[c]))
        await asyncio.gather(*added)
        self._note_backup_copies()
        self.started_at = time.time()
        await asyncio.gather(*[h.start.remote() for h in self.handles.values()])
        self._save_layout()
        # A container may have failed (or every container finished) while the hosts' start was
        # awaited: a failed job stays failed, and a finish that came early is taken now.
        self._job(Deployed(self._live(), {"containers": len(self.host_of), "nodes": len(set(self.nodes.values()))}))
        self._ensure_watching()
        if self.policy is not None:
            self._in_background(self._autoscale())
        return self.placement.as_dict(self.plan)

    async def _add_container(self, c: int, stage_id: int, slices: list[int], backup_peers: dict[int, list[int]],
                             restore_from: dict[int, list[tuple[int, Any]]] | None = None,
                             hand_over_from: list[int] | None = None) -> Any:
        src = await self._source_ref(stage_id)
        hosts = {**self._stage_hosts(stage_id), **{h: self.handles[h] for ps in backup_peers.values() for h in ps}}
        return await self.handles[self.host_of[c]].add_container.remote(
            c, stage_id, slices, self.placement.routes_for(self.plan, stage_id),
            self.placement.sender_coverage(self.plan, stage_id), self._peers_of(stage_id),
            hosts, src, self.opts.output_log, backup_peers, restore_from, hand_over_from)

    async def _source_ref(self, stage_id: int) -> Any:
        """The object reference of stage ``stage_id``'s in-memory table (None for other stages).

        ``deploy`` brings them; a restarted master asks the hosts, which keep the ones
        ``configure`` gave them (the references are the client's: the master only borrows)."""
        if stage_id not in self.source_stages:
            return None
        await self._find_source_refs()
        if stage_id not in self.source_refs:
            await self._source_ref_from_client(stage_id)
        return self.source_refs[stage_id][0]

    async def _source_ref_from_client(self, stage_id: int) -> None:
        """No live host holds stage ``stage_id``'s table reference (a restarted master whose
        hosts all died): wait for the client's ``Job`` handle, which owns the tables, to hand
        them back (its keeper thread asks ``wants_source_refs`` every second; ``status``,
        ``wait`` and ``progress`` answer too); fail naming the stage after
        ``SOURCE_REFS_CLIENT_WAIT_S``."""
        name = self.plan.stages[stage_id].name
        self.source_refs_wanted.add(stage_id)
        self._event("source_refs_wanted", stage=name, hosts=sorted(self.alive))
        deadline = time.monotonic() + SOURCE_REFS_CLIENT_WAIT_S
        while stage_id not in self.source_refs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if stage_id not in self.source_refs:
            raise RuntimeError(
                f"the source table of stage {name!r} is lost: no live host holds its reference (hosts "
                f"{sorted(self.alive)}), and the client's Job handle did not hand it back within "
                f"{SOURCE_REFS_CLIENT_WAIT_S:.0f} s (the process that started the job owns the table and "
                f"answers while it runs: it has exited, or its Job handle was dropped)")

    async def wants_source_refs(self) -> tuple[bool, JobState]:
        """(Whether this master waits for the source tables' references from the client, the
        job's state): the client's ``SourceRefKeeper`` asks every second."""
        return bool(self.source_refs_wanted - self.source_refs.keys()), self.state

    async def give_source_refs(self, source_refs: dict[int, list]) -> list[int]:
        """The client's ``Job`` handle hands back the source tables' references (stage id ->
        [reference]) after ``status`` said ``wants_source_refs``. Returns the stages the master
        lacked; the live hosts keep them too, for the next restart (``configure`` adds them)."""
        new = sorted(set(source_refs) - self.source_refs.keys())
        self.source_refs.update({s: source_refs[s] for s in new})
        self.source_refs_wanted -= set(source_refs)
        if new:
            self._event("source_refs_from_client", stages=[self.plan.stages[s].name for s in new])
            hosts = [self.handles[h] for h in sorted(self.alive) if self.handles.get(h) is not None]
            await asyncio.gather(*[asyncio.wait_for(h.configure.remote(self.plan, self.opts, self.source_refs),
                                                    timeout=10) for h in hosts], return_exceptions=True)
        return new

    async def _find_source_refs(self) -> None:
        """A restarted master: the source tables' references it lacks, from the live hosts
        (``configure`` gave every host all of them), asked at once: a dead or hung host that
        still counts as live costs one wait, not one per host."""
        if self.source_stages <= self.source_refs.keys():
            return
        hosts = [h for h in sorted(self.alive) if self.handles.get(h) is not None]
        answers = await asyncio.gather(*[asyncio.wait_for(self.handles[h].source_refs.remote(), timeout=10)
                                         for h in hosts], return_exceptions=True)
        for h, found in zip(hosts, answers):
            if isinstance(found, dict) and found.keys() - self.source_refs.keys():
                self.source_refs.update(found)
                self._event("source_refs_from_host", host=h, stages=sorted(found))

    async def _configure(self, host_id: int) -> None:
        """Give host ``host_id`` the job (plan, options and the source tables' references: a
        restarted master finds them first, so a host it adds can hand them on too)."""
        await self._find_source_refs()
        self.nodes[host_id] = await self.handles[host_id].configure.remote(self.plan, self.opts, self.source_refs)

    # -- watching ------------------------------------------------------------------

    async def _watch(self) -> None:
        tick = 0
        while self.state is JobState.RUNNING:
            await asyncio.sleep(self.heartbeat_s)
            tick += 1
            if tick % self.gc_every_ticks == 0:
                await self._collect_garbage()
            dead = await self._probe(sorted(self.alive))
            now = time.monotonic()
            silent = {h for h in self.alive - dead if now - self.last_seen.get(h, now) > self.opts.heartbeat_timeout_s}
            for h in dead:
                self._event("fault_detected", host=h, by="probe (actor dead)")
            for h in silent:
                self._event("fault_detected", host=h, by=f"no heartbeat for {now - self.last_seen[h]:.1f}s")
            if (dead | silent) and self.state is JobState.RUNNING:
                await self._recover(dead | silent)
            elif self.state is JobState.FINISHED and self.opts.checkpointing:
                for h in dead:  # (a silent host may just be slow: only a dead one is forgotten)
                    self._lost_after_end(h, RayActorError())

    async def _probe(self, hosts: list[int]) -> set[int]:
        """Hosts whose actor is dead (a ping raises). A busy host just answers late: not dead."""
        async def one(h: int) -> bool:
            if self.handles.get(h) is None:
                return True
            try:
                await asyncio.wait_for(self.handles[h].ping.remote(), timeout=max(1.0, self.heartbeat_s * 4))
                self.last_seen[h] = time.monotonic()
                return False
            except RayActorError:
                return True
            except asyncio.TimeoutError:
                return False
        results = await asyncio.gather(*[one(h) for h in hosts])
        return {h for h, d in zip(hosts, results) if d}

    async def _collect_garbage(self) -> None:
        """Drop outputs no recovery can need: below every consumer stage's oldest newest checkpoint."""
        if not self.opts.checkpointing or self.opts.recompute_lost or self.control_lock.locked():
            return  # (recomputing a lost slice from the start needs every log from epoch 0)
        hosts = sorted(self.alive)
        assert self.gc is not None
        try:
            held = await asyncio.gather(*[self.handles[h].backup_epochs.remote() for h in hosts])
            for cmd in self.gc.handle(HeldRead(tuple(held))):
                if isinstance(cmd, SaveMarks):  # (before any host trims to them)
                    self.catalog.save_gc_marks(cmd.marks)
                elif isinstance(cmd, Trim):
                    dropped = await asyncio.gather(*[self.handles[h].gc.remote(cmd.marks) for h in hosts])
                    self.gc_dropped += sum(dropped)
            await self._drop_stale_backups(dict(zip(hosts, held)))
        except RayActorError:
            pass  # a host died: the watch loop recovers it; GC waits for the next round
        except Exception:  # noqa: BLE001
            if self.state is JobState.RUNNING:
                raise
            # The job was stopped mid-round (hosts closing their stores): nothing to collect.

    async def _drop_stale_backups(self, held: dict[int, dict[tuple[int, int], int]]) -> None:
        """Tell hosts to forget the copies their slices' chains left behind once the chain holds
        newer ones (``stale_backups``): a scale-out or recovery re-plans chains, and the old
        holders' copies would otherwise take their disk for the rest of the job.

        Under the control lock: a migration or recovery that started since ``held`` was read
        could make a host a chain member again, or warm a destination up with a copy it is about
        to rebuild from; neither runs while the copies are judged and dropped."""
        if self.control_lock.locked():
            return  # (a migration or recovery runs: the next round judges the chains it leaves)
        assert self.gc is not None
        async with self.control_lock:
            chains = chains_by_slice({st: self._backup_chain(st) for st in self.placement.containers})
            drops = self.gc.handle(ChainsRead(chains, held))
            dropped = await asyncio.gather(*[self.handles[d.host].drop_backups.remote(list(d.keys)) for d in drops])
        for d, n in zip(drops, dropped):
            if n:
                self.stale_backups_dropped += n
                self._event("stale_backups_dropped", host=d.host, slices=[list(k) for k in d.keys])

    async def container_unreachable(self, container_id: int, reporter: int) -> None:
        """A host could not push to ``container_id``: check its host now rather than at the next probe."""
        h = self.host_of.get(container_id)
        if h is None or h not in self.alive or self.state is not JobState.RUNNING:
            return
        if await self._probe([h]):
            self._event("fault_detected", host=h, by=f"host {reporter} (push failed)")
            await self._recover({h})

    # -- recovery ------------------------------------------------------------------

    def _hosts_not_found(self) -> set[int]:
        """Live hosts a restarted master could not find by name (they died while it was away)."""
        return {h for h in self.alive if self.handles.get(h) is None}

    async def _recover(self, dead_hosts: set[int]) -> None:
        async with self.control_lock:
            # A recovery a previous master left comes first (a host's report can arrive before
            # the watch loop starts the resume).
            await self._resume_recovery_locked()
            # Hosts a restarted master could not find again are dead as well.
            dead = (dead_hosts | self._hosts_not_found()) & self.alive
            if not dead or self.state is not JobState.RUNNING:
                return
            try:
                await self._recover_hosts(dead)
            except Exception as exc:  # noqa: BLE001 - a recovery that cannot be exact fails the job
                log.exception("recovery failed")
                self._fail(None, exc)

    async def _recover_hosts(self, dead: set[int], plans: list[dict[str, Any]] | None = None,
                             gone: set[int] = frozenset()) -> None:
        """Recover every container on ``dead`` hosts, together with ``plans`` (saved plans a
        previous master left unfinished; ``gone``: the hosts they were made for), to the end even
        when more hosts die on the way: ``master.protocols.recovery`` decides the steps,
        ``master.ray_recovery`` carries them out (docs/design.md section 7d). A step that raises
        with every host alive fails the job (the caller's handler)."""
        machine = RecoveryProtocol([PlanRecord.from_plain(p) for p in plans or []], gone)
        await RayRecovery(self).run(machine, HostsDied(frozenset(dead)))

    async def _resume_recovery(self) -> None:
        """A master restarted in the middle of a recovery: plan again for the hosts it had not
        planned for, and run the saved plans again (``_recover_hosts``), before the watch loop looks."""
        async with self.control_lock:
            await self._resume_recovery_locked()

    async def _resume_recovery_locked(self) -> None:
        record, self._unfinished_recovery = self._unfinished_recovery, None
        if record is None or self.state is not JobState.RUNNING:
            return
        # A migration the dead master left settles first (its done transfers rehosted), as one a
        # death meets settles before the recovery plans (``LocalCluster._restart_master`` too).
        await self._settle_pending()
        plans = [{**rec, "resumed": True} for rec in record["plans"]]
        planned = {h for rec in plans for h in rec["dead"]}
        self._event("recovery_resumed", hosts=sorted(planned | set(record["dead"])),
                    step="planning" if record["dead"] else "running")
        try:
            # Hosts that died meanwhile are planned for with those it had not (the saved plans'
            # adoptions on them are skipped: their containers are placed there).
            away = self._hosts_not_found()
            found = away | await self._probe(sorted(self.alive - away))
            if found:
                self._event("fault_detected", hosts=sorted(found), by="probe of a restarted master")
            await self._recover_hosts(set(record["dead"]) | found, plans, planned)
        except Exception as exc:  # noqa: BLE001 - a recovery that cannot be exact fails the job
            log.exception("resumed recovery failed")
            self._fail(None, exc)

    async def crash_in_recovery(self, step: str) -> None:
        """Failure injection (``chronostream.chaos``, kind ``kill_master_in_recovery``): this master
        process exits at ``step`` (``master.recovery.RECOVERY_STEPS``) of its next recovery; Ray
        restarts it and it resumes the recovery from its catalog. Not persisted: once only."""
        if step not in RECOVERY_STEPS:
            raise ValueError(f"unknown recovery step {step!r}; steps: {RECOVERY_STEPS}")
        self._crash_at = step

    async def kill_in_recovery(self, step: str, role: str) -> None:
        """Failure injection (``chronostream.chaos``, kind ``kill_in_recovery``): at ``step`` of its
        next recovery this master kills a host with ``role`` in it (``master.recovery.RECOVERY_ROLES``;
        the lowest such host id), so a step meets a host that died after the recovery began. Once only."""
        if step not in RECOVERY_STEPS:
            raise ValueError(f"unknown recovery step {step!r}; steps: {RECOVERY_STEPS}")
        if role not in RECOVERY_ROLES:
            raise ValueError(f"unknown role {role!r}; roles: {RECOVERY_ROLES}")
        self._kill_at = (step, role)

    # -- migration and scaling (master.migration; docs/design.md section 7f) ------------

    def _backup_chain(self, stage_id: int) -> dict[int, dict[int, list[int]]]:
        """``host_backup_peers`` of a stage as placed now: over its own hosts, or, when it lives on
        one host, over the job's other live hosts (other nodes first)."""
        return host_backup_peers(self.placement, self.host_of, stage_id, self.opts.backup_factor,
                                 self._chain_hosts(), self.nodes)

    def backup_copies(self) -> dict[str, int]:
        """Stage name -> the fewest backup copies a slice of it has as placed now
        (``fewest_backup_copies``); empty when the job takes no checkpoints."""
        if not (self.opts.checkpointing and self.opts.backup_factor):
            return {}
        return {self.plan.stages[st].name: fewest_backup_copies(self._backup_chain(st))
                for st in sorted(self.placement.containers)}

    def _note_backup_copies(self) -> None:
        """Say when a stage's slices get fewer copies than ``backup_factor`` (event
        ``backups_short``, a warning: the job has too few hosts for them), at deploy and whenever
        that number changes, and when they have their copies again (``backups_restored``)."""
        factor = self.opts.backup_factor
        for name, copies in self.backup_copies().items():
            before = self._copies_said.get(name, factor)
            if copies < factor and copies != before:
                log.warning("stage %s: %d backup copies a slice, not backup_factor=%d: the job has %d hosts",
                            name, copies, factor, len(self.alive))
                self._event("backups_short", stage=name, copies=copies, backup_factor=factor, hosts=len(self.alive))
            elif copies >= factor > before:
                self._event("backups_restored", stage=name, copies=copies, backup_factor=factor,
                            hosts=len(self.alive))
            self._copies_said[name] = copies

    def _off_stage_backup_stages(self) -> set[int]:
        """Stages whose chains go on over other stages' hosts (``off_stage_backup_stages``)."""
        return off_stage_backup_stages(self.placement, self.host_of, self.opts.backup_factor)

    def _chain_hosts(self, transfers: list[Transfer] = ()) -> list[int]:
        """The hosts a stage on too few hosts of its own may back up to: every live one (and
        migrations' new hosts)."""
        return sorted(self.alive | {t.host for t in transfers if t.host is not None})

    async def _retarget_backups(self, stages: set[int], tolerate_dead: bool = True) -> None:
        """Re-plan the backup chain of ``stages`` over their hosts as they are now (each slice's
        next checkpoint is a full one: the new peers hold no chain)."""
        calls = []
        for st in sorted(stages):
            for c, peers in self._backup_chain(st).items():
                hosts = {**self._stage_hosts(st), **{h: self.handles[h] for ps in peers.values() for h in ps}}
                calls.append(self.handles[self.host_of[c]].retarget_backups.remote(c, peers, hosts))
        await asyncio.gather(*calls, return_exceptions=tolerate_dead)
        self._note_backup_copies()

    def _check_can_migrate(self) -> None:
        if self.state is not JobState.RUNNING:
            raise MigrationError(f"the job is {self.state}: nothing to rescale")
        if not self.opts.output_log:
            raise MigrationError("migration replays upstream output logs: run the job with output_log=True")

    async def _replayed(self, request: str | None) -> Any:
        """A control call Ray retried after a master restart: the result it already had, if any
        (settling first the migration it may have left in progress). Under the control lock."""
        await self._settle_pending()
        return self.catalog.load_request(request)

    async def scale_out(self, stage: str | int, n: int = 1, reason: str = "requested",
                        request: str | None = None) -> dict[str, Any]:
        """Add ``n`` hosts to ``stage`` and move slices so every host of it runs an even share.

        ``request``: an id making the call idempotent (Ray retries it on a restarted master).
        """
        async with self.control_lock:
            if (done := await self._replayed(request)) is not None:
                return done
            self._check_can_migrate()
            sid = stage_id_of(self.plan, stage)
            if n < 1:
                raise MigrationError(f"scale_out needs n >= 1, got {n}")
            layout = stage_hosts(self.placement, self.host_of, sid)
            new = [-(i + 1) for i in range(n)]
            moves = balanced_moves(layout, list(layout) + new, container_of=container_of_slices(self.placement, sid))
            return await self._migrate(sid, moves, {h: None for h in new}, f"scale_out {n}: {reason}", request=request)

    async def scale_in(self, stage: str | int, n: int = 1, reason: str = "requested",
                       request: str | None = None) -> dict[str, Any]:
        """Move every slice off ``n`` of ``stage``'s hosts (those running the fewest slices), then release them."""
        async with self.control_lock:
            if (done := await self._replayed(request)) is not None:
                return done
            self._check_can_migrate()
            sid = stage_id_of(self.plan, stage)
            layout = stage_hosts(self.placement, self.host_of, sid)
            if n < 1 or n >= len(layout):
                raise MigrationError(f"stage {self.plan.stages[sid].name!r} runs on {len(layout)} hosts; "
                                     f"cannot remove {n}")
            leaving = sorted(layout, key=lambda h: (len(layout[h]), -h))[:n]
            staying = [h for h in layout if h not in leaving]
            held = await asyncio.gather(*[self.handles[h].backup_epochs.remote() for h in staying])
            holders: dict[int, set[int]] = {}
            for h, epochs in zip(staying, held):
                for (st, s), _e in epochs.items():
                    if st == sid:
                        holders.setdefault(s, set()).add(h)
            moves = balanced_moves({**{h: layout[h] for h in staying},
                                    -1: [s for h in leaving for s in layout[h]]}, staying, holders=holders)
            where = container_of_slices(self.placement, sid)
            moves = [(s, self.host_of[where[s]], t) for s, _, t in moves]
            return await self._migrate(sid, moves, {}, f"scale_in {n}: {reason}", request=request)

    async def compact(self, stage: str | int, reason: str = "requested",
                      request: str | None = None) -> dict[str, Any]:
        """Merge ``stage``'s containers on each host into one (``master.migration.compaction_moves``);
        a no-op when every host runs one."""
        async with self.control_lock:
            if (done := await self._replayed(request)) is not None:
                return done
            self._check_can_migrate()
            sid = stage_id_of(self.plan, stage)
            moves = compaction_moves(self.placement, self.host_of, sid)
            where = container_of_slices(self.placement, sid)
            # A merged container keeps the most threads any of its containers had or was asked for
            # (a scale-up takes effect at the container's next epoch; a restarted master knows only those).
            threads = {c: max(self.threads_asked.get(c, 1), await self.threads_of(c))
                       for c in sorted({where[s] for s, _, _ in moves})}
            summary = await self._migrate(sid, moves, {}, f"compact: {reason}", request=request, handover=True)
            for new_id in sorted({t["to"] for t in summary["transfers"] if t["phase"] == "done"}):
                most = max(threads[t["from"]] for t in summary["transfers"] if t["to"] == new_id)
                if most > 1:
                    await self.set_threads(new_id, most)
            return summary

    async def migrate(self, stage: str | int, slices: list[int], to_container: int | None = None,
                      reason: str = "requested", baseline: str | None = None,
                      request: str | None = None) -> dict[str, Any]:
        """Move ``slices`` of ``stage`` to the host of container ``to_container`` (None: a new host).

        ``baseline="stop_copy"`` runs the stop-copy-restart migration that
        ``benchmarks.migration`` compares against (the source container
        pauses while a fresh snapshot is copied and restored); not for use.
        """
        async with self.control_lock:
            if (done := await self._replayed(request)) is not None:
                return done
            self._check_can_migrate()
            sid = stage_id_of(self.plan, stage)
            where = container_of_slices(self.placement, sid)
            bad = [s for s in slices if s not in where]
            if bad or not slices:
                raise MigrationError(f"stage {self.plan.stages[sid].name!r} has no slices {bad or slices}")
            if to_container is not None and (to_container not in self.host_of
                                             or self.host_of[to_container] not in self.alive):
                raise MigrationError(f"no live container {to_container}")
            to = -1 if to_container is None else self.host_of[to_container]
            moves = [(s, self.host_of[where[s]], to) for s in slices if self.host_of[where[s]] != to]
            return await self._migrate(sid, moves, {-1: None} if to_container is None else {},
                                       f"migrate {slices}: {reason}", stop_copy=baseline == "stop_copy",
                                       request=request)

    async def set_threads(self, container: int, threads: int) -> dict[str, Any]:
        """Scale up/down (paper III-D): run ``container``'s slices on ``threads`` threads."""
        if threads < 1:
            raise MigrationError(f"a container needs at least 1 thread, got {threads}")
        self._check_live(container)
        out = await self.handles[self.host_of[container]].set_threads.remote(container, threads)
        self.threads_asked[container] = threads
        self._event("threads_set", container=container, threads=threads, from_epoch=out["from_epoch"])
        return out

    def _check_live(self, container: int) -> None:
        live = {c for ids in self.placement.containers.values() for c in ids}
        if container not in live or self.host_of[container] not in self.alive:
            raise MigrationError(f"no live container {container}; containers: {sorted(live)}")

    async def threads_of(self, container: int) -> int:
        """Threads of the table in effect in ``container`` (fresh from its host)."""
        self._check_live(container)
        stats = await self.handles[self.host_of[container]].statistics.remote()
        return stats[container].threads

    async def _migrate(self, sid: int, moves: list[tuple[int, int, int]], new_hosts: dict[int, int | None],
                       reason: str, stop_copy: bool = False, request: str | None = None,
                       handover: bool = False) -> dict[str, Any]:
        """Run one migration (every transfer in parallel, phase by phase); under the control lock.
        ``handover``: a compaction, whose slices stay in their processes (``master.ray_migration``)."""
        # (a source stage's migration has no producer to mark one release epoch for several
        # sources: one new container each; a handover's host fixes one epoch for all)
        transfers = group_transfers(moves, container_of_slices(self.placement, sid), sid, self.next_id, new_hosts,
                                    shared_destination=handover or self.plan.stages[sid].kind != "source")
        if not transfers:
            return {"transfers": [], "reason": reason}
        for t in transfers:
            t.handover = handover
        self.next_id = max([self.next_id] + [t.new_id + 1 for t in transfers])
        self._save_layout()  # (next_id: a restarted master never reuses the new ids)
        for t in transfers:  # every phase change is in the catalog: a restarted master settles it
            t.on_advance = lambda _t, ts=transfers: self.catalog.save_migration(request, [x.to_plain() for x in ts])
        self.catalog.save_migration(request, [t.to_plain() for t in transfers])
        t0 = time.time()
        self._event("migration_start", stage=self.plan.stages[sid].name, reason=reason,
                    transfers=[{"from": t.source, "to": t.new_id, "slices": t.slices} for t in transfers])
        driver = RayMigration(self, sid, transfers, stop_copy)
        try:
            await driver.run()
        except (RayActorError, MigrationError, asyncio.TimeoutError) as exc:
            log.warning("migration interrupted: %s", exc)
            self._event("migration_interrupted", error=str(exc))
            await driver.settle(str(exc))
        released = await self._release_idle_hosts()
        # Stages backed up off their own hosts too, hosts added or released: their chains run over
        # the job's hosts, and the master's view of every chain (GC of stale copies, ``placement()``)
        # must be the one their containers ship to.
        await self._retarget_backups({sid} | self._off_stage_backup_stages())
        self._save_layout()
        self.catalog.save_migration(None, [])
        summary = {"transfers": [{"from": t.source, "to": t.new_id, "host": t.host, "slices": t.slices,
                                  "phase": t.phase.value, "resume": t.resume, "released_at": t.released_at,
                                  "pause_ms": t.pause_ms, "catch_up": t.catch_up,
                                  "hand_over_epoch": t.hand_over_epoch,
                                  "warm_wait_s": next((info.get("warm_wait_s", 0.0) for _, p, _, info in t.story
                                                       if p == "rebuilding"), 0.0),
                                  "phases_s": {p: round(info["at"] - t0, 3) for _, p, _, info in t.story}}
                                 for t in transfers],
                   "released_hosts": released, "seconds": round(time.time() - t0, 3), "reason": reason}
        self._event("migration_end", stage=self.plan.stages[sid].name, **summary)
        if request:
            self.catalog.save_request(request, summary)
        return summary

    def _least_used_node(self) -> str | None:
        alive_nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        if len(alive_nodes) <= 1:
            return None
        used = {n: 0 for n in alive_nodes}
        for h in self.alive:
            if self.nodes.get(h) in used:
                used[self.nodes[h]] += 1
        return min(alive_nodes, key=lambda n: (used[n], n))

    def _producers(self, stage_id: int, dead: set[int] = frozenset(),
                   live_only: bool = True) -> list[tuple[int, Any]]:
        """(container, host actor) of the containers of the stages feeding ``stage_id`` (the live
        ones; with ``live_only=False`` all, so that a call to a dead one fails loudly)."""
        return [(c, self.handles[self.host_of[c]]) for u in self.plan.upstream_stages(stage_id)
                for c in self.placement.containers[u] if not live_only or self.host_of[c] in self.alive - dead]

    async def _release_idle_hosts(self) -> list[int]:
        """Hosts running no container of the placement any more (scale-in): keep their sink rows, stop them."""
        busy = {self.host_of[c] for ids in self.placement.containers.values() for c in ids}
        idle = sorted(h for h in self.alive if h not in busy)
        for h in idle:
            try:
                parts = await self.handles[h].drain_sink_parts.remote()
                if parts:
                    await self.store_sink_parts(parts)
                await self.handles[h].stop.remote(True)
                ray.kill(self.handles[h])
            except RayActorError:
                pass
            self.alive.discard(h)
            self._event("host_released", host=h)
        return idle

    # -- metrics and autoscaling (chronostream.containers.metrics, chronostream.master.policies) ------------------

    async def metrics_snapshot(self) -> MetricsSnapshot:
        """Per stage: input and processing rates, utilization, backlog, per-slice figures; job
        latency percentiles (since the previous snapshot) and throughput; per host CPU and RSS."""
        ids: dict[int, list[int]] = {}
        for c in (c for cs_ in self.placement.containers.values() for c in cs_):
            if self.host_of[c] in self.alive:
                ids.setdefault(self.host_of[c], []).append(c)
        parts = await asyncio.gather(*[self.handles[h].metrics.remote(cs_) for h, cs_ in ids.items()],
                                     return_exceptions=True)
        stats, slices = {}, {}
        for part in parts:
            if isinstance(part, dict):
                for c, (st, sl) in part.items():
                    stats[c], slices[c] = st, sl
        t = time.time() - self.started_at if self.started_at else 0.0
        snap, self._counters = build_snapshot(t, self.plan, self.placement, self.host_of, stats, slices,
                                              self._counters)
        return snap

    async def metrics(self) -> dict[str, Any]:
        """A fresh snapshot (plain), the end-to-end latency over the whole run, and autoscaler ticks so far."""
        snap = await self.metrics_snapshot()
        total = LatencyHistogram()
        for st in (await self.statistics()).values():
            if st is not None and st.latency:
                total = total.merge(LatencyHistogram.from_plain(st.latency))
        return {"snapshot": snap.to_plain(), "latency_total": total.summary(), "decisions": self.decisions_made}

    async def autoscale_trace(self) -> list[dict[str, Any]]:
        """The latest autoscaler ticks (plain ``Decision``s, at most ``DECISIONS_KEPT``): replay
        them with ``autoscale.simulate``."""
        return [d.to_plain() for d in self.decisions]

    async def _autoscale(self) -> None:
        """Every ``autoscale_interval_s``: snapshot, ask the policy, take its actions (logged with reasons)."""
        self._counters = None
        await self.metrics_snapshot()  # the base of the first interval's rates
        while self.state is JobState.RUNNING:
            await asyncio.sleep(self.opts.autoscale_interval_s)
            if self.state is not JobState.RUNNING:
                return
            async with self.control_lock:  # no snapshot in the middle of a recovery or migration
                snap = await self.metrics_snapshot()
            try:
                actions = list(self.policy.decide(snap))
            except Exception as exc:  # noqa: BLE001 - a broken policy must not kill the job
                self._event("autoscale_error", error=f"{type(exc).__name__}: {exc}")
                continue
            self.decisions.append(Decision(snap, tuple(actions)))
            self.decisions_made += 1
            for a in actions:
                self._event("autoscale_decision", action=a.describe(), t=snap.t)
                try:
                    await self._take(a)
                except (MigrationError, ValueError) as exc:
                    self._event("autoscale_refused", action=a.describe(), error=str(exc))
            if actions:  # rates right after a migration mix old and new containers: start afresh
                self._counters = None
                await self.metrics_snapshot()

    async def _take(self, a: ScalingAction) -> Any:
        if a.kind == "scale_out":
            return await self.scale_out(a.stage, a.n, reason=a.reason)
        if a.kind == "scale_in":
            return await self.scale_in(a.stage, a.n, reason=a.reason)
        if a.kind == "migrate":
            return await self.migrate(a.stage, [a.slice], a.to_container, reason=a.reason)
        if a.kind == "compact":
            return await self.compact(a.stage, reason=a.reason)
        return await self.set_threads(a.container, a.threads)

    # -- reports from hosts ------------------------------------------------------------

    def _fail(self, container_id: int | None, error: BaseException) -> None:
        if self.state.terminal:
            return
        where = ""
        if container_id is not None and self.placement is not None and container_id in self.placement.stage_of:
            where = f" in container {container_id} (stage {self.plan.stages[self.placement.stage_of[container_id]].name!r})"
        self.error = error
        self._job(ContainerFailed(where.strip(), str(error)))

    async def ping(self) -> str:
        """The job's state, as its plain value: a host's sign that its master lives
        (``ResourceContainer._watch_master``; a host reads no master type)."""
        return self.state.value

    async def heartbeat(self, host_id: int, stats: dict[int, ContainerStatistics]) -> None:
        """Liveness and progress from a host."""
        self._ensure_watching()
        self.last_seen[host_id] = time.monotonic()
        self.stats.update(stats)

    async def container_done(self, container_id: int, stats: ContainerStatistics) -> None:
        """A container processed its last epoch."""
        self._ensure_watching()
        self.stats[container_id] = stats
        self._job(ContainerDone(container_id, self._live(), self.control_lock.locked()))
        self._save_progress()

    def _check_finished(self) -> None:
        self._job(Settled(self._live(), self.control_lock.locked()))

    async def container_failed(self, container_id: int, error: BaseException) -> None:
        """A container hit an error it cannot handle."""
        self._fail(container_id, error)

    async def store_sink_parts(self, packed: PackedSinkParts) -> None:
        """Memory-sink rows up to a checkpoint (they outlive the container that made them)."""
        self.catalog.add_sink_parts(packed)
        self.sink_groups.extend(packed.groups)

    # -- reading ---------------------------------------------------------------

    async def status(self) -> MasterStatus:
        """The job's state (a ``JobState``), its error, and its progress."""
        self._ensure_watching()
        self._check_finished()  # the last container may have finished during a recovery
        live = [c for ids in self.placement.containers.values() for c in ids]
        return MasterStatus(
            state=self.state,
            error=self.error,
            containers=len(live),
            done=len([c for c in live if c in self.done]),
            elapsed_s=(self.finished_at or time.time()) - self.started_at if self.started_at else 0.0,
            epochs=self.plan.num_epochs,
            min_epoch=min((self.stats[c].next_epoch for c in live if c in self.stats), default=0),
            recoveries=self.timeline.count("recovery_end"),
            gc_dropped=self.gc_dropped,
            stale_backups_dropped=self.stale_backups_dropped,
            # (the client's Job handle answers with give_source_refs)
            wants_source_refs=(await self.wants_source_refs())[0],
        )

    async def source_log_floors(self) -> dict[str, int]:
        """Source stage name -> the first global order it may read again (0: all of it): a
        recovery or migration of its slices restores them from checkpoints no older, and the
        floor only grows. Computed at each GC round; 0 without checkpoints or with
        ``recompute_lost`` (a lost slice is then rebuilt from the start)."""
        return floors_of_sources(self.plan, self.gc.source_floors if self.gc is not None else {})

    async def plan_of(self) -> JobPlan:
        """The job's plan (``Job.attach`` from another process)."""
        return self.plan

    async def placement_view(self) -> PlacementView:
        """Stage name -> container id -> slices, each container's host, each host's node, the
        master's own node and the fewest backup copies a slice of each stage has (empty without
        checkpoints)."""
        return PlacementView(stages=self.placement.as_dict(self.plan), nodes=dict(self.nodes),
                             hosts=dict(self.host_of), master_node=ray.get_runtime_context().get_node_id(),
                             backup_copies=self.backup_copies())

    async def statistics(self) -> dict[int, ContainerStatistics]:
        """Latest statistics of every live container (fresh from the hosts)."""
        hosts = sorted(self.alive)
        fresh = await asyncio.gather(*[self.handles[h].statistics.remote() for h in hosts], return_exceptions=True)
        out = {}
        for r in fresh:
            if not isinstance(r, BaseException):
                out.update(r)
        live = {c for ids in self.placement.containers.values() for c in ids}
        return {c: out.get(c, self.stats.get(c)) for c in sorted(live) if c in out or c in self.stats}

    async def recovery_timeline(self) -> list[tuple[float, str, dict[str, Any]]]:
        """What happened, in order: faults, detection, per-slice restore and first output after recovery.

        First outputs are those of containers a recovery made (``slices_restored``); a migration's
        new container restores slices too, but its first output is a migration's, not a recovery's
        (the demo's "first output (last)" showed a scale-in's 4 s later as the recovery's)."""
        events = list(self.timeline)
        recovered = {info["container"] for _, kind, info in events if kind == "slices_restored"}
        infos = await asyncio.gather(*[self.handles[h].recovery_info.remote() for h in sorted(self.alive)],
                                     return_exceptions=True)
        for info in infos:
            if isinstance(info, BaseException):
                continue
            for c, d in info.items():
                if c not in recovered:
                    continue
                for s, t in d["first_output_at"].items():
                    events.append((t, "first_output", {"container": c, "slice": s}))
        return sorted(events, key=lambda e: e[0])

    async def sink_part_refs(self, sink_name: str) -> SinkPartRefs:
        """Where every part of a memory sink (or the dead letters) is: object references of
        packed parts (``PackedSinkParts``), the master's own first (handed over at checkpoints
        and by released hosts), then each live host's, which the host put in the object store
        itself; the client reads them and builds the table (``chronostream.client``): the rows
        never pass through the master's process. A host found dead here is settled as after
        the job's end (``_lost_after_end``: raises when rows died with it)."""
        ids = memory_sink_ids(self.plan, sink_name)
        # The groups as they came (a part in two of them: the later one's, as the client reads
        # them in order); each group's table is whole, so the put writes its rows once.
        own = [g for g in self.sink_groups if g[0] in ids]
        refs = [ray.put(PackedSinkParts(own))] if own else []
        hosts = sorted(self.alive)

        async def not_found() -> Any:  # (a restarted master did not find the host by name: dead)
            raise RayActorError()
        held = await asyncio.gather(*[self.handles[h].sink_parts.remote(ids) if self.handles.get(h) is not None
                                      else not_found() for h in hosts], return_exceptions=True)
        for h, got in zip(hosts, held):
            if isinstance(got, RayActorError):
                self._lost_after_end(h, got)
            elif isinstance(got, BaseException):
                raise got
            else:
                refs.extend(got)
        return SinkPartRefs(ids, refs, list(self.plan.source_dead_letters))

    def _lost_after_end(self, host: int, error: BaseException) -> None:
        """A dead host of a job that ended (while it runs: ``error``, and the watch loop
        recovers the host). With checkpoints, every container on it that
        reported done had handed the master every memory-sink row it made (its last epoch is a
        checkpoint; ``ContainerCore.hand_over_last_sink_parts`` covers the rest). Forget the host;
        raise ``SinkRowsLost``, naming them, when a container on it had not finished (its rows
        since its last checkpoint died with it) or the job ran without checkpoints (its rows
        lived only there). Containers that left the placement (slices migrated away) handed the
        master every row their slices' new owners do not re-make: those up to the checkpoint or
        snapshot the new owners were restored from (``ResourceContainer.migration_snapshot``)."""
        if self.state is JobState.RUNNING:
            raise error  # the watch loop recovers it (its output logs may still be replayed)
        live = {c for ids in self.placement.containers.values() for c in ids}
        on_it = sorted(c for c, h in self.host_of.items() if h == host and c in live)
        unfinished = [c for c in on_it if c not in self.done]
        gone = unfinished or (on_it if not self.opts.checkpointing else [])
        if gone:
            lost = [{"stage": self.plan.stages[self.placement.stage_of[c]].name, "slices": self.placement.slices_of(c),
                     "container": c, "host": host} for c in gone]
            why = (f"they had not finished (job {self.state}): their rows since their last checkpoint "
                   f"died with it" if unfinished else
                   "without checkpoints a container keeps its rows until they are read; run with "
                   "checkpoint_every=K to hand them to the master as the job goes")
            raise SinkRowsLost(f"host {host} died after the job's end holding the memory-sink rows of containers "
                               f"{gone}: {why}; lost: {SinkRowsLost.describe(lost)}", lost) from error
        if host in self.alive:
            self.alive.discard(host)
            self._event("host_lost_after_end", host=host, containers=on_it)

    async def sink_write_times(self, sink_name: str) -> dict[tuple[int, int], float]:
        """(slice, epoch) -> first time a live host wrote that part of a memory sink (diagnostics)."""
        sink = next((s for s in self.plan.sinks if s.name == sink_name), None)
        if sink is None:
            raise KeyError(f"no sink named {sink_name!r}; sinks: {[s.name for s in self.plan.sinks]}")
        out: dict[tuple[int, int], float] = {}
        for part in await asyncio.gather(*[self.handles[h].sink_write_times.remote(sink.sink_id)
                                           for h in sorted(self.alive)], return_exceptions=True):
            if isinstance(part, dict):
                for k, t in part.items():
                    out[k] = min(t, out.get(k, t))
        return out

    async def backup_catalog(self) -> dict[int, list[tuple[int, int, int]]]:
        """Host id -> (stage, slice, epoch) of the backups it holds."""
        hosts = sorted(self.alive)
        return dict(zip(hosts, await asyncio.gather(*[self.handles[h].backups_held.remote() for h in hosts])))

    async def backup_plan(self) -> dict[int, dict[int, list[int]]]:
        """Stage id -> slice -> the hosts that should hold its backups (the chain)."""
        out: dict[int, dict[int, list[int]]] = {}
        for st in self.placement.containers:
            for peers in self._backup_chain(st).values():
                out.setdefault(st, {}).update(peers)
        return out

    async def container_handles(self) -> dict[int, Any]:
        """The actor hosting each live container, by container id (tests and the failure harness)."""
        return {c: self.handles[self.host_of[c]] for ids in self.placement.containers.values() for c in ids}

    def _remove_job_files(self) -> None:
        """Delete what this job made under its work directory: the whole directory when ``run``
        made it for the job; otherwise only the catalog (``master/``) and each of its hosts'
        stores (``host-<id>/``; a live host removes its own at its stop, these are the ones of
        hosts that died): nothing else in a directory the caller gave is touched."""
        if self.identity.get("made_workdir"):
            shutil.rmtree(self.workdir, ignore_errors=True)
            return
        shutil.rmtree(os.path.join(self.workdir, "master"), ignore_errors=True)
        for h in sorted(set(self.handles) | set(self.host_of.values()) | self.alive):
            shutil.rmtree(os.path.join(self.workdir, f"host-{int(h)}"), ignore_errors=True)

    async def host_handles(self) -> dict[int, Any]:
        """Live hosts by host id."""
        return {h: self.handles[h] for h in sorted(self.alive)}

    async def stop(self, cleanup: bool = True) -> None:
        """Stop and release every host; ``cleanup`` deletes what the job wrote under its work
        directory (``_remove_job_files``)."""
        self._job(StopAsked())
        self._save_progress()
        for task in self._background:
            task.cancel()  # (a probe left pending at the hosts' kill: "Task was destroyed but it is pending")
        await asyncio.gather(*self._background, return_exceptions=True)
        for h in sorted(self.alive):
            if self.handles.get(h) is None:
                continue  # (a host a restarted master did not find: dead, nothing to stop)
            try:
                await self.handles[h].stop.remote(cleanup)
            except RayActorError:
                pass  # a dead host has nothing left to stop
            except RayError as exc:
                # Its stop raised: the kill below ends it all the same, and the stop of the
                # other hosts must not wait on this one.
                log.warning("host %s: its stop failed (%s); killing it", h, exc)
        self.catalog.close()
        if cleanup:
            self._remove_job_files()
        # Files of pushes that never ran (a host that died, or stopped, with parts in flight to it).
        remove_job_files(shm_job_tag(ray.get_runtime_context().current_actor))
        for h, handle in self.handles.items():
            kill_host(h, handle)  # detached: nothing else would release them
