"""A host's pushes to other hosts: shared-memory wiring, acknowledgements, replays and reroutes.

Owns how an epoch message travels to a peer host (its large parts as files
in shared memory when the peer is on this node: ``containers.shm_transport``),
waiting for a push's acknowledgement (a dead receiver is marked unreachable
and reported to the master), and the replays a reroute or a recovered
producer owes a consumer. State changes are the cores' (``ContainerCore``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from ray.exceptions import RayActorError, RayError

from chronostream.containers.core import ContainerCore
from chronostream.containers.epoch_message import EpochMessage
from chronostream.containers.shm_transport import discard, shm_paths, unpack

log = logging.getLogger("chronostream.container")


#: How long making a peer known waits for its node (``learn_nodes``): its parts can then go
#: through shared memory from the first one.
LEARN_NODE_WAIT_S = 1.0


class HostPushes:
    """Pushes of one ``ResourceContainer`` host (``host``)."""

    def __init__(self, host: Any) -> None:
        self.h = host

    def wire(self, handle: Any, message: EpochMessage, core: ContainerCore | None
             ) -> tuple[EpochMessage, list[str]]:
        """``message`` as it travels to the host ``handle``: its large parts as files in shared
        memory when that host is on this node and says so (``containers.shm_transport``).
        ``core``: the sending container, which counts the files (``shm_parts``) and the parts
        sent before the receiver's node was known (``parts_node_unknown``)."""
        h = self.h
        if h._shm is None:
            return message, []
        node = h._peer_node.get(handle._actor_id.hex())
        if not node:  # (not asked yet, or no answer yet: Ray carries its pushes until the answer)
            self.ask_nodes([handle])
            if core is not None:
                core.parts_node_unknown += len(message.parts)
            return message, []
        if node != h._node_id:
            return message, []
        wire, files = h._shm.pack(message)
        if core is not None:
            core.shm_parts += len(files)
        return wire, files

    async def learn_nodes(self, handles: Iterable[Any], wait_s: float = LEARN_NODE_WAIT_S) -> None:
        """Ask the hosts ``handles`` which node they run on (once each) and wait up to ``wait_s``
        for the answers: done when a peer is made known (``add_container``, ``reroute``), so the
        first part sent to it can go through shared memory. A slow or dead peer's answer is
        left to come in the background."""
        asks = self.ask_nodes(handles)
        if asks:
            await asyncio.wait(asks, timeout=wait_s)

    def ask_nodes(self, handles: Iterable[Any]) -> list[asyncio.Task]:
        h = self.h
        if h._shm is None:
            return []
        asks = []
        for handle in handles:
            aid = handle._actor_id.hex()
            if aid not in h._peer_node:
                h._peer_node[aid] = ""  # asked
                asks.append(asyncio.get_running_loop().create_task(self.ask_node(aid, handle)))
        return asks

    async def ask_node(self, aid: str, handle: Any) -> None:
        h = self.h
        try:
            h._peer_node[aid] = await handle.node.remote()
        except RayError:
            # A dead or unreachable peer: its node stays unknown (parts to it go through Ray),
            # its pushes fail and recovery takes over.
            pass

    async def push_replay(self, target: int, target_host: Any, sender: int, replay: dict[int, EpochMessage]
                          ) -> None:
        """Push a replay in epoch order, ``REPLAY_BATCH`` epochs per call (large parts through
        shared memory as live pushes: ``wire``)."""
        h = self.h
        epochs = sorted(replay)
        for i in range(0, len(epochs), h.REPLAY_BATCH):
            run, files = [], []
            for e in epochs[i:i + h.REPLAY_BATCH]:
                wire, written = self.wire(target_host, replay[e], h.cores.get(sender))
                run.append((e, wire))
                files += written
            try:
                await target_host.push_many.remote(target, sender, run)
            except asyncio.CancelledError:
                files = []  # (the call may still run: its receiver unlinks them, as in ``acknowledged``)
                raise
            finally:
                discard(files)  # (each push unlinked its own; what is left never ran)

    async def acknowledged(self, dst: int, ref: Any) -> bool:
        """Wait for one push; False (and the master told) when its receiver died."""
        h = self.h
        try:
            await ref
            return True
        except RayActorError:
            if dst not in h.unreachable:
                h.unreachable.add(dst)
                log.warning("host %s: container %s is unreachable; stop sending to it", h.host_id, dst)
                h.master.container_unreachable.remote(dst, h.host_id)
            return False
        except asyncio.CancelledError:
            # This host is stopping; the push may still run, and its receiver unlinks the files
            # (unlinked here, a live receiver would find them gone). The job's stop removes the rest.
            h._shm_files.pop(ref, None)
            raise
        finally:
            # The receiver unlinked them when the push ran; one that never ran left them.
            discard(h._shm_files.pop(ref, []))

    async def tell_end(self, core: ContainerCore, target: int, target_host: Any, sender: int) -> None:
        """Tell a rerouted-to container where a sealed followed input ends.

        This container may have announced the end before ``target`` became a
        destination (``take_end_notice`` goes out once), and a replay that was
        empty carries nothing. Epoch -1 is below every container's next epoch:
        ``deliver`` records the end and keeps nothing in the inbox.
        """
        if core.num_epochs is not None and core.plan.num_epochs is None:
            await target_host.push.remote(target, -1, sender, EpochMessage(end=core.num_epochs))

    async def reroute(self, container_id: int, stage_id: int, slices: list[int], target: int, target_host: Any,
                      progress: dict[int, dict[int, list[int]]], resume: dict[int, int],
                      dual: bool = False) -> dict[str, int]:
        """Send ``slices`` of ``stage_id`` to ``target`` from now on and replay what it is owed.

        Returns ``{"epochs": replayed, "rounds": catch-up rounds}``. The replay messages are
        pushed in epoch order and awaited (the receiver's window paces them).

        With ``dual`` (migration phase 2) the slices' owner keeps getting
        them too, and the new copy catches up *before* it joins the live
        route: rounds of replay, each read from the output log in a worker
        thread while this container keeps stepping, until the gap is at most
        one window (or after ``CATCH_UP_ROUNDS``); only then does the route
        switch, at an epoch boundary, and the last gap is replayed. So this
        container never waits on a copy that is still far behind (its other
        destinations, the slices' owner among them, keep their pace), and
        it is never blocked while the replay is read.
        """
        h = self.h
        core, cond = h.cores[container_id], h.conds[container_id]
        await self.learn_nodes([target_host])  # (before the lock: the container steps on meanwhile)
        async with cond:
            h.peers[target] = target_host
            h.unreachable.discard(target)
            if not dual:
                replay = core.reroute(stage_id, slices, target, progress, resume)
        if not dual:
            await self.push_replay(target, target_host, container_id, replay)
            await self.tell_end(core, target, target_host, container_id)
            return {"epochs": len(replay), "rounds": 1}
        since, pushed, round_ = 0, 0, 0
        cursor: dict[tuple[int, int], int] = {}  # each round reads only the log after the last one
        for round_ in range(1, h.CATCH_UP_ROUNDS + 1):
            async with cond:  # between two steps: an epoch boundary
                upto = core.next_epoch
                joining = upto - max(since, min(resume[s] for s in slices)) <= h.window \
                    or round_ == h.CATCH_UP_ROUNDS
                if joining:
                    core.switch_route(stage_id, slices, target, dual=True)
            replay = await asyncio.to_thread(core.replay_epochs, stage_id, slices, target, progress, resume,
                                             upto, since, cursor)
            log.info("host %s: container %s replays epochs %s..%s of stage %s slices %s to container %s "
                     "(catch-up round %d%s)", h.host_id, container_id, since, upto - 1, stage_id, slices,
                     target, round_, ", then live" if joining else "")
            await self.push_replay(target, target_host, container_id, replay)
            pushed += len(replay)
            since = upto
            if joining:
                break
        await self.tell_end(core, target, target_host, container_id)
        return {"epochs": pushed, "rounds": round_}

    async def replay_to(self, container_id: int, stage_id: int, target: int, target_host: Any, upto: int) -> int:
        """A recovered container replays its relogged outputs of epochs before ``upto`` (its
        resume epoch) to consumer ``target`` from where that consumer is: the dead container's
        messages of those epochs may never have reached it (a replay it owed a migration's
        destination is covered by no checkpoint). Returns the epochs pushed."""
        h = self.h
        core = h.cores[container_id]
        pos = await target_host.position.remote(target)
        if pos is None:
            return 0
        replay = await asyncio.to_thread(core.replay_behind, stage_id, target, pos["next_epoch"],
                                         pos["progress"], upto)
        if not replay:
            return 0
        await self.learn_nodes([target_host])
        await self.push_replay(target, target_host, container_id, replay)
        return len(replay)

    async def receive(self, container_id: int, epoch: int, sender: int, message: EpochMessage) -> bool:
        """Receive one epoch message for a hosted container (waits while its inbox is full)."""
        h = self.h
        if h.stopped:  # (its files unlinked unread: a stopped host takes no message)
            discard(shm_paths(message))
            return False
        message = unpack(message)  # first: a refused message's files are unlinked too
        core, cond = h.cores.get(container_id), h.conds.get(container_id)
        if core is None or cond is None or core.retired:
            return False  # removed, or every slice migrated away: nothing needs it
        async with cond:
            await cond.wait_for(lambda: epoch < core.next_epoch + h.window + h.extra_window.get(container_id, 0)
                                or h.stopped or core.retired)
            accepted = core.deliver(epoch, sender, message)
            cond.notify_all()
        return accepted

    async def receive_many(self, container_id: int, sender: int, messages: list[tuple[int, EpochMessage]]) -> int:
        """Receive a run of epoch messages (a replay) in one call, in order, each waiting for room
        in the inbox as ``push`` does; returns how many were accepted.

        One awaited call per replayed epoch made a catch-up as slow as the
        call's round trip (tens of ms on a busy host), barely faster than
        the epochs a producer makes meanwhile.
        """
        accepted = 0
        for epoch, message in messages:
            accepted += bool(await self.receive(container_id, epoch, sender, message))
        return accepted
