"""A host's loops: each container's epoch loop, the heartbeats, and the watch on the master.

Owns stepping a hosted container (``ContainerCore.step``) when its inbox is
ready, sending its messages with the backpressure bound, starting each
checkpoint round's shipment, reporting its end or failure to the master;
the heartbeat loop (backup-store flushes, statistics); and exiting when the
master is gone for good.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import Any

from ray.exceptions import ActorDiedError

from chronostream.slices.errors import ChronoStreamError, StoreFullError

log = logging.getLogger("chronostream.container")


class EpochLoop:
    """The loops of one ``ResourceContainer`` host (``host``)."""

    def __init__(self, host: Any) -> None:
        self.h = host

    async def run(self, cid: int) -> None:
        h = self.h
        core, cond = h.cores[cid], h.conds[cid]
        inflight: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        try:
            while not core.done and not h.stopped:
                async with cond:
                    while not ((core.ready() and cid not in h.frozen) or h.stopped or core.done):
                        if core.reader is not None:
                            # A followed source log: nothing will notify; poll it, and take
                            # what the poll found at once (waiting first would add a period).
                            core.poll_source()
                            if core.ready() and cid not in h.frozen:
                                break
                            try:
                                await asyncio.wait_for(cond.wait(), h.opts.source_poll_s)
                            except asyncio.TimeoutError:
                                pass
                        else:
                            await cond.wait()
                    if h.stopped or core.done:
                        break
                    epoch = core.next_epoch
                    t0 = time.perf_counter()
                    messages = core.step()
                    core.busy_s += time.perf_counter() - t0
                    cond.notify_all()  # next_epoch moved: blocked pushes may proceed
                if cid in h._handover_of:  # a compaction's source: at the handover epoch now?
                    await h.hosting.try_hand_over(h._handover_of[cid])
                pause = h.delay_s or (h.opts.source_pace_s if core.reader is not None else 0.0)
                if pause:
                    await asyncio.sleep(pause)
                if messages:
                    t0 = time.perf_counter()
                    for dst, msg in messages.items():
                        if dst not in h.unreachable:
                            wire, files = h.pushes.wire(h.peers[dst], msg, core)
                            ref = h.peers[dst].push.remote(dst, epoch, cid, wire)
                            if files:
                                h._shm_files[ref] = files
                            inflight[dst].append((dst, ref))
                    core.send_s += time.perf_counter() - t0
                parts, backups = core.take_sink_parts(), core.take_backups()
                if parts or backups:  # (the shipping machine decides when they leave: containers.shipping)
                    h.shipping.take_round(cid, epoch, [r for dq in inflight.values() for r in dq], parts, backups)
                t0 = time.perf_counter()
                for dq in inflight.values():
                    while len(dq) > h.window:
                        await h.pushes.acknowledged(*dq.popleft())
                core.backpressured_s += time.perf_counter() - t0
                await asyncio.sleep(0)
            notice = core.take_end_notice()
            if notice is not None and not h.stopped:  # the input was sealed after its last epoch
                epoch, messages = notice
                for dst, msg in messages.items():
                    if dst not in h.unreachable:
                        inflight[dst].append((dst, h.peers[dst].push.remote(dst, epoch, cid, msg)))
            for dq in inflight.values():
                while dq:
                    await h.pushes.acknowledged(*dq.popleft())
            if not h.stopped and cid in h.cores and core.checkpointer is not None:
                # The master gets the rows not handed over yet before it hears "done" (without
                # checkpoints the container keeps them: handing every row over cost a 2 M-row
                # word count a quarter of its throughput).
                core.hand_over_last_sink_parts()
                parts = core.take_sink_parts()
                if parts:
                    h.shipping.take_round(cid, core.next_epoch - 1, [], parts, {})
            await h.shipping.drained(cid)
            if cid not in h.cores:
                return  # removed (an aborted migration destination): nothing to report
            if not h.stopped:
                await h.master.container_done.remote(cid, core.statistics())
        except Exception as exc:  # noqa: BLE001 - report every failure to the master
            h.failed = exc
            for dq in inflight.values():  # (never acknowledged now: their receivers unlink the files)
                for _dst, ref in dq:
                    h._shm_files.pop(ref, None)
            # The runtime's own errors (a poison event, a lost backup) reach the user whole, as
            # the job's ``JobFailed``: their traceback only at INFO (``CHRONOSTREAM_LOG``), so the
            # driver shows the error once. Anything else is a fault of the runtime: its traceback
            # is all there is to go on, the master only gets the message.
            log.log(logging.INFO if isinstance(exc, ChronoStreamError) else logging.ERROR,
                    "container %s failed: %s", cid, exc, exc_info=exc)
            try:
                await h.master.container_failed.remote(cid, exc)
            except Exception as report_exc:  # noqa: BLE001 - the epoch loop ends here either way
                # A master dead for good cannot be told (``watch_master`` ends this host); an
                # error Ray cannot carry leaves the failure only in this host's log, so say it.
                log.warning("container %s: its failure was not reported to the master: %s", cid, report_exc)

    async def heartbeats(self) -> None:
        h = self.h
        while not h.stopped:
            if h.gc_pacing is not None:
                # On the event loop, so between two epochs of every hosted container.
                h.gc_pacing.collect_if_due()
            try:
                if h.backup_store is not None:  # lazy persistence of the replication buffer
                    await h.backups.in_store_thread(h.backup_store.flush)
                    h._store_full_said = False
            except StoreFullError as exc:
                # The chains stay in the replication buffer (memory) and the next flush tries
                # again; said once per episode, not every heartbeat.
                if not h._store_full_said:
                    log.warning("host %s: %s", h.host_id, exc)
                    h._store_full_said = True
            except Exception as exc:  # noqa: BLE001 - the heartbeats must go on
                # A stop closes the store between two heartbeats (lmdb raises then): nothing is
                # left to persist. Otherwise the chains stay in memory, where restores read
                # them; the failure is said and the next heartbeat tries again.
                if not h.stopped:
                    log.warning("host %s: backup store flush failed: %s", h.host_id, exc)
            try:
                h.master.heartbeat.remote(h.host_id, {c: core.statistics() for c, core in h.cores.items()})
            except Exception as exc:  # noqa: BLE001 - the heartbeats must go on
                # (A restarting master's calls wait; they do not raise.) A heartbeat not sent is
                # one missed: the next follows in heartbeat_s, and the master declares a host
                # dead only after heartbeat_timeout_s of silence.
                log.warning("host %s: heartbeat not sent: %s", h.host_id, exc)
            await asyncio.sleep(h.heartbeat_s)

    async def watch_master(self) -> None:
        """Exit when the master is gone for good. A host is a detached actor: nothing else ends
        it when the driver that owned the master dies (``kill -9``) or the master is killed.
        The host pings the master; once a ping says its actor is dead (``ActorDiedError``: a
        restarting master's calls wait, an unreachable one's raise ``ActorUnavailableError``)
        and nothing was heard from it for ``JobOptions.master_lost_after_s``, the host
        persists its backup store and exits, leaving its files: with the job's catalog they are
        what ``chronostream resume WORKDIR`` goes on from (``master.ray_disk_copies``)."""
        h = self.h
        bound = h.opts.master_lost_after_s
        every = min(max(h.heartbeat_s, 0.1), bound / 4)
        h._master_heard = time.monotonic()
        while True:
            await asyncio.sleep(every)
            try:
                await asyncio.wait_for(h.master.ping.remote(), timeout=bound)
                h._master_heard = time.monotonic()
                continue
            except ActorDiedError:
                pass  # dead for good
            except Exception:  # noqa: BLE001 - slow, restarting or unreachable for now: not gone
                continue
            silent = time.monotonic() - h._master_heard
            if silent >= bound:
                log.warning("host %s: its master is dead and silent for %.0f s; exiting", h.host_id, silent)
                try:
                    await asyncio.wait_for(h.stop(cleanup=False), timeout=10)
                    if h.backup_store is not None:
                        store = h.backup_store
                        await asyncio.wait_for(h.backups.in_store_thread(store.close), timeout=30)
                finally:
                    os._exit(0)
