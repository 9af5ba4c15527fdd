"""The JobMaster Ray actor: deploys the stages, owns the placement, watches containers.

Owns: creating the ResourceContainer actors (spread over the cluster's
nodes), wiring their routing tables from the placement, collecting
heartbeats, progress and completion, and turning a failure into a job
status with a readable error. The data plane never waits on the master.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from typing import Any

import pyarrow as pa
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from chronostream.dag import JobPlan
from chronostream.sinks import sort_output
from containers.actor import ResourceContainer
from containers.core import ContainerStatistics
from master.backups import backup_plan
from master.placement import Placement, initial_placement

log = logging.getLogger("chronostream.master")


@ray.remote(num_cpus=0)
class JobMaster:
    """One per job. Created by ``chronostream.run``."""

    def __init__(self, plan: JobPlan, containers_per_stage: dict[int, int], workdir: str,
                 max_inflight_epochs: int = 4, heartbeat_timeout_s: float = 60.0,
                 output_log: bool = True, checkpoint_every: int = 0, backup_factor: int = 2,
                 full_checkpoint_every: int = 8) -> None:
        self.plan = plan
        self.workdir = workdir
        self.max_inflight_epochs = max_inflight_epochs
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.output_log = output_log
        self.checkpoint_every = checkpoint_every
        self.backup_factor = backup_factor
        self.full_checkpoint_every = full_checkpoint_every
        self.placement: Placement = initial_placement(plan, containers_per_stage)
        self.handles: dict[int, Any] = {}
        self.nodes: dict[int, str] = {}
        self.last_seen: dict[int, float] = {}
        self.stats: dict[int, ContainerStatistics] = {}
        self.done: set[int] = set()
        self.state = "created"
        self.error: BaseException | None = None
        self.started_at = 0.0
        self.finished_at = 0.0
        self.events: list[tuple[float, str]] = []

    def _event(self, text: str) -> None:
        self.events.append((time.time(), text))
        log.info(text)

    async def deploy(self, source_refs: dict[int, list]) -> dict[str, Any]:
        """Create, configure and start every container. Returns the placement."""
        me = ray.get_runtime_context().current_actor
        # Spread each stage's containers over the alive nodes round-robin. SPREAD
        # and soft node affinity are best-effort and were seen stacking a stage on
        # one node; hard affinity to a node alive now is exact (a node that dies
        # before its container starts fails the deploy with Ray's error).
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        for stage_id, ids in self.placement.containers.items():
            for i, c in enumerate(ids):
                strategy: Any = "SPREAD"
                if len(nodes) > 1:
                    strategy = NodeAffinitySchedulingStrategy(nodes[(i + stage_id) % len(nodes)], soft=False)
                self.handles[c] = ResourceContainer.options(
                    scheduling_strategy=strategy, max_concurrency=1000,
                ).remote(c, me, self.workdir)
        configured = []
        for stage_id, ids in self.placement.containers.items():
            routes = self.placement.routes_for(self.plan, stage_id)
            senders = self.placement.senders_for(self.plan, stage_id)
            peers = {c: self.handles[c] for r in routes.values() for c in r.containers()}
            peers.update({c: self.handles[c] for c in ids})  # same-stage peers hold our backups
            src = source_refs.get(stage_id, [None])[0]
            chain = backup_plan(ids, {c: self.placement.slices_of(c) for c in ids}, self.backup_factor)
            for c in ids:
                mine = {s: chain[s] for s in self.placement.slices_of(c)}
                configured.append((c, self.handles[c].configure.remote(
                    self.plan, stage_id, self.placement.slices_of(c), routes, senders, peers, src,
                    self.max_inflight_epochs, self.output_log, mine, self.checkpoint_every,
                    self.full_checkpoint_every)))
        for c, ref in configured:
            self.nodes[c] = await ref
        self.started_at = time.time()
        now = time.monotonic()
        for c in self.handles:
            self.last_seen[c] = now
        await asyncio.gather(*[h.start.remote() for h in self.handles.values()])
        self.state = "running"
        self._event(f"job running: {len(self.handles)} containers over {len(set(self.nodes.values()))} node(s)")
        asyncio.get_running_loop().create_task(self._watch())
        return self.placement.as_dict(self.plan)

    async def _watch(self) -> None:
        # Failure detection for this issue: a container that stops answering fails
        # the job with a clear error (recovery comes with the fault-tolerance work).
        while self.state == "running":
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for c, h in self.handles.items():
                if c in self.done:
                    continue
                if now - self.last_seen.get(c, now) > self.heartbeat_timeout_s:
                    self._fail(c, RuntimeError(f"container {c} missed heartbeats for {self.heartbeat_timeout_s}s"))
                    return

    def _fail(self, container_id: int, error: BaseException) -> None:
        if self.state in ("failed", "stopped"):
            return
        stage = self.plan.stages[self.placement.stage_of[container_id]].name
        self.state = "failed"
        self.error = error
        self.finished_at = time.time()
        self._event(f"job failed in container {container_id} (stage {stage!r}): {error}")
        for h in self.handles.values():
            h.stop.remote()

    async def heartbeat(self, container_id: int, stats: ContainerStatistics) -> None:
        """Liveness and progress from a container."""
        self.last_seen[container_id] = time.monotonic()
        self.stats[container_id] = stats

    async def container_done(self, container_id: int, stats: ContainerStatistics) -> None:
        """A container processed its last epoch."""
        self.stats[container_id] = stats
        self.done.add(container_id)
        if len(self.done) == len(self.handles) and self.state == "running":
            self.state = "finished"
            self.finished_at = time.time()
            self._event("job finished")

    async def container_failed(self, container_id: int, error: BaseException) -> None:
        """A container hit an error it cannot handle."""
        self._fail(container_id, error)

    async def status(self) -> dict[str, Any]:
        """State ("running", "finished", "failed", "stopped"), error, progress."""
        return {
            "state": self.state,
            "error": self.error,
            "containers": len(self.handles),
            "done": len(self.done),
            "elapsed_s": (self.finished_at or time.time()) - self.started_at if self.started_at else 0.0,
            "epochs": self.plan.num_epochs,
            "min_epoch": min((s.next_epoch for s in self.stats.values()), default=0),
        }

    async def placement_view(self) -> dict[str, Any]:
        """Stage name -> container id -> slices, plus each container's node."""
        return {"stages": self.placement.as_dict(self.plan), "nodes": dict(self.nodes)}

    async def statistics(self) -> dict[int, ContainerStatistics]:
        """Latest statistics of every container (fresh from the containers)."""
        refs = {c: h.statistics.remote() for c, h in self.handles.items()}
        out = {}
        for c, r in refs.items():
            try:
                out[c] = await r
            except Exception:  # noqa: BLE001 - a dead container reports its last heartbeat
                if c in self.stats:
                    out[c] = self.stats[c]
        return out

    async def collect(self, sink_name: str) -> pa.Table:
        """All rows of a memory sink, sorted by (producer slice, out_seq)."""
        dl = self.plan.dead_letter_sink
        if dl is not None and dl.name == sink_name:
            parts = await asyncio.gather(*[h.collect_dead_letters.remote() for h in self.handles.values()])
            parts = [p for p in parts if p is not None]
            dead = self.plan.source_dead_letters
            if dead:
                parts.insert(0, pa.Table.from_pylist(dead))
            return pa.concat_tables(parts, promote_options="permissive") if parts else pa.table({})
        sink = next((s for s in self.plan.sinks if s.name == sink_name), None)
        if sink is None:
            raise KeyError(f"no sink named {sink_name!r}; sinks: {[s.name for s in self.plan.sinks]}")
        stage = self.plan.streams[sink.stream_id].stage_id
        hs = [self.handles[c] for c in self.placement.containers[stage]]
        parts = await asyncio.gather(*[h.collect.remote(sink.sink_id) for h in hs])
        parts = [p for p in parts if p is not None]
        if not parts:
            return pa.table({})
        return sort_output(pa.concat_tables(parts, promote_options="permissive"))

    async def backup_catalog(self) -> dict[int, list[tuple[int, int, int]]]:
        """Container id -> (stage, slice, epoch) of the backups it holds."""
        refs = {c: h.backups_held.remote() for c, h in self.handles.items()}
        return {c: await r for c, r in refs.items()}

    async def backup_plan(self) -> dict[int, dict[int, list[int]]]:
        """Stage id -> slice -> the containers that should hold its backups (the chain)."""
        return {st: backup_plan(ids, {c: self.placement.slices_of(c) for c in ids}, self.backup_factor)
                for st, ids in self.placement.containers.items()}

    async def container_handles(self) -> dict[int, Any]:
        """Actor handles by container id (for tests and the failure harness)."""
        return dict(self.handles)

    async def stop(self, cleanup: bool = True) -> None:
        """Stop and release every container; ``cleanup`` deletes their local stores."""
        if self.state == "running":
            self.state = "stopped"
            self.finished_at = time.time()
        for h in self.handles.values():
            try:
                await h.stop.remote(cleanup)
            except Exception:  # noqa: BLE001 - a dead container has nothing left to stop
                pass
        if cleanup:
            shutil.rmtree(self.workdir, ignore_errors=True)
        for h in self.handles.values():
            ray.kill(h)
