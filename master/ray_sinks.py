"""Owns the master's commit of a finished job's Parquet sinks (``slices.sinks.commit_parquet_sink``).

A Parquet sink's writers stage one part per slice and epoch while the job
runs; once every container finished, no part will change, and the master
commits them into the sink's final files. It starts the commit when the job
enters ``finished`` and the client's ``Job.wait`` awaits it (``commit``), so
``wait`` returns with the files in place. The commit is idempotent: a master
restarted half-way finishes it from the sink's ``_committed.json``.
Must not touch: the parts of a job that has not finished (a recovery or a
resume may still replace them).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from chronostream.master.job_state import JobState
from chronostream.slices.sinks import ParquetSink, commit_parquet_sink

log = logging.getLogger("chronostream.master")


class RaySinks:
    """The sink commit of one ``JobMaster`` (``master``)."""

    def __init__(self, master: Any) -> None:
        self.m = master
        self._task: asyncio.Task | None = None

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

    async def _commit(self) -> list[str]:
        m = self.m
        specs = [(s.sink.path, s.sink.target_file_bytes) for s in m.plan.sinks if isinstance(s.sink, ParquetSink)]
        names: list[str] = []
        loop = asyncio.get_running_loop()
        for path, target in specs:
            names += await loop.run_in_executor(None, commit_parquet_sink, path, target)
        if specs:
            m._event("sinks_committed", files=len(names))
        return names
