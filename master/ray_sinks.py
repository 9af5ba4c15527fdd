"""Owns the master's commits of a job's Parquet sinks (``slices.parquet_commit``).

A Parquet sink's writers stage one part per slice and epoch while the job
runs. While it runs, every ``max_age_s`` at a GC round, the master commits
each sink's parts up to the newest epoch that every slice of the sink's stage
has a backup copy of (``commit_due``): a slice's copy of an epoch is captured
after the slice wrote that epoch's parts, so they are all there; a recovery
that restores a slice from an older copy makes some of them again, with the
same rows, and the next commit deletes those unread. Once every container
finished, the final commit takes every part left: started when the job
enters ``finished``; the client's ``Job.wait`` awaits it (``commit``), so
``wait`` returns with the files in place. One commit at a time; each is
idempotent: a master restarted half-way finishes it from the sink's
``_committed.json``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from chronostream.master.job_state import JobState
from chronostream.slices.parquet_commit import read_record
from chronostream.slices.sinks import ParquetSink

SliceKey = tuple[int, int]  # (stage id, slice id)


def committable_epoch(held: list[dict[SliceKey, int]], stage_id: int, num_slices: int) -> int:
    """The newest epoch every slice of ``stage_id`` has a backup copy of, among the hosts' held
    copies (``held``: one dict per host); -1 while a slice has none.

    >>> committable_epoch([{(1, 0): 7, (1, 1): 3}, {(1, 1): 5}], 1, 2), committable_epoch([{(1, 0): 7}], 1, 2)
    (5, -1)
    """
    newest = [max((h.get((stage_id, s), -1) for h in held), default=-1) for s in range(num_slices)]
    return min(newest, default=-1)

log = logging.getLogger("chronostream.master")


class RaySinks:
    """The sink commit of one ``JobMaster`` (``master``)."""

    def __init__(self, master: Any) -> None:
        self.m = master
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # one commit at a time (a running one, then the final one)
        self._running: asyncio.Task | None = None  # a commit while the job runs
        self._last: dict[str, float] = {}  # sink path -> when its last commit while running started
        self.through: dict[str, int] = {}  # sink path -> the epoch it is committed up to while running

    def _file_sinks(self) -> list[tuple[ParquetSink, int]]:
        """Each Parquet sink of the plan and the stage producing its stream."""
        m = self.m
        return [(s.sink, m.plan.streams[s.stream_id].stage_id) for s in m.plan.sinks if isinstance(s.sink, ParquetSink)]

    def commit_due(self, held: list[dict[SliceKey, int]]) -> None:
        """A GC round read the hosts' copies (``held``): start a commit, in the background, of each
        Parquet sink whose ``max_age_s`` passed, up to its stage's committable epoch."""
        m = self.m
        if m.state is not JobState.RUNNING or (self._running is not None and not self._running.done()):
            return
        now = time.monotonic()
        due = []
        for sink, stage_id in self._file_sinks():
            last = self._last.setdefault(sink.path, now)  # (the age counts from the first round)
            if sink.max_age_s <= 0 or now - last < sink.max_age_s:
                continue
            epoch = committable_epoch(held, stage_id, m.plan.stages[stage_id].num_slices)
            if epoch > self.through.get(sink.path, -1):
                due.append((sink, epoch))
        if due:
            self._running = asyncio.get_running_loop().create_task(self._commit_running(due, now))

    async def _commit_running(self, due: list[tuple[ParquetSink, int]], now: float) -> None:
        m = self.m
        loop = asyncio.get_running_loop()
        async with self._lock:
            for sink, epoch in due:
                if m.state is not JobState.RUNNING:
                    return
                try:
                    files = await loop.run_in_executor(None, sink.commit, epoch)
                except Exception as exc:  # noqa: BLE001 - the final commit tries again; the job goes on
                    log.warning("sink %r: a commit up to epoch %s failed: %s", sink.name, epoch, exc)
                    m._event("sink_commit_failed", sink=sink.name, through=epoch, error=repr(exc))
                    continue
                self._last[sink.path] = now
                if read_record(sink.path)["through"] < epoch:  # (column types not settled yet)
                    m._event("sink_commit_waits", sink=sink.name, through=epoch,
                             why="a column is all null so far, or its type widened")
                    continue
                self.through[sink.path] = epoch
                m._event("sink_committed", sink=sink.name, through=epoch, files=len(files))

    def commit_soon(self, state: JobState) -> None:
        """The job entered ``state``: when finished, start the commit in the background."""
        if state is not JobState.FINISHED or self._task is not None:
            return
        try:
            self._task = asyncio.get_running_loop().create_task(self._commit())
        except RuntimeError:  # (no loop running: the first ``commit`` call starts it)
            pass

    async def commit(self) -> list[str]:
        """Commit every Parquet sink of the finished job (once; later calls wait for that one);
        the committed files' names. Nothing for a job that has not finished."""
        if self.m.state is not JobState.FINISHED:
            return []
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._commit())
        return await asyncio.shield(self._task)

    async def quiet(self, timeout_s: float = 30.0) -> None:
        """The job stops: let a commit made while it ran finish (it is in a thread; one cut
        short is finished by the next commit, from its record)."""
        if self._running is not None and not self._running.done():
            await asyncio.wait([self._running], timeout=timeout_s)

    async def _commit(self) -> list[str]:
        m = self.m
        sinks = [sink for sink, _ in self._file_sinks()]
        names: list[str] = []
        loop = asyncio.get_running_loop()
        async with self._lock:
            for sink in sinks:
                names += await loop.run_in_executor(None, sink.commit)
        if sinks:
            m._event("sinks_committed", files=len(names))
        return names
