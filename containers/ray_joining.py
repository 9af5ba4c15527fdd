"""How a host joins a job and leaves it: a spare's warm-up, lease and adoption, configuration, the stop.

Owns the life of a host before its first container: a spare (``master.host_pool``)
pays its imports early, exits when a lease ends without an adoption, and
becomes host ``host_id`` when a master adopts it; ``configure`` sets the
job-wide parameters once (plan, options, stores, thread pools, shared memory,
the heartbeat and master-watch loops) and keeps the source tables' references;
``stop`` releases pending pushes and, with cleanup, the host's stores.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray

from chronostream.slices.plan import JobPlan
from chronostream.containers.options import JobOptions
from chronostream.containers.backup_store import BackupStore
from chronostream.containers.gc_pacing import CollectorPacing
from chronostream.containers.spill import SpillStore
from chronostream.containers.thread_priority import background_pool, set_background_niceness
from chronostream.containers.shm_transport import ShmSender, shm_available, shm_job_tag

log = logging.getLogger("chronostream.container")

#: Threads of the pool ``asyncio.to_thread`` uses in a host (asyncio's own default).
HOST_WORKER_THREADS = min(32, (os.cpu_count() or 1) + 4)


@dataclass(frozen=True)
class SpareState:
    """A spare host no job adopted yet, as it reports itself (``ResourceContainer.spare_state``)."""

    node: str  # the Ray node it runs on
    leased: bool  # a pool handed it to a master, which is about to adopt it


def warm_up() -> None:
    """Pay lazy imports now, not in the first epoch: pyarrow imports pandas
    (when installed) on its first numpy conversion, which takes about a second."""
    import numpy as np
    import pyarrow.compute as pc

    arr = pa.array(["a", "b", "a"])
    np.asarray(pc.dictionary_encode(arr).indices)
    np.asarray(pa.chunked_array([pa.array([1, 2])]))
    pa.Table.from_pylist([{"a": 1}]).to_pylist()




class HostJoining:
    """Joining a job for one ``ResourceContainer`` host (``host``)."""

    def __init__(self, host: Any) -> None:
        self.h = host

    def take_job(self, host_id: int, master: Any, workdir: str, heartbeat_s: float) -> None:
        h = self.h
        h.host_id = host_id
        h.container_id = host_id  # the container it starts with
        h.master = master
        h.workdir = Path(workdir) / f"host-{host_id}"
        h.heartbeat_s = heartbeat_s
        if h._stall_probe is not None:
            h._stall_probe.name = f"host {host_id}"

    async def ready(self) -> str:
        """A spare's warm-up: pay the lazy imports now (``warm_up``), before any job needs this
        process. Returns the node id."""
        warm_up()
        return ray.get_runtime_context().get_node_id()

    async def lease(self, seconds: float) -> None:
        """A spare handed to a master (``HostPool.take``): unless ``adopt`` follows within
        ``seconds``, the process exits, so a master that died in between leaks no host."""
        h = self.h
        if h.host_id is None and h._lease is None:
            h._lease = asyncio.get_running_loop().call_later(seconds, self.expire_lease)

    async def spare_state(self) -> SpareState | None:
        """For a host pool that lost track of this spare (a pool that died, then made anew):
        None once adopted by a job; else its node and whether a take leased it (a master is
        about to adopt it)."""
        h = self.h
        if h.host_id is not None:
            return None
        return SpareState(node=ray.get_runtime_context().get_node_id(), leased=h._lease is not None)

    def expire_lease(self) -> None:
        h = self.h
        if h.host_id is None:
            log.warning("spare host: not adopted within its lease; exiting")
            os._exit(0)

    async def adopt(self, host_id: int, master: Any, workdir: str, heartbeat_s: float) -> None:
        """A spare becomes host ``host_id`` of the job ``master`` runs: what the constructor of a
        host made for a job sets. Idempotent for the same ``host_id`` (a restarted master adopts
        again the hosts it finds by name); another id raises ``ValueError``."""
        h = self.h
        if h.host_id is not None:
            if h.host_id != host_id:
                raise ValueError(f"host {h.host_id} cannot be adopted again as host {host_id}")
            return
        if h._lease is not None:
            h._lease.cancel()
            h._lease = None
        self.take_job(host_id, master, workdir, heartbeat_s)

    async def configure(self, plan: JobPlan, options: JobOptions, source_refs: dict[int, list] | None = None) -> str:
        """Set the job-wide parameters and open the backup store. Returns the node id.
        ``source_refs``: stage id -> [reference of its in-memory table], kept for a restarted
        master (``source_refs``); a later call adds the ones this host lacks.

        Once only: a second call (a restarted master runs a recovery's plan
        again) returns the node id and changes nothing else."""
        h = self.h
        for stage_id, refs in (source_refs or {}).items():
            h._source_refs.setdefault(stage_id, refs)
        if h.plan is not None:
            return ray.get_runtime_context().get_node_id()
        if h.host_id is None:
            raise RuntimeError("a spare host runs no job: adopt() it first (master.host_pool)")
        h.plan = plan
        h.opts = options
        h.window = options.max_inflight_epochs
        # Before any work: pools start their threads on first use, at the priority set now.
        set_background_niceness(options.background_niceness)
        # asyncio.to_thread (restores, decoding, replays, ray.put of shipments) runs on it.
        asyncio.get_running_loop().set_default_executor(background_pool(HOST_WORKER_THREADS, "host-worker"))
        # This host's stores live under it, readable by the job's user only (docs/guide.md,
        # "Security and safety"); on a node where the job's work directory does not exist
        # yet, its parents are made here too.
        h.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if options.checkpointing:
            h.backup_store = BackupStore(h.workdir / "backups")
        if options.spill_state:
            h.spill_store = SpillStore(h.workdir / "spill")
        warm_up()
        # After the warm-up, so what it made is frozen too (containers/gc_pacing.py).
        h.gc_pacing = CollectorPacing(options.full_gc_interval_s)
        h.gc_pacing.install()
        h._tasks.append(asyncio.get_running_loop().create_task(h.loops.heartbeats()))
        h._tasks.append(asyncio.get_running_loop().create_task(h.loops.watch_master()))
        h._node_id = ray.get_runtime_context().get_node_id()
        if options.shm_transport and shm_available():
            h._shm = ShmSender(shm_job_tag(h.master), h.host_id or 0)
        return h._node_id

    async def stop(self, cleanup: bool = False) -> None:
        """Stop processing; pending pushes are released. ``cleanup`` deletes the local store."""
        h = self.h
        h.stopped = True
        if h.gc_pacing is not None:
            h.gc_pacing.uninstall()
        for cond in h.conds.values():
            async with cond:
                cond.notify_all()
        if cleanup:
            for t in h._tasks:
                t.cancel()
            for core in h.cores.values():
                core.close()
            if h.backup_store is not None:
                store = h.backup_store
                await h.backups.in_store_thread(lambda: store.close(flush=False))
            shutil.rmtree(h.workdir, ignore_errors=True)
