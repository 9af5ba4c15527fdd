"""The end of a job on Ray: stopping the master's loops and every host, and deleting what the job made.

Owns the order of a stop (the job's state first, then the master's own
background loops, then each host's stop, the catalog closed, the job's
files removed when asked, leftover shared-memory files, the detached hosts
killed) and what a cleanup may delete: only what the job made.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from chronostream.master.source_copies import SOURCES_DIR
from chronostream.containers.shm_transport import remove_job_files, shm_job_tag
from chronostream.master.ray_recovery import kill_host
from chronostream.master.protocols.job import StopAsked

log = logging.getLogger("chronostream.master")


class RayStop:
    """The stop of one ``JobMaster`` (``master``)."""

    def __init__(self, master: Any) -> None:
        self.m = master

    async def stop(self, cleanup: bool = True) -> None:
        """Stop and release every host; ``cleanup`` deletes what the job wrote under its work
        directory (``remove_files``)."""
        m = self.m
        m._job(StopAsked())
        m._save_progress()
        for task in m._background:
            task.cancel()  # (a probe left pending at the hosts' kill: "Task was destroyed but it is pending")
        await asyncio.gather(*m._background, return_exceptions=True)
        await m.sinks.quiet()
        await m.reads.endpoint.stop()
        for h in sorted(m.alive):
            if m.handles.get(h) is None:
                continue  # (a host a restarted master did not find: dead, nothing to stop)
            try:
                await m.handles[h].stop.remote(cleanup)
            except RayActorError:
                pass  # a dead host has nothing left to stop
            except RayError as exc:
                # Its stop raised: the kill below ends it all the same, and the stop of the
                # other hosts must not wait on this one.
                log.warning("host %s: its stop failed (%s); killing it", h, exc)
        m.catalog.close()
        await m.disk_copies.release()
        if cleanup:
            self.remove_files()
        # Files of pushes that never ran (a host that died, or stopped, with parts in flight to it).
        remove_job_files(shm_job_tag(ray.get_runtime_context().current_actor))
        for h, handle in m.handles.items():
            kill_host(h, handle)  # detached: nothing else would release them
        m.savepoints.release()

    def remove_files(self) -> None:
        """Delete what this job made under its work directory: the whole directory when ``run``
        made it for the job; otherwise only the catalog (``master/``), the copies of its in-memory
        source tables (``sources/``) and each of its hosts' stores (``host-<id>/``; a live host
        removes its own at its stop, these are the ones of hosts that died): nothing else in a
        directory the caller gave is touched."""
        m = self.m
        if m.identity.get("made_workdir"):
            shutil.rmtree(m.workdir, ignore_errors=True)
            return
        shutil.rmtree(os.path.join(m.workdir, "master"), ignore_errors=True)
        shutil.rmtree(os.path.join(m.workdir, SOURCES_DIR), ignore_errors=True)
        for h in sorted(set(m.handles) | set(m.host_of.values()) | m.alive):
            shutil.rmtree(os.path.join(m.workdir, f"host-{int(h)}"), ignore_errors=True)
