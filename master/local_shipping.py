"""Carries out the checkpoint shipping machine's commands in process, for ``LocalCluster``.

Owns the in-process side of ``containers.shipping.ShippingProtocol``: one
machine per container; a round awaits the container's messages still in
flight when it was taken (settled once they leave the network: delivered,
refused, or lost with a dead host); its memory-sink rows go to the cluster's
``sink_parts`` (the master's copy) and its frames into the peers' backup
stores at once when the machine says so. The Ray driver is
``containers.ray_shipping.CheckpointShipping``; the rule is the machine's.
"""

from __future__ import annotations

import collections
from typing import Any

from chronostream.containers.core import add_sink_parts
from chronostream.containers.shipping import (ForceFull, PartsStored, PeerFailed, PeerShipped, RoundEnded,
                                              RoundTaken, Settled, Ship, ShippingProtocol, StoreRows)


class LocalShipping:
    """The shipping machines of one ``LocalCluster`` (``cl``)."""

    def __init__(self, cl: Any) -> None:
        self.cl = cl
        self.machines: dict[int, ShippingProtocol] = {}
        # (container, round) -> (memory-sink rows, frames per peer, slices)
        self.payload: dict[tuple[int, int], tuple[dict, dict[int, list[bytes]], tuple[int, ...]]] = {}
        # Per container, each await token and what settles it: a message in flight (held here, so
        # its id names no other object while the token waits), or None for another container's
        # rounds (token ("drained", container)).
        self.awaiting: dict[int, dict[tuple, Any]] = {}

    def take_round(self, cid: int, epoch: int, parts: dict, backups: dict[int, list[bytes]],
                   after: list[int] = ()) -> None:
        """Round of container ``cid`` after ``epoch``: it waits for the container's messages in
        flight now, and for the open rounds of ``after`` (a compaction's sources)."""
        machine = self.machines.setdefault(cid, ShippingProtocol(cid))
        waits = self.awaiting.setdefault(cid, {})
        tokens = set()
        for f in self.cl.in_flight:
            if f[2] == cid:
                tokens.add(("push", id(f)))
                waits.setdefault(("push", id(f)), f)
        for c in after:
            if not self.idle(c):
                tokens.add(("drained", c))
                waits.setdefault(("drained", c), None)
        core = self.cl.cores.get(cid)
        if backups and core is not None and core.checkpointer is not None:
            core.checkpointer.unshipped += 1  # (counted down when the round ends)
        slices = tuple(sorted(core.slices)) if core is not None else ()
        self.payload[(cid, machine.next_round)] = (parts, backups, slices)
        self._feed(cid, RoundTaken(epoch, frozenset(tokens), bool(parts), tuple(sorted(backups)), slices))

    def after(self, cid: int, sources: list[int]) -> None:
        """Container ``cid``'s next rounds go after ``sources``' open rounds (a compaction's receiver)."""
        if any(not self.idle(c) for c in sources):
            self.take_round(cid, -1, {}, {}, after=sources)

    def idle(self, cid: int) -> bool:
        machine = self.machines.get(cid)
        return machine is None or machine.idle

    def sweep(self) -> bool:
        """Settle every await whose message left the network or whose container drained (until
        none is left to settle); returns whether any was."""
        live = {id(f) for f in self.cl.in_flight}
        progressed = False
        while True:
            settled = False
            for cid in sorted(self.awaiting):
                waits = self.awaiting[cid]
                done = [t for t, f in waits.items() if (t[0] == "push" and id(f) not in live)
                        or (t[0] == "drained" and self.idle(t[1]))]
                for t in done:
                    del waits[t]
                    if cid in self.machines:
                        self._feed(cid, Settled(t))
                    settled = progressed = True
            if not settled:
                break
        return progressed

    def forget(self, containers: list[int]) -> None:
        """Containers that died with their host: their open rounds die with them."""
        for c in containers:
            self.machines.pop(c, None)
            self.awaiting.pop(c, None)
        self.payload = {k: v for k, v in self.payload.items() if k[0] in self.machines}

    def _feed(self, cid: int, first: Any) -> None:
        cl = self.cl
        machine = self.machines[cid]
        events = collections.deque([first])
        while events:
            for cmd in machine.handle(events.popleft()):
                core = cl.cores.get(cid)
                if isinstance(cmd, StoreRows):
                    parts = self.payload[(cid, cmd.round)][0]
                    add_sink_parts(cl.sink_parts, parts)
                    for other in cl.cores.values():  # (as on Ray: the master's copy is read from now)
                        other.drop_handed_sink_parts(parts)
                    events.append(PartsStored(cmd.round))
                elif isinstance(cmd, Ship):
                    events.append(self._ship(cid, cmd))
                elif isinstance(cmd, ForceFull):
                    if core is not None and core.checkpointer is not None:
                        core.checkpointer.force_full(list(cmd.slices))
                elif isinstance(cmd, RoundEnded):
                    _, backups, slices = self.payload.pop((cid, cmd.round))
                    if backups and core is not None and core.checkpointer is not None:
                        core.checkpointer.unshipped -= 1
                    if cmd.shipped and backups and cid in cl.placement.stage_of:
                        stage = cl.placement.stage_of[cid]
                        cl.checkpointed.update((stage, s) for s in slices)

    def _ship(self, cid: int, cmd: Ship) -> Any:
        if cmd.peer not in self.cl.alive:
            return PeerFailed(cmd.round, cmd.peer, dead=True)
        store = self.cl._store(cmd.peer)
        refused = [k[1] for k in (store.put(b) for b in self.payload[(cid, cmd.round)][1][cmd.peer])
                   if k is not None]
        return PeerShipped(cmd.round, cmd.peer, tuple(refused))
