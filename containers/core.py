"""The pure protocol core of a ResourceContainer: epochs in, messages out. No Ray here.

Owns: the container's local slices (input routing table), its output
routing table, the inbox of epoch messages from upstream containers, the
output log and the sink writers. The actor shell (``containers.actor``)
only moves the messages this core returns.

An epoch is processed once every upstream container has delivered its
message for it (one message per container pair per epoch, empty or not),
strictly in epoch order. Processing one epoch:

1. gather: split each message's parts by local slice;
2. process: each local slice admits, merges, runs and numbers (``slices``);
3. persist: the epoch's outputs go to the output log in one transaction,
   and to the sinks;
4. route: each produced stream is split by destination container, giving
   exactly one message per downstream container.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from chronostream.dag import JobPlan
from chronostream.readers import SourceReader, make_reader
from chronostream.sinks import SinkWriter
from chronostream.types import ORDER
from containers.backup_store import BackupStore
from containers.checkpointing import SliceCheckpointer
from containers.output_log import OutputLog
from containers.routing import OutputRoute, RoutedPart, route, rows_of_slice
from slices.slice import SliceRuntime

log = logging.getLogger("chronostream.container")

#: One container-to-container message of one epoch: stream id -> routed part.
Message = dict[int, RoutedPart]
#: Message key carrying the number of epochs once a followed source log is sealed.
END_KEY = -1


@dataclass(frozen=True)
class ContainerStatistics:
    """Counters of one container (read by the master, metrics and benchmarks)."""

    container_id: int
    stage: str
    slices: tuple[int, ...]
    next_epoch: int
    num_epochs: int | None
    events_in: int
    events_out: int
    duplicates_dropped: int
    messages_dropped: int
    buffered_epochs: int
    buffered_bytes: int
    busy_s: float
    cpu_s: float
    rss_bytes: int


class ContainerCore:
    """One container of one stage. Feed it ``deliver``; call ``step`` while ``ready``."""

    def __init__(self, plan: JobPlan, stage_id: int, container_id: int, local_slices: list[int],
                 routes: dict[int, OutputRoute], senders: set[int], *, source_table: Any = None,
                 output_log: OutputLog | None = None, sink_writers: dict[int, SinkWriter] | None = None,
                 dead_letter_writer: SinkWriter | None = None,
                 backup_peers: dict[int, list[int]] | None = None, checkpoint_every: int = 0,
                 full_checkpoint_every: int = 8, backup_store: BackupStore | None = None) -> None:
        self.plan = plan
        self.stage = plan.stages[stage_id]
        self.container_id = container_id
        dead = plan.dead_letter_sink is not None
        self.slices: dict[int, SliceRuntime] = {s: SliceRuntime(plan, stage_id, s, dead) for s in sorted(local_slices)}
        self.routes = routes
        self.senders = set(senders)
        self.output_log = output_log
        self.sink_writers = sink_writers or {}
        self.dead_letter_writer = dead_letter_writer
        self.inbox: dict[int, dict[int, Message]] = {}
        self.next_epoch = 0  # invariant: only grows; every epoch below it is fully processed
        self.num_epochs: int | None = plan.num_epochs  # None until a followed source log is sealed
        self.messages_dropped = 0
        self.busy_s = 0.0
        self.dead_letter_rows = 0
        self.reader: SourceReader | None = None
        if self.stage.kind == "source":
            assert source_table is not None, f"source stage {self.stage.name} needs its input"
            self.reader = make_reader(source_table, plan.order_end)
        self.destinations = sorted({c for r in routes.values() for c in r.containers()})
        # Chained backups: this container checkpoints its slices to peers, and
        # holds its peers' backups in its own store.
        self.checkpointer = (SliceCheckpointer(self.slices, backup_peers or {}, checkpoint_every,
                                               full_checkpoint_every) if checkpoint_every else None)
        self.backup_store = backup_store
        self.outgoing_backups: dict[int, list[bytes]] = {}

    # -- inbox -----------------------------------------------------------------

    def deliver(self, epoch: int, sender: int, message: Message) -> bool:
        """Accept an upstream message; False when it is a duplicate (already had or processed)."""
        if sender not in self.senders:
            raise ValueError(f"container {self.container_id} got a message from unknown sender {sender}")
        if END_KEY in message and self.num_epochs is None:
            self.num_epochs = int(message[END_KEY])  # type: ignore[arg-type]
        if epoch < self.next_epoch or sender in self.inbox.get(epoch, {}):
            self.messages_dropped += 1
            return False
        self.inbox.setdefault(epoch, {})[sender] = message
        return True

    def ready(self) -> bool:
        """True when the next epoch can be processed."""
        if self.done:
            return False
        if self.reader is not None:
            return self._source_ready()
        return len(self.inbox.get(self.next_epoch, {})) == len(self.senders)

    def _source_ready(self) -> bool:
        reader = self.reader
        assert reader is not None
        if self.num_epochs is None:
            end = reader.end_order()
            if end is not None:
                self.num_epochs = max(1, -(-end // self.plan.epoch_events))
                return not self.done
        return reader.available_order() >= (self.next_epoch + 1) * self.plan.epoch_events \
            or self.num_epochs is not None

    def poll_source(self) -> None:
        """Look for new input in a followed source log (called when not ready)."""
        if self.reader is not None:
            self.reader.refresh()

    @property
    def done(self) -> bool:
        """True when every epoch of the input is processed (never while a followed log is open)."""
        return self.num_epochs is not None and self.next_epoch >= self.num_epochs

    # -- one epoch ---------------------------------------------------------------

    def step(self) -> dict[int, Message]:
        """Process the next epoch; return one message per downstream container."""
        assert self.ready(), f"container {self.container_id}: epoch {self.next_epoch} not ready"
        epoch = self.next_epoch
        outputs = self._process(epoch)
        self._persist(epoch, outputs)
        messages = self._route(outputs)
        self.next_epoch = epoch + 1
        if self.checkpointer is not None:
            for peer, blobs in self.checkpointer.after_epoch(epoch, last=self.done).items():
                self.outgoing_backups.setdefault(peer, []).extend(blobs)
        return messages

    def take_backups(self) -> dict[int, list[bytes]]:
        """Encoded checkpoints to send, by peer container (emptied by the call)."""
        out, self.outgoing_backups = self.outgoing_backups, {}
        return out

    def receive_backups(self, blobs: list[bytes]) -> None:
        """Keep checkpoints a peer sent (verified by the store)."""
        if self.backup_store is None:
            raise RuntimeError(f"container {self.container_id} holds no backups (no backup store)")
        for b in blobs:
            self.backup_store.put(b)

    def _process(self, epoch: int) -> dict[int, dict[int, pa.Table]]:
        results: dict[int, dict[int, pa.Table]] = {}
        if self.reader is not None:
            e0 = epoch * self.plan.epoch_events
            rows = self.reader.rows(e0, e0 + self.plan.epoch_events)
            owner = np.asarray(rows.column(ORDER)) % self.stage.num_slices
            for s, rt in self.slices.items():
                mine = rows.filter(pa.array(owner == s)) if self.stage.num_slices > 1 else rows
                results[s] = rt.process_source(epoch, mine)
            return results
        messages = self.inbox.pop(epoch)
        for s, rt in self.slices.items():
            inputs: dict[int, list[pa.Table]] = {}
            for sender in sorted(messages):
                for stream_id, part in messages[sender].items():
                    if stream_id == END_KEY:
                        continue
                    rows = rows_of_slice(part, s)
                    if rows is not None:
                        inputs.setdefault(stream_id, []).append(rows)
            if inputs:
                results[s] = rt.process(epoch, inputs)
        return results

    def _persist(self, epoch: int, outputs: dict[int, dict[int, pa.Table]]) -> None:
        if self.output_log is not None:
            # Only streams with consumers are logged: replay feeds consumers. A
            # sink-only stream is re-produced by its (recovered) slice instead,
            # and sinks are idempotent per (slice, epoch).
            self.output_log.append_epoch({(sid, s): t for s, per in outputs.items() for sid, t in per.items()
                                          if self.plan.streams[sid].consumers})
        for s, per in outputs.items():
            for sid, t in per.items():
                for k in self.plan.streams[sid].sinks:
                    writer = self.sink_writers.get(k)
                    if writer is not None:
                        writer.write(epoch, s, t)
        if self.dead_letter_writer is not None:
            for s, rt in self.slices.items():
                dead = rt.take_dead_letters()
                if dead:
                    self.dead_letter_rows += len(dead)
                    self.dead_letter_writer.write(epoch, s, pa.Table.from_pylist(dead))

    def _route(self, outputs: dict[int, dict[int, pa.Table]]) -> dict[int, Message]:
        messages: dict[int, Message] = {c: {} for c in self.destinations}
        if self.num_epochs is not None and self.plan.num_epochs is None:
            # Followed source: tell downstream where the input ends.
            for m in messages.values():
                m[END_KEY] = self.num_epochs  # type: ignore[assignment]
        for sid in self.stage.produced:
            sp = self.plan.streams[sid]
            if not sp.consumers:
                continue
            tables = [outputs[s][sid] for s in sorted(outputs) if sid in outputs[s]]
            if not tables:
                continue
            combined = tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="permissive")
            for consumer, _name in sp.consumers:
                try:
                    parts = route(combined, sp.key, self.routes[consumer])
                except KeyError as exc:
                    raise KeyError(f"stage {self.stage.name!r}, stream {sp.name!r} -> stage "
                                   f"{self.plan.stages[consumer].name!r}: {exc.args[0]}") from None
                for c, part in parts.items():
                    messages[c][sid] = part
        return messages

    # -- reading ---------------------------------------------------------------

    def statistics(self) -> ContainerStatistics:
        """A frozen snapshot of this container's counters."""
        stats = [rt.statistics() for rt in self.slices.values()]
        try:
            import psutil
            proc = psutil.Process(os.getpid())
            rss = proc.memory_info().rss
            cpu = sum(proc.cpu_times()[:2])
        except Exception:  # noqa: BLE001 - metrics must never fail the job
            rss, cpu = 0, 0.0
        return ContainerStatistics(
            self.container_id, self.stage.name, tuple(self.slices), self.next_epoch, self.num_epochs,
            sum(s.events_in for s in stats), sum(s.events_out for s in stats),
            sum(s.duplicates_dropped for s in stats), self.messages_dropped, len(self.inbox),
            self.buffered_bytes(), self.busy_s, cpu, rss)

    def buffered_bytes(self) -> int:
        """Bytes of input held in the inbox (epochs received, not yet processed)."""
        return sum(part[0].nbytes for msgs in self.inbox.values() for msg in msgs.values()
                   for k, part in msg.items() if k != END_KEY)
