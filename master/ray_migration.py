"""Carries out the migration machine's commands on Ray hosts, for the ``JobMaster``.

Owns the Ray side of one migration: turning each command of
``master.protocols.migration.MigrationProtocol`` into calls on the hosts and
their answers into events, and settling the migration when a call fails
(``Interrupted``). Decides nothing about phases (the machine does); must not
change the placement except as a command says (``AcceptSenders``,
``Rehost``, ``RemoveContainer``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

from ray.exceptions import RayActorError

from chronostream.slices.errors import RecoveryError
from chronostream.master.migration import MigrationError, MigrationPhase, Transfer, backup_peers_after, by_destination
from chronostream.master.protocols.migration import (
    Abandon, AcceptSenders, Begin, BeginDual, Command, ContainerView, DropDual, DualBegun, Event, FixHandover,
    ForgetReleased, Freeze, HandoverFixed, HostMade, Interrupted, MakeHost, MigrationOptions, MigrationProtocol,
    Observe, Observed, ReleaseRoutes, ReleaseSource, Rehost, RemoveContainer, Reroute, Rerouted, RestoreFailed,
    Snapshot, Snapshotted, SourceReleased, Started, StartContainer, View, Warn)

log = logging.getLogger("chronostream.migration")

#: Seconds between two observations while the machine waits.
POLL_S = 0.02
#: How often a pending handover checks that no host died (a dead producer keeps the sources from the epoch).
HANDOVER_PROBE_S = 1.0


class RayMigration:
    """One migration of stage ``sid`` driven on Ray for ``master`` (a ``JobMaster``)."""

    def __init__(self, master: Any, sid: int, transfers: list[Transfer], stop_copy: bool = False) -> None:
        self.m = master
        self.sid = sid
        self.transfers = transfers
        opts = master.opts
        handover = bool(transfers) and transfers[0].handover
        backed = bool(opts.checkpointing and opts.backup_factor)
        self.machine = MigrationProtocol(sid, transfers, MigrationOptions(
            warm_up_s=opts.migration_warm_up_s if opts.checkpointing and not stop_copy else 0.0,
            off_host=backed and not stop_copy and not handover, off_host_timeout_s=60.0, phase_timeout_s=120.0,
            pause_wait_s=3.0, stop_copy=stop_copy, source_stage=master.plan.stages[sid].kind == "source"),
            chain=master.chains.of_stage(sid) if opts.checkpointing else {})
        # new containers' backup peers as after the move (their first checkpoints reach a peer
        # before the sources release them); computed once every new container is accepted
        self.with_peers = backed and not stop_copy
        self._peers_after: dict[int, dict[int, list[int]]] | None = None
        self._probed = time.monotonic()

    async def run(self, event: Event = Begin()) -> None:
        """Feed ``event`` and every result after it until the machine asks for nothing more.
        A failed call or an ``Abandon`` raises (the caller settles: ``settle``)."""
        events: list[Event] = [event]
        while events:
            commands = [c for e in events for c in self.machine.handle(e)]
            events = []
            # (commands of one kind are independent: concurrently; kinds in order)
            for _kind, same in itertools.groupby(commands, key=type):
                results = await asyncio.gather(*[self._one(c) for c in same])
                events += [r for r in results if r is not None]

    async def settle(self, reason: str) -> None:
        """Finish or abort every live transfer (``Interrupted``): after a failed call, a stuck
        phase, or for a restarted master's left-over migration."""
        P = MigrationPhase
        m = self.m
        dead = await m.hosts.probe(sorted(m.alive))
        # A compaction's fate is decided first, on its host, atomically against the handover:
        # cancelled unless it happened already (before any source is let go on).
        handed_over: dict[int, bool] = {}
        for new_id, group in by_destination(self.machine.live()).items():
            t0 = group[0]
            if t0.handover and t0.host is not None and t0.host not in dead and t0.phase is not P.RELEASING:
                try:
                    handed_over[new_id] = await m.handles[t0.host].handover_state.remote(new_id, cancel=True) \
                        == "done"
                except RayActorError:
                    dead.add(t0.host)
        why = f"hosts {sorted(dead)} died" if dead else f"a phase got stuck ({reason})"
        await self.run(Interrupted(frozenset(dead), why, handed_over))

    # -- one command ---------------------------------------------------------------

    async def _one(self, cmd: Command) -> Event | None:
        m = self.m
        handles, host_of = m.handles, m.host_of
        if isinstance(cmd, Observe):
            return Observed(await self._view(cmd))
        if isinstance(cmd, MakeHost):
            h = m.next_id
            m.next_id += 1
            await m.hosts.new_or_found(h, m.hosts.least_used_node())
            await m.deployer.configure(h)
            m._save_layout()  # (a restarted master releases it if the migration is undone)
            return HostMade(cmd.target, h)
        if isinstance(cmd, Freeze):
            await asyncio.gather(*[handles[host_of[c]].freeze.remote(c, cmd.on) for c in cmd.sources
                                   if host_of.get(c) in m.alive], return_exceptions=not cmd.on)
            return None
        if isinstance(cmd, Snapshot):
            info = await handles[host_of[cmd.source]].migration_snapshot.remote(
                cmd.source, list(cmd.slices), cmd.host, handles[cmd.host])
            return Snapshotted(cmd.index, info["epoch"], info["bytes"])
        if isinstance(cmd, AcceptSenders):
            m.placement.stage_of[cmd.new_id] = cmd.stage_id
            host_of[cmd.new_id] = cmd.host
            cov = frozenset((cmd.stage_id, s) for s in cmd.slices)
            await asyncio.gather(*[handles[host_of[c]].add_senders.remote(c, {cmd.new_id: cov})
                                   for d in m.plan.downstream_stages(cmd.stage_id)
                                   for c in m.placement.containers[d]])
            return None
        if isinstance(cmd, StartContainer):
            return await self._start(cmd)
        if isinstance(cmd, Reroute):
            host = handles[host_of[cmd.new_id]]
            producers = m.hosts.producers(cmd.stage_id, live_only=False)
            caught = await asyncio.gather(*[p.reroute.remote(c, cmd.stage_id, list(cmd.slices), cmd.new_id, host,
                                                             cmd.progress, cmd.resume, True) for c, p in producers])
            return Rerouted(cmd.new_id, {c: x for (c, _), x in zip(producers, caught)})
        if isinstance(cmd, BeginDual):
            host = handles[host_of[cmd.new_id]]
            epochs = await asyncio.gather(*[p.begin_dual.remote(c, cmd.stage_id, list(cmd.slices), cmd.new_id, host)
                                            for c, p in m.hosts.producers(cmd.stage_id, live_only=False)])
            return DualBegun(cmd.new_id, list(epochs))
        if isinstance(cmd, FixHandover):
            epoch = await handles[host_of[cmd.new_id]].hand_over.remote(cmd.new_id, list(cmd.sources), cmd.not_before)
            return HandoverFixed(cmd.new_id, epoch)
        if isinstance(cmd, ReleaseRoutes):
            calls = [p.release_route.remote(c, cmd.stage_id, list(cmd.slices), cmd.new_id)
                     for c, p in m.hosts.producers(cmd.stage_id)]
            calls += [handles[host_of[c]].release_slices.remote(c, list(slices)) for c, slices in cmd.release.items()
                      if host_of.get(c) in m.alive]
            await asyncio.gather(*calls)
            return None
        if isinstance(cmd, ReleaseSource):
            return await self._release_source(cmd)
        if isinstance(cmd, ForgetReleased):
            await asyncio.gather(*[p.forget_released.remote(c, cmd.source, list(cmd.slices))
                                   for c, p in m.hosts.producers(cmd.stage_id)], return_exceptions=True)
            return None
        if isinstance(cmd, Rehost):
            t = self.transfers[cmd.index]
            if t.host in m.alive:
                try:
                    await handles[t.host].set_extra_window.remote(cmd.new_id, 0)
                except RayActorError:
                    pass
            m.placement.rehost(cmd.source, cmd.new_id, list(cmd.slices))
            return None
        if isinstance(cmd, DropDual):
            await asyncio.gather(*[p.drop_dual.remote(c, cmd.stage_id, list(cmd.slices))
                                   for c, p in m.hosts.producers(cmd.stage_id)], return_exceptions=True)
            return None
        if isinstance(cmd, RemoveContainer):
            if cmd.host is not None and cmd.host in m.alive and handles.get(cmd.host) is not None:
                try:
                    await handles[cmd.host].remove_container.remote(cmd.new_id)
                except RayActorError:
                    pass
            host_of.pop(cmd.new_id, None)
            m.placement.stage_of.pop(cmd.new_id, None)
            return None
        if isinstance(cmd, Warn):
            log.warning("%s", cmd.message)
            m._event("migration_warning", message=cmd.message)
            return None
        if isinstance(cmd, Abandon):
            raise MigrationError(cmd.reason)
        raise MigrationError(f"the Ray driver cannot carry out {cmd}")

    async def _start(self, cmd: StartContainer) -> Started | RestoreFailed:
        m = self.m
        if self._peers_after is None:
            self._peers_after = backup_peers_after(
                m.placement, m.host_of, self.transfers, self.sid, m.opts.backup_factor,
                m.chains.hosts(self.transfers), m.nodes) if self.with_peers else {}
        peers = self._peers_after.get(cmd.new_id, {})
        host = m.handles[cmd.host]
        if cmd.hand_over_from:
            await m.deployer.add_container(cmd.new_id, cmd.stage_id, [], peers, hand_over_from=list(cmd.hand_over_from))
            info: dict[str, Any] = {"progress": {}, "resume": {}, "restore_start": 0.0, "restore_end": 0.0}
        else:
            try:
                info = await m.deployer.add_container(cmd.new_id, cmd.stage_id, list(cmd.slices), peers,
                                                      {s: [(cmd.host, host)] for s in cmd.slices})
            except RecoveryError as exc:  # (the host's own copy did not verify: snapshots replace it)
                await host.remove_container.remote(cmd.new_id)
                why = next(iter(str(exc).splitlines()), "")
                m._event("migration_restore_failed", container=cmd.new_id, host=cmd.host, slices=list(cmd.slices),
                         error=why)
                return RestoreFailed(cmd.new_id, tuple(cmd.slices), why)
        await host.set_extra_window.remote(cmd.new_id, 64)  # catching up: it may run ahead
        await host.start.remote([cmd.new_id])
        return Started(cmd.new_id, info["progress"], info["resume"],
                       round((info["restore_end"] - info["restore_start"]) * 1000, 1))

    async def _release_source(self, cmd: ReleaseSource) -> SourceReleased:
        m = self.m
        try:
            st = await self._states([cmd.source, cmd.dest], times=True)
        except RayActorError:  # (one of the two hosts is dead: ask the source's alone)
            st = await self._source_state(cmd.source)
        src = st.get(cmd.source)
        if src is not None and not src.done and not set(cmd.slices) <= set(src.released):
            # Settled early (a producer died mid-migration): its replacement routes the slices to
            # their new container only and will never mark them to the source.
            try:
                await m.handles[m.host_of[cmd.source]].release_slices.remote(cmd.source, list(cmd.slices))
            except RayActorError:
                pass
            src = (await self._source_state(cmd.source)).get(cmd.source)
        return SourceReleased(cmd.index, src, st.get(cmd.dest))

    # -- observing -----------------------------------------------------------------

    async def _view(self, ask: Observe) -> View:
        m = self.m
        if ask.wait:
            await asyncio.sleep(POLL_S)
        containers = await self._states(list(ask.containers), ask.times)
        held: dict[int, dict[tuple[int, int], int]] = {}
        if ask.held:
            hosts = sorted(m.alive)
            held = dict(zip(hosts, await asyncio.gather(*[m.handles[h].backup_epochs.remote() for h in hosts])))
        handovers: dict[int, str] = {}
        for new_id in ask.handovers:
            handovers[new_id] = await m.handles[m.host_of[new_id]].handover_state.remote(new_id)
        if handovers and any(s == "pending" for s in handovers.values()) \
                and time.monotonic() - self._probed > HANDOVER_PROBE_S:
            self._probed = time.monotonic()
            if dead := await m.hosts.probe(sorted(m.alive)):
                raise MigrationError(f"hosts {sorted(dead)} died before the handover")
        return View(time.monotonic(), containers, held, handovers)

    async def _states(self, ids: list[int], times: bool = False) -> dict[int, ContainerView]:
        """``migration_state`` of the containers ``ids`` (a container on a dead host raises)."""
        m = self.m
        by_host: dict[int, list[int]] = {}
        for c in ids:
            if c in m.host_of:
                by_host.setdefault(m.host_of[c], []).append(c)
        out: dict[int, ContainerView] = {}
        for part in await asyncio.gather(*[m.handles[h].migration_state.remote(cs_, times)
                                           for h, cs_ in by_host.items()]):
            out.update({c: ContainerView.of(s) for c, s in part.items()})
        return out

    async def _source_state(self, source: int) -> dict[int, ContainerView]:
        """``_states`` of a transfer's source alone ({} when its host is dead)."""
        if self.m.host_of.get(source) not in self.m.alive:
            return {}
        try:
            return await self._states([source], True)
        except RayActorError:
            return {}
