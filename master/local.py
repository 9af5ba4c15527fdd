"""An in-process driver for the container cores: same placement, routing, merge and recovery, no Ray.

Owns: running every ``ContainerCore`` of a job in this process, delivering
messages in a seeded random order (to show that the output does not depend
on delivery order), the master's books and its catalog, and, when asked,
killing hosts or the master between rounds. Migrations and recoveries run
the same protocol machines as the Ray master (``master.protocols``),
carried out by ``master.local_migration`` and ``master.local_recovery``.
Used by unit and property tests, the simulator (``chronostream.sim``) and as
a debug mode (``cs.run(query, executor="local")``). The real runtime is
``master.actor``.

A *host* stands for a ResourceContainer actor: it keeps a ``BackupStore``
and runs one or more cores (a recovery adds cores to live hosts). One round
steps every ready core once; the messages of a round are delivered before
its checkpoints ship to backup hosts (the runtime ships a checkpoint only
after the pushes of its epoch were accepted downstream).
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import pyarrow as pa

from chronostream.slices.plan import JobPlan
from chronostream.containers.backup_store import BackupStore
from chronostream.containers.core import ContainerCore, SinkParts, add_sink_parts
from chronostream.containers.epoch_message import EpochMessage
from chronostream.containers.output_log import OutputLog
from chronostream.containers.spill import SpillStore
from chronostream.master.catalog import MasterCatalog
from chronostream.master.job_state import JobState
from chronostream.master.local_migration import LocalMigration
from chronostream.master.local_recovery import LocalRecovery
from chronostream.master.local_shipping import LocalShipping
from chronostream.master.migration import (MigrationError, MigrationPhase, Transfer, balanced_moves, by_destination,
                                           compaction_moves, container_of_slices, group_transfers, resume_transfers,
                                           stage_hosts, stage_id_of)
from chronostream.master.protocols.gc import ChainsRead, GcProtocol, HeldRead, SaveMarks, Trim
from chronostream.master.protocols.job import (ContainerDone, ContainerFailed, Deployed, Enter, JobLifecycle, Kept,
                                               StopHosts)
from chronostream.master.protocols.migration import Interrupted
from chronostream.master.protocols.recovery import AtStep, HostsDied, PlanRecord, RecoveryProtocol
from chronostream.master.backups import chains_by_slice
from chronostream.master.placement import Placement
from chronostream.master.results import memory_sink_ids, sink_table
from chronostream.master.timeline import Timeline
from chronostream.master.recovery import (floors_of_sources, host_backup_peers, lost_containers,
                                          off_stage_backup_stages, recovery_slack)
from chronostream.slices.checkpoint import CheckpointCorrupt, RestorePoint, decode_outputs
from chronostream.slices.errors import RecoveryError


def make_core(plan: JobPlan, placement: Placement, c: int, sources: dict, *, slices: list[int] | None = None,
              output_log: OutputLog | None = None, backup_peers: dict | None = None, checkpoint_every: int = 0,
              full_checkpoint_every: int = 0, backup_store: BackupStore | None = None,
              checkpoint_interval_s: float = 0.0, spill: SpillStore | None = None,
              async_checkpoints: bool = True) -> ContainerCore:
    """One core for container ``c`` of ``placement`` (its slices, routes, senders, sinks).
    ``async_checkpoints=False`` encodes checkpoints in the step that takes them (no thread: the
    simulator's runs repeat bit for bit)."""
    stage_id = placement.stage_of[c]
    writers = {s.sink_id: s.sink.writer(f"c{c}") for s in plan.sinks if plan.streams[s.stream_id].stage_id == stage_id}
    dl = plan.dead_letter_sink.dead_letter_writer(f"c{c}", stage_id) \
        if plan.dead_letter_sink is not None else None
    return ContainerCore(plan, stage_id, c, placement.slices_of(c) if slices is None else slices,
                         placement.routes_for(plan, stage_id), placement.sender_coverage(plan, stage_id),
                         source_table=sources.get(stage_id), output_log=output_log, sink_writers=writers,
                         dead_letter_writer=dl, backup_peers=backup_peers, checkpoint_every=checkpoint_every,
                         full_checkpoint_every=full_checkpoint_every, backup_store=backup_store,
                         checkpoint_interval_s=checkpoint_interval_s, spill=spill,
                         async_checkpoints=async_checkpoints)


def build_cores(plan: JobPlan, placement: Placement, sources: dict, workdir: str | None = None,
                with_log: bool = False) -> dict[int, ContainerCore]:
    """Create one core per container of ``placement``."""
    root = Path(workdir or tempfile.mkdtemp(prefix="chronostream-local-")) if with_log else Path(".")
    return {c: make_core(plan, placement, c, sources,
                         output_log=OutputLog(root / f"container-{c}") if with_log else None)
            for ids in placement.containers.values() for c in ids}


#: A message in flight: (destination container, epoch, sender container, message).
Flight = tuple[int, int, int, EpochMessage]


class Network:
    """The hook through which the in-process driver delivers messages: which messages in flight
    arrive in a round, and in which order. This one delivers all of them, shuffled by the
    cluster's seeded generator, and with ``duplicate_every`` = k every k-th one twice. The
    simulator's network (``chronostream.sim``) holds some back for later rounds and delivers
    some twice. Faults reach a local job through this class, ``step_every`` (slow hosts) and
    ``run``'s ``on_round`` callback, never through the cores.
    """

    def __init__(self, duplicate_every: int = 0) -> None:
        self.duplicate_every = duplicate_every
        self.sent = 0

    def arrivals(self, rng: random.Random, in_flight: list[Flight]) -> tuple[list[Flight], list[Flight]]:
        """(the messages arriving now, in delivery order; those still in flight after this round)."""
        rng.shuffle(in_flight)
        if not self.duplicate_every:
            return in_flight, []
        now = []
        for flight in in_flight:
            now.append(flight)
            self.sent += 1
            if self.sent % self.duplicate_every == 0:
                now.append(flight)
        return now, []

    def delivered(self, flight: Flight, accepted: bool | None) -> None:
        """Told of each arrival: ``accepted`` as the receiving core's ``deliver`` answered (False: a
        duplicate or stale message it dropped), None when its destination is dead."""


class LocalCluster:
    """A job's cores and hosts in this process, with optional checkpoints, kills and recovery.

    >>> import chronostream as cs
    >>> from chronostream.dag import compile_query
    >>> from chronostream.master.placement import initial_placement
    >>> q = cs.Query(epoch_events=2)
    >>> _ = q.source("w", [{"w": x} for x in "abab"]).key_by("w").count(slices=2).sink(name="c")
    >>> plan, src = compile_query(q)
    >>> cl = LocalCluster(plan, initial_placement(plan, {0: 1, 1: 2}), src, checkpoint_every=1)
    >>> cl.run(kills={1: [2]}).results("c")["count"].to_pylist()
    [1, 2, 1, 2]
    """

    def __init__(self, plan: JobPlan, placement: Placement, sources: dict, *, seed: int = 0,
                 duplicate_every: int = 0, workdir: str | None = None, checkpoint_every: int = 0,
                 backup_factor: int = 2, full_checkpoint_every: int = 0, recompute_lost: bool = False,
                 merge_every: int = 16, checkpoint_interval_s: float = 0.0, output_logs: bool = False,
                 spill_state: bool = True, network: Network | None = None,
                 async_checkpoints: bool = True, deploy_rounds: int = 0) -> None:
        """``deploy_rounds``: the hosts start over that many first rounds (host ``h`` at round
        ``h % deploy_rounds``), the job runs once all did; a started host's containers step
        meanwhile, as on Ray, where a host runs once started while the deploy awaits the others."""
        self.plan = plan
        self.placement = placement
        self.sources = sources
        self.rng = random.Random(seed)
        self.network = network if network is not None else Network(duplicate_every)
        self.async_checkpoints = async_checkpoints
        # Hosts that step only every k-th round (a slow host; the simulator sets it), and how
        # many steps of a ready core each such host skipped.
        self.step_every: dict[int, int] = {}
        self.skipped_steps: dict[int, int] = {}
        self.fault_tolerant = checkpoint_every > 0 or checkpoint_interval_s > 0
        self.checkpoint_every = checkpoint_every
        self.checkpoint_interval_s = checkpoint_interval_s
        self.backup_factor = backup_factor
        self.full_checkpoint_every = full_checkpoint_every
        self.recompute_lost = recompute_lost
        self.merge_every = merge_every
        # Output logs feed replay (recovery and migration): kept when checkpointing or asked for.
        self.logged = self.fault_tolerant or output_logs
        # A directory made here is removed with the cluster (garbage collection or exit): a
        # test session runs hundreds of fault-tolerant local jobs. A caller's ``workdir`` stays.
        self._made_dir = tempfile.TemporaryDirectory(prefix="chronostream-local-") \
            if self.logged and workdir is None else None
        self.root = Path(workdir or self._made_dir.name) if self.logged else None  # type: ignore[union-attr]
        ids = [c for cs_ in placement.containers.values() for c in cs_]
        self.hosts: dict[int, int] = {c: c for c in ids}  # container -> host
        self.alive: set[int] = set(ids)  # the master's view of the live hosts
        self.processes: set[int] = set(ids)  # the hosts that really run (a restarted master probes them)
        self.next_id = max(ids) + 1
        self.stores: dict[int, BackupStore] = {}
        # Each host's spill store (long queues' middle chunks): under the workdir, or a
        # temporary directory made on the first spill.
        self.spill_state = spill_state
        self.spills: dict[int, SpillStore] = {}
        if self.fault_tolerant:
            self.stores = {h: BackupStore(self.root / f"host-{h}" / "backups", merge_every=merge_every) for h in ids}
        self.cores: dict[int, ContainerCore] = {}
        for stage_id in placement.containers:
            peers = self._backup_chain(stage_id) if self.fault_tolerant else {}
            for c in placement.containers[stage_id]:
                self.cores[c] = self._core(c, None, peers.get(c))
        self.in_flight: list[Flight] = []
        self.sink_parts: dict[int, dict[tuple[int, int], pa.Table]] = {}  # what the master holds
        self.checkpointed: set[tuple[int, int]] = set()
        self.shipping = LocalShipping(self)  # (the hosts' side: a master's crash leaves it as it is)
        self.timeline = Timeline()  # bounded per kind, as the Ray master's
        self.sent = 0
        self.gc = GcProtocol(plan, recovery_slack(self))  # (its marks: saved per producer stage)
        self.stale_backups_dropped = 0  # copies off their slice's chain dropped by GC
        self.migration: LocalMigration | None = None  # in progress, advanced once per round
        self.migrated: list[Transfer] = []  # finished or aborted
        # A recovery's step hook (failure injection: ``kill`` or ``crash_master`` from it) and the
        # recovery in progress.
        self.recovery_hook: Callable[["LocalCluster", AtStep], None] | None = None
        self.recovery: LocalRecovery | None = None
        self.round = 0
        # The master's books, saved where and when the Ray master saves them (``master.catalog``):
        # a master that dies (``crash_master``) comes back with them alone. The hosts' reports
        # (``checkpointed``), the sink parts and the timeline stay in memory here; the Ray master
        # hears the reports again and keeps the rest in its catalog.
        self.catalog = MasterCatalog(self.root / "master", sync=False) if self.fault_tolerant else None
        self.master_restarts = 0
        self._save_layout(None)  # (a caller's workdir may hold an earlier job's records: none carry over)
        if self.catalog is not None:
            self.catalog.save_migration(None, [])
            self.catalog.save_gc_marks({})
        # The job's state (``master.protocols.job``), the first container error, and the hosts
        # started so far by the deploy.
        self.job = JobLifecycle()
        self.error: BaseException | None = None
        self.stopped = False
        self.deploy_rounds = deploy_rounds
        self.unstarted: set[int] = set(self.alive) if deploy_rounds > 0 else set()
        self.deployed = False
        self._deploy_round()

    def _core(self, c: int, slices: list[int] | None, backup_peers: dict | None) -> ContainerCore:
        log = OutputLog(self.root / f"container-{c}" / "output-log") if self.logged else None
        return make_core(self.plan, self.placement, c, self.sources, slices=slices, output_log=log,
                         backup_peers=backup_peers, checkpoint_every=self.checkpoint_every,
                         full_checkpoint_every=self.full_checkpoint_every,
                         checkpoint_interval_s=self.checkpoint_interval_s,
                         backup_store=self.stores.get(self.hosts[c]), spill=self._spill_store(self.hosts[c]),
                         async_checkpoints=self.async_checkpoints)

    def _spill_store(self, host: int) -> SpillStore | None:
        if not self.spill_state:
            return None
        if host not in self.spills:
            self.spills[host] = SpillStore(self.root / "spill" / f"host-{host}" if self.root else None)
        return self.spills[host]

    def _event(self, kind: str, **info: Any) -> None:
        self.timeline.add((time.time(), kind, info))

    def _live(self) -> frozenset[int]:
        return frozenset(c for ids in self.placement.containers.values() for c in ids)

    def _job(self, event: Any) -> None:
        """The job's state changes here only (``JobMaster._job``)."""
        for cmd in self.job.handle(event):
            if isinstance(cmd, Enter):
                self._event(f"job_{cmd.state}", **cmd.info)
            elif isinstance(cmd, Kept):
                self._event("state_kept", state=cmd.state.value, refused=cmd.refused.value)
            elif isinstance(cmd, StopHosts):
                self.stopped = True  # (no core steps again; the deploy still ends)

    def _fail(self, container: int, error: BaseException) -> None:
        """A container raised (``JobMaster.container_failed``): the job fails with its error."""
        if self.error is None:
            self.error = error
        stage = self.plan.stages[self.placement.stage_of[container]].name
        self._job(ContainerFailed(f"in container {container} (stage {stage!r})", str(error)))

    def _deploy_round(self) -> None:
        """Start this round's hosts; once every host started, the job runs (``Deployed``)."""
        if self.deployed:
            return
        self.unstarted -= {h for h in self.unstarted if h % max(1, self.deploy_rounds) == self.round}
        if self.round + 1 >= self.deploy_rounds:
            self.unstarted.clear()
            self.deployed = True
            self._job(Deployed(self._live(), {"containers": len(self.cores)}))

    def _save_layout(self, recovery: Any = ...) -> None:
        """Save the placement, hosts and next id (``JobMaster._save_layout``); ``recovery``: the
        recovery record saved with them (None once it ended; ``...``: unchanged)."""
        if self.catalog is not None:
            self.catalog.save_layout(self.placement, self.hosts, self.alive, {}, self.next_id, recovery)

    # -- running ---------------------------------------------------------------

    def run(self, kills: dict[int, list[int]] | None = None,
            faults: dict[int, Callable[["LocalCluster"], None]] | None = None, poll_s: float = 0.02,
            timeout_s: float = 600.0, on_round: Callable[["LocalCluster"], None] | None = None,
            max_rounds: int | None = None) -> "LocalCluster":
        """Run to completion.

        ``kills`` maps a round number to the hosts that die after its steps;
        ``faults`` maps a round number to any function of this cluster (it
        may corrupt backups, then ``kill``); ``on_round`` is called after the
        steps of every round (the simulator's faults). ``max_rounds`` bounds a
        run that no longer progresses in time (``RuntimeError``).
        """
        todo: dict[int, Callable[[LocalCluster], None]] = dict(faults or {})
        for r, hosts in (kills or {}).items():
            todo[r] = lambda cl, hosts=hosts: cl.kill(hosts)
        deadline = time.monotonic() + timeout_s
        # (messages still in flight at the end arrive too: a late copy is refused, not lost from view;
        # a failed job's deploy still ends)
        while not self.deployed or not self.stopped and (
                not all(c.done for c in self.cores.values()) or self.migrations or self.in_flight):
            rnd = self.round
            self._deploy_round()
            progressed = self._step_all()
            progressed |= not self.deployed
            if rnd in todo or on_round is not None:
                if rnd in todo:
                    todo.pop(rnd)(self)
                if on_round is not None:
                    on_round(self)
                progressed = True
            progressed |= self._deliver()
            progressed |= self.shipping.sweep()  # (rounds whose messages left the network ship now)
            progressed |= self._advance_migrations()
            # (recomputing needs every log from epoch 0; a migration replays from its restore point)
            if self.fault_tolerant and not self.recompute_lost and not self.migrations:
                self.collect_garbage()
            self.round += 1
            if max_rounds is not None and self.round > max_rounds:
                raise RuntimeError(f"local run did not finish in {max_rounds} rounds")
            if not progressed:
                readers = [c for c in self.cores.values() if c.reader is not None and not c.done]
                if not readers or time.monotonic() > deadline:
                    stuck = [t.describe() + f" in {t.phase.value}" for t in self.migrations]
                    raise RuntimeError("local run stalled: no container ready and nothing in flight"
                                       + (f"; migrations: {stuck}" if stuck else ""))
                time.sleep(poll_s)  # a followed source log: wait for the writer
                for c in readers:
                    c.poll_source()
        if self.error is not None:
            raise self.error  # (the job failed: the container's own error, as ``Job.wait`` names it)
        live = self._live()
        for c in sorted(live):
            if c in self.cores and self.cores[c].done:
                self._job(ContainerDone(c, live))
        return self

    def _step_all(self) -> bool:
        progressed = False
        # A migration destination catching up has a backlog (the replay): it may run ahead.
        catching_up = {t.new_id for t in self.migrations if t.phase is MigrationPhase.DUAL}
        for cid in sorted(self.cores):
            core = self.cores[cid]
            if self.stopped or self.hosts[cid] in self.unstarted:
                continue
            every = self.step_every.get(self.hosts[cid], 1)
            if every > 1 and self.round % every:
                if core.ready():
                    self.skipped_steps[self.hosts[cid]] = self.skipped_steps.get(self.hosts[cid], 0) + 1
                continue
            for _ in range(8 if cid in catching_up else 1):
                if not core.ready():
                    break
                epoch = core.next_epoch
                try:
                    sent = core.step()
                except Exception as exc:  # noqa: BLE001 - a container's error fails the job (``_fail``)
                    self._fail(cid, exc)
                    return True
                for dst, msg in sent.items():
                    self.in_flight.append((dst, epoch, cid, msg))
                parts, frames = core.take_sink_parts(), core.take_backups()
                if parts or frames:  # (the shipping machine decides when they leave: containers.shipping)
                    self.shipping.take_round(cid, epoch, parts, frames)
                progressed = True
            notice = core.take_end_notice()
            if notice is not None:  # a followed input sealed after its last epoch was processed
                self.in_flight += [(dst, notice[0], cid, msg) for dst, msg in notice[1].items()]
                progressed = True
        return progressed

    def _deliver(self) -> bool:
        progressed = bool(self.in_flight)
        now, self.in_flight = self.network.arrivals(self.rng, self.in_flight)
        for flight in now:
            dst, epoch, sender, msg = flight
            core = self.cores.get(dst)
            if core is None:  # sent to a dead container: lost (replayed from output logs later)
                self.network.delivered(flight, None)
                continue
            self.network.delivered(flight, core.deliver(epoch, sender, msg))
            self.sent += 1
        return progressed

    def collect_garbage(self) -> int:
        """Trim output logs and carried outputs below the low-water marks and drop stale backup
        copies (``master.protocols.gc``); returns how many entries were trimmed."""
        held = {h: store.epochs() for h, store in self.stores.items()}  # (a dead host's store is gone)
        dropped = 0
        for cmd in self.gc.handle(HeldRead(tuple(held.values()))):
            if isinstance(cmd, SaveMarks) and self.catalog is not None:  # (before any host trims to them)
                self.catalog.save_gc_marks(cmd.marks)
            elif isinstance(cmd, Trim):
                for core in self.cores.values():
                    dropped += core.gc(cmd.marks.get(core.stage.stage_id, -1))
                for store in self.stores.values():
                    for stage_id, lw in cmd.marks.items():
                        dropped += store.trim_outputs(stage_id, lw)
        for cmd in self.gc.handle(ChainsRead(self.slice_chains(), held)):
            self.stale_backups_dropped += sum(self.stores[cmd.host].drop(st, sl) for st, sl in cmd.keys)
        return dropped

    def source_log_floors(self) -> dict[str, int]:
        """Source stage name -> the first global order it may read again (``JobMaster.source_log_floors``)."""
        return floors_of_sources(self.plan, self.gc.source_floors)

    # -- migration and scaling (master.migration; docs/design.md section 7f) ----------

    def stage_id(self, stage: str | int) -> int:
        """A stage's id from its name (or id)."""
        return stage_id_of(self.plan, stage)

    def _new_host(self) -> int:
        h = self.next_id
        self.next_id += 1
        self.alive.add(h)
        self.processes.add(h)
        return h

    def _store(self, h: int) -> BackupStore:
        if h not in self.stores:
            assert self.root is not None
            self.stores[h] = BackupStore(self.root / f"host-{h}" / "backups", merge_every=self.merge_every)
        return self.stores[h]

    def migrate(self, stage: str | int, slices: list[int], to_host: int | None = None) -> list[Transfer]:
        """Start moving ``slices`` of ``stage`` to host ``to_host`` (None: a new host).

        Returns the transfers (one new container per source container);
        ``run`` advances them one phase at a time between rounds.
        """
        sid = self.stage_id(stage)
        where = container_of_slices(self.placement, sid)
        bad = [s for s in slices if s not in where]
        if bad:
            raise MigrationError(f"stage {self.plan.stages[sid].name!r} has no slices {bad}")
        placeholder = -1 if to_host is None else to_host
        if to_host is not None and to_host not in self.alive:
            raise MigrationError(f"host {to_host} is not alive")
        moves = [(s, self.hosts[where[s]], placeholder) for s in slices if self.hosts[where[s]] != to_host]
        return self._start(sid, moves, {-1: None} if to_host is None else {})

    def scale_out(self, stage: str | int, n: int = 1) -> list[Transfer]:
        """Add ``n`` hosts to ``stage`` and move slices so every host runs an even share."""
        sid = self.stage_id(stage)
        layout = stage_hosts(self.placement, self.hosts, sid)
        new = [-(i + 1) for i in range(n)]  # placeholders for hosts still to be created
        moves = balanced_moves(layout, list(layout) + new, container_of=container_of_slices(self.placement, sid))
        return self._start(sid, moves, {h: None for h in new})

    def scale_in(self, stage: str | int, n: int = 1) -> list[Transfer]:
        """Move every slice off ``n`` of ``stage``'s hosts (those with the fewest slices)."""
        sid = self.stage_id(stage)
        layout = stage_hosts(self.placement, self.hosts, sid)
        if n >= len(layout):
            raise MigrationError(f"stage {self.plan.stages[sid].name!r} runs on {len(layout)} hosts; "
                                 f"cannot remove {n}")
        leaving = sorted(layout, key=lambda h: (len(layout[h]), -h))[:n]
        staying = [h for h in layout if h not in leaving]
        holders: dict[int, set[int]] = {}
        for h in staying:
            for (st, s), _e in (self.stores[h].epochs() if h in self.stores else {}).items():
                if st == sid:
                    holders.setdefault(s, set()).add(h)
        moves = balanced_moves({**{h: layout[h] for h in staying}, -1: [s for h in leaving for s in layout[h]]},
                               staying, holders=holders)
        where = container_of_slices(self.placement, sid)
        return self._start(sid, [(s, self.hosts[where[s]], t) for s, _, t in moves], {})

    def compact(self, stage: str | int) -> list[Transfer]:
        """Merge ``stage``'s containers on each host into one (``master.migration.compaction_moves``)."""
        sid = self.stage_id(stage)
        return self._start(sid, compaction_moves(self.placement, self.hosts, sid), {}, handover=True)

    def _start(self, sid: int, moves: list[tuple[int, int, int]], new_hosts: dict[int, int | None],
               handover: bool = False) -> list[Transfer]:
        """``handover``: a compaction (the slices stay in their process: handed over, not copied)."""
        if self.migrations:
            raise MigrationError("a migration is in progress; one at a time")
        if self.job.state is not JobState.RUNNING:  # (``JobMaster._check_can_migrate``)
            raise MigrationError(f"the job is {self.job.state}: nothing to rescale")
        if not self.logged:
            raise MigrationError("migration replays upstream output logs: create the cluster with "
                                 "output_logs=True or checkpoints")
        # (a source stage's migration has no producer to mark one release epoch for several
        # sources: one new container each; a handover's host fixes one epoch for all)
        source_stage = self.plan.stages[sid].kind == "source"
        transfers = group_transfers(moves, container_of_slices(self.placement, sid), sid, self.next_id, new_hosts,
                                    shared_destination=handover or not source_stage)
        if not transfers:
            return []
        for t in transfers:
            t.handover = handover
        self.next_id = max([self.next_id] + [t.new_id + 1 for t in transfers])
        self._save_layout()  # (next_id: a restarted master never reuses the new ids)
        self.migration = LocalMigration(self, sid, transfers)
        self._event("migration_start", stage=sid, transfers=[(t.source, t.new_id, t.slices) for t in transfers])
        return transfers

    @property
    def migrations(self) -> list[Transfer]:
        """The transfers of the migration in progress (empty: none)."""
        return self.migration.transfers if self.migration is not None else []

    def _advance_migrations(self) -> bool:
        """Advance the migration in progress by a round (``LocalMigration.advance``)."""
        if self.migration is None:
            return False
        changed = self.migration.advance()
        if self.migration.finished:
            self._finish_migrations()
        return changed

    def producers(self, stage_id: int) -> list[tuple[int, ContainerCore]]:
        """The live containers of every stage feeding ``stage_id``."""
        return [(c, self.cores[c]) for u in self.plan.upstream_stages(stage_id)
                for c in self.placement.containers[u] if c in self.cores]

    def _finish_migrations(self) -> None:
        stages = sorted({t.stage_id for t in self.migrations})
        if self.fault_tolerant:  # (a released host may have held backups of stages on few hosts)
            self._retarget(set(stages) | off_stage_backup_stages(self.placement, self.hosts, self.backup_factor))
        self._event("migration_end", transfers=[(t.source, t.new_id, t.slices, t.phase.value, t.pause_ms)
                                                 for t in self.migrations])
        assert self.migration is not None
        self.migration.forget()
        self.migrated += self.migrations
        self.migration = None
        self._save_layout()
        if self.catalog is not None:
            self.catalog.save_migration(None, [])

    def _settle_migrations(self, dead: set[int]) -> None:
        """Hosts died mid-migration: finish what can finish (the destination has the slices),
        abort what cannot (the destination died before the source let go)."""
        if self.migration is None:
            return
        self.migration.settle(Interrupted(frozenset(dead), f"hosts {sorted(dead)} died"))
        if self.migration.finished:
            self._finish_migrations()

    # -- faults and recovery -------------------------------------------------------

    def kill(self, hosts: list[int]) -> None:
        """Hosts die: their cores, output logs and backups are gone; then recover their slices
        (``master.protocols.recovery``). Called from a recovery's step hook (``recovery_hook``),
        the step fails and the recovery plans for these hosts too."""
        dead = {h for h in hosts if h in self.alive}
        if not dead:
            return
        lost = lost_containers(self.placement, self.hosts, dead)
        self._event("fault", hosts=sorted(dead), containers=sorted(lost))
        self.alive -= dead
        self.processes -= dead
        gone = [c for c in self.cores if self.hosts[c] in dead]  # (migration destinations too)
        for c in gone:
            self.cores.pop(c).close()
        self.shipping.forget(gone)
        for h in dead:
            store = self.stores.pop(h, None)
            if store is not None:
                store.close(flush=False)
        # Messages of the dead still in flight: some arrived, some were lost.
        self.in_flight = [m for m in self.in_flight if m[2] not in lost or self.rng.random() < 0.5]
        if self.recovery is not None:
            self.recovery.died_in_step |= dead
            return
        self._settle_migrations(dead)
        LocalRecovery(self).run(RecoveryProtocol(), HostsDied(frozenset(dead)))

    def crash_master(self) -> None:
        """The master dies and a new one starts: everything it held in memory is gone (the
        migration and recovery in progress, its placement and hosts); it comes back from its
        catalog alone, finds which hosts still run, settles a migration it left and runs a
        recovery it left again (``JobMaster._resume``). Called from a recovery's step hook, the
        recovery stops at that step and the new master resumes it."""
        if self.catalog is None:
            raise RecoveryError("a master without checkpoints keeps no catalog to restart from")
        if self.recovery is not None:
            self.recovery.master_crashed = True
            return
        self._restart_master()

    def _restart_master(self) -> None:
        assert self.catalog is not None
        self.master_restarts += 1
        if self.migration is not None:  # (the dead master's: nothing of it is saved any more)
            self.migration.forget()
        self.migration = None
        self.placement, self.hosts, self.alive, _nodes, self.next_id = self.catalog.load_layout()
        self.gc = GcProtocol(self.plan, recovery_slack(self), self.catalog.load_gc_marks())
        record = self.catalog.load_recovery()
        _request, left = self.catalog.load_migration()
        self._event("master_restarted", hosts=sorted(self.alive), containers=len(self.hosts))
        # A recovery left unfinished comes first (``JobMaster._ensure_watching``), with the hosts
        # that died while the master was away (its probe).
        found = self.alive - self.processes
        if record is not None or found:
            plans = [PlanRecord.from_plain({**p, "resumed": True}) for p in (record or {}).get("plans", [])]
            planned = {h for p in plans for h in p.dead}
            dead = set((record or {}).get("dead", [])) | found
            self.alive -= found
            self._event("recovery_resumed", hosts=sorted(planned | dead))
            if left:  # (a migration meeting a death settles first, as ``kill`` does)
                self._settle_left_over(left, found)
                left = []
            LocalRecovery(self).run(RecoveryProtocol(plans, planned), HostsDied(frozenset(dead)))
        if left:
            self._settle_left_over(left, set())

    def _settle_left_over(self, left: list[dict[str, Any]], dead: set[int]) -> None:
        """A restarted master's migration in progress: finish or undo it (``JobMaster._settle_pending``)."""
        transfers, rehosted = resume_transfers(left, self.placement, self.hosts)
        self._event("migration_resumed", transfers=list(left))
        for t in rehosted:
            self._event("migration_rehosted", container=t.new_id, slices=t.slices)
        # A compaction's fate is decided first, on its host, against the handover itself
        # (``ResourceContainer.handover_state``): cancelled unless it happened already.
        handed_over = {}
        live = [t for t in transfers if t.phase not in (MigrationPhase.DONE, MigrationPhase.ABORTED)]
        for new_id, group in by_destination(live).items():
            t0 = group[0]
            if t0.handover and t0.host in self.alive and t0.phase is not MigrationPhase.RELEASING:
                handed_over[new_id] = self._cancel_handover(new_id, [t.source for t in group])
        self.migration = LocalMigration(self, transfers[0].stage_id, transfers)
        why = f"hosts {sorted(dead)} died" if dead else "the master restarted"
        self.migration.settle(Interrupted(frozenset(dead), why, handed_over))
        if self.migration.finished:
            self._finish_migrations()

    def _cancel_handover(self, new_id: int, sources: list[int]) -> bool:
        """Cancel a compaction's handover unless it happened; True when it had."""
        dest = self.cores.get(new_id)
        if dest is not None and not dest.awaiting_handover:
            return True
        for c in sources:
            if c in self.cores:
                self.cores[c].stop_before = None
        return False

    def _backup_chain(self, stage_id: int) -> dict[int, dict[int, list[int]]]:
        """``host_backup_peers`` as placed now: a stage on one host backs up to the other live hosts."""
        return host_backup_peers(self.placement, self.hosts, stage_id, self.backup_factor, sorted(self.alive))

    def _retarget(self, stages: set[int]) -> None:
        """Re-plan the backup chains of ``stages`` over the hosts as they are now."""
        for st in sorted(stages):
            for c, peers in self._backup_chain(st).items():
                if c in self.cores and self.cores[c].checkpointer is not None:
                    self.cores[c].checkpointer.retarget(peers)

    def slice_chains(self, stages: Iterable[int] | None = None) -> dict[tuple[int, int], list[int]]:
        """(stage, slice) -> its backup hosts in chain order (l = 1 first), as placed now, for
        ``stages`` (default: every stage)."""
        stages = [st.stage_id for st in self.plan.stages] if stages is None else stages
        return chains_by_slice({st: self._backup_chain(st) for st in stages})

    def chain_order(self, lost: dict[int, tuple[int, list[int]]]) -> dict[tuple[int, int], list[int]]:
        """(stage, slice) -> its backup hosts in chain order, as they were shipped to, for the
        stages of the ``lost`` containers."""
        return self.slice_chains({st for st, _ in lost.values()})

    def _load_backup(self, stage_id: int, slice_id: int, holders: list[int]) -> RestorePoint:
        """The ``RestorePoint`` of the newest verified checkpoint among ``holders``
        (no holder: rebuild from the start)."""
        errors = []
        for h in holders:
            try:
                store = self.stores[h]
                ckpt, outs, seed = store.restore_point(stage_id, slice_id)
                return RestorePoint(ckpt, [decode_outputs(b) for b in outs], seed)
            except (CheckpointCorrupt, KeyError) as exc:
                errors.append(f"host {h}: {exc}")
                self._event("backup_rejected", stage=stage_id, slice=slice_id, host=h, error=str(exc))
        if holders:

            raise RecoveryError(f"no usable backup of stage {self.plan.stages[stage_id].name!r} slice {slice_id}: "
                                + "; ".join(errors))
        return RestorePoint(None, [], [])

    def close(self) -> None:
        """Close every core, backup store and spill store, and remove the directory made here (a
        caller's ``workdir`` stays)."""
        for core in list(self.cores.values()):
            core.close()
        for store in self.stores.values():
            store.close(flush=False)
        self.stores.clear()
        for spill in self.spills.values():
            spill.close()
        self.spills.clear()
        if self.catalog is not None:
            self.catalog.close()
        if self._made_dir is not None:
            self._made_dir.cleanup()

    # -- reading -------------------------------------------------------------

    def results(self, sink_name: str) -> pa.Table:
        """A memory sink's rows: parts handed over at checkpoints plus the live cores' own."""
        ids = memory_sink_ids(self.plan, sink_name)
        parts = {i: dict(self.sink_parts.get(i, {})) for i in ids}
        for core in self.cores.values():
            add_sink_parts(parts, core.sink_parts(ids))
        return sink_table(parts, self.plan.source_dead_letters)


def run_local(plan: JobPlan, placement: Placement, sources: dict, seed: int = 0,
              duplicate_every: int = 0, poll_s: float = 0.02, timeout_s: float = 600.0,
              spill_state: bool = True) -> dict[int, ContainerCore]:
    """Run the job to completion in this process; return the cores (their sinks hold the output).

    Messages are delivered in a seeded shuffled order; with ``duplicate_every``
    = k every k-th message is delivered twice (dedup must absorb it).
    """
    cluster = LocalCluster(plan, placement, sources, seed=seed, duplicate_every=duplicate_every,
                           spill_state=spill_state)
    return cluster.run(poll_s=poll_s, timeout_s=timeout_s).cores


def collect(plan: JobPlan, cores: dict[int, ContainerCore], sink_name: str) -> pa.Table:
    """A memory sink's rows over all cores (``run_local``'s), sorted by identity."""
    ids = memory_sink_ids(plan, sink_name)
    parts: dict[int, SinkParts] = {i: {} for i in ids}
    for core in cores.values():
        add_sink_parts(parts, core.sink_parts(ids))
    return sink_table(parts, plan.source_dead_letters)
