"""The JobMaster's rescaling on Ray: scale-out/in, compaction, one migration, threads, the autoscaler loop.

Owns turning a rescaling request into slice moves (``master.migration``),
running them through the migration machine's Ray driver
(``master.ray_migration``) under the control lock, saving each request's
result so a call Ray retries after a master restart gets it again, settling a
migration a previous master left, and the autoscaler's loop
(``master.policies``). Placement decisions are ``master.migration``'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ray.exceptions import RayActorError

from chronostream.master.policies import Decision, ScalingAction
from chronostream.master.job_state import JobState
from chronostream.master.migration import (MigrationError, balanced_moves, compaction_moves, container_of_slices,
                                           group_transfers,
                                           resume_transfers,
                                           stage_hosts, stage_id_of)
from chronostream.master.ray_migration import RayMigration

log = logging.getLogger("chronostream.master")


class RayScaling:
    """Rescaling of one ``JobMaster`` (``master``); every entry point takes the control lock."""

    def __init__(self, master: Any) -> None:
        self.m = master

    async def settle_left_over(self) -> None:
        m = self.m
        async with m.control_lock:
            await self.settle_pending()

    async def settle_pending(self) -> None:
        """A master restarted in the middle of a migration: finish or undo it (``RayMigration.settle``)
        before anything else changes the placement. Called under the control lock."""
        m = self.m
        if not m._unsettled:
            return
        left, m._unsettled = m._unsettled, []
        transfers, rehosted = resume_transfers(left, m.placement, m.host_of)
        m._event("migration_resumed", transfers=list(left))
        for t in rehosted:
            m._event("migration_rehosted", container=t.new_id, slices=t.slices)
        await RayMigration(m, transfers[0].stage_id, transfers).settle("the master restarted")
        released = await m.hosts.release_idle()
        await m.chains.retarget({t.stage_id for t in transfers} | m.chains.off_stage_stages())
        m._save_layout()
        summary = {"transfers": [{**t.to_plain(), "pause_ms": {}, "released_at": {}} for t in transfers],
                   "released_hosts": released, "seconds": 0.0, "reason": "settled by a restarted master"}
        m.catalog.save_request(m._unsettled_request or "", summary)
        m.catalog.save_migration(None, [])
        m._event("migration_end", **summary)

    def check_can_migrate(self) -> None:
        m = self.m
        if m.state is not JobState.RUNNING:
            raise MigrationError(f"the job is {m.state}: nothing to rescale")
        if not m.opts.output_log:
            raise MigrationError("migration replays upstream output logs: run the job with output_log=True")

    async def replayed(self, request: str | None) -> Any:
        """A control call Ray retried after a master restart: the result it already had, if any
        (settling first the migration it may have left in progress). Under the control lock."""
        m = self.m
        await self.settle_pending()
        return m.catalog.load_request(request)

    async def _request(self, stage: str | int, request: str | None,
                       rescale: Callable[[int], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """One rescaling request of ``stage``, under the control lock: the result a retried request
        already had (``request``), else what ``rescale(stage id)`` returns, once the job can migrate."""
        m = self.m
        async with m.control_lock:
            if (done := await self.replayed(request)) is not None:
                return done
            self.check_can_migrate()
            return await rescale(stage_id_of(m.plan, stage))

    async def scale_out(self, stage: str | int, n: int = 1, reason: str = "requested",
                        request: str | None = None) -> dict[str, Any]:
        """Add ``n`` hosts to ``stage`` and move slices so every host of it runs an even share.

        ``request``: an id making the call idempotent (Ray retries it on a restarted master).
        """
        m = self.m

        async def rescale(sid: int) -> dict[str, Any]:
            if n < 1:
                raise MigrationError(f"scale_out needs n >= 1, got {n}")
            layout = stage_hosts(m.placement, m.host_of, sid)
            new = [-(i + 1) for i in range(n)]
            moves = balanced_moves(layout, list(layout) + new, container_of=container_of_slices(m.placement, sid))
            return await self.run_migration(sid, moves, {h: None for h in new}, f"scale_out {n}: {reason}",
                                            request=request)

        return await self._request(stage, request, rescale)

    async def scale_in(self, stage: str | int, n: int = 1, reason: str = "requested",
                       request: str | None = None) -> dict[str, Any]:
        """Move every slice off ``n`` of ``stage``'s hosts (those running the fewest slices), then release them."""
        m = self.m

        async def rescale(sid: int) -> dict[str, Any]:
            layout = stage_hosts(m.placement, m.host_of, sid)
            if n < 1 or n >= len(layout):
                raise MigrationError(f"stage {m.plan.stages[sid].name!r} runs on {len(layout)} hosts; "
                                     f"cannot remove {n}")
            leaving = sorted(layout, key=lambda h: (len(layout[h]), -h))[:n]
            staying = [h for h in layout if h not in leaving]
            held = await asyncio.gather(*[m.handles[h].backup_epochs.remote() for h in staying])
            holders: dict[int, set[int]] = {}
            for h, epochs in zip(staying, held):
                for (st, s), _e in epochs.items():
                    if st == sid:
                        holders.setdefault(s, set()).add(h)
            moves = balanced_moves({**{h: layout[h] for h in staying},
                                    -1: [s for h in leaving for s in layout[h]]}, staying, holders=holders)
            where = container_of_slices(m.placement, sid)
            moves = [(s, m.host_of[where[s]], t) for s, _, t in moves]
            return await self.run_migration(sid, moves, {}, f"scale_in {n}: {reason}", request=request)

        return await self._request(stage, request, rescale)

    async def compact(self, stage: str | int, reason: str = "requested",
                      request: str | None = None) -> dict[str, Any]:
        """Merge ``stage``'s containers on each host into one (``master.migration.compaction_moves``);
        a no-op when every host runs one."""
        m = self.m

        async def rescale(sid: int) -> dict[str, Any]:
            moves = compaction_moves(m.placement, m.host_of, sid)
            where = container_of_slices(m.placement, sid)
            # A merged container keeps the most threads any of its containers had or was asked for
            # (a scale-up takes effect at the container's next epoch; a restarted master knows only those).
            threads = {c: max(m.threads_asked.get(c, 1), await self.threads_of(c))
                       for c in sorted({where[s] for s, _, _ in moves})}
            summary = await self.run_migration(sid, moves, {}, f"compact: {reason}", request=request, handover=True)
            for new_id in sorted({t["to"] for t in summary["transfers"] if t["phase"] == "done"}):
                most = max(threads[t["from"]] for t in summary["transfers"] if t["to"] == new_id)
                if most > 1:
                    await self.set_threads(new_id, most)
            return summary

        return await self._request(stage, request, rescale)

    async def migrate(self, stage: str | int, slices: list[int], to_container: int | None = None,
                      reason: str = "requested", baseline: str | None = None,
                      request: str | None = None) -> dict[str, Any]:
        """Move ``slices`` of ``stage`` to the host of container ``to_container`` (None: a new host).

        ``baseline="stop_copy"`` runs the stop-copy-restart migration that
        ``benchmarks.migration`` compares against (the source container
        pauses while a fresh snapshot is copied and restored); not for use.
        """
        m = self.m

        async def rescale(sid: int) -> dict[str, Any]:
            where = container_of_slices(m.placement, sid)
            bad = [s for s in slices if s not in where]
            if bad or not slices:
                raise MigrationError(f"stage {m.plan.stages[sid].name!r} has no slices {bad or slices}")
            if to_container is not None and (to_container not in m.host_of
                                             or m.host_of[to_container] not in m.alive):
                raise MigrationError(f"no live container {to_container}")
            to = -1 if to_container is None else m.host_of[to_container]
            moves = [(s, m.host_of[where[s]], to) for s in slices if m.host_of[where[s]] != to]
            return await self.run_migration(sid, moves, {-1: None} if to_container is None else {},
                                            f"migrate {slices}: {reason}", stop_copy=baseline == "stop_copy",
                                            request=request)

        return await self._request(stage, request, rescale)

    async def set_threads(self, container: int, threads: int) -> dict[str, Any]:
        """Scale up/down (paper III-D): run ``container``'s slices on ``threads`` threads."""
        m = self.m
        if threads < 1:
            raise MigrationError(f"a container needs at least 1 thread, got {threads}")
        self.check_live(container)
        out = await m.handles[m.host_of[container]].set_threads.remote(container, threads)
        m.threads_asked[container] = threads
        m._event("threads_set", container=container, threads=threads, from_epoch=out["from_epoch"])
        return out

    async def threads_of(self, container: int) -> int:
        """Threads of the table in effect in ``container`` (fresh from its host)."""
        m = self.m
        self.check_live(container)
        stats = await m.handles[m.host_of[container]].statistics.remote()
        return stats[container].threads

    def check_live(self, container: int) -> None:
        m = self.m
        live = {c for ids in m.placement.containers.values() for c in ids}
        if container not in live or m.host_of[container] not in m.alive:
            raise MigrationError(f"no live container {container}; containers: {sorted(live)}")

    async def run_migration(self, sid: int, moves: list[tuple[int, int, int]], new_hosts: dict[int, int | None],
                            reason: str, stop_copy: bool = False, request: str | None = None,
                            handover: bool = False) -> dict[str, Any]:
        """Run one migration (every transfer in parallel, phase by phase); under the control lock.
        ``handover``: a compaction, whose slices stay in their processes (``master.ray_migration``)."""
        m = self.m
        # (a source stage's migration has no producer to mark one release epoch for several
        # sources: one new container each; a handover's host fixes one epoch for all)
        transfers = group_transfers(moves, container_of_slices(m.placement, sid), sid, m.next_id, new_hosts,
                                    shared_destination=handover or m.plan.stages[sid].kind != "source")
        if not transfers:
            return {"transfers": [], "reason": reason}
        for t in transfers:
            t.handover = handover
        m.next_id = max([m.next_id] + [t.new_id + 1 for t in transfers])
        m._save_layout()  # (next_id: a restarted master never reuses the new ids)
        for t in transfers:  # every phase change is in the catalog: a restarted master settles it
            t.on_advance = lambda _t, ts=transfers: m.catalog.save_migration(request, [x.to_plain() for x in ts])
        m.catalog.save_migration(request, [t.to_plain() for t in transfers])
        t0 = time.time()
        m._event("migration_start", stage=m.plan.stages[sid].name, reason=reason,
                 transfers=[{"from": t.source, "to": t.new_id, "slices": t.slices} for t in transfers])
        driver = RayMigration(m, sid, transfers, stop_copy)
        try:
            await driver.run()
        except (RayActorError, MigrationError, asyncio.TimeoutError) as exc:
            log.warning("migration interrupted: %s", exc)
            m._event("migration_interrupted", error=str(exc))
            await driver.settle(str(exc))
        released = await m.hosts.release_idle()
        # Stages backed up off their own hosts too, hosts added or released: their chains run over
        # the job's hosts, and the master's view of every chain (GC of stale copies, ``placement()``)
        # must be the one their containers ship to.
        await m.chains.retarget({sid} | m.chains.off_stage_stages())
        m._save_layout()
        m.catalog.save_migration(None, [])
        summary = {"transfers": [{"from": t.source, "to": t.new_id, "host": t.host, "slices": t.slices,
                                  "phase": t.phase.value, "resume": t.resume, "released_at": t.released_at,
                                  "pause_ms": t.pause_ms, "catch_up": t.catch_up,
                                  "hand_over_epoch": t.hand_over_epoch,
                                  "warm_wait_s": next((info.get("warm_wait_s", 0.0) for _, p, _, info in t.story
                                                       if p == "rebuilding"), 0.0),
                                  "phases_s": {p: round(info["at"] - t0, 3) for _, p, _, info in t.story}}
                                 for t in transfers],
                   "released_hosts": released, "seconds": round(time.time() - t0, 3), "reason": reason}
        m._event("migration_end", stage=m.plan.stages[sid].name, **summary)
        if request:
            m.catalog.save_request(request, summary)
        return summary

    async def autoscale(self) -> None:
        """Every ``autoscale_interval_s``: snapshot, ask the policy, take its actions (logged with reasons)."""
        m = self.m
        m._counters = None
        await m.reads.metrics_snapshot()  # the base of the first interval's rates
        while m.state is JobState.RUNNING:
            await asyncio.sleep(m.opts.autoscale_interval_s)
            if m.state is not JobState.RUNNING:
                return
            async with m.control_lock:  # no snapshot in the middle of a recovery or migration
                snap = await m.reads.metrics_snapshot()
            try:
                actions = list(m.policy.decide(snap))
            except Exception as exc:  # noqa: BLE001 - a broken policy must not kill the job
                m._event("autoscale_error", error=f"{type(exc).__name__}: {exc}")
                continue
            m.decisions.append(Decision(snap, tuple(actions)))
            m.decisions_made += 1
            for a in actions:
                m._event("autoscale_decision", action=a.describe(), t=snap.t)
                try:
                    await self.take(a)
                except (MigrationError, ValueError) as exc:
                    m._event("autoscale_refused", action=a.describe(), error=str(exc))
            if actions:  # rates right after a migration mix old and new containers: start afresh
                m._counters = None
                await m.reads.metrics_snapshot()

    async def take(self, a: ScalingAction) -> Any:
        if a.kind == "scale_out":
            return await self.scale_out(a.stage, a.n, reason=a.reason)
        if a.kind == "scale_in":
            return await self.scale_in(a.stage, a.n, reason=a.reason)
        if a.kind == "migrate":
            return await self.migrate(a.stage, [a.slice], a.to_container, reason=a.reason)
        if a.kind == "compact":
            return await self.compact(a.stage, reason=a.reason)
        return await self.set_threads(a.container, a.threads)
