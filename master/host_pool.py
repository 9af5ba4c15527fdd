"""Warm spare hosts: ResourceContainer processes started and warmed before a job needs them.

Owns: the ``HostPool`` actor (detached, named ``HOST_POOL_NAME`` in the
``chronostream`` namespace), which keeps ``size`` idle spare hosts warm
(Ray, Arrow and the runtime imported, ``ResourceContainer.ready``) and
hands them to masters; ``take_spare``, the master's side of it. It must
not touch a job: a spare it hands out belongs to the master that took it
(``ResourceContainer.adopt``), and the pool forgets it.

Why: a new host is a new Python process. On a 2-core machine one costs
about 1.5-2 s of CPU before it can run a slice (importing Ray, Arrow and
the runtime), and a job deploys several at once; a scale-out or a recovery
onto a new host waits for one. A spare was paid for earlier, while the
cluster had time.

The pool starts its spares one at a time, so refilling it takes at most
one core. A spare handed out is leased (``ResourceContainer.lease``): a
master that dies before adopting it does not leak a process. Spares are
detached named actors (``chronostream-spare-<hex>``); the master records
the name of every host it adopted (``MasterCatalog.save_host_name``) so a
restarted master finds it again.

    import chronostream as cs
    cs.ensure_ray(num_cpus=2)
    cs.keep_warm_hosts(6)    # later jobs deploy, scale out and recover onto warm spares
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from chronostream.containers.actor import ResourceContainer
from chronostream.containers.ray_joining import SpareState

log = logging.getLogger("chronostream.host_pool")

HOST_POOL_NAME = "chronostream-host-pool"
SPARE_PREFIX = "chronostream-spare-"
#: Seconds a spare handed out waits for its ``adopt`` before it exits.
LEASE_S = 120.0
#: Seconds a spare has to answer when it is taken (else it is dropped as dead).
ANSWER_S = 10.0


@dataclass(frozen=True)
class PoolStats:
    """A host pool's counts (``HostPool.stats``, ``cs.keep_warm_hosts``)."""

    size: int  # spares it keeps
    ready: int  # spares started, warm and not handed out
    by_node: dict[str, int]  # node id -> ready spares on it
    handed_out: int  # spares taken by masters so far
    started: int  # spare processes started so far
    dropped: int  # spares found dead (when taken, or on a node that died)
    found: int  # spares an earlier pool left, kept by this one
    names: list[str]  # the ready spares' actor names
    pool_node: str  # the node the pool itself runs on


@ray.remote(num_cpus=0)
class HostPool:
    """Keeps ``size`` warm spare hosts; ``take`` hands one out and starts its replacement."""

    def __init__(self) -> None:
        self.size = 0  # (set by ``resize``)
        self.spares: list[tuple[str, Any, str]] = []  # (actor name, handle, node id), oldest first
        self.handed_out = 0
        self.started = 0
        self.dropped = 0  # spares found dead when taken
        self.found = 0  # spares an earlier pool left, kept by this one
        self._filling: asyncio.Task | None = None
        self._looked_for_orphans = False

    async def resize(self, size: int) -> None:
        """Keep ``size`` spares from now on: more are started, spares over it are stopped.
        A new pool's first call also takes over the spares a pool before it left (it died)."""
        if size < 0:
            raise ValueError(f"a host pool's size must be >= 0, got {size}")
        self.size = size
        if not self._looked_for_orphans:
            self._looked_for_orphans = True
            await self._take_over_orphans()
        while len(self.spares) > size:
            _name, handle, _node = self.spares.pop()
            ray.kill(handle)
        self._refill()

    async def take(self, node: str | None = None, lease_s: float = LEASE_S) -> tuple[str, Any] | None:
        """A ready spare on ``node`` (any node when None) as (actor name, handle), leased
        for ``lease_s``; None when none is ready (the caller starts a host itself). A spare
        that does not take its lease within ``ANSWER_S`` (its process or node died) is
        dropped and the next one tried."""
        for spare in list(self.spares):
            name, handle, on = spare
            if node is not None and on != node:
                continue
            self.spares.remove(spare)
            try:  # (a spare whose process or node died since: dropped, the next one tried)
                await asyncio.wait_for(handle.lease.remote(lease_s), timeout=ANSWER_S)
            except Exception as exc:  # noqa: BLE001 - dead, or not answering: not handed out
                log.warning("spare host %s did not answer (%s); dropped", name, type(exc).__name__)
                ray.kill(handle)
                self.dropped += 1
                continue
            self.handed_out += 1
            self._refill()
            return name, handle
        self._refill()
        return None

    async def stats(self) -> PoolStats:
        """The target size, ready spares (count, per node, their actor names), spares handed out,
        started and found dead so far (dead when taken, or on a node that died), kept from an
        earlier pool, and the pool's own node."""
        self._refill()
        nodes: dict[str, int] = {}
        for _name, _handle, node in self.spares:
            nodes[node] = nodes.get(node, 0) + 1
        return PoolStats(size=self.size, ready=len(self.spares), by_node=nodes, handed_out=self.handed_out,
                         started=self.started, dropped=self.dropped, found=self.found,
                         names=[name for name, _handle, _node in self.spares],
                         pool_node=ray.get_runtime_context().get_node_id())

    async def wait_full(self, timeout_s: float = 60.0) -> bool:
        """Wait until ``size`` spares are ready (or ``timeout_s``); True when they are."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        self._refill()
        while len(self.spares) < self.size and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return len(self.spares) >= self.size

    def _refill(self) -> None:
        self._drop_spares_of_dead_nodes()
        if len(self.spares) < self.size and (self._filling is None or self._filling.done()):
            self._filling = asyncio.get_running_loop().create_task(self._fill())

    async def _fill(self) -> None:
        # One spare at a time: starting a process costs a core for a second or two, and the
        # cluster is running jobs meanwhile.
        while len(self.spares) < self.size:
            node = self._emptiest_node()
            strategy: Any = "DEFAULT" if node is None else NodeAffinitySchedulingStrategy(node, soft=False)
            name = SPARE_PREFIX + uuid.uuid4().hex[:12]
            handle = ResourceContainer.options(name=name, lifetime="detached", max_concurrency=1000,
                                               scheduling_strategy=strategy).remote(None, None, ".")
            try:
                on = await handle.ready.remote()
            except Exception as exc:  # noqa: BLE001 - a node that died: try again on the others
                log.warning("a spare host failed to start (%s: %s)", type(exc).__name__, exc)
                await asyncio.sleep(1.0)
                continue
            self.started += 1
            if len(self.spares) >= self.size:  # resized down while it started
                ray.kill(handle)
                break
            self.spares.append((name, handle, on))

    async def _take_over_orphans(self) -> None:
        """Spares named like ours that no pool knows: an earlier pool started them and died.
        Unadopted and unleased ones are kept (up to ``size``) or stopped, so none lives on
        unadopted for good; adopted or leased ones belong to a master."""
        namespace = ray.get_runtime_context().namespace
        # (GCS lookups block: off the event loop, so the pool keeps answering meanwhile)
        named = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        names = sorted(a["name"] for a in named if a["namespace"] == namespace and a["name"].startswith(SPARE_PREFIX))
        known = {name for name, _handle, _node in self.spares}

        async def state_of(name: str) -> tuple[Any, SpareState | None]:
            try:
                handle = await asyncio.to_thread(ray.get_actor, name, namespace=namespace)
                return handle, await asyncio.wait_for(handle.spare_state.remote(), timeout=ANSWER_S)
            except Exception:  # noqa: BLE001 - gone or not answering: not ours to keep
                return None, None
        unknown = [name for name in names if name not in known]
        for name, (handle, state) in zip(unknown, await asyncio.gather(*[state_of(n) for n in unknown])):
            if state is None or state.leased:
                continue
            if len(self.spares) < self.size:
                self.spares.append((name, handle, state.node))
                self.found += 1
            else:
                ray.kill(handle)
        if names:
            log.info("host pool: %d spare(s) of an earlier pool kept, of %d named", self.found, len(names))

    def _drop_spares_of_dead_nodes(self) -> None:
        """Forget the spares of nodes that died: they would count as ready forever (a master
        never asks for a dead node), and the pool would stay short on the live ones."""
        if not self.spares:
            return
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        gone = [spare for spare in self.spares if spare[2] not in alive]
        for spare in gone:
            log.warning("spare host %s: its node %s died; dropped", spare[0], spare[2][:12])
            self.spares.remove(spare)
            self.dropped += 1

    def _emptiest_node(self) -> str | None:
        """The alive node holding the fewest ready spares; None on a one-node cluster."""
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        if len(nodes) < 2:
            return None
        held = {n: 0 for n in nodes}
        for _name, _handle, node in self.spares:
            if node in held:
                held[node] += 1
        return min(nodes, key=lambda n: held[n])


def keep_warm_hosts(size: int, namespace: str) -> Any:
    """The cluster's host pool (created detached when missing), resized to ``size`` spares.

    A new pool is placed on the caller's node (usually the head, the node least likely to go
    away; Ray's soft affinity placed it on a worker all the same, so the affinity is hard). A
    pool that dies forgets its spares; the next pool made (this call, again) takes them over."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    pool = HostPool.options(name=HOST_POOL_NAME, namespace=namespace, lifetime="detached",
                            get_if_exists=True, scheduling_strategy=here).remote()
    ray.get(pool.resize.remote(size))
    return pool


async def take_spare(node: str | None) -> tuple[str, Any] | None:
    """A warm spare host on ``node`` from the pool of the caller's namespace, or None (no pool,
    or no spare ready there)."""
    try:
        pool = ray.get_actor(HOST_POOL_NAME, namespace=ray.get_runtime_context().namespace)
    except ValueError:
        return None
    try:
        return await pool.take.remote(node)
    except Exception as exc:  # noqa: BLE001 - a pool that died: start hosts the plain way
        log.warning("the host pool did not answer (%s: %s); starting a host", type(exc).__name__, exc)
        return None
