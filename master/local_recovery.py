"""Carries out the recovery machine's commands in process, for ``LocalCluster``.

Owns the in-process side of a recovery: turning each command of
``master.protocols.recovery.RecoveryProtocol`` into changes to the cluster's
books (placement, hosts, catalog record) and cores, and their results into
events; a host killed from the step hook (``LocalCluster.recovery_hook``)
fails the step (``StepFailed``), a master crashing there ends the recovery
for the restarted master to resume. Decides nothing about the order of steps
(the machine does); the Ray twin is ``master.ray_recovery``.
"""

from __future__ import annotations

from typing import Any

from chronostream.master.protocols.recovery import (
    AcceptSenders, ApplyPlan, AtStep, BackupsRead, Declared, DeclareDead, Finish, HostMade, MakeHost, PlanInputs,
    ReadBackups, RecoveryProtocol, ReplayToConsumers, Reroute, Rerouted, Restore, Restored, RestoreSlices,
    Retargeted, RetargetBackups, StartContainers, StepFailed, Survey, Surveyed)
from chronostream.master.recovery import (live_hosts, lost_containers, off_stage_backup_stages, rebuildable_stages,
                                          recovery_slack, replay_targets, restore_floor, restore_order)
from chronostream.slices.errors import RecoveryError


class LocalRecovery:
    """Drives one ``RecoveryProtocol`` for ``cluster`` (a ``LocalCluster``), to its end."""

    def __init__(self, cluster: Any) -> None:
        self.cl = cluster
        self.died_in_step: set[int] = set()  # hosts killed from the step hook (the step fails)
        self.master_crashed = False  # the master died at a step hook (the recovery ends there)

    def run(self, machine: RecoveryProtocol, first: Any) -> None:
        """Drive a recovery machine to its end, in process: its commands in order, their results
        fed back; a host killed during a command (the step hook) fails the step."""
        self.cl.recovery = self
        try:
            events = [first]
            while events:
                commands = [c for e in events for c in machine.handle(e)]
                events = []
                for cmd in commands:
                    result = self._one(cmd)
                    if self.master_crashed:  # (the master died: its recovery goes with it)
                        events = []
                        break
                    if self.died_in_step:
                        dead, self.died_in_step = frozenset(self.died_in_step), set()
                        self.cl._event("recovery_step_failed", hosts=sorted(dead), step=type(cmd).__name__)
                        self.cl._settle_migrations(set(dead))
                        events = [StepFailed(dead)]
                        break
                    if result is not None:
                        events.append(result)
        finally:
            self.cl.recovery = None
            self.died_in_step = set()
        if self.master_crashed:
            self.master_crashed = False
            self.cl._restart_master()

    def _one(self, cmd: Any) -> Any:
        """One command of the recovery machine, in this process; returns its result event (or None)."""
        if isinstance(cmd, DeclareDead):
            return Declared(cmd.dead)  # (fenced by ``kill``)
        if isinstance(cmd, Survey):
            lost = lost_containers(self.cl.placement, self.cl.hosts, set(cmd.dead))
            dead = sorted(cmd.dead) if lost else []
            self.cl._save_layout({"dead": dead, "plans": [p.to_plain() for p in cmd.plans]}
                                 if dead or cmd.plans else None)
            return Surveyed(lost, float(self.cl.round))
        if isinstance(cmd, AtStep):
            if self.cl.recovery_hook is not None:
                self.cl.recovery_hook(self.cl, cmd)
            return None
        if isinstance(cmd, ReadBackups):
            return BackupsRead(self._plan_inputs(cmd.lost))
        if isinstance(cmd, ApplyPlan):
            self.cl.next_id = max(self.cl.next_id, cmd.next_id)
            for a in cmd.made.plan:
                self.cl.hosts[a.new_id] = a.host  # type: ignore[assignment]
                self.cl.placement.rehost(a.replaces, a.new_id, a.slices)
            self.cl._save_layout({"dead": [], "plans": [p.to_plain() for p in cmd.plans]})
            return None
        if isinstance(cmd, MakeHost):
            self.cl.alive.add(cmd.host)
            self.cl.processes.add(cmd.host)
            self.cl._store(cmd.host)
            return HostMade(cmd.host)
        if isinstance(cmd, AcceptSenders):
            for a in cmd.plan:
                self.cl._event("recovery_start", container=a.replaces, new=a.new_id, host=a.host, slices=a.slices)
                coverage = frozenset((a.stage_id, s) for s in a.slices)
                for d in self.cl.plan.downstream_stages(a.stage_id):
                    for c in self.cl.placement.containers[d]:
                        if c in self.cl.cores and c not in cmd.not_made:
                            self.cl.cores[c].add_senders({a.new_id: coverage})
            return None
        if isinstance(cmd, RestoreSlices):
            restores = {}
            for a in cmd.plan:
                core = self.cl.cores.get(a.new_id)
                if core is None:  # (a step run again after a host died: made once)
                    core = self.cl._core(a.new_id, a.slices, None)
                    core.restore_slices({s: self.cl._load_backup(a.stage_id, s, restore_order(a.holders[s], a.host))
                                         for s in a.slices})
                    self.cl.cores[a.new_id] = core
                restores[a.new_id] = Restore({s: core.progress_of(s) for s in a.slices},
                                             {s: core.slices[s].last_epoch + 1 for s in a.slices})
            return Restored(cmd.plan_index, restores)
        if isinstance(cmd, StartContainers):
            return None  # (a core here runs once it exists)
        if isinstance(cmd, Reroute):
            a, epochs = cmd.adoption, 0
            for u in self.cl.plan.upstream_stages(a.stage_id):
                for c in self.cl.placement.containers[u]:
                    if c in self.cl.cores:
                        replay = self.cl.cores[c].reroute(a.stage_id, a.slices, a.new_id, cmd.restore.progress,
                                                       cmd.restore.resume)
                        self.cl.in_flight += [(a.new_id, e, c, m) for e, m in replay.items()]
                        epochs += len(replay)
            return Rerouted(a.new_id, epochs)
        if isinstance(cmd, ReplayToConsumers):
            self._replay_to_consumers(cmd)
            return None
        if isinstance(cmd, RetargetBackups):
            if self.cl.fault_tolerant:  # stages backed up off their hosts too: a dead host may have held them
                self.cl._retarget(set(cmd.stages) | off_stage_backup_stages(self.cl.placement, self.cl.hosts,
                                                                         self.cl.backup_factor))
            return Retargeted()
        if isinstance(cmd, Finish):
            self.cl._save_layout(None)
            for run in cmd.ran:
                for a in run:
                    core = self.cl.cores.get(a.new_id)
                    self.cl._event("recovery_end", container=a.replaces, new=a.new_id, host=a.host,
                                resume_epoch=None if core is None else core.next_epoch)
            return None
        raise RecoveryError(f"the in-process driver cannot carry out {cmd}")

    def _plan_inputs(self, lost: dict[int, tuple[int, list[int]]]) -> PlanInputs:
        """What the recovery planner needs: the live stores' catalogs (damaged copies named), the live
        hosts, the chains, the restore floor."""
        backups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        damaged: dict[tuple[int, int], list[str]] = {}
        for h, store in self.cl.stores.items():
            good, bad = store.catalog()
            for st, sl, epoch in good:
                backups.setdefault((st, sl), []).append((h, epoch))
            for st, sl, error in bad:
                self.cl._event("backup_rejected", stage=st, slice=sl, host=h, error=error)
                damaged.setdefault((st, sl), []).append(f"host {h}: {error}")
        return PlanInputs(backups, live_hosts(self.cl.placement, self.cl.hosts, self.cl.alive), self.cl.next_id,
                          frozenset(self.cl.checkpointed), self.cl.recompute_lost,
                          {s.stage_id: s.name for s in self.cl.plan.stages}, self.cl.chain_order(lost), damaged,
                          restore_floor(self.cl.plan, self.cl.gc.marks), recovery_slack(self.cl),
                          frozenset(rebuildable_stages(self.cl.plan)))

    def _replay_to_consumers(self, cmd: ReplayToConsumers) -> None:
        """A recovered producer replays its relogged outputs to each live consumer behind its
        restore point: the dead one's messages of those epochs may never have arrived (a
        replay it owed a migration's destination, in flight when it died, is covered by no
        checkpoint). A consumer keeps the dead sender's message of an epoch when it has it
        (``ContainerCore._epoch_messages``); adopted consumers were rerouted to already."""
        a = cmd.adoption
        core = self.cl.cores[a.new_id]
        for c, d in replay_targets(self.cl.plan, self.cl.placement.stage_of, a.stage_id, set(cmd.adopted)):
            consumer = self.cl.cores.get(c)
            if consumer is None or consumer.done:
                continue
            replay = core.replay_behind(d, c, consumer.next_epoch,
                                        {s: consumer.progress_of(s) for s in consumer.slices}, core.next_epoch)
            self.cl.in_flight += [(c, e, a.new_id, m) for e, m in replay.items()]
