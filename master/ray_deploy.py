"""The JobMaster's deploy on Ray (hosts made and configured, containers added and started) and its reload after a restart.

Owns the order of a deploy (identity and launch saved in the catalog first,
hosts spread over the alive nodes, every host configured, every container
added with its backup chain, then started, then the job is running) and the
call that adds one container to a host (used by recovery and migration too);
a restarted master's reading of its catalog and finding its hosts again.
The job's state changes go through ``JobMaster._job``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

from chronostream.master.launch import JobLaunch, plan_fingerprint
from chronostream.master.protocols.job import Deployed, JobLifecycle
from chronostream.master.placement import initial_placement
from chronostream.containers.ray_savepoints import SAVEPOINT_HOLDER

log = logging.getLogger("chronostream.master")


class RayDeploy:
    """Deploy and resume of one ``JobMaster`` (``master``)."""

    def __init__(self, master: Any) -> None:
        self.m = master

    async def deploy(self, launch: bytes, source_refs: dict[int, list], made_workdir: bool = False) -> dict[str, Any]:
        """Create, configure and start every container of the job ``launch`` describes
        (``JobLaunch.pack``); ``source_refs``: stage id -> [object reference of its in-memory
        table]; ``made_workdir``: ``run`` made the work directory for this job (a stop with
        cleanup removes it whole). Returns the placement.

        The job's identity and launch are saved in the catalog first, so a master restarted
        from here on knows the job; a call Ray retries after a restart finds it deployed (or
        deploys it)."""
        m = self.m
        m.source_refs = dict(source_refs)
        if m.resumed or m.handles:  # a retried call after a restart: already deployed
            m._ensure_watching()
            await m.reads.endpoint.start()
            return m.placement.as_dict(m.plan)
        job = JobLaunch.unpack(launch)
        m._launch(job)
        m.placement = initial_placement(job.plan, job.containers_per_stage)
        m.catalog.save_identity(m.job_key, plan_fingerprint(job.plan), made_workdir)
        m.identity = m.catalog.load_identity()
        m.catalog.save_launch(launch)
        # Spread each stage's containers over the alive nodes round-robin. SPREAD
        # and soft node affinity are best-effort and were seen stacking a stage on
        # one node; hard affinity to a node alive now is exact (a node that dies
        # before its container starts fails the deploy with Ray's error).
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        for stage_id, ids in m.placement.containers.items():
            for i, c in enumerate(ids):
                m.host_of[c] = c
                await m.hosts.new_or_found(c, nodes[(i + stage_id) % len(nodes)] if len(nodes) > 1 else None)
        m.next_id = max(m.host_of) + 1
        await asyncio.gather(*[self.configure(h) for h in m.handles])
        # A job started from a savepoint restores every slice from it, as a recovery from a backup.
        reader = None
        if job.restore_from is not None:
            reader = await m.savepoints.reader(job.restore_from, job.drop_states)
        added = []
        for stage_id, ids in m.placement.containers.items():
            chain = m.chains.of_stage(stage_id)
            for c in ids:
                slices = m.placement.slices_of(c)
                restore = None if reader is None else {s: [(SAVEPOINT_HOLDER, reader)] for s in slices}
                added.append(self.add_container(c, stage_id, slices, chain[c], restore))
        try:
            await asyncio.gather(*added)
        except BaseException:
            m.savepoints.release()
            raise
        if reader is not None:  # (it stays: the slices' copy until their first checkpoints)
            m._event("restored_from_savepoint", path=job.restore_from)
        m.chains.note_copies()
        m.started_at = time.time()
        await asyncio.gather(*[h.start.remote() for h in m.handles.values()])
        m._save_layout()
        # A container may have failed (or every container finished) while the hosts' start was
        # awaited: a failed job stays failed, and a finish that came early is taken now.
        m._job(Deployed(m._live(), {"containers": len(m.host_of), "nodes": len(set(m.nodes.values()))}))
        m._ensure_watching()
        await m.reads.endpoint.start()
        if m.policy is not None:
            m._in_background(m.scaling.autoscale())
        return m.placement.as_dict(m.plan)

    async def add_container(self, c: int, stage_id: int, slices: list[int], backup_peers: dict[int, list[int]],
                            restore_from: dict[int, list[tuple[int, Any]]] | None = None,
                            hand_over_from: list[int] | None = None) -> Any:
        m = self.m
        src = await m.sources.ref(stage_id)
        hosts = {**m.hosts.stage_hosts(stage_id), **{h: m.handles[h] for ps in backup_peers.values() for h in ps}}
        return await m.handles[m.host_of[c]].add_container.remote(
            c, stage_id, slices, m.placement.routes_for(m.plan, stage_id),
            m.placement.sender_coverage(m.plan, stage_id), m.hosts.peers_of(stage_id),
            hosts, src, m.opts.output_log, backup_peers, restore_from, hand_over_from)

    async def configure(self, host_id: int) -> None:
        """Give host ``host_id`` the job (plan, options and the source tables' references: a
        restarted master finds them first, so a host it adds can hand them on too)."""
        m = self.m
        await m.sources.find()
        m.nodes[host_id] = await m.handles[host_id].configure.remote(m.plan, m.opts, m.source_refs)

    def resume(self) -> None:
        """A restarted master: reload the catalog and find the hosts again."""
        m = self.m
        m.placement, m.host_of, m.alive, m.nodes, m.next_id = m.catalog.load_layout()
        prog = m.catalog.load_progress()
        m.job = JobLifecycle(prog["state"], set(prog["done"]))
        m.started_at, m.finished_at = prog["started_at"], prog["finished_at"]
        m.sink_groups = m.catalog.load_sink_groups()
        m.catalog.forget_events(m.timeline.extend(m.catalog.load_numbered_events()))
        now = time.monotonic()
        for h in sorted(m.alive):
            try:
                m.handles[h] = ray.get_actor(m.hosts.host_name(h))
                m.last_seen[h] = now
            except ValueError:  # it died while the master was away: recovered by the watch loop,
                m.handles[h] = None  # from its peers' copies, or its own store's on disk
                m.disk_copies.found_dead.add(h)
                m.last_seen[h] = now - 2 * m.opts.heartbeat_timeout_s
        m._event("master_restarted", hosts=sorted(m.alive), containers=len(m.host_of),
                 gc_marks={str(k): v for k, v in sorted(m.gc_marks.items())})
        m._unsettled_request, left = m.catalog.load_migration()
        m._unsettled = left
        m._unfinished_recovery = m.catalog.load_recovery()
        if m.restored_from[0] is not None:  # (its slices' copy until their first checkpoints)
            m.savepoints.reopen(*m.restored_from)
