"""The JobMaster's hosts on Ray: making, finding and adopting them, probing, and releasing idle ones.

Owns the calls that create a host actor (a new detached named process, or a
warm spare adopted from ``master.host_pool``), find one again by name after a
master restart, ask whether hosts are alive (``probe``), and stop the hosts a
scale-in left idle. The books they change (``handles``, ``alive``,
``last_seen``, ``host_names``) stay the master's; decides nothing about
placement or recovery.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from chronostream.containers.actor import ResourceContainer
from chronostream.master.host_pool import take_spare

log = logging.getLogger("chronostream.master")


class RayHosts:
    """Host-level calls of one ``JobMaster`` (``master``)."""

    def __init__(self, master: Any) -> None:
        self.m = master

    def host_name(self, host_id: int) -> str:
        """The host's actor name: a warm spare's own (``master.host_pool``), else the job's naming."""
        m = self.m
        return m.host_names.get(host_id) or f"chronostream-{m.job_key}-host-{host_id}"

    async def new_or_found(self, host_id: int, node: str | None = None) -> Any:
        """Host ``host_id`` (a deploy's, a recovery's or a scale-out's new one): found by name when
        a previous master process created or adopted it already (and died before it saved its
        layout, or in a recovery), else made now on ``node``."""
        m = self.m
        try:
            h = ray.get_actor(self.host_name(host_id))
            if host_id in m.host_names:  # a spare: its adoption may not have happened
                await h.adopt.remote(host_id, ray.get_runtime_context().current_actor, m.workdir,
                                     m.heartbeat_s)
        except (ValueError, RayActorError):
            return await self.new(host_id, node)
        m.handles[host_id] = h
        m.alive.add(host_id)
        m.last_seen[host_id] = time.monotonic()
        return h

    async def new(self, host_id: int, node: str | None) -> Any:
        """Host ``host_id`` on ``node`` (None: any): a warm spare when the cluster keeps some
        (``master.host_pool``), else a new process."""
        m = self.m
        me = ray.get_runtime_context().current_actor
        h = await self.adopted_spare(host_id, node, me)
        if h is None:
            strategy: Any = "SPREAD" if node is None else NodeAffinitySchedulingStrategy(node, soft=False)
            if m.host_names.pop(host_id, None) is not None:
                m.catalog.save_host_name(host_id, None)
            # Detached and named: a host outlives a master restart and is found again by name.
            h = ResourceContainer.options(scheduling_strategy=strategy, max_concurrency=1000, lifetime="detached",
                                          name=self.host_name(host_id)).remote(
                host_id, me, m.workdir, m.heartbeat_s)
        m.handles[host_id] = h
        m.alive.add(host_id)
        m.last_seen[host_id] = time.monotonic()
        return h

    async def adopted_spare(self, host_id: int, node: str | None, me: Any) -> Any:
        """A warm spare adopted as host ``host_id``, or None when the pool had none ready."""
        m = self.m
        spare = await take_spare(node)
        if spare is None:
            return None
        name, h = spare
        # Named in the catalog before the adoption: a restarted master finds and adopts it.
        m.host_names[host_id] = name
        m.catalog.save_host_name(host_id, name)
        try:
            if m._kill_spare:
                m._kill_spare = False
                await self.kill_spare_now(h, host_id, name)
            await h.adopt.remote(host_id, me, m.workdir, m.heartbeat_s)
        except RayActorError:
            # It died after the pool leased it to us (its process or node): the caller starts the
            # host itself. (Its name in the catalog is dropped there.)
            log.warning("master: spare %s died before its adoption as host %s; starting the host", name, host_id)
            m._event("spare_lost", host=host_id, spare=name)
            return None
        m._event("spare_adopted", host=host_id, spare=name)
        return h

    async def kill_spare_now(self, h: Any, host_id: int, name: str, timeout_s: float = 30.0) -> None:
        """Kill spare ``h`` and return once it no longer answers (``ray.kill`` only asks: until the
        process is gone it could still be adopted)."""
        m = self.m
        log.warning("master: killing spare %s before its adoption as host %s (failure injection)", name, host_id)
        m._event("spare_kill_injected", host=host_id, spare=name)
        ray.kill(h, no_restart=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(h.ready.remote(), timeout=5)
            except RayActorError:
                return
            except asyncio.TimeoutError:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError(f"spare {name} still answers {timeout_s:.0f} s after it was killed")

    def stage_hosts(self, stage_id: int) -> dict[int, Any]:
        m = self.m
        return {m.host_of[c]: m.handles[m.host_of[c]] for c in m.placement.containers[stage_id]}

    def peers_of(self, stage_id: int) -> dict[int, Any]:
        """Actors hosting the containers a container of ``stage_id`` sends to."""
        m = self.m
        return {c: m.handles[m.host_of[c]] for d in m.plan.downstream_stages(stage_id)
                for c in m.placement.containers[d]}

    async def probe(self, hosts: list[int]) -> set[int]:
        """Hosts whose actor is dead (a ping raises). A busy host just answers late: not dead."""
        m = self.m
        async def one(h: int) -> bool:
            if m.handles.get(h) is None:
                return True
            try:
                await asyncio.wait_for(m.handles[h].ping.remote(), timeout=max(1.0, m.heartbeat_s * 4))
                m.last_seen[h] = time.monotonic()
                return False
            except RayActorError:
                return True
            except asyncio.TimeoutError:
                return False
        results = await asyncio.gather(*[one(h) for h in hosts])
        return {h for h, d in zip(hosts, results) if d}

    def least_used_node(self) -> str | None:
        m = self.m
        alive_nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        if len(alive_nodes) <= 1:
            return None
        used = {n: 0 for n in alive_nodes}
        for h in m.alive:
            if m.nodes.get(h) in used:
                used[m.nodes[h]] += 1
        return min(alive_nodes, key=lambda n: (used[n], n))

    def producers(self, stage_id: int, dead: set[int] = frozenset(),
                  live_only: bool = True) -> list[tuple[int, Any]]:
        """(container, host actor) of the containers of the stages feeding ``stage_id`` (the live
        ones; with ``live_only=False`` all, so that a call to a dead one fails loudly)."""
        m = self.m
        return [(c, m.handles[m.host_of[c]]) for u in m.plan.upstream_stages(stage_id)
                for c in m.placement.containers[u] if not live_only or m.host_of[c] in m.alive - dead]

    async def release_idle(self) -> list[int]:
        """Hosts running no container of the placement any more (scale-in): keep their sink rows, stop them."""
        m = self.m
        busy = {m.host_of[c] for ids in m.placement.containers.values() for c in ids}
        idle = sorted(h for h in m.alive if h not in busy)
        for h in idle:
            try:
                parts = await m.handles[h].drain_sink_parts.remote()
                if parts:
                    await m.store_sink_parts(parts)
                await m.handles[h].stop.remote(True)
                ray.kill(m.handles[h])
            except RayActorError:
                pass
            m.alive.discard(h)
            m._event("host_released", host=h)
        return idle

    def not_found(self) -> set[int]:
        """Live hosts a restarted master could not find by name (they died while it was away)."""
        m = self.m
        return {h for h in m.alive if m.handles.get(h) is None}
