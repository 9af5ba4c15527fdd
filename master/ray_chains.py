"""The JobMaster's backup chains and garbage collection on Ray.

Owns planning each stage's backup chain over its hosts as placed now
(``master.backups``), telling hosts their new chains after a placement
change, warning when a stage has fewer copies than ``backup_factor``, and
driving the GC machine (``master.protocols.gc``): reading what hosts hold,
saving marks, trimming logs, dropping copies their chain left behind.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray.exceptions import RayActorError

from chronostream.master.backups import chains_by_slice, fewest_backup_copies
from chronostream.master.job_state import JobState
from chronostream.master.migration import Transfer
from chronostream.master.protocols.gc import ChainsRead, HeldRead, SaveMarks, Trim
from chronostream.master.recovery import host_backup_peers, off_stage_backup_stages

log = logging.getLogger("chronostream.master")


class RayChains:
    """Backup chains and GC rounds of one ``JobMaster`` (``master``)."""

    def __init__(self, master: Any) -> None:
        self.m = master

    def of_stage(self, stage_id: int) -> dict[int, dict[int, list[int]]]:
        """``host_backup_peers`` of a stage as placed now: over its own hosts, or, when it lives on
        one host, over the job's other live hosts (other nodes first)."""
        m = self.m
        return host_backup_peers(m.placement, m.host_of, stage_id, m.opts.backup_factor,
                                 self.hosts(), m.nodes)

    def copies(self) -> dict[str, int]:
        """Stage name -> the fewest backup copies a slice of it has as placed now
        (``fewest_backup_copies``); empty when the job takes no checkpoints."""
        m = self.m
        if not (m.opts.checkpointing and m.opts.backup_factor):
            return {}
        return {m.plan.stages[st].name: fewest_backup_copies(self.of_stage(st))
                for st in sorted(m.placement.containers)}

    def note_copies(self) -> None:
        """Say when a stage's slices get fewer copies than ``backup_factor`` (event
        ``backups_short``, a warning: the job has too few hosts for them), at deploy and whenever
        that number changes, and when they have their copies again (``backups_restored``)."""
        m = self.m
        factor = m.opts.backup_factor
        for name, copies in self.copies().items():
            before = m._copies_said.get(name, factor)
            if copies < factor and copies != before:
                log.warning("stage %s: %d backup copies a slice, not backup_factor=%d: the job has %d hosts",
                            name, copies, factor, len(m.alive))
                m._event("backups_short", stage=name, copies=copies, backup_factor=factor, hosts=len(m.alive))
            elif copies >= factor > before:
                m._event("backups_restored", stage=name, copies=copies, backup_factor=factor,
                         hosts=len(m.alive))
            m._copies_said[name] = copies

    def off_stage_stages(self) -> set[int]:
        """Stages whose chains go on over other stages' hosts (``off_stage_backup_stages``)."""
        m = self.m
        return off_stage_backup_stages(m.placement, m.host_of, m.opts.backup_factor)

    def hosts(self, transfers: list[Transfer] = ()) -> list[int]:
        """The hosts a stage on too few hosts of its own may back up to: every live one (and
        migrations' new hosts)."""
        m = self.m
        return sorted(m.alive | {t.host for t in transfers if t.host is not None})

    async def retarget(self, stages: set[int], tolerate_dead: bool = True) -> None:
        """Re-plan the backup chain of ``stages`` over their hosts as they are now (each slice's
        next checkpoint is a full one: the new peers hold no chain)."""
        m = self.m
        calls = []
        for st in sorted(stages):
            for c, peers in self.of_stage(st).items():
                hosts = {**m.hosts.stage_hosts(st), **{h: m.handles[h] for ps in peers.values() for h in ps}}
                calls.append(m.handles[m.host_of[c]].retarget_backups.remote(c, peers, hosts))
        await asyncio.gather(*calls, return_exceptions=tolerate_dead)
        self.note_copies()

    def plan(self) -> dict[int, dict[int, list[int]]]:
        """Stage id -> slice -> the hosts that should hold its backups (the chain)."""
        m = self.m
        out: dict[int, dict[int, list[int]]] = {}
        for st in m.placement.containers:
            for peers in self.of_stage(st).values():
                out.setdefault(st, {}).update(peers)
        return out

    async def collect_garbage(self) -> None:
        """Drop outputs no recovery can need: below every consumer stage's oldest newest checkpoint."""
        m = self.m
        if not m.opts.checkpointing or m.opts.recompute_lost or m.control_lock.locked():
            return  # (recomputing a lost slice from the start needs every log from epoch 0)
        if m.hosts.not_found():
            return  # (hosts a restarted master did not find: their recovery comes first)
        hosts = sorted(m.alive)
        assert m.gc is not None
        try:
            held = await asyncio.gather(*[m.handles[h].backup_epochs.remote() for h in hosts])
            m.sinks.commit_due(held)  # (parts of epochs every slice has checkpointed are final)
            for cmd in m.gc.handle(HeldRead(tuple(held))):
                if isinstance(cmd, SaveMarks):  # (before any host trims to them)
                    m.catalog.save_gc_marks(cmd.marks)
                elif isinstance(cmd, Trim):
                    dropped = await asyncio.gather(*[m.handles[h].gc.remote(cmd.marks) for h in hosts])
                    m.gc_dropped += sum(dropped)
            await self.drop_stale(dict(zip(hosts, held)))
        except RayActorError:
            pass  # a host died: the watch loop recovers it; GC waits for the next round
        except Exception:  # noqa: BLE001
            if m.state is JobState.RUNNING:
                raise
            # The job was stopped mid-round (hosts closing their stores): nothing to collect.

    async def drop_stale(self, held: dict[int, dict[tuple[int, int], int]]) -> None:
        """Tell hosts to forget the copies their slices' chains left behind once the chain holds
        newer ones (``stale_backups``): a scale-out or recovery re-plans chains, and the old
        holders' copies would otherwise take their disk for the rest of the job.

        Under the control lock: a migration or recovery that started since ``held`` was read
        could make a host a chain member again, or warm a destination up with a copy it is about
        to rebuild from; neither runs while the copies are judged and dropped."""
        m = self.m
        if m.control_lock.locked():
            return  # (a migration or recovery runs: the next round judges the chains it leaves)
        assert m.gc is not None
        async with m.control_lock:
            chains = chains_by_slice({st: self.of_stage(st) for st in m.placement.containers})
            drops = m.gc.handle(ChainsRead(chains, held))
            dropped = await asyncio.gather(*[m.handles[d.host].drop_backups.remote(list(d.keys)) for d in drops])
        for d, n in zip(drops, dropped):
            if n:
                m.stale_backups_dropped += n
                m._event("stale_backups_dropped", host=d.host, slices=[list(k) for k in d.keys])
