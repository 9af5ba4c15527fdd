"""Where the JobMaster finds the object references of the jobs' in-memory source tables.

Owns the lookup of a stage's table reference: the one ``deploy`` brought,
else (a restarted master) the live hosts' copies, else the client's ``Job``
handle, which owns the tables and hands them back when asked
(``wants_source_refs`` / ``give_source_refs``). The master only borrows them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

log = logging.getLogger("chronostream.master")

#: How long a restarted master that found a source table's reference on no live host waits for
#: the client's ``Job`` handle to hand it back before the recovery fails naming the stage.
SOURCE_REFS_CLIENT_WAIT_S = 30.0


class SourceRefs:
    """Source table references of one ``JobMaster`` (``master``)."""

    def __init__(self, master: Any) -> None:
        self.m = master

    async def ref(self, stage_id: int) -> Any:
        """The object reference of stage ``stage_id``'s in-memory table (None for other stages).

        ``deploy`` brings them; a restarted master asks the hosts, which keep the ones
        ``configure`` gave them (the references are the client's: the master only borrows)."""
        m = self.m
        if stage_id not in m.source_stages:
            return None
        await self.find()
        if stage_id not in m.source_refs:
            await self.from_client(stage_id)
        return m.source_refs[stage_id][0]

    async def from_client(self, stage_id: int) -> None:
        """No live host holds stage ``stage_id``'s table reference (a restarted master whose
        hosts all died): wait for the client's ``Job`` handle, which owns the tables, to hand
        them back (its keeper thread asks ``wants_source_refs`` every second; ``status``,
        ``wait`` and ``progress`` answer too); fail naming the stage after
        ``SOURCE_REFS_CLIENT_WAIT_S``."""
        m = self.m
        name = m.plan.stages[stage_id].name
        m.source_refs_wanted.add(stage_id)
        m._event("source_refs_wanted", stage=name, hosts=sorted(m.alive))
        deadline = time.monotonic() + SOURCE_REFS_CLIENT_WAIT_S
        while stage_id not in m.source_refs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if stage_id not in m.source_refs:
            raise RuntimeError(
                f"the source table of stage {name!r} is lost: no live host holds its reference (hosts "
                f"{sorted(m.alive)}), and the client's Job handle did not hand it back within "
                f"{SOURCE_REFS_CLIENT_WAIT_S:.0f} s (the process that started the job owns the table and "
                f"answers while it runs: it has exited, or its Job handle was dropped)")

    def wanted(self) -> bool:
        """Whether this master waits for source tables' references from the client."""
        m = self.m
        return bool(m.source_refs_wanted - m.source_refs.keys())

    async def give(self, source_refs: dict[int, list]) -> list[int]:
        """The client's ``Job`` handle hands back the source tables' references (stage id ->
        [reference]) after ``status`` said ``wants_source_refs``. Returns the stages the master
        lacked; the live hosts keep them too, for the next restart (``configure`` adds them)."""
        m = self.m
        new = sorted(set(source_refs) - m.source_refs.keys())
        m.source_refs.update({s: source_refs[s] for s in new})
        m.source_refs_wanted -= set(source_refs)
        if new:
            m._event("source_refs_from_client", stages=[m.plan.stages[s].name for s in new])
            hosts = [m.handles[h] for h in sorted(m.alive) if m.handles.get(h) is not None]
            await asyncio.gather(*[asyncio.wait_for(h.configure.remote(m.plan, m.opts, m.source_refs),
                                                    timeout=10) for h in hosts], return_exceptions=True)
        return new

    async def find(self) -> None:
        """A restarted master: the source tables' references it lacks, from the live hosts
        (``configure`` gave every host all of them), asked at once: a dead or hung host that
        still counts as live costs one wait, not one per host."""
        m = self.m
        if m.source_stages <= m.source_refs.keys():
            return
        hosts = [h for h in sorted(m.alive) if m.handles.get(h) is not None]
        answers = await asyncio.gather(*[asyncio.wait_for(m.handles[h].source_refs.remote(), timeout=10)
                                         for h in hosts], return_exceptions=True)
        for h, found in zip(hosts, answers):
            if isinstance(found, dict) and found.keys() - m.source_refs.keys():
                m.source_refs.update(found)
                m._event("source_refs_from_host", host=h, stages=sorted(found))
