"""Carries out the recovery machine's commands on Ray hosts, for the ``JobMaster``.

Owns the Ray side of a recovery: turning each command of
``master.protocols.recovery.RecoveryProtocol`` into calls on the hosts and
the master's books (placement, hosts, catalog record) and their answers
into events; when a step raises, probing the hosts and reporting the dead
(``StepFailed``), or re-raising when every host is alive (the job fails).
Decides nothing about the order of steps (the machine does). Failure
injection (``JobMaster.crash_in_recovery``, ``kill_in_recovery``) happens at
the machine's ``AtStep`` hooks, here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from chronostream.master.job_state import JobState
from chronostream.master.protocols.recovery import (
    AcceptSenders, ApplyPlan, AtStep, BackupsRead, Command, Declared, DeclareDead, Event, Finish, HostMade,
    MakeHost, PlanInputs, ReadBackups, RecoveryProtocol, ReplayToConsumers, Reroute, Rerouted, Restore,
    Restored, RestoreSlices, Retargeted, RetargetBackups, StartContainers, StepFailed, Survey, Surveyed)
from chronostream.master.recovery import (live_hosts, lost_containers, rebuildable_stages,
                                          recovery_slack, replay_targets, restore_floor, restore_order)

log = logging.getLogger("chronostream.master")


class RayRecovery:
    """Drives one ``RecoveryProtocol`` for ``master`` (a ``JobMaster``), under its control lock."""

    def __init__(self, master: Any) -> None:
        self.m = master

    async def run(self, machine: RecoveryProtocol, first: Event) -> None:
        """Feed ``first`` and every result after it until the recovery ends. Commands of one kind
        in a batch run concurrently, kinds in order; a batch that raises with a host found dead
        becomes ``StepFailed``, with every host alive it raises."""
        m = self.m
        events: list[Event] = [first]
        while events:
            commands = [c for e in events for c in machine.handle(e)]
            events = []
            try:
                for _kind, same in itertools.groupby(commands, key=type):
                    results = await asyncio.gather(*[self._one(c) for c in same])
                    events += [r for r in results if r is not None]
            except Exception as exc:  # noqa: BLE001 - re-raised unless a host died
                dead = await m.hosts.probe(sorted(m.alive)) if m.state is JobState.RUNNING else set()
                if not dead:
                    raise
                first_line = next(iter(str(exc).splitlines()), "")  # (Ray's errors run to many lines)
                m._event("fault_detected", hosts=sorted(dead),
                         by=f"probe after a recovery step failed ({type(exc).__name__}: {first_line})")
                events = [StepFailed(frozenset(dead), first_line)]

    # -- one command ---------------------------------------------------------------

    async def _one(self, cmd: Command) -> Event | None:
        m = self.m
        if isinstance(cmd, DeclareDead):
            return Declared(frozenset(await self._declare_dead(set(cmd.dead))))
        if isinstance(cmd, Survey):
            lost = lost_containers(m.placement, m.host_of, set(cmd.dead))
            dead = sorted(cmd.dead) if lost else []
            m._save_layout({"dead": dead, "plans": [p.to_plain() for p in cmd.plans]}
                           if dead or cmd.plans else None)
            m._event("recovery_planning", hosts=sorted(cmd.dead), containers=sorted(lost))
            return Surveyed(lost, time.time())
        if isinstance(cmd, AtStep):
            self._at_step(cmd)
            return None
        if isinstance(cmd, ReadBackups):
            return BackupsRead(await self._plan_inputs(cmd.lost))
        if isinstance(cmd, ApplyPlan):
            m.next_id = max(m.next_id, cmd.next_id)
            for a in cmd.made.plan:
                m.host_of[a.new_id] = a.host
                m.placement.rehost(a.replaces, a.new_id, a.slices)
            m._save_layout({"dead": [], "plans": [p.to_plain() for p in cmd.plans]})
            return None
        if isinstance(cmd, MakeHost):
            await m.hosts.new_or_found(cmd.host)
            await m.deployer.configure(cmd.host)
            return HostMade(cmd.host)
        if isinstance(cmd, AcceptSenders):
            calls = []
            for a in cmd.plan:
                m._event("recovery_start", container=a.replaces, new=a.new_id, host=a.host, slices=a.slices,
                         backup_epochs=a.epochs)
                cov = frozenset((a.stage_id, s) for s in a.slices)
                for d in m.plan.downstream_stages(a.stage_id):
                    for c in m.placement.containers[d]:
                        if m.host_of[c] in m.alive and c not in cmd.not_made:
                            calls.append(m.handles[m.host_of[c]].add_senders.remote(c, {a.new_id: cov}))
            await asyncio.gather(*calls)
            return None
        if isinstance(cmd, RestoreSlices):
            return await self._restore(cmd)
        if isinstance(cmd, StartContainers):
            await asyncio.gather(*[m.handles[a.host].start.remote([a.new_id]) for a in cmd.adoptions])
            return None
        if isinstance(cmd, Reroute):
            a = cmd.adoption
            calls = [m.handles[m.host_of[c]].reroute.remote(c, a.stage_id, a.slices, a.new_id, m.handles[a.host],
                                                            cmd.restore.progress, cmd.restore.resume)
                     for u in m.plan.upstream_stages(a.stage_id) for c in m.placement.containers[u]
                     if m.host_of[c] in m.alive]
            return Rerouted(a.new_id, sum(r["epochs"] for r in await asyncio.gather(*calls)))
        if isinstance(cmd, ReplayToConsumers):
            a = cmd.adoption
            calls = [m.handles[a.host].replay_to.remote(a.new_id, st, c, m.handles[m.host_of[c]], cmd.upto)
                     for c, st in replay_targets(m.plan, m.placement.stage_of, a.stage_id, set(cmd.adopted))
                     if m.host_of.get(c) in m.alive]
            for r in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(r, BaseException) and not isinstance(r, RayActorError):
                    raise r  # (a host that died on the way is recovered next: its consumers are rerouted to)
            return None
        if isinstance(cmd, RetargetBackups):
            # Backups over the stages' hosts as they are now (full checkpoints follow), also of
            # stages backed up off their own hosts: a dead host may have held their backups.
            await m.chains.retarget(set(cmd.stages) | m.chains.off_stage_stages(), tolerate_dead=False)
            return Retargeted()
        if isinstance(cmd, Finish):
            m._save_layout(None)
            for rec, run in zip(cmd.plans, cmd.ran):
                m._event("recovery_end", containers=sorted(rec.lost), new=[a.new_id for a in run],
                         hosts=sorted({a.host for a in run}), epochs_replayed=sum(cmd.epochs.get(a.new_id, 0)
                                                                                  for a in run),
                         seconds=round(time.time() - rec.t0, 3), **({"resumed": True} if rec.resumed else {}))
            return None
        raise TypeError(f"the Ray driver cannot carry out {cmd}")

    async def _declare_dead(self, dead: set[int]) -> set[int]:
        """``dead`` and the hosts found dead with them (a node takes all its hosts; any other
        host that no longer answers), fenced and out of the live set: one plan for them all."""
        m = self.m
        dead_nodes = {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}
        on_dead_nodes = {h for h in m.alive if m.nodes.get(h) in dead_nodes}
        more = (on_dead_nodes | await m.hosts.probe(sorted(m.alive - dead))) - dead
        if more:
            m._event("fault_detected", hosts=sorted(more), by="probe during recovery"
                     + (" (node died)" if on_dead_nodes else ""))
            dead = dead | more
        for h in dead:
            kill_host(h, m.handles.get(h))  # fence a host that only looked dead
        m.alive -= dead
        return dead

    async def _plan_inputs(self, lost: dict[int, tuple[int, list[int]]]) -> PlanInputs:
        """The live hosts' backup catalogs (damaged copies named) and the rest the recovery planner needs."""
        m = self.m
        backups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        damaged: dict[tuple[int, int], list[str]] = {}
        hosts = sorted(m.alive)
        catalogs = await asyncio.gather(*[m.handles[h].backup_catalog.remote() for h in hosts],
                                        return_exceptions=True)
        for i, h in enumerate(hosts):
            if isinstance(catalogs[i], BaseException) and not isinstance(catalogs[i], RayActorError):
                # A live host that failed to answer (not a death: the watch loop finds those)
                # holds copies the plan must not miss: ask once more.
                m._event("backup_catalog_failed", host=h, error=repr(catalogs[i]))
                await asyncio.sleep(0.2)
                catalogs[i] = (await asyncio.gather(m.handles[h].backup_catalog.remote(),
                                                    return_exceptions=True))[0]
        for h, cat in zip(hosts, catalogs):
            if isinstance(cat, BaseException):
                continue
            good, bad = cat
            for st, sl, epoch in good:
                backups.setdefault((st, sl), []).append((h, epoch))
            for st, sl, error in bad:
                m._event("backup_rejected", stage=st, slice=sl, host=h, error=error)
                damaged.setdefault((st, sl), []).append(f"host {h}: {error}")
        for key, copy in m.savepoints.recovery_copies(lost).items():
            backups.setdefault(key, []).append(copy)
        on_disk, disk_damaged = await m.disk_copies.recovery_copies(lost)
        for key, copy in on_disk.items():
            backups.setdefault(key, []).append(copy)
        for key, errors in disk_damaged.items():
            damaged.setdefault(key, []).extend(errors)
        checkpointed = frozenset((st, s) for c, (st, slices) in lost.items()
                                 if c in m.stats and m.stats[c].checkpoints > 0 for s in slices)
        chain = {}
        for st in {st for st, _ in lost.values()}:
            for _c, peers in m.chains.of_stage(st).items():
                chain.update({(st, s): hs for s, hs in peers.items()})
        return PlanInputs(backups, live_hosts(m.placement, m.host_of, m.alive), m.next_id, checkpointed,
                          m.opts.recompute_lost, {s.stage_id: s.name for s in m.plan.stages}, chain, damaged,
                          restore_floor(m.plan, m.gc_marks), recovery_slack(m.opts),
                          frozenset(rebuildable_stages(m.plan)))

    async def _restore(self, cmd: RestoreSlices) -> Restored:
        """Each host restores its share, in parallel (a container it already restores or runs is
        not made again: its current progress is replayed from)."""
        m = self.m
        infos = await asyncio.gather(*[m.deployer.add_container(
            a.new_id, a.stage_id, a.slices, {},
            {s: [(h, m.disk_copies.holder(h)) for h in restore_order(a.holders[s], a.host)] for s in a.slices})
            for a in cmd.plan])
        for a, info in zip(cmd.plan, infos):
            for s, h, why in info["rejected"]:
                m._event("backup_rejected", container=a.new_id, stage=a.stage_id, slice=s, host=h, error=why)
            # restored_from[i]: the host whose copy of slices[i] was restored (None: rebuilt from the
            # start), so a damaged copy's rejection shows which replica took its place.
            m._event("slices_restored", container=a.new_id, host=a.host, slices=a.slices, stage=a.stage_id,
                     restored_from=[info["restored_from"].get(s) for s in a.slices],
                     seconds=round(info["restore_end"] - info["restore_start"], 4),
                     fetch_s=round(info["fetch_s"], 4), resume=info["resume"], mb=round(info["bytes"] / 1e6, 3))
        return Restored(cmd.plan_index, {a.new_id: Restore(info["progress"], info["resume"])
                                         for a, info in zip(cmd.plan, infos)})

    def _at_step(self, cmd: AtStep) -> None:
        """A recovery reached ``cmd.step``: carry out the failure injection armed for it, if any."""
        m = self.m
        step, lost, plan = cmd.step, cmd.lost, None if cmd.plan is None else list(cmd.plan)
        if m._crash_at == step:
            log.warning("master: exiting at recovery step %r (failure injection)", step)
            m._event("master_crash_injected", step=step)
            os._exit(1)
        if m._kill_at is None or m._kill_at[0] != step:
            return
        role, m._kill_at = m._kill_at[1], None
        stages = {st for st, _ in lost.values()}
        if role == "adopter":
            hosts = {a.host for a in plan} if plan is not None else \
                {m.host_of[c] for st in stages for c in m.placement.containers[st]}
        else:
            near = m.plan.upstream_stages if role == "producer" else m.plan.downstream_stages
            hosts = {m.host_of[c] for st in stages for n in near(st) for c in m.placement.containers[n]}
        hosts &= m.alive
        if not hosts:
            m._event("host_kill_skipped", step=step, role=role, why="no live host has that role")
            return
        victim = min(hosts)
        log.warning("master: killing host %s (%s) at recovery step %r (failure injection)", victim, role, step)
        m._event("host_kill_injected", step=step, role=role, host=victim)
        ray.kill(m.handles[victim], no_restart=True)


def kill_host(host_id: int, handle: Any) -> None:
    """``ray.kill`` a host's actor for good. A host with no handle (one a restarted master did
    not find by name, or one declared dead before that master's restart) is gone already; a
    kill Ray refuses (an actor it no longer knows, a worker disconnecting) leaves nothing to
    end either, so it is logged and the caller goes on."""
    if handle is None:
        return
    try:
        ray.kill(handle, no_restart=True)
    except RayError as exc:
        log.debug("host %s: kill refused (%s)", host_id, exc)
