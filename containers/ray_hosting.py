"""A host's containers: making one (restored from backups or empty), compaction handovers, removal.

Owns creating a ``ContainerCore`` with its sinks, logs and peers (idempotent
by container id: a restarted master runs a recovery's plan again), restoring
its slices from fetched backups off the event loop, and the handover of a
compaction's source containers' slices at one epoch, and what a migration asks of its
containers' positions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pyarrow as pa

from chronostream.containers.core import ContainerCore, hand_over
from chronostream.containers.output_log import OutputLog
from chronostream.containers.routing import OutputRoute
from chronostream.containers.ray_savepoints import SAVEPOINT_HOLDER

log = logging.getLogger("chronostream.container")


class Handover:
    """A compaction in progress on this host: its sources, the epoch, and whether it happened."""

    def __init__(self, sources: list[int], epoch: int) -> None:
        self.sources = sources
        self.epoch = epoch
        self.state = "pending"  # then "done" or "cancelled"


def progress_info(core: ContainerCore) -> dict[str, dict[int, Any]]:
    """Where each of a container's slices stands: the epoch it resumes at, its progress vector
    and its last epoch (what producers rerouting to it replay from)."""
    return {"resume": {s: core.slices[s].last_epoch + 1 for s in core.slices},
            "progress": {s: core.progress_of(s) for s in core.slices},
            "epochs": {s: core.slices[s].last_epoch for s in core.slices}}


class ContainerHosting:
    """Containers made and handed over on one ``ResourceContainer`` host (``host``)."""

    def __init__(self, host: Any) -> None:
        self.h = host

    async def add(self, container_id: int, stage_id: int, slices: list[int],
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
        h = self.h
        first = h._adding.get(container_id)
        if first is None or (first.done() and first.exception() is not None):
            first = h._adding[container_id] = asyncio.get_running_loop().create_task(self.make(
                container_id, stage_id, slices, routes, senders, peers, hosts, source_table, output_log,
                backup_peers, restore_from, hand_over_from))
            return await asyncio.shield(first)
        info = dict(await asyncio.shield(first))
        core = h.cores.get(container_id)
        if core is not None and "resume" in info:
            async with h.conds[container_id]:  # (between two epochs)
                info.update(progress_info(core))
        return info

    async def make(self, container_id: int, stage_id: int, slices: list[int],
                   routes: dict[int, OutputRoute], senders: dict[int, frozenset],
                   peers: dict[int, Any], hosts: dict[int, Any], source_table: pa.Table | None,
                   output_log: bool, backup_peers: dict[int, list[int]] | None,
                   restore_from: dict[int, list[tuple[int, Any]]] | None,
                   hand_over_from: list[int] | None) -> dict[str, Any]:
        h = self.h
        plan = h.plan
        assert plan is not None, "configure() first"
        writers = {s.sink_id: s.sink.writer(f"c{container_id}") for s in plan.sinks
                   if plan.streams[s.stream_id].stage_id == stage_id}
        dl = plan.dead_letter_sink.dead_letter_writer(f"c{container_id}", stage_id) \
            if plan.dead_letter_sink is not None else None
        olog = OutputLog(h.workdir / f"container-{container_id}" / "output-log") if output_log else None
        core = ContainerCore(plan, stage_id, container_id, slices, routes, senders, source_table=source_table,
                             output_log=olog, sink_writers=writers, dead_letter_writer=dl,
                             backup_peers=backup_peers, checkpoint_every=h.opts.checkpoint_every,
                             full_checkpoint_every=h.opts.full_checkpoint_every, backup_store=h.backup_store,
                             checkpoint_interval_s=h.opts.checkpoint_period_s, spill=h.spill_store)
        # (None: a host the master found dead and is about to recover; pushes to it stop, as for
        # any unreachable container, until a reroute names its replacement.)
        h.peers.update({c: a for c, a in peers.items() if a is not None})
        await h.pushes.learn_nodes(a for a in peers.values() if a is not None)
        h.unreachable.update(c for c, a in peers.items() if a is None)
        h.hosts.update({host_id: a for host_id, a in hosts.items() if a is not None})
        info: dict[str, Any] = {"container": container_id, "host": h.host_id}
        if restore_from is not None:
            t0 = time.time()
            fetched = {s: await h.backups.fetch(stage_id, s, restore_from.get(s, [])) for s in slices}
            t1 = time.time()
            kinds = None  # (the savepoint's, asked once: the same for every slice of the stage)
            for s, f in fetched.items():
                if f.holder == SAVEPOINT_HOLDER and f.point.checkpoint is not None:
                    if kinds is None:
                        kinds = await dict(restore_from[s])[SAVEPOINT_HOLDER].state_kinds.remote(stage_id)
                    core.check_state_names(s, f.point.checkpoint, kinds)  # an upgrade may not drop a state
            # Off the event loop: a large state takes a while to load, and this host's other
            # containers keep processing meanwhile (the new core is not running yet).
            await asyncio.to_thread(core.restore_slices, {s: f.point for s, f in fetched.items()})
            info.update(restore_start=t0, restore_end=time.time(), fetch_s=t1 - t0,
                        bytes=sum(f.nbytes for f in fetched.values()),
                        rejected=[(s, holder, why) for s, f in fetched.items() for holder, why in f.rejected],
                        restored_from={s: f.holder for s, f in fetched.items()}, **progress_info(core))
        if hand_over_from is not None:
            core.awaiting_handover = True
            # (its inbox window starts where its sources are: producers may send it their rows now)
            core.next_epoch = min(h.cores[c].next_epoch for c in hand_over_from)
        core.gc_pacing = h.gc_pacing
        h.cores[container_id] = core
        h.conds[container_id] = asyncio.Condition()
        return info

    async def hand_over(self, container_id: int, sources: list[int], not_before: int) -> int:
        """Compaction: every slice of the hosted containers ``sources`` goes to the hosted container
        ``container_id`` (made with ``hand_over_from``) at one epoch, the first at or after
        ``not_before`` that no source has reached; each source stops before it. Returns the epoch;
        the handover itself happens once every source is there (``handover_state``)."""
        h = self.h
        epoch = max([not_before] + [h.cores[c].next_epoch for c in sources])
        h._handovers[container_id] = Handover(list(sources), epoch)
        for c in sources:
            h.cores[c].stop_before = epoch
            h._handover_of[c] = container_id
        log.info("host %s: containers %s hand their slices to container %s at epoch %s", h.host_id, sources,
                 container_id, epoch)
        await self.try_hand_over(container_id)
        return epoch

    async def try_hand_over(self, container_id: int) -> None:
        """Hand over once every source stands at the epoch; give up if one finished first (the
        input ended before it). Synchronous up to the notifications: no step runs in between."""
        h = self.h
        plan = h._handovers.get(container_id)
        if plan is None or plan.state != "pending":
            return
        sources = [h.cores[c] for c in plan.sources]
        if any(src.done for src in sources):
            self.cancel_handover(container_id, "a source finished before the handover epoch")
        elif all(src.next_epoch >= plan.epoch for src in sources):
            hand_over(sources, h.cores[container_id], plan.epoch)
            plan.state = "done"
            # The receiver's first shipment (the rounds it took over, then its own) waits for the
            # sources' shipments in flight: deltas must reach a peer in order.
            h.shipping.after(container_id, plan.sources)
        else:
            return
        for c in [*plan.sources, container_id]:
            if c in h.conds:
                async with h.conds[c]:
                    h.conds[c].notify_all()

    def cancel_handover(self, container_id: int, why: str) -> None:
        h = self.h
        plan = h._handovers[container_id]
        plan.state = "cancelled"
        for c in plan.sources:
            if c in h.cores:
                h.cores[c].stop_before = None
        log.info("host %s: handover to container %s cancelled: %s", h.host_id, container_id, why)

    async def handover_state(self, container_id: int, cancel: bool = False) -> str:
        """``pending``, ``done`` or ``cancelled``; with ``cancel``, a pending handover is cancelled
        first (its sources go on with their slices). Atomic against the handover itself."""
        h = self.h
        plan = h._handovers.get(container_id)
        if plan is None:
            return "cancelled"
        if cancel and plan.state == "pending":
            self.cancel_handover(container_id, "the master undid the compaction")
            for c in plan.sources:
                if c in h.conds:
                    async with h.conds[c]:
                        h.conds[c].notify_all()
        return plan.state

    def migration_state(self, container_ids: list[int], with_times: bool) -> dict[int, dict[str, Any]]:
        """Per hosted container: next epoch, done, released slices, a handover awaited (and,
        ``with_times``, when its recent epochs finished: a migration's pause)."""
        out = {}
        for c in container_ids:
            core = self.h.cores.get(c)
            if core is not None:
                out[c] = {"next_epoch": core.next_epoch, "done": core.done, "released": dict(core.released),
                          "awaiting_handover": core.awaiting_handover,
                          "epoch_done_at": dict(core.epoch_done_at) if with_times else {}}
        return out

    async def remove(self, container_id: int) -> None:
        """Drop a hosted container that never joined the placement (an aborted migration destination)."""
        h = self.h
        core = h.cores.pop(container_id, None)
        cond = h.conds.pop(container_id, None)
        if core is None:
            return
        core.retire()  # its loop ends, pushes are refused
        if cond is not None:
            async with cond:
                cond.notify_all()
        core.close()
