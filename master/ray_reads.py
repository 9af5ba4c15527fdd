"""What the JobMaster answers about a running job: status, statistics, metrics, timeline, sink parts.

Owns gathering the hosts' answers into the master's read results
(``master.rpc_results``, ``master.results``, ``containers.metrics``) and
settling a host found dead after the job's end (``lost_after_end``). Changes
nothing but the host books of such a host.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

import ray
from ray.exceptions import RayActorError

from chronostream.slices.errors import SinkRowsLost
from chronostream.containers.core import ContainerStatistics
from chronostream.containers.sink_parts import PackedSinkParts
from chronostream.containers.metrics import LatencyHistogram, MetricsSnapshot
from chronostream.master.ray_http import JobHttp
from chronostream.master.autoscaler import Counters, build_snapshot
from chronostream.master.job_state import JobState
from chronostream.master.results import SinkPartRefs, memory_sink_ids
from chronostream.master.rpc_results import MasterStatus, PlacementView

log = logging.getLogger("chronostream.master")

#: Callers' rate windows kept (``metrics_snapshot(window=...)``); the oldest used goes first.
WINDOWS_KEPT = 64


class RayReads:
    """Read-only answers of one ``JobMaster`` (``master``)."""

    def __init__(self, master: Any) -> None:
        self.m = master
        self.endpoint = JobHttp(master)  # the job's dashboard and Prometheus /metrics (master.ray_http)
        # Each caller's counters at its previous snapshot (its rates are over its own interval:
        # one caller's read never shortens another's); the autoscaler's are ``master._counters``.
        self.windows: collections.OrderedDict[str, Counters] = collections.OrderedDict()

    def answering(self) -> list[int]:
        """The live hosts that have a handle to ask (not those a restarted master did not find:
        a finished job's, or ones its watch loop is about to recover)."""
        m = self.m
        return sorted(m.alive - m.hosts.not_found())

    async def metrics_snapshot(self, window: str | None = None) -> MetricsSnapshot:
        """Per stage: input and processing rates, utilization, backlog, per-slice figures; job
        latency percentiles and throughput; per host CPU and RSS. Rates and latency are over the
        interval since the previous snapshot of the same ``window`` (a caller's name; None: the
        autoscaler's); a window's first snapshot has no rates."""
        m = self.m
        ids: dict[int, list[int]] = {}
        answering = set(self.answering())
        for c in (c for cs_ in m.placement.containers.values() for c in cs_):
            if m.host_of[c] in answering:
                ids.setdefault(m.host_of[c], []).append(c)
        parts = await asyncio.gather(*[m.handles[h].metrics.remote(cs_) for h, cs_ in ids.items()],
                                     return_exceptions=True)
        stats, slices = {}, {}
        for part in parts:
            if isinstance(part, dict):
                for c, (st, sl) in part.items():
                    stats[c], slices[c] = st, sl
        t = time.time() - m.started_at if m.started_at else 0.0
        if window is None:
            snap, m._counters = build_snapshot(t, m.plan, m.placement, m.host_of, stats, slices, m._counters)
            return snap
        snap, self.windows[window] = build_snapshot(t, m.plan, m.placement, m.host_of, stats, slices,
                                                    self.windows.get(window))
        self.windows.move_to_end(window)
        while len(self.windows) > WINDOWS_KEPT:
            self.windows.popitem(last=False)
        return snap

    async def metrics(self, window: str = "") -> dict[str, Any]:
        """A fresh snapshot (plain; rates since ``window``'s previous call), the end-to-end latency
        over the whole run, and autoscaler ticks so far."""
        m = self.m
        snap = await self.metrics_snapshot(window)
        total = LatencyHistogram()
        for st in (await self.statistics()).values():
            if st is not None and st.latency:
                total = total.merge(LatencyHistogram.from_plain(st.latency))
        return {"snapshot": snap.to_plain(), "latency_total": total.summary(), "decisions": m.decisions_made}

    async def status(self) -> MasterStatus:
        """The job's state (a ``JobState``), its error, and its progress."""
        m = self.m
        m._ensure_watching()
        m._check_finished()  # the last container may have finished during a recovery
        live = [c for ids in m.placement.containers.values() for c in ids]
        return MasterStatus(
            state=m.state,
            error=m.error,
            containers=len(live),
            done=len([c for c in live if c in m.done]),
            elapsed_s=(m.finished_at or time.time()) - m.started_at if m.started_at else 0.0,
            epochs=m.plan.num_epochs,
            min_epoch=min((m.stats[c].next_epoch for c in live if c in m.stats), default=0),
            recoveries=m.timeline.count("recovery_end"),
            gc_dropped=m.gc_dropped,
            stale_backups_dropped=m.stale_backups_dropped,
            # (the client's Job handle answers with give_source_refs)
            wants_source_refs=m.sources.wanted(),
            metrics_url=self.endpoint.url,
            dashboard_url=self.endpoint.base_url,
        )

    async def statistics(self) -> dict[int, ContainerStatistics]:
        """Latest statistics of every live container (fresh from the hosts)."""
        m = self.m
        hosts = self.answering()
        fresh = await asyncio.gather(*[m.handles[h].statistics.remote() for h in hosts], return_exceptions=True)
        out = {}
        for r in fresh:
            if not isinstance(r, BaseException):
                out.update(r)
        live = {c for ids in m.placement.containers.values() for c in ids}
        return {c: out.get(c, m.stats.get(c)) for c in sorted(live) if c in out or c in m.stats}

    async def recovery_timeline(self) -> list[tuple[float, str, dict[str, Any]]]:
        """What happened, in order: faults, detection, per-slice restore and first output after recovery.

        First outputs are those of containers a recovery made (``slices_restored``); a migration's
        new container restores slices too, but its first output is a migration's, not a recovery's
        (the demo's "first output (last)" showed a scale-in's 4 s later as the recovery's)."""
        m = self.m
        events = list(m.timeline)
        recovered = {info["container"] for _, kind, info in events if kind == "slices_restored"}
        infos = await asyncio.gather(*[m.handles[h].recovery_info.remote() for h in self.answering()],
                                     return_exceptions=True)
        for info in infos:
            if isinstance(info, BaseException):
                continue
            for c, d in info.items():
                if c not in recovered:
                    continue
                for s, t in d["first_output_at"].items():
                    events.append((t, "first_output", {"container": c, "slice": s}))
        return sorted(events, key=lambda e: e[0])

    async def sink_part_refs(self, sink_name: str) -> SinkPartRefs:
        """Where every part of a memory sink (or the dead letters) is: object references of
        packed parts (``PackedSinkParts``), the master's own first (handed over at checkpoints
        and by released hosts), then each live host's, which the host put in the object store
        itself; the client reads them and builds the table (``chronostream.client``): the rows
        never pass through the master's process. A host found dead here is settled as after
        the job's end (``_lost_after_end``: raises when rows died with it)."""
        m = self.m
        ids = memory_sink_ids(m.plan, sink_name)
        # The groups as they came (a part in two of them: the later one's, as the client reads
        # them in order); each group's table is whole, so the put writes its rows once.
        own = [g for g in m.sink_groups if g[0] in ids]
        refs = [ray.put(PackedSinkParts(own))] if own else []
        hosts = sorted(m.alive)

        async def not_found() -> Any:  # (a restarted master did not find the host by name: dead)
            raise RayActorError()
        held = await asyncio.gather(*[m.handles[h].sink_parts.remote(ids) if m.handles.get(h) is not None
                                      else not_found() for h in hosts], return_exceptions=True)
        for h, got in zip(hosts, held):
            if isinstance(got, RayActorError):
                self.lost_after_end(h, got)
            elif isinstance(got, BaseException):
                raise got
            else:
                refs.extend(got)
        return SinkPartRefs(ids, refs, list(m.plan.source_dead_letters))

    def lost_after_end(self, host: int, error: BaseException) -> None:
        """A dead host of a job that ended (while it runs: ``error``, and the watch loop
        recovers the host). With checkpoints, every container on it that
        reported done had handed the master every memory-sink row it made (its last epoch is a
        checkpoint; ``ContainerCore.hand_over_last_sink_parts`` covers the rest). Forget the host;
        raise ``SinkRowsLost``, naming them, when a container on it had not finished (its rows
        since its last checkpoint died with it) or the job ran without checkpoints (its rows
        lived only there). Containers that left the placement (slices migrated away) handed the
        master every row their slices' new owners do not re-make: those up to the checkpoint or
        snapshot the new owners were restored from (``ResourceContainer.migration_snapshot``)."""
        m = self.m
        if m.state is JobState.RUNNING:
            raise error  # the watch loop recovers it (its output logs may still be replayed)
        live = {c for ids in m.placement.containers.values() for c in ids}
        on_it = sorted(c for c, h in m.host_of.items() if h == host and c in live)
        unfinished = [c for c in on_it if c not in m.done]
        gone = unfinished or (on_it if not m.opts.checkpointing else [])
        if gone:
            lost = [{"stage": m.plan.stages[m.placement.stage_of[c]].name, "slices": m.placement.slices_of(c),
                     "container": c, "host": host} for c in gone]
            why = (f"they had not finished (job {m.state}): their rows since their last checkpoint "
                   f"died with it" if unfinished else
                   "without checkpoints a container keeps its rows until they are read; run with "
                   "checkpoint_every=K to hand them to the master as the job goes")
            raise SinkRowsLost(f"host {host} died after the job's end holding the memory-sink rows of containers "
                               f"{gone}: {why}; lost: {SinkRowsLost.describe(lost)}", lost) from error
        if host in m.alive:
            m.alive.discard(host)
            m._event("host_lost_after_end", host=host, containers=on_it)

    async def sink_write_times(self, sink_name: str) -> dict[tuple[int, int], float]:
        """(slice, epoch) -> first time a live host wrote that part of a memory sink (diagnostics)."""
        m = self.m
        sink = next((s for s in m.plan.sinks if s.name == sink_name), None)
        if sink is None:
            raise KeyError(f"no sink named {sink_name!r}; sinks: {[s.name for s in m.plan.sinks]}")
        out: dict[tuple[int, int], float] = {}
        for part in await asyncio.gather(*[m.handles[h].sink_write_times.remote(sink.sink_id)
                                           for h in self.answering()], return_exceptions=True):
            if isinstance(part, dict):
                for k, t in part.items():
                    out[k] = min(t, out.get(k, t))
        return out

    async def backup_catalog(self) -> dict[int, list[tuple[int, int, int]]]:
        """Host id -> (stage, slice, epoch) of the backups it holds."""
        m = self.m
        hosts = self.answering()
        return dict(zip(hosts, await asyncio.gather(*[m.handles[h].backups_held.remote() for h in hosts])))

    async def placement_view(self) -> PlacementView:
        """Stage name -> container id -> slices, each container's host, each host's node, the
        master's own node and the fewest backup copies a slice of each stage has (empty without
        checkpoints)."""
        m = self.m
        return PlacementView(stages=m.placement.as_dict(m.plan), nodes=dict(m.nodes),
                             hosts=dict(m.host_of), master_node=ray.get_runtime_context().get_node_id(),
                             backup_copies=m.chains.copies())
