"""Owns the master's side of a savepoint (``Job.savepoint``): the epoch, the hosts' captures,
the files (``slices.savepoint``); and of a point query of live state (``Job.query_state``:
each slice asked on the host that owns it, under the control lock, so no slice moves meanwhile).

The cut: the source containers are frozen between two epochs for the time of
one call each; the savepoint's epoch E is the newest epoch any of them has
processed (0 before any has; a bounded job's last epoch at most), so every
row E needs is already read. Every other container is behind its sources,
so none is past E: each is armed to capture its
slices' full state at the end of E, the sources go on, and the job keeps
running while the captures are encoded and collected. Every slice is then at
epoch E, having consumed exactly its producers' rows of epochs up to E: a
consistent cut, which a resumed job restores without any output log.

Runs under the master's control lock: no migration, rescaling or recovery
changes the placement between the freeze and the last capture. A host that
dies on the way fails the savepoint (``SavepointError``); the job goes on and
its recovery runs once the lock is free.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from chronostream.containers.ray_savepoints import SAVEPOINT_HOLDER
from chronostream.master.job_state import JobState
from chronostream.master.launch import plan_fingerprint
from chronostream.slices.errors import QueryError, SavepointError
from chronostream.slices.plan import JobPlan
from chronostream.slices.savepoint import (check_restorable, read_manifest, saved_kinds, slice_files, without_states,
                                           write_savepoint)


@ray.remote(num_cpus=0)
class SavepointReader:
    """A savepoint's frames to the hosts of a job starting from it, as a backup holder hands its
    copies (``HostBackups.fetch`` calls ``backup_bytes``): one file read a slice, nothing kept."""

    def __init__(self, path: str, plan: JobPlan, drop_states: dict[str, list[str]] | None = None) -> None:
        self.files = slice_files(path)
        self.names = {st.stage_id: st.name for st in plan.stages}
        self.drop = {k: v for k, v in (drop_states or {}).items() if v}
        manifest = read_manifest(path)
        self.kinds = {st.stage_id: {n: k for n, k in saved_kinds(manifest, st.name).items()
                                    if n not in self.drop.get(st.name, [])} for st in plan.stages}

    def backup_bytes(self, stage_id: int, slice_id: int, with_outputs: bool = False) -> Any:
        """The slice's checkpoint frame, without the states dropped (and no carried outputs: the
        cut needs none)."""
        stage = self.names[stage_id]
        data = self.files[(stage, slice_id)].read_bytes()
        if stage in self.drop:
            data = without_states(data, self.drop[stage])
        return (data, []) if with_outputs else data

    def state_kinds(self, stage_id: int) -> dict[str, str]:
        """The kinds of the stage's key-value states the savepoint recorded (those kept)."""
        return self.kinds.get(stage_id, {})


class RaySavepoints:
    """The savepoints of one ``JobMaster`` (``master``), and the one its job started from: its
    reader stays for the job's life as a holder of every slice's copy at its epoch, so a host
    that dies before its slices' first checkpoint is recovered from the savepoint
    (``recovery_copies``)."""

    def __init__(self, master: Any) -> None:
        self.m = master
        self.started_from: tuple[int, Any] | None = None  # (epoch, SavepointReader) of the restore

    def reopen(self, path: str, drop_states: dict[str, list[str]] | None) -> None:
        """A restarted master of a job started from the savepoint at ``path``: its reader again."""
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        reader = SavepointReader.options(scheduling_strategy=here).remote(path, self.m.plan, drop_states)
        self.started_from = (int(read_manifest(path)["epoch"]), reader)

    def recovery_copies(self, lost: dict[int, tuple[int, list[int]]]) -> dict[tuple[int, int], tuple[int, int]]:
        """(stage, slice) -> (``SAVEPOINT_HOLDER``, epoch) for every lost slice, when the job started
        from a savepoint (a copy every slice has, older than any checkpoint of the job)."""
        if self.started_from is None:
            return {}
        epoch = self.started_from[0]
        return {(st, s): (SAVEPOINT_HOLDER, epoch) for st, slices in lost.values() for s in slices}

    def holder(self, host: int) -> Any:
        """The handle of a backup holder: a host's, or the savepoint reader's."""
        if host == SAVEPOINT_HOLDER and self.started_from is not None:
            return self.started_from[1]
        return self.m.handles.get(host)

    def release(self) -> None:
        """The job stops: its savepoint reader goes."""
        if self.started_from is not None:
            ray.kill(self.started_from[1])
            self.started_from = None

    def _layout(self) -> tuple[dict[int, list[int]], list[int]]:
        """Host id -> its containers holding slices, and the source containers among them."""
        m = self.m
        by_host: dict[int, list[int]] = {}
        sources = []
        for stage_id, ids in m.placement.containers.items():
            for c in ids:
                if not m.placement.slices_of(c):
                    continue
                by_host.setdefault(m.host_of[c], []).append(c)
                if m.plan.stages[stage_id].kind == "source":
                    sources.append(c)
        return by_host, sources

    async def reader(self, path: str, drop_states: dict[str, list[str]] | None = None) -> Any:
        """A ``SavepointReader`` of ``path`` on this node (where the path is), once the savepoint
        is checked against the plan (``SavepointError``)."""
        await asyncio.get_running_loop().run_in_executor(None, check_restorable, path, self.m.plan, drop_states)
        self.reopen(path, drop_states)
        return self.started_from[1]

    async def take(self, path: str, timeout_s: float = 120.0) -> dict[str, Any]:
        """Write a savepoint of every slice to ``path`` (a new directory) while the job runs;
        returns ``path``, ``epoch``, ``slices`` and ``bytes``."""
        m = self.m
        if m.state not in (JobState.RUNNING, JobState.FINISHED):
            raise SavepointError(f"savepoint {path}: the job is {m.state}; a savepoint needs its hosts")
        async with m.control_lock:
            by_host, sources = self._layout()
            try:
                nexts = await asyncio.gather(*(m.handles[m.host_of[c]].freeze.remote(c, True) for c in sources))
                # The newest epoch a source has processed: its input is there for every other
                # container (a source idle on a followed log holds nothing back).
                epoch = max(max(nexts) - 1 if nexts else 0, 0)
                if m.plan.num_epochs is not None:
                    epoch = min(epoch, m.plan.num_epochs - 1)
                armed = await asyncio.gather(*(m.handles[h].arm_savepoint.remote(cs, epoch)
                                               for h, cs in by_host.items()))
            finally:  # (every source, also when a freeze failed: thawing a running one is a no-op)
                await asyncio.gather(*(m.handles[m.host_of[c]].freeze.remote(c, False) for c in sources),
                                     return_exceptions=True)
            late = sorted(c for a in armed for c, v in a.items() if v == "late")
            if late:  # (none can be: every container is behind its frozen sources)
                raise SavepointError(f"savepoint {path}: containers {late} were past epoch {epoch}")
            frames = await asyncio.gather(*(m.handles[h].savepoint_frames.remote(cs, timeout_s)
                                            for h, cs in by_host.items()))
        flat = [f for fs, _ in frames for f in fs]
        kinds = {sid: k for _, ks in frames for sid, k in ks.items()}
        fingerprint = plan_fingerprint(m.plan)
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: write_savepoint(path, m.plan, epoch, flat, job=m.job_key, fingerprint=fingerprint,
                                          kinds=kinds))
        size = sum(len(f) for f in flat)
        m._event("savepoint", path=str(path), epoch=epoch, slices=len(flat), bytes=size)
        return {"path": str(path), "epoch": epoch, "slices": len(flat), "bytes": size}

    async def query(self, stage_id: int, wanted: dict[int, list[tuple]], timeout_s: float = 60.0
                    ) -> dict[int, dict[str, Any]]:
        """Slice -> keys of ``stage_id``: slice -> each state's values of them (``slices.state_query``),
        every slice read on its host between two of its epochs."""
        m = self.m
        if m.state is not JobState.RUNNING:
            raise QueryError(f"query_state: the job is {m.state}; live state is read from a running job's hosts "
                             "(take a savepoint and read it with cs.read_state)")
        async with m.control_lock:
            by_host: dict[int, dict[int, dict[int, list[tuple]]]] = {}
            for c in m.placement.containers[stage_id]:
                mine = set(m.placement.slices_of(c)) & set(wanted)
                if mine:
                    by_host.setdefault(m.host_of[c], {})[c] = {s: wanted[s] for s in sorted(mine)}
            answers = await asyncio.wait_for(asyncio.gather(
                *(m.handles[h].query_state.remote(req) for h, req in by_host.items())), timeout_s)
        return {s: a for answer in answers for s, a in answer.items()}
