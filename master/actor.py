"""The JobMaster Ray actor: the job's books and its remote methods, a shell over one module per topic.

Owns the books (plan, placement, hosts and their handles, liveness, the
job's state through ``master.protocols.job``, the catalog, the timeline)
and the calls hosts and clients make. The work is done by its topic
drivers: ``master.ray_deploy`` (deploy, a restarted master's reload), ``ray_stop``,
``ray_hosts`` (making, finding, probing, releasing hosts), ``ray_sources``,
``ray_chains`` (backup chains, GC), ``ray_watch`` (detection, recovery entry),
``ray_scaling`` (rescaling, autoscaler), ``ray_reads``, ``ray_savepoints``, ``ray_disk_copies``,
``ray_sinks``, and the machines' drivers ``ray_migration`` and ``ray_recovery``. The data plane
never waits on the master.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

import numpy as np
import pyarrow as pa
import ray

from chronostream.slices.plan import JobPlan
from chronostream.containers.logs import configure_from_env
from chronostream.containers.stall_probe import start_from_env as start_stall_probe
from chronostream.containers.core import ContainerStatistics
from chronostream.containers.sink_parts import PackedSinkParts
from chronostream.master.policies import Decision
from chronostream.containers.metrics import MetricsSnapshot
from chronostream.containers.options import JobOptions
from chronostream.master.autoscaler import Counters
from chronostream.master.catalog import CatalogError, MasterCatalog
from chronostream.master.job_state import JobState
from chronostream.master.launch import JobLaunch
from chronostream.master.ray_chains import RayChains
from chronostream.master.ray_deploy import RayDeploy
from chronostream.master.ray_hosts import RayHosts
from chronostream.master.ray_reads import RayReads
from chronostream.master.ray_disk_copies import DiskCopies
from chronostream.master.ray_savepoints import RaySavepoints
from chronostream.master.ray_sinks import RaySinks
from chronostream.master.ray_scaling import RayScaling
from chronostream.master.ray_sources import SourceRefs
from chronostream.master.ray_stop import RayStop
from chronostream.master.ray_watch import RayWatch
from chronostream.master.protocols.gc import GcProtocol
from chronostream.master.protocols.job import (ContainerDone, ContainerFailed, Enter, JobLifecycle, Kept, Settled,
                                               StopHosts)
from chronostream.master.placement import Placement
from chronostream.master.results import SinkPartRefs
from chronostream.master.rpc_results import MasterStatus, PlacementView
from chronostream.master.timeline import Timeline
from chronostream.master.recovery import RECOVERY_ROLES, RECOVERY_STEPS, floors_of_sources, recovery_slack

log = logging.getLogger("chronostream.master")

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
        # CHRONOSTREAM_STALL_MS: see chronostream.containers.stall_probe
        self._stall_probe = start_stall_probe("master")
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
        self.next_id, self._watching = 0, False
        self.threads_asked: dict[int, int] = {}  # container -> threads last asked for (set_threads)
        # The master's own loops (watch, autoscaler, a resumed recovery or migration): cancelled
        # first at the stop, so none is left waiting on a host the stop kills.
        self._background: list[asyncio.Task] = []
        self.gc_dropped = self.stale_backups_dropped = 0  # (the latter: copies off their slice's chain)
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
        # The master's work by topic, each a driver over the books above (one module each).
        self.deployer = RayDeploy(self)
        self.hosts = RayHosts(self)
        self.stopper = RayStop(self)
        self.sources = SourceRefs(self)
        self.chains = RayChains(self)
        self.scaling = RayScaling(self)
        self.watcher = RayWatch(self)
        self.reads = RayReads(self)
        self.savepoints = RaySavepoints(self)
        self.disk_copies = DiskCopies(self)
        self.sinks = RaySinks(self)
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
            self.deployer.resume()

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
        self.restored_from = (launch.restore_from, launch.drop_states)  # (a savepoint the job started from)

    def _ensure_watching(self) -> None:
        if not self._watching and self.state is JobState.RUNNING:
            self._watching = True
            if self._unfinished_recovery is not None:  # (first: it takes the lock before the watch loop looks)
                self._in_background(self.watcher.resume())
            self._in_background(self.watcher.watch())
            if self._unsettled:
                self._in_background(self.scaling.settle_left_over())

    def _in_background(self, coro: Any) -> None:
        self._background.append(asyncio.get_running_loop().create_task(coro))

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
                    self.sinks.commit_soon(cmd.state)
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

    async def kill_next_spare(self) -> None:
        """Failure injection (``kill_spare``): the next spare this master takes dies before its adoption."""
        self._kill_spare = True

    async def deploy(self, launch: bytes, source_refs: dict[int, list], made_workdir: bool = False) -> dict[str, Any]:
        """Create, configure and start every container of the job ``launch`` describes
        (``JobLaunch.pack``); ``source_refs``: stage id -> [object reference of its in-memory
        table]; ``made_workdir``: ``run`` made the work directory (``RayDeploy.deploy``). Returns
        the placement."""
        return await self.deployer.deploy(launch, source_refs, made_workdir)

    async def wants_source_refs(self) -> tuple[bool, JobState]:
        """(Whether this master waits for the client's source table references, the job's state)."""
        return self.sources.wanted(), self.state

    async def give_source_refs(self, source_refs: dict[int, list]) -> list[int]:
        """The client's ``Job`` handle hands back the source tables' references (stage id ->
        [reference]); returns the stages the master lacked (``SourceRefs.give``)."""
        return await self.sources.give(source_refs)

    # -- recovery (master.ray_watch, master.ray_recovery; docs/design.md section 7d) ----------

    async def container_unreachable(self, container_id: int, reporter: int) -> None:
        """A host could not push to ``container_id``: check its host now rather than at the next probe."""
        await self.watcher.unreachable(container_id, reporter)

    async def crash_in_recovery(self, step: str) -> None:
        """Failure injection (``kill_master_in_recovery``): this process exits at ``step`` of its next
        recovery (``RECOVERY_STEPS``); restarted, it resumes the recovery from its catalog. Once only."""
        if step not in RECOVERY_STEPS:
            raise ValueError(f"unknown recovery step {step!r}; steps: {RECOVERY_STEPS}")
        self._crash_at = step

    async def kill_in_recovery(self, step: str, role: str) -> None:
        """Failure injection (``kill_in_recovery``): at ``step`` of its next recovery this master kills
        the lowest host with ``role`` in it (``RECOVERY_ROLES``). Once only."""
        if step not in RECOVERY_STEPS:
            raise ValueError(f"unknown recovery step {step!r}; steps: {RECOVERY_STEPS}")
        if role not in RECOVERY_ROLES:
            raise ValueError(f"unknown role {role!r}; roles: {RECOVERY_ROLES}")
        self._kill_at = (step, role)

    # -- rescaling (master.ray_scaling, master.migration; docs/design.md section 7f) ----------

    async def scale_out(self, stage: str | int, n: int = 1, reason: str = "requested",
                        request: str | None = None) -> dict[str, Any]:
        """Add ``n`` hosts to ``stage`` and even its slices out; ``request`` makes the call idempotent."""
        return await self.scaling.scale_out(stage, n, reason, request)

    async def scale_in(self, stage: str | int, n: int = 1, reason: str = "requested",
                       request: str | None = None) -> dict[str, Any]:
        """Move every slice off ``n`` of ``stage``'s hosts (those running the fewest slices), then release them."""
        return await self.scaling.scale_in(stage, n, reason, request)

    async def compact(self, stage: str | int, reason: str = "requested",
                      request: str | None = None) -> dict[str, Any]:
        """Merge ``stage``'s containers on each host into one; a no-op when every host runs one."""
        return await self.scaling.compact(stage, reason, request)

    async def migrate(self, stage: str | int, slices: list[int], to_container: int | None = None,
                      reason: str = "requested", baseline: str | None = None,
                      request: str | None = None) -> dict[str, Any]:
        """Move ``slices`` of ``stage`` to container ``to_container``'s host (None: a new host)."""
        return await self.scaling.migrate(stage, slices, to_container, reason, baseline, request)

    async def savepoint(self, path: str) -> dict[str, Any]:
        """Every slice's state at one epoch boundary to ``path``, the job running (``master.ray_savepoints``)."""
        return await self.savepoints.take(path)

    async def query_state(self, stage_id: int, wanted: dict[int, list[tuple]]) -> dict[int, dict[str, Any]]:
        """Slice -> keys: slice -> each state's values of those keys, read from the live slices."""
        return await self.savepoints.query(stage_id, wanted)

    async def set_threads(self, container: int, threads: int) -> dict[str, Any]:
        """Scale up/down (paper III-D): run ``container``'s slices on ``threads`` threads."""
        return await self.scaling.set_threads(container, threads)

    async def threads_of(self, container: int) -> int:
        """Threads of the table in effect in ``container`` (fresh from its host)."""
        return await self.scaling.threads_of(container)

    async def autoscale_trace(self) -> list[dict[str, Any]]:
        """The latest autoscaler ticks (plain ``Decision``s, at most ``DECISIONS_KEPT``)."""
        return [d.to_plain() for d in self.decisions]

    # -- reports from hosts ------------------------------------------------------------

    def _fail(self, container_id: int | None, error: BaseException) -> None:
        if self.state.terminal:
            return
        where = ""
        if container_id is not None and self.placement is not None and container_id in self.placement.stage_of:
            stage = self.plan.stages[self.placement.stage_of[container_id]].name
            where = f" in container {container_id} (stage {stage!r})"
        self.error = error
        self._job(ContainerFailed(where.strip(), str(error)))

    async def ping(self) -> str:
        """The job's state's plain value: a host's sign that its master lives (``EpochLoop.watch_master``)."""
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

    # -- reading (master.ray_reads) ---------------------------------------------------------

    async def status(self) -> MasterStatus:
        """The job's state (a ``JobState``), its error, and its progress."""
        return await self.reads.status()

    async def metrics_snapshot(self) -> MetricsSnapshot:
        """Per stage rates, utilization, backlog and per-slice figures; latency; per host CPU and RSS."""
        return await self.reads.metrics_snapshot()

    async def metrics(self, window: str = "") -> dict[str, Any]:
        """A fresh snapshot (plain; rates since ``window``'s previous call), the whole run's latency, autoscaler ticks."""
        return await self.reads.metrics(window)

    async def statistics(self) -> dict[int, ContainerStatistics]:
        """Latest statistics of every live container (fresh from the hosts)."""
        return await self.reads.statistics()

    async def placement_view(self) -> PlacementView:
        """Stage name -> container id -> slices, hosts, nodes and backup copies (``RayReads.placement_view``)."""
        return await self.reads.placement_view()

    async def recovery_timeline(self) -> list[tuple[float, str, dict[str, Any]]]:
        """What happened, in order: faults, detection, per-slice restore and first output after recovery."""
        return await self.reads.recovery_timeline()

    async def sink_part_refs(self, sink_name: str) -> SinkPartRefs:
        """Where every part of a memory sink (or the dead letters) is (``RayReads.sink_part_refs``)."""
        return await self.reads.sink_part_refs(sink_name)

    async def sink_write_times(self, sink_name: str) -> dict[tuple[int, int], float]:
        """(slice, epoch) -> first time a live host wrote that part of a memory sink (diagnostics)."""
        return await self.reads.sink_write_times(sink_name)

    async def backup_catalog(self) -> dict[int, list[tuple[int, int, int]]]:
        """Host id -> (stage, slice, epoch) of the backups it holds."""
        return await self.reads.backup_catalog()

    async def backup_plan(self) -> dict[int, dict[int, list[int]]]:
        """Stage id -> slice -> the hosts that should hold its backups (the chain)."""
        return self.chains.plan()

    async def source_log_floors(self) -> dict[str, int]:
        """Source stage name -> the first global order a recovery or migration may read again
        (``master.recovery.floors_of_sources``; 0: all of it)."""
        return floors_of_sources(self.plan, self.gc.source_floors if self.gc is not None else {})

    async def commit_sinks(self) -> list[str]:
        """Once the job finished: its Parquet sinks' staged parts committed into their files (``RaySinks``)."""
        return await self.sinks.commit()

    async def plan_of(self) -> JobPlan:
        """The job's plan (``Job.attach`` from another process)."""
        return self.plan

    async def container_handles(self) -> dict[int, Any]:
        """The actor hosting each live container, by container id (tests and the failure harness)."""
        return {c: self.handles[self.host_of[c]] for ids in self.placement.containers.values() for c in ids}

    async def host_handles(self) -> dict[int, Any]:
        """Live hosts by host id."""
        return {h: self.handles[h] for h in sorted(self.alive)}

    async def stop(self, cleanup: bool = True) -> None:
        """Stop and release every host; ``cleanup`` deletes what the job wrote, nothing else (``RayStop``)."""
        await self.stopper.stop(cleanup)
