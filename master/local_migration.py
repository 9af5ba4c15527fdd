"""Carries out the migration machine's commands in process, for ``LocalCluster``.

Owns the in-process side of one migration: the machine
(``master.protocols.migration.MigrationProtocol``), the observation it waits
for (answered at the cluster's next round, so every phase lasts a round and
the simulator's faults meet each), and turning each command into changes to
the cluster's books and cores. Decides nothing about phases (the machine
does); the Ray twin is ``master.ray_migration``.
"""

from __future__ import annotations

from typing import Any

from chronostream.containers.core import ContainerCore, add_sink_parts, hand_over
from chronostream.master.migration import MigrationError, Transfer, backup_peers_after
from chronostream.master.protocols.migration import (
    AcceptSenders, Begin, BeginDual, ContainerView, DropDual, DualBegun, FixHandover, ForgetReleased, Freeze,
    HandoverFixed, HostMade, Interrupted, MakeHost, MigrationOptions, MigrationProtocol, Observe, Observed,
    ReleaseRoutes, ReleaseSource, Rehost, RemoveContainer, Reroute, Rerouted, RestoreFailed, Snapshot, Snapshotted,
    SourceReleased, Started, StartContainer, View, Warn)
from chronostream.slices.errors import RecoveryError


class LocalMigration:
    """Drives one ``MigrationProtocol`` for ``cluster`` (a ``LocalCluster``); each phase change
    is saved in the cluster's catalog, as the Ray master saves it."""

    def __init__(self, cluster: Any, stage_id: int, transfers: list[Transfer]) -> None:
        self.cl = cluster
        self.machine = MigrationProtocol(stage_id, transfers, MigrationOptions(
            off_host=cluster.fault_tolerant and cluster.backup_factor > 0,
            source_stage=cluster.plan.stages[stage_id].kind == "source"))
        self.observe: Observe | None = None  # what the machine asked to see at the next round
        self.placeholders: dict[int, int] = {}  # placeholder host id (< 0) -> the host PREPARING made
        if cluster.catalog is not None:
            for t in transfers:
                t.on_advance = lambda _t: self._save()
            self._save()

    @property
    def transfers(self) -> list[Transfer]:
        return self.machine.transfers

    @property
    def finished(self) -> bool:
        return self.machine.finished

    def _save(self) -> None:
        self.cl.catalog.save_migration(None, [t.to_plain() for t in self.transfers])

    def forget(self) -> None:
        """The migration ended, or its master died: nothing of it is saved any more."""
        for t in self.transfers:
            t.on_advance = None

    def advance(self) -> bool:
        """Begin, or answer the pending observation (one a round); True when a phase changed."""
        before = [t.phase for t in self.transfers]
        if not self.machine.story:
            self.drive(Begin())
        elif self.observe is not None:
            ask, self.observe = self.observe, None
            self.drive(Observed(self._view(ask)))
        return before != [t.phase for t in self.transfers]

    def settle(self, event: Interrupted) -> None:
        """Hosts died or the master restarted: the machine finishes or undoes every live transfer."""
        self.observe = None
        self.drive(event)

    def drive(self, event: Any) -> None:
        """Hand ``event`` to the migration machine and carry out its commands, feeding their results
        back at once; an ``Observe`` waits for the next round."""
        m = self.machine
        assert m is not None
        todo = [event]
        while todo:
            for cmd in m.handle(todo.pop(0)):
                if isinstance(cmd, Observe):
                    self.observe = cmd
                    continue
                result = self._carry_out(cmd)
                if result is not None:
                    todo.append(result)

    def _view(self, ask: Observe) -> View:
        """What ``ask`` wants to see, as this process has it; a compaction's host part (hand the
        slices over once every source stands at the epoch) happens here."""
        cores = {c: self.cl.cores[c] for c in ask.containers if c in self.cl.cores}
        handovers = {new_id: self._hand_over_if_due(new_id) for new_id in ask.handovers}
        held = {h: store.epochs() for h, store in self.cl.stores.items() if h in self.cl.alive} if ask.held else {}
        return View(float(self.cl.round), {c: container_view(core) for c, core in cores.items()}, held, handovers)

    def _hand_over_if_due(self, new_id: int) -> str:
        """``ContainerHosting.try_hand_over`` in process: ``done``, ``pending`` or ``cancelled``."""
        group = [t for t in self.machine.transfers if t.new_id == new_id]
        dest = self.cl.cores.get(new_id)
        sources = [self.cl.cores.get(t.source) for t in group]
        epoch = group[0].hand_over_epoch
        if dest is None or any(src is None for src in sources) or epoch is None:
            return "cancelled"
        if not dest.awaiting_handover:
            return "done"
        if any(src.done for src in sources):  # type: ignore[union-attr]
            for src in sources:
                src.stop_before = None  # type: ignore[union-attr]
            return "cancelled"
        if any(src.next_epoch < epoch for src in sources):  # type: ignore[union-attr]
            return "pending"
        hand_over(sources, dest, epoch)  # type: ignore[arg-type]
        self.cl.shipping.after(new_id, [t.source for t in group])  # (deltas reach the peers in order)
        return "done"

    def _carry_out(self, cmd: Any) -> Any:
        """One command of the migration machine, in this process; returns its result event (or None)."""
        m = self.machine
        assert m is not None
        if isinstance(cmd, MakeHost):
            if cmd.target not in self.placeholders:
                self.placeholders[cmd.target] = self.cl._new_host()
                self.cl._save_layout()  # (a restarted master knows the host, and releases it if undone)
            return HostMade(cmd.target, self.placeholders[cmd.target])
        if isinstance(cmd, Snapshot):
            src, store = self.cl.cores[cmd.source], self.cl._store(cmd.host)
            # The slices' sink parts up to the snapshot go to the master first, as at a
            # checkpoint (``ResourceContainer.migration_snapshot``).
            taken = src.take_sink_parts_of(list(cmd.slices))
            add_sink_parts(self.cl.sink_parts, taken)
            src.drop_handed_sink_parts(taken)
            blobs = src.migration_snapshot(list(cmd.slices))
            for b in blobs:
                store.put(b)
            return Snapshotted(cmd.index, src.next_epoch - 1, sum(len(b) for b in blobs))
        if isinstance(cmd, AcceptSenders):
            self.cl.placement.stage_of[cmd.new_id] = cmd.stage_id
            self.cl.hosts[cmd.new_id] = cmd.host
            cov = frozenset((cmd.stage_id, s) for s in cmd.slices)
            for d in self.cl.plan.downstream_stages(cmd.stage_id):
                for c in self.cl.placement.containers[d]:
                    if c in self.cl.cores:
                        self.cl.cores[c].add_senders({cmd.new_id: cov})
            return None
        if isinstance(cmd, StartContainer):
            # (backup peers as after the move from the start: the moved slices' first
            # checkpoints reach a peer before the sources release them)
            job_hosts = sorted(self.cl.alive | {t.host for t in m.transfers if t.host is not None})
            peers = backup_peers_after(self.cl.placement, self.cl.hosts, m.transfers, cmd.stage_id, self.cl.backup_factor,
                                       job_hosts).get(cmd.new_id) if self.cl.fault_tolerant else None
            core = self.cl._core(cmd.new_id, list(cmd.slices), peers)
            self.cl.cores[cmd.new_id] = core
            if cmd.hand_over_from:
                core.awaiting_handover = True
                core.next_epoch = min(self.cl.cores[c].next_epoch for c in cmd.hand_over_from)
                return Started(cmd.new_id)
            points, bad = {}, {}
            for s in cmd.slices:
                try:
                    points[s] = self.cl._load_backup(cmd.stage_id, s, [cmd.host])
                except RecoveryError as exc:
                    bad[s] = str(exc)
            if bad:  # (the destination's own copy did not verify: a snapshot replaces it)
                self.cl.cores.pop(cmd.new_id).close()
                self.cl._event("migration_restore_failed", container=cmd.new_id, host=cmd.host, slices=sorted(bad))
                return RestoreFailed(cmd.new_id, tuple(sorted(bad)), "; ".join(bad.values()))
            core.restore_slices(points)
            return Started(cmd.new_id, {s: core.progress_of(s) for s in cmd.slices},
                           {s: core.slices[s].last_epoch + 1 for s in cmd.slices})
        if isinstance(cmd, Reroute):
            for c, producer in self.cl.producers(cmd.stage_id):
                replay = producer.reroute(cmd.stage_id, list(cmd.slices), cmd.new_id, cmd.progress, cmd.resume,
                                          dual=True)
                self.cl.in_flight += [(cmd.new_id, e, c, msg) for e, msg in replay.items()]
            return Rerouted(cmd.new_id)
        if isinstance(cmd, BeginDual):
            epochs = []
            for _, producer in self.cl.producers(cmd.stage_id):
                producer.switch_route(cmd.stage_id, list(cmd.slices), cmd.new_id, dual=True)
                epochs.append(producer.next_epoch)
            return DualBegun(cmd.new_id, epochs)
        if isinstance(cmd, FixHandover):
            # the first epoch no source has reached, at or after every producer's switch
            epoch = max([cmd.not_before] + [self.cl.cores[c].next_epoch for c in cmd.sources])
            for c in cmd.sources:
                self.cl.cores[c].stop_before = epoch
            return HandoverFixed(cmd.new_id, epoch)
        if isinstance(cmd, ReleaseRoutes):
            for _, producer in self.cl.producers(cmd.stage_id):
                producer.release_route(cmd.stage_id, list(cmd.slices), cmd.new_id)
            for c, slices in cmd.release.items():
                if c in self.cl.cores:
                    self.cl.cores[c].request_release(list(slices))  # a source stage has no upstream marker
            return None
        if isinstance(cmd, ReleaseSource):
            src = self.cl.cores.get(cmd.source)
            if src is not None and not src.done and not set(cmd.slices) <= set(src.released):
                src.request_release(list(cmd.slices))  # (settled early: a producer may never mark it)
            dst = self.cl.cores.get(cmd.dest)
            return SourceReleased(cmd.index, None if src is None else container_view(src, True),
                                  None if dst is None else container_view(dst, True))
        if isinstance(cmd, ForgetReleased):
            for _, producer in self.cl.producers(cmd.stage_id):
                producer.forget_released(cmd.source, list(cmd.slices))
            return None
        if isinstance(cmd, Rehost):
            self.cl.placement.rehost(cmd.source, cmd.new_id, list(cmd.slices))
            return None
        if isinstance(cmd, DropDual):
            for _, producer in self.cl.producers(cmd.stage_id):
                producer.drop_dual(cmd.stage_id, list(cmd.slices))
            return None
        if isinstance(cmd, RemoveContainer):
            for c in cmd.sources:
                if c in self.cl.cores:
                    self.cl.cores[c].stop_before = None
            if cmd.new_id in self.cl.cores:
                self.cl.cores.pop(cmd.new_id).close()
            return None
        if isinstance(cmd, Warn):
            self.cl._event("migration_warning", message=cmd.message)
            return None
        if isinstance(cmd, Freeze) and not cmd.on:  # (nothing here pauses a core)
            return None
        raise MigrationError(f"the in-process driver cannot carry out {cmd}")  # (Freeze, Abandon: Ray only)


def container_view(core: ContainerCore, times: bool = False) -> ContainerView:
    """A core as the migration machine sees it (``ResourceContainer.migration_state``)."""
    return ContainerView(core.next_epoch, core.done, dict(core.released),
                         dict(core.epoch_done_at) if times else {})
