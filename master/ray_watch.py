"""The JobMaster's fault detection and recovery entry points on Ray.

Owns the watch loop (heartbeat timeouts, probes, the GC round's turn), a
host's report that a push failed, and starting a recovery (a new one, or one
a previous master left in its catalog) under the control lock. The recovery
itself is ``master.protocols.recovery`` driven by ``master.ray_recovery``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray.exceptions import RayActorError

from chronostream.master.job_state import JobState
from chronostream.master.ray_recovery import RayRecovery
from chronostream.master.protocols.recovery import HostsDied, PlanRecord, RecoveryProtocol

log = logging.getLogger("chronostream.master")


class RayWatch:
    """Detection and recovery entry points of one ``JobMaster`` (``master``)."""

    def __init__(self, master: Any) -> None:
        self.m = master

    async def watch(self) -> None:
        """Every heartbeat interval while the job runs: a GC round at its turn, a probe of every
        host, and a recovery of the hosts found dead or silent past ``heartbeat_timeout_s``; after
        the end, forget a dead host (``RayReads.lost_after_end``)."""
        m = self.m
        tick = 0
        while m.state is JobState.RUNNING:
            await asyncio.sleep(m.heartbeat_s)
            tick += 1
            if tick % m.gc_every_ticks == 0:
                await m.chains.collect_garbage()
            dead = await m.hosts.probe(sorted(m.alive))
            now = time.monotonic()
            silent = {h for h in m.alive - dead if now - m.last_seen.get(h, now) > m.opts.heartbeat_timeout_s}
            for h in dead:
                m._event("fault_detected", host=h, by="probe (actor dead)")
            for h in silent:
                m._event("fault_detected", host=h, by=f"no heartbeat for {now - m.last_seen[h]:.1f}s")
            if (dead | silent) and m.state is JobState.RUNNING:
                await self.recover(dead | silent)
            elif m.state is JobState.FINISHED and m.opts.checkpointing:
                for h in dead:  # (a silent host may just be slow: only a dead one is forgotten)
                    m.reads.lost_after_end(h, RayActorError())

    async def unreachable(self, container_id: int, reporter: int) -> None:
        """A host could not push to ``container_id``: check its host now rather than at the next probe."""
        m = self.m
        h = m.host_of.get(container_id)
        if h is None or h not in m.alive or m.state is not JobState.RUNNING:
            return
        if await m.hosts.probe([h]):
            m._event("fault_detected", host=h, by=f"host {reporter} (push failed)")
            await self.recover({h})

    async def recover(self, dead_hosts: set[int]) -> None:
        m = self.m
        async with m.control_lock:
            # A recovery a previous master left comes first (a host's report can arrive before
            # the watch loop starts the resume).
            await self.resume_locked()
            # Hosts a restarted master could not find again are dead as well.
            dead = (dead_hosts | m.hosts.not_found()) & m.alive
            if not dead or m.state is not JobState.RUNNING:
                return
            try:
                await self.recover_hosts(dead)
            except Exception as exc:  # noqa: BLE001 - a recovery that cannot be exact fails the job
                log.exception("recovery failed")
                m._fail(None, exc)

    async def recover_hosts(self, dead: set[int], plans: list[dict[str, Any]] | None = None,
                            gone: set[int] = frozenset()) -> None:
        """Recover every container on ``dead`` hosts, together with ``plans`` (saved plans a
        previous master left unfinished; ``gone``: the hosts they were made for), to the end even
        when more hosts die on the way: ``master.protocols.recovery`` decides the steps,
        ``master.ray_recovery`` carries them out (docs/design.md section 7d). A step that raises
        with every host alive fails the job (the caller's handler)."""
        m = self.m
        machine = RecoveryProtocol([PlanRecord.from_plain(p) for p in plans or []], gone)
        await RayRecovery(m).run(machine, HostsDied(frozenset(dead)))

    async def resume(self) -> None:
        """A master restarted in the middle of a recovery: plan again for the hosts it had not
        planned for, and run the saved plans again (``_recover_hosts``), before the watch loop looks."""
        m = self.m
        async with m.control_lock:
            await self.resume_locked()

    async def resume_locked(self) -> None:
        m = self.m
        record, m._unfinished_recovery = m._unfinished_recovery, None
        if record is None or m.state is not JobState.RUNNING:
            return
        # A migration the dead master left settles first (its done transfers rehosted), as one a
        # death meets settles before the recovery plans (``LocalCluster._restart_master`` too).
        await m.scaling.settle_pending()
        plans = [{**rec, "resumed": True} for rec in record["plans"]]
        planned = {h for rec in plans for h in rec["dead"]}
        m._event("recovery_resumed", hosts=sorted(planned | set(record["dead"])),
                 step="planning" if record["dead"] else "running")
        try:
            # Hosts that died meanwhile are planned for with those it had not (the saved plans'
            # adoptions on them are skipped: their containers are placed there).
            away = m.hosts.not_found()
            found = away | await m.hosts.probe(sorted(m.alive - away))
            if found:
                m._event("fault_detected", hosts=sorted(found), by="probe of a restarted master")
            await self.recover_hosts(set(record["dead"]) | found, plans, planned)
        except Exception as exc:  # noqa: BLE001 - a recovery that cannot be exact fails the job
            log.exception("resumed recovery failed")
            m._fail(None, exc)
