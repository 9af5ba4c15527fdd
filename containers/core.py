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

Between two epochs a core can also hand every slice it runs to another core
of its stage in the same process (``hand_over``: compaction, no copy).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import pyarrow as pa

from chronostream.slices.plan import JobPlan
from chronostream.slices.errors import QueryError, RecoveryError, SavepointError
from chronostream.containers.metrics import LatencyHistogram, SliceMetrics, StateSizes
from chronostream.slices.readers import SourceReader, make_reader
from chronostream.slices.sinks import SinkWriter
from chronostream.slices.types import ORDER, SEQ
from chronostream.containers.backup_store import BackupStore
from chronostream.containers.checkpointing import SliceCheckpointer
from chronostream.containers.epoch_message import EpochMessage
from chronostream.containers.output_log import OutputLog
from chronostream.containers.routing import OutputRoute, RoutedPart, consumer_slices, route, rows_of_slice
from chronostream.containers.sink_parts import SinkParts, add_sink_parts  # noqa: F401 - SinkParts: re-exported
from chronostream.containers.spill import SpillStore
from chronostream.containers.threads import SliceThreads, ThreadControlTable
from chronostream.slices.group import process_inputs, process_parts, reads_key_codes, runs_grouped
from chronostream.slices.slice import SliceRuntime
from chronostream.slices.checkpoint import CarriedOutputs, capture, encode, encode_outputs, restore

log = logging.getLogger("chronostream.container")

def dead_letter_sink_id(stage_id: int) -> int:
    """The sink id a stage's dead-letter parts travel under (``take_sink_parts``): one per stage,
    below every sink's id, since two stages' dead letters of one slice id and epoch are different
    rows (keyed by the sink id and (slice, epoch) alone, one replaced the other at the master).

    >>> dead_letter_sink_id(0), dead_letter_sink_id(3), is_dead_letter_sink_id(-4), is_dead_letter_sink_id(0)
    (-1, -4, True, False)
    """
    return -1 - stage_id


def is_dead_letter_sink_id(sink_id: int) -> bool:
    """True for a ``dead_letter_sink_id``."""
    return sink_id < 0


#: What a sender's message covers: the (stage id, slice id) pairs it carries rows of.
Coverage = frozenset


class ReplayUnavailable(RecoveryError):
    """Rows a recovering slice needs are in no output log any more (lost with a container)."""


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
    rss_bytes: int  # resident memory the process owns (RSS without file-backed shared pages)
    checkpoints: int = 0  # slice checkpoints taken (shipped to backups)
    log_entries: int = 0  # batches in the output log (bounded by GC)
    backup_bytes: int = 0  # bytes of peers' checkpoints and carried outputs held by this host
    released: tuple[int, ...] = ()  # slices migrated away from this container
    threads: int = 1  # threads running the slices (thread-control table in effect)
    latency: dict = field(default_factory=dict)  # end-to-end latency histogram of its sink writes (plain)
    backlog_events: int = 0  # input events received, not yet processed
    source_lag: int = 0  # a source container: events readable in its source and not read yet (approx.)
    gc_full_collections: int = 0  # the host's own paced full garbage collections (containers/gc_pacing.py)
    gc_full_pause_s: float = 0.0  # their total pause
    checkpoints_seeded: int = 0  # first checkpoints of restored slices sent as seed + delta, not full
    send_s: float = 0.0  # seconds handing epoch messages to the transport (Ray: serializing them into its object store)
    shm_parts: int = 0  # routed parts sent as files in shared memory (containers/shm_transport.py)
    # Routed parts sent through Ray's object store because the receiving host's node was not known
    # yet (it is asked when the peer is made known: ``HostPushes.learn_nodes``).
    parts_node_unknown: int = 0
    # Seconds its epoch loop waited for receivers to acknowledge pushes beyond the window
    # (``max_inflight_epochs``): held back by a slower downstream (the dashboard's "backpressured").
    backpressured_s: float = 0.0
    checkpoint_seconds: dict = field(default_factory=dict)  # its checkpoint rounds' durations (``BoundedHistogram``, plain)
    checkpoint_bytes: dict = field(default_factory=dict)  # their encoded sizes (``BoundedHistogram``, plain)
    # Per local slice: (slice, events in, state keys, approximate state bytes): the job's
    # per-slice metrics (Prometheus, the dashboard's placement map) from the heartbeats alone.
    slice_figures: tuple[tuple[int, int, int, int], ...] = ()


class ContainerCore:
    """One container of one stage. Feed it ``deliver``; call ``step`` while ``ready``."""

    #: Run the local slices of a groupable stage (``slices.group.runs_grouped``: an
    #: operator with one input, or a per-event one with several) as one group
    #: (slices/group.py). Off: each
    #: slice alone (benchmarks.slices compares the two; outputs are the same). A diagnostic
    #: switch: ``CHRONOSTREAM_GROUP_SLICES=0`` in the environment of the processes that host
    #: containers (Ray workers inherit the driver's when ``cs.run`` starts Ray) turns it off.
    GROUP_SLICES = os.environ.get("CHRONOSTREAM_GROUP_SLICES", "1") != "0"

    def __init__(self, plan: JobPlan, stage_id: int, container_id: int, local_slices: list[int],
                 routes: dict[int, OutputRoute], senders: set[int] | dict[int, Coverage], *,
                 source_table: Any = None,
                 output_log: OutputLog | None = None, sink_writers: dict[int, SinkWriter] | None = None,
                 dead_letter_writer: SinkWriter | None = None,
                 backup_peers: dict[int, list[int]] | None = None, checkpoint_every: int = 0,
                 full_checkpoint_every: int = 0, backup_store: BackupStore | None = None,
                 async_checkpoints: bool = True, checkpoint_interval_s: float = 0.0, threads: int = 1,
                 spill: SpillStore | None = None) -> None:
        self.plan = plan
        self.stage = plan.stages[stage_id]
        self.container_id = container_id
        dead = plan.dead_letter_sink is not None
        # Long queues (window contents) keep their middle chunks in the host's spill store.
        cold = spill is not None and self.stage.kind == "operator"
        self.slices: dict[int, SliceRuntime] = {
            s: SliceRuntime(plan, stage_id, s, dead, cold_tiers=spill.tiers_for(stage_id, s) if cold else None)
            for s in sorted(local_slices)}
        self.routes = routes
        # Consumer stages that take routing's key codes (one string key's dictionary encoding).
        self.key_codes = {d: reads_key_codes(plan.stages[d]) for d in routes}
        self.gc_pacing: Any = None  # the host's CollectorPacing (set by the Ray host; figures in statistics)
        # Sender -> the upstream (stage, slice) pairs its messages cover. A
        # recovered container's slices are re-hosted by new senders whose
        # coverage is a part of the dead one's; see ``_epoch_messages``.
        cov = senders if isinstance(senders, dict) else {c: frozenset({("c", c)}) for c in senders}
        self.coverage: dict[int, Coverage] = dict(cov)
        self.senders = set(cov)
        self.required: frozenset = frozenset().union(*cov.values()) if cov else frozenset()
        self.replaced = False  # fast path of _epoch_messages until a sender is replaced
        # First epoch each local slice's outputs are in this container's output log
        # (0 here; a slice restored from a checkpoint at epoch C logs from C + 1).
        self.log_start: dict[int, int] = {s: 0 for s in local_slices}
        # (stream, slice) -> (epoch, out_seq) where _with_held_outputs last stopped reading the log
        self._held_read: dict[tuple[int, int], tuple[int, int]] = {}
        self.restored_at: dict[int, float] = {}
        self.first_output_at: dict[int, float] = {}
        # Output GC: epochs <= low_water are covered by every consumer's checkpoint.
        self.low_water = -1
        self.carried_seq: dict[tuple[int, int], int] = {}  # (slice, stream) -> next_seq at the last checkpoint
        self.output_log = output_log
        self.sink_writers = sink_writers or {}
        self.dead_letter_writer = dead_letter_writer
        self.inbox: dict[int, dict[int, EpochMessage]] = {}
        self.next_epoch = 0  # invariant: only grows; every epoch below it is fully processed
        self.num_epochs: int | None = plan.num_epochs  # None until a followed source log is sealed
        self.end_announced = False  # a message carrying ``end`` went to every destination
        self.savepoint_epoch: int | None = None  # capture every slice after this epoch (a savepoint)
        self.savepoint_taken: tuple[int, list[Any]] | None = None  # (epoch, full checkpoints) not collected
        self.messages_dropped = 0
        self.busy_s = 0.0
        # Seconds the host's loop spent handing this container's epoch messages to the transport,
        # outside ``busy_s`` (on Ray each ``push.remote`` serializes the message into the object
        # store: a few ms an epoch, up to 40% of a source's CPU; the metrics count it as busy).
        self.send_s = 0.0
        self.backpressured_s = 0.0  # waiting for receivers' acknowledgements (the epoch loop adds it)
        self.state_sizes = StateSizes()  # the per-slice figures of ``statistics`` (keys, bytes)
        self.shm_parts = 0  # parts of its messages sent through shared memory (containers/shm_transport.py)
        self.parts_node_unknown = 0  # parts sent through Ray before the receiver's node was known
        self.dead_letter_rows = 0
        self.reader: SourceReader | None = None
        self.threads = SliceThreads(list(self.slices), threads)  # vertical scaling (set_threads)
        # One vectorized pass per epoch for all local slices when the operator allows it.
        self.group_slices = self.GROUP_SLICES and runs_grouped(self.stage)
        self.grouped_epochs = 0  # epochs run as one group (tests and benchmarks read it)
        if self.stage.kind == "source":
            assert source_table is not None, f"source stage {self.stage.name} needs its input"
            self.reader = make_reader(source_table, plan.order_end)
        self.destinations: list[int] = []
        self.released_to: dict[int, set[int]] = {}
        self._refresh_destinations()
        # Chained backups: this container checkpoints its slices to peers, and
        # holds its peers' backups in its own store.
        self.checkpointer = (SliceCheckpointer(self.slices, backup_peers or {}, checkpoint_every,
                                               full_checkpoint_every, async_encode=async_checkpoints,
                                               every_s=checkpoint_interval_s)
                             if checkpoint_every or checkpoint_interval_s else None)
        self.backup_store = backup_store
        # Migration (docs/design.md section 7f). Slices released to another
        # container -> the first epoch no longer processed here; slices the
        # master asked to release (source stages) at the next step; and, as a
        # producer, per old owner the slices routed away from it (the marker
        # ``release`` its messages carry until the master says it saw it).
        self.released: dict[int, int] = {}
        self.pending_release: set[int] = set()
        self._retired = False
        # Compaction (``hand_over`` below): a container whose slices are handed to another
        # one in this process stops before epoch ``stop_before``; the receiver processes
        # nothing while ``awaiting_handover``.
        self.stop_before: int | None = None
        self.awaiting_handover = False
        self.epoch_done_at: collections.OrderedDict[int, float] = collections.OrderedDict()  # last 256 epochs
        # End-to-end latency: when the epoch being processed was ingested (None: unknown,
        # e.g. a replayed epoch), and the histogram of sink writes.
        self.epoch_ingest: float | None = None
        self.latency = LatencyHistogram()
        self.outgoing_backups: dict[int, list[bytes]] = {}
        self.outgoing_sink_parts: dict[int, dict[tuple[int, int], pa.Table]] = {}

    # -- inbox -----------------------------------------------------------------

    def deliver(self, epoch: int, sender: int, message: EpochMessage) -> bool:
        """Accept an upstream message; False when it is a duplicate (already had or processed)."""
        if sender not in self.senders:
            raise ValueError(f"container {self.container_id} got a message from unknown sender {sender}")
        if self.retired:
            self.messages_dropped += 1
            return False  # every slice migrated away: nothing here needs input any more
        if message.end is not None and self.num_epochs is None:
            self.num_epochs = message.end
        if epoch < self.next_epoch or sender in self.inbox.get(epoch, {}):
            self.messages_dropped += 1
            return False
        self.inbox.setdefault(epoch, {})[sender] = message
        return True

    def ready(self) -> bool:
        """True when the next epoch can be processed."""
        if self.done or self.awaiting_handover or (self.stop_before is not None
                                                   and self.next_epoch >= self.stop_before):
            return False
        if self.reader is not None:
            return self._source_ready()
        return self._epoch_messages(self.next_epoch) is not None

    def _epoch_messages(self, epoch: int) -> dict[int, EpochMessage] | None:
        """The messages that make up ``epoch``'s input, or None while some are missing.

        Normally one message from every sender. Once a dead sender X has been
        replaced by senders X1..Xk (each re-hosting part of X's slices, with a
        higher id), X's message, when it arrived, still covers all of X's
        slices and is preferred; otherwise every Xi must have sent its part.
        Coverages form a tree (a replacement covers part of one dead sender),
        so taking senders in id order (ancestors first) and skipping any that
        overlaps what is covered picks one complete, duplicate-free set.
        Migration keeps that shape: the destination is a new container (the
        highest id) covering slices its source still covers in dual mode;
        once the source releases them its messages say so (``coverage``).
        Every sender covering a (stage, slice) at an epoch sends the same rows
        of it, so when a message overlaps what is taken only in part (the
        source died mid-release, its destination is the one copy left of
        the moved slices) its new part is taken (``EpochMessage.restricted``).
        """
        got = self.inbox.get(epoch)
        if not got:
            return None if self.senders else {}
        if not self.replaced:
            return got if len(got) == len(self.senders) else None
        covered: set = set()
        chosen: dict[int, EpochMessage] = {}
        for sender in sorted(got):
            msg = got[sender]
            # A sender that released slices by migration declares what it covers now.
            cov = msg.coverage if msg.coverage is not None else self.coverage[sender]
            if cov.isdisjoint(covered):
                chosen[sender] = msg
                covered |= cov
            elif not cov <= covered and all(isinstance(p[0], int) for p in cov):
                # Part of it is new: a migration's source died mid-release without sending
                # this epoch, and its destination (dual since before) is the only one left
                # with the moved slices' rows, beside slices another sender already gave.
                take = frozenset(cov - covered)
                chosen[sender] = msg.restricted(take)
                covered |= take
        return chosen if covered == self.required else None

    def add_senders(self, coverage: dict[int, Coverage]) -> None:
        """Accept messages from new senders that re-host part of a dead sender's slices."""
        for sender, cov in coverage.items():
            if not cov <= self.required:
                raise ValueError(f"container {self.container_id}: sender {sender} covers {sorted(cov - self.required)}, "
                                 "which no sender of this container covered")
            self.coverage[sender] = frozenset(cov)
            self.senders.add(sender)
        self.replaced = True

    def take_end_notice(self) -> tuple[int, dict[int, EpochMessage]] | None:
        """The end of a followed input, for destinations no epoch message told it.

        A followed log can be sealed after its last (full) epoch was already
        processed: no message carried ``end`` then. This gives, once,
        (last epoch, one message per destination carrying it); receivers
        learn the end and drop the message itself (an epoch they already have).
        """
        if self.plan.num_epochs is not None or self.num_epochs is None or not self.done or self.end_announced:
            return None
        self.end_announced = True
        return self.num_epochs - 1, {c: EpochMessage(end=self.num_epochs) for c in self.destinations}

    def _source_ready(self) -> bool:
        reader = self.reader
        assert reader is not None
        if self.num_epochs is None:
            end = reader.end_order()
            if end is not None:
                self.num_epochs = self.plan.epochs_until(end)
                return not self.done
        return reader.available_order() >= (self.next_epoch + 1) * self.plan.epoch_events \
            or self.num_epochs is not None

    def poll_source(self) -> None:
        """Look for new input in a followed source log (called when not ready)."""
        if self.reader is not None:
            self.reader.refresh()

    @property
    def done(self) -> bool:
        """True when every epoch of the input is processed (never while a followed log is open),
        or when every slice migrated away (retired)."""
        return self.retired or (self.num_epochs is not None and self.next_epoch >= self.num_epochs)

    @property
    def retired(self) -> bool:
        """True when this container released all its slices by migration, or was retired
        (an aborted migration destination): it processes nothing more."""
        return self._retired or (not self.slices and bool(self.released))

    def retire(self) -> None:
        """Stop for good: no more epochs, every message refused."""
        self._retired = True

    # -- one epoch ---------------------------------------------------------------

    def step(self) -> dict[int, EpochMessage]:
        """Process the next epoch; return one message per downstream container."""
        assert self.ready(), f"container {self.container_id}: epoch {self.next_epoch} not ready"
        epoch = self.next_epoch
        inbound = None if self.reader is not None else (self._epoch_messages(epoch) or {})
        self._release(self._releases_due(inbound), epoch)
        outputs = self._process(epoch, inbound)
        self._persist(epoch, outputs)
        messages = self._route(self._with_held_outputs(epoch, outputs))
        self.next_epoch = epoch + 1
        if self.savepoint_epoch is not None and (epoch >= self.savepoint_epoch or self.done):
            self._capture_savepoint(epoch)
        self.epoch_done_at[epoch] = time.time()
        if len(self.epoch_done_at) > 256:
            self.epoch_done_at.popitem(last=False)
        if self.checkpointer is not None and self.checkpointer.due(epoch, self.done):
            # Memory-sink rows up to the checkpoint go to the master before the
            # checkpoint ships: recovered slices only re-produce later epochs.
            for k, w in self._all_writers().items():
                parts = w.take_parts(epoch)
                if parts:
                    add_sink_parts(self.outgoing_sink_parts, {k: parts})
            self._queue_backups(self.checkpointer.after_epoch(epoch, last=self.done, carry=self._carried))
        elif self.checkpointer is None:
            self._forget_changed_keys()
        return messages

    def _with_held_outputs(self, epoch: int, outputs: dict[int, dict[int, pa.Table]]
                           ) -> dict[int, dict[int, pa.Table]]:
        """``outputs`` plus the logged rows of ``epoch`` of every slice restored past it.

        A slice restored from a checkpoint newer than its container's next epoch skips the
        epochs it holds; its rows of those epochs live only in the output log it was rebuilt
        with (carried outputs). A consumer restored further back (a producer and its consumer
        recovered together, or one after the other) needs them, and a replay reaches only up
        to the producer's next epoch: so each epoch's message carries them, as the dead
        container's did. A consumer that has them already drops them (its progress vector)."""
        held = [s for s, rt in self.slices.items() if epoch <= rt.last_epoch and self.log_start.get(s, 0) <= epoch]
        if not held or self.output_log is None:
            self._held_read.clear()
            return outputs
        lo, hi = epoch * self.plan.epoch_events, (epoch + 1) * self.plan.epoch_events
        out = dict(outputs)
        for s in held:
            per = dict(out.get(s, {}))
            for sid in self._logged_streams():
                # (where the previous epoch's read stopped, when it was the previous epoch)
                was_epoch, after = self._held_read.get((sid, s), (None, -1))
                t, last = self.output_log.read_orders(sid, s, lo, hi, after if was_epoch == epoch - 1 else -1)
                self._held_read[(sid, s)] = (epoch, last)
                if t.num_rows:
                    per[sid] = t
            if per:
                out[s] = per
        return out

    def _forget_changed_keys(self) -> None:
        """Without checkpoints no delta will read the keys an epoch changed: the registered
        states' dirty sets are emptied each epoch instead of holding every key ever written
        (a cold key's only object in memory would be its dirty-set entry)."""
        for rt in self.slices.values():
            if rt.ctx is not None:
                for st in rt.ctx.states.values():
                    st.clear_dirty()

    def _queue_backups(self, ready: dict[int, list[bytes]]) -> None:
        for peer, blobs in ready.items():
            self.outgoing_backups.setdefault(peer, []).extend(blobs)

    def _all_writers(self) -> dict[int, SinkWriter]:
        writers: dict[int, SinkWriter] = dict(self.sink_writers)
        if self.dead_letter_writer is not None:
            writers[dead_letter_sink_id(self.stage.stage_id)] = self.dead_letter_writer
        return writers

    def hand_over_last_sink_parts(self) -> None:
        """Queue every memory-sink part not handed to the master yet (``take_sink_parts``).

        Called, with checkpoints, once the container processed its last epoch, before it reports
        done: the master then holds every row a finished container made, so a host that dies
        after the job's end loses none (the last epoch is a checkpoint, which handed over the rows
        up to it; for a container whose slices all migrated away this is the only hand-over)."""
        for k, w in self._all_writers().items():
            parts = w.take_parts(self.next_epoch)
            if parts:
                add_sink_parts(self.outgoing_sink_parts, {k: parts})

    def take_sink_parts(self) -> dict[int, dict[tuple[int, int], pa.Table]]:
        """Memory-sink parts to hand to the master, by sink id (``dead_letter_sink_id`` for dead letters)."""
        out, self.outgoing_sink_parts = self.outgoing_sink_parts, {}
        return out

    def take_sink_parts_of(self, slices: Iterable[int]) -> dict[int, SinkParts]:
        """Every memory-sink and dead-letter part this container holds of ``slices``, by sink id
        (``SinkWriter.take_parts_of``), for the master to keep before a migration snapshot of
        them ships (``drop_handed_sink_parts`` then lets their rows go here). Call it between
        two epochs, with the snapshot's capture."""
        wanted = set(slices)
        out = {k: w.take_parts_of(wanted) for k, w in self._all_writers().items()}
        return {k: parts for k, parts in out.items() if parts}

    def drop_handed_sink_parts(self, keys: dict[int, Iterable[tuple[int, int]]]) -> int:
        """Let go of the rows of memory-sink parts (by sink id) the master now holds for good: it
        stored them in its catalog, which a restarted master reads back. Parts taken for the
        master and not confirmed (the master died while storing them) stay, and ``sink_parts``
        keeps offering them. Returns how many parts were dropped."""
        writers = self._all_writers()
        return sum(writers[k].drop_handed(ks) for k, ks in keys.items() if k in writers)

    def sink_parts(self, sink_ids: list[int]) -> dict[int, SinkParts]:
        """Every (slice, epoch) part the memory sinks ``sink_ids`` of this container hold, by sink
        id: on Ray, the parts not yet confirmed held by the master (``drop_handed_sink_parts``)."""
        writers = self._all_writers()
        return {i: dict(getattr(writers.get(i), "parts", {})) for i in sink_ids}

    def take_backups(self) -> dict[int, list[bytes]]:
        """Encoded checkpoints to send, by peer container (emptied by the call).

        With asynchronous checkpoints this includes rounds whose encoding
        finished since the last step (the last epoch's call waits for all).
        """
        if self.checkpointer is not None:
            self._queue_backups(self.checkpointer.ready())
        out, self.outgoing_backups = self.outgoing_backups, {}
        return out

    def set_threads(self, threads: int) -> int:
        """Scale up/down: run the slices on ``threads`` threads from the next epoch on
        (a new thread-control table; no state moves). Returns the table's version."""
        return self.threads.resize(list(self.slices), threads)

    def close(self) -> None:
        """Release the threads and the output log (the core is dropped: stopped or dead)."""
        self.threads.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.output_log is not None:
            self.output_log.close()

    def _process(self, epoch: int, messages: dict[int, EpochMessage] | None) -> dict[int, dict[int, pa.Table]]:
        """Run every local slice on the epoch, each on its thread (``containers.threads``);
        ``messages``: the epoch's input (``_epoch_messages``; None at a source)."""
        if self.reader is not None:
            e0 = epoch * self.plan.epoch_events
            rows = self.reader.rows(e0, e0 + self.plan.epoch_events)
            self.epoch_ingest = time.time()
            owner = np.asarray(rows.column(ORDER)) % self.stage.num_slices
            mine = {s: rows.filter(pa.array(owner == s)) if self.stage.num_slices > 1 else rows
                    for s, rt in self.slices.items() if epoch > rt.last_epoch}  # (skip: restored past it)
            results = self.threads.run_epoch(epoch, list(mine),
                                             lambda s: self.slices[s].process_source(epoch, mine[s]))
        else:
            # Slices that run the end-of-input hook after this epoch's input (not restored past it).
            finishing = [s for s, rt in self.slices.items() if epoch > rt.last_epoch] \
                if self.stage.ends and self.num_epochs is not None and epoch == self.num_epochs - 1 else []
            messages = messages or {}
            self.inbox.pop(epoch, None)
            stamps = [m.ingest for m in messages.values() if m.ingest is not None]
            self.epoch_ingest = min(stamps) if stamps else None
            # The epoch's routed parts as (stream id, part), senders in id order.
            stream_parts = [(sid, part) for sender in sorted(messages) for sid, part in messages[sender].parts.items()]
            if self.group_slices:
                # One vectorized pass per thread for the slices the thread-control table
                # gives it (slices/group.py), over the senders' parts as they came; one
                # group when the container has one thread.
                if len(self.stage.inputs) == 1:
                    parts = [part for _stream_id, part in stream_parts]
                    results = self.threads.run_groups(epoch, list(self.slices), lambda group: process_parts(
                        [self.slices[s] for s in group], epoch, parts))
                else:  # a per-event operator with several inputs (a join)
                    results = self.threads.run_groups(epoch, list(self.slices), lambda group: process_inputs(
                        [self.slices[s] for s in group], epoch, stream_parts))
                self.grouped_epochs += 1
            else:
                todo = self._inputs_by_slice(epoch, stream_parts)
                results = self.threads.run_epoch(epoch, list(todo), lambda s: self.slices[s].process(epoch, todo[s]))
            if finishing:
                results = self._finish(epoch, finishing, results)
        if self.restored_at:
            self._note_first_outputs(results)
        return results

    def _finish(self, epoch: int, slices: list[int], results: dict[int, dict[int, pa.Table]]
                ) -> dict[int, dict[int, pa.Table]]:
        """Run the end-of-input hook of ``slices`` (the last epoch's input is processed) and add
        its rows after the epoch's other rows of each slice and stream (``SliceRuntime.finish``)."""
        end_order = self.plan.end_order(self.num_epochs)  # type: ignore[arg-type]
        results = dict(results)
        for s in sorted(slices):
            per = dict(results.get(s, {}))
            for sid, t in self.slices[s].finish(epoch, end_order).items():
                per[sid] = pa.concat_tables([per[sid], t], promote_options="permissive") if sid in per else t
            if per:
                results[s] = per
        log.info("end of input: stage %s slices %s ran their end hook in epoch %d",
                 self.stage.name, sorted(slices), epoch)
        return results

    def _inputs_by_slice(self, epoch: int, parts: list[tuple[int, RoutedPart]]
                         ) -> dict[int, dict[int, list[pa.Table]]]:
        """Each local slice's rows of the epoch by input stream, from the epoch's (stream id,
        part) in sender order (slices restored from a checkpoint taken after the epoch and
        slices without rows are left out)."""
        todo: dict[int, dict[int, list[pa.Table]]] = {}
        for s, rt in self.slices.items():
            if epoch <= rt.last_epoch:
                continue
            inputs: dict[int, list[pa.Table]] = {}
            for stream_id, part in parts:
                rows = rows_of_slice(part, s)
                if rows is not None:
                    inputs.setdefault(stream_id, []).append(rows)
            if inputs:
                todo[s] = inputs
        return todo

    def _note_first_outputs(self, results: dict[int, dict[int, pa.Table]]) -> None:
        now = time.time()
        for s, per in results.items():
            if s in self.restored_at and s not in self.first_output_at and any(t.num_rows for t in per.values()):
                self.first_output_at[s] = now

    def _persist(self, epoch: int, outputs: dict[int, dict[int, pa.Table]]) -> None:
        if self.output_log is not None:
            # Only streams with consumers are logged: replay feeds consumers. A
            # sink-only stream is re-produced by its (recovered) slice instead,
            # and sinks are idempotent per (slice, epoch).
            self.output_log.append_epoch({(sid, s): t for s, per in outputs.items() for sid, t in per.items()
                                          if self.plan.streams[sid].consumers})
        sunk = 0  # rows written to sinks this epoch: they share one latency (one histogram add)
        for s, per in outputs.items():
            for sid, t in per.items():
                for k in self.plan.streams[sid].sinks:
                    writer = self.sink_writers.get(k)
                    if writer is not None:
                        writer.write(epoch, s, t)
                        sunk += t.num_rows
        if sunk and self.epoch_ingest is not None:
            self.latency.add((time.time() - self.epoch_ingest) * 1000, sunk)
        if self.dead_letter_writer is not None:
            for s, rt in self.slices.items():
                dead = rt.take_dead_letters()
                if dead:
                    self.dead_letter_rows += len(dead)
                    self.dead_letter_writer.write(epoch, s, pa.Table.from_pylist(dead))

    def _route(self, outputs: dict[int, dict[int, pa.Table]]) -> dict[int, EpochMessage]:
        parts: dict[int, dict[int, RoutedPart]] = {c: {} for c in self.destinations}
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
                    routed = route(combined, sp.key, self.routes[consumer], self.key_codes.get(consumer, False))
                except KeyError as exc:  # a key column the build could not check (its schema was unknown)
                    raise QueryError(f"stage {self.stage.name!r}, stream {sp.name!r} -> stage "
                                   f"{self.plan.stages[consumer].name!r}: {exc.args[0]}") from None
                for c, part in routed.items():
                    parts[c][sid] = part
        # Followed source: tell downstream where the input ends.
        end = self.num_epochs if self.plan.num_epochs is None else None
        if end is not None:
            self.end_announced = True
        cover = frozenset((self.stage.stage_id, s) for s in self.slices) if self.released else None
        return {c: EpochMessage(parts[c], end=end, coverage=cover,
                                release=tuple(sorted(self.released_to[c])) if c in self.released_to else None,
                                ingest=self.epoch_ingest)
                for c in self.destinations}

    # -- carried outputs and GC -------------------------------------------------------

    def _logged_streams(self) -> list[int]:
        return [sid for sid in self.stage.produced if self.plan.streams[sid].consumers]

    def _carried(self, slice_id: int, full: bool, epoch: int, prev_epoch: int):
        """The outputs a checkpoint of ``slice_id`` carries: since the low-water mark (full) or
        since the previous checkpoint (delta), read back from the output log."""

        sids = self._logged_streams()
        if self.output_log is None or not sids:
            return None
        tables: dict[int, pa.Table] = {}
        first = self.low_water + 1 if full else prev_epoch + 1
        for sid in sids:
            if full:
                t = self._logged_since(sid, slice_id, first)
            else:
                t = self.output_log.read(sid, slice_id, self.carried_seq.get((slice_id, sid), 0) - 1)
            if t.num_rows:
                tables[sid] = t
            self.carried_seq[(slice_id, sid)] = self.slices[slice_id].next_seq.get(sid, 0)
        return CarriedOutputs(self.stage.stage_id, slice_id, max(first, 0), epoch, full, tables)

    def gc(self, low_water: int) -> int:
        """Forget logged outputs of epochs <= ``low_water`` (every consumer's checkpoint covers them)."""
        if low_water <= self.low_water:
            return 0
        self.low_water = low_water
        if self.output_log is None:
            return 0
        bound = (low_water + 1) * self.plan.epoch_events
        return sum(self.output_log.trim(sid, s, bound) for sid in self._logged_streams() for s in self.slices)

    # -- recovery ----------------------------------------------------------------

    def restore_slices(self, points: dict[int, Any]) -> int:
        """Load each slice's ``RestorePoint`` (its checkpoint: a ``SliceCheckpoint``, or None to
        rebuild it from the start; its carried outputs; its seed frames).

        The core resumes at the epoch after the oldest checkpoint; a slice
        whose checkpoint is newer skips the epochs it already holds (its
        upstream rows for them are below its progress vector anyway).
        The carried outputs (oldest first) rebuild the slice's output log up
        to its checkpoint, so consumers restored from older checkpoints can
        still be replayed to. The seed is the encoded frames the checkpoint
        came from; the slice's first checkpoint here is then a delta shipped
        after them (``SliceCheckpointer.seed``), not a full one.
        Returns the first epoch this core processes.
        """

        if set(points) != set(self.slices):
            raise ValueError(f"container {self.container_id}: checkpoints for {sorted(points)}, "
                             f"slices {sorted(self.slices)}")
        now = time.time()
        for s, (ckpt, carried, seed) in points.items():
            if ckpt is not None:
                restore(self.slices[s], ckpt)
            self.log_start[s] = self.slices[s].last_epoch + 1
            if ckpt is not None and carried:
                self.log_start[s] = self._relog(s, carried, ckpt.epoch)
            for sid in self._logged_streams():
                self.carried_seq[(s, sid)] = self.slices[s].next_seq.get(sid, 0)
            self.restored_at[s] = now
            if ckpt is not None and seed and self.checkpointer is not None:
                self.checkpointer.seed(s, ckpt.epoch, seed)
        self.next_epoch = min(rt.last_epoch + 1 for rt in self.slices.values())
        return self.next_epoch

    def _relog(self, slice_id: int, segments: list[Any], epoch: int) -> int:
        """Write carried outputs back to the output log; return the first epoch now logged.

        Segments must be contiguous up to the checkpoint's epoch; from a gap
        on, only what follows counts (a consumer needing rows before it gets
        ``ReplayUnavailable``, never a hole).
        """
        start, expect = epoch + 1, None
        for seg in segments:
            if expect is None or seg.from_epoch != expect:
                start = seg.from_epoch  # a new contiguous run (after a gap, older rows do not count)
            expect = seg.epoch + 1
        if expect is None or expect < epoch + 1:
            return epoch + 1  # the outputs do not reach the checkpoint
        if self.output_log is not None:
            written: dict[int, int] = {}
            for seg in segments:
                batch = {}
                for sid, t in seg.tables.items():
                    seq = np.asarray(t.column(SEQ))
                    keep = seq > written.get(sid, -1)
                    if keep.any():
                        batch[(sid, slice_id)] = t.filter(pa.array(keep))
                        written[sid] = int(seq[keep].max())
                self.output_log.append_epoch(batch)
        return start

    # -- migration (docs/design.md section 7f) -------------------------------------

    def _refresh_destinations(self) -> None:
        self.destinations = sorted({c for r in self.routes.values() for c in r.containers()} | set(self.released_to))

    def request_release(self, slices: list[int]) -> None:
        """Release ``slices`` before the next epoch: a source stage (no upstream marker tells it),
        or a transfer the master completed before every producer marked it (a producer died
        mid-migration; its replacement routes the slices to their new container only).

        When every slice goes, they go now: producers may route nothing here any more, so no
        epoch's input would arrive to release them at."""
        self.pending_release |= set(slices) & set(self.slices)
        if self.reader is None and self.slices and self.pending_release >= set(self.slices):
            self._release(set(self.pending_release), self.next_epoch)
            self.pending_release.clear()

    def _releases_due(self, inbound: dict[int, EpochMessage] | None) -> set[int]:
        """Slices to release before processing an epoch: asked for, or marked by an upstream
        sender in the epoch's messages (``inbound``; None at a source)."""
        due = set(self.pending_release)
        self.pending_release.clear()
        for msg in (inbound or {}).values():
            if msg.release is not None:
                due |= set(msg.release)
        return due & set(self.slices)

    def _release(self, slices: set[int], epoch: int) -> None:
        """Stop running ``slices`` from ``epoch`` on (migration phase 3): their new container has them.

        An upstream sender marks the first epoch whose rows of the slice it
        no longer sends here, so every epoch processed here had complete
        input; the destination, in dual mode since before, has every epoch
        from its restore point on. The slices' logged outputs are dropped:
        the destination logs its own (and relogged what its consumers may need).
        """
        for s in sorted(slices):
            self.slices.pop(s).drop_cold()  # (the checkpointer shares this dict: it stops capturing s too)
            self.released[s] = epoch
            self.log_start.pop(s, None)
            if self.output_log is not None:
                for sid in self._logged_streams():
                    self.output_log.drop(sid, s)
            log.info("migration: stage %s slice %s released by container %s at epoch %s",
                     self.stage.name, s, self.container_id, epoch)

    def release_route(self, stage_id: int, slices: list[int], target: int) -> int:
        """End dual mode: ``stage_id``'s ``slices`` go to ``target`` only, from this core's next epoch.

        Their old owners get ``release`` in this core's messages from
        that epoch on (until ``forget_released``). Returns that epoch.
        """
        route_ = self.routes[stage_id]
        table = route_.slice_to_container.copy()
        for s in slices:
            owner = int(table[s])
            if owner != target:
                self.released_to.setdefault(owner, set()).add(int(s))
            table[s] = target
        self.routes[stage_id] = OutputRoute(stage_id, table, {s: c for s, c in route_.dual.items() if s not in slices})
        self._refresh_destinations()
        return self.next_epoch

    def drop_dual(self, stage_id: int, slices: list[int]) -> None:
        """Abort dual mode for ``slices`` (a migration that cannot finish): the owner keeps them."""
        route_ = self.routes[stage_id]
        self.routes[stage_id] = OutputRoute(stage_id, route_.slice_to_container,
                                            {s: c for s, c in route_.dual.items() if s not in slices})
        self._refresh_destinations()

    def forget_released(self, container_id: int, slices: list[int]) -> None:
        """Stop marking ``slices`` in messages to ``container_id`` (it released them). Only those:
        another transfer from the same container may still wait for its own marker (two
        destinations of one scale-in release at different epochs when their producers are at
        different epochs), and with no mark and no route left the container would get no more
        messages and wait forever."""
        left = self.released_to.get(container_id, set()) - set(slices)
        if left:
            self.released_to[container_id] = left
        else:
            self.released_to.pop(container_id, None)
        self._refresh_destinations()

    def migration_snapshot(self, slices: list[int]) -> list[bytes]:
        """Full checkpoints of ``slices`` as of the last processed epoch, each followed by its
        carried outputs: what a migration destination rebuilds them from (warm-up).

        Does not start a new delta: the regular checkpoints go on as before.
        """
        return encode_snapshot(self.migration_capture(slices))

    def migration_capture(self, slices: list[int]) -> list[tuple[Any, Any]]:
        """The CAPTURE half of ``migration_snapshot`` (between two epochs; ``encode_snapshot`` may
        run later, elsewhere: the capture holds frozen copies)."""

        out = []
        epoch = self.next_epoch - 1
        for s in slices:
            ck = capture(self.slices[s], delta=False, epoch=epoch, clear=False)
            carried = None
            if self.output_log is not None and self._logged_streams():
                first = self.low_water + 1
                tables = {sid: t for sid in self._logged_streams()
                          if (t := self._logged_since(sid, s, first)).num_rows}
                carried = CarriedOutputs(self.stage.stage_id, s, max(first, 0), ck.epoch, True, tables)
            out.append((ck, carried))
        return out

    # -- compaction: slices handed over in process (hand_over below) ------------------

    def give_all_to(self, dest: "ContainerCore") -> list[int]:
        """Hand every local slice, as it is after the last processed epoch, to ``dest`` (another
        container of this stage in this process, which goes on from this core's next epoch):
        the runtimes (state, progress vectors, out_seq counters), their logged outputs, memory-
        sink parts, backup chains and the checkpoint rounds not shipped yet. Nothing is copied
        but the logged outputs (moved as stored). This core then counts them as released at
        its next epoch and retires. Returns the slices. Call it between two epochs."""
        epoch = self.next_epoch
        slices = sorted(self.slices)
        for s in slices:
            if self.output_log is not None and dest.output_log is not None:
                for sid in self._logged_streams():
                    self.output_log.move_to(dest.output_log, sid, s)
            dest.log_start[s] = self.log_start.pop(s, epoch)
            for sid in self._logged_streams():
                if (s, sid) in self.carried_seq:
                    dest.carried_seq[(s, sid)] = self.carried_seq.pop((s, sid))
        mine, theirs = self._all_writers(), dest._all_writers()
        for k, w in mine.items():
            if k in theirs:
                theirs[k].take_in(w.give_parts(set(slices)))
        add_sink_parts(dest.outgoing_sink_parts, self.take_sink_parts())
        for peer, blobs in self.outgoing_backups.items():
            dest.outgoing_backups[peer] = blobs + dest.outgoing_backups.get(peer, [])
        self.outgoing_backups = {}
        if self.checkpointer is not None and dest.checkpointer is not None:
            full = dest.checkpointer.take_chains(self.checkpointer.give_chains(slices))
            if full:
                log.info("compaction: stage %s slices %s have other backup peers in container %s: "
                         "next checkpoint full", self.stage.name, full, dest.container_id)
        for s in slices:
            dest.slices[s] = self.slices.pop(s)  # (dest's checkpointer shares its dict: it captures s now)
            self.released[s] = epoch
        dest.low_water = max(dest.low_water, self.low_water)  # (a stage-wide mark: every consumer has it)
        self.inbox.clear()
        self.stop_before = None
        log.info("compaction: stage %s slices %s handed over by container %s to container %s at epoch %s",
                 self.stage.name, slices, self.container_id, dest.container_id, epoch)
        return slices

    def _logged_since(self, stream_id: int, slice_id: int, first_epoch: int) -> pa.Table:
        """Logged outputs of (stream, slice) derived from epochs >= ``first_epoch``."""
        assert self.output_log is not None
        t = self.output_log.read(stream_id, slice_id, -1)
        if t.num_rows and first_epoch > 0:
            t = t.filter(pa.array(np.asarray(t.column(ORDER)) >= first_epoch * self.plan.epoch_events))
        return t

    def replay_floor(self) -> int:
        """The first epoch this core's output log can replay to any consumer (older rows were
        dropped by GC, or were not carried by the checkpoint its slices were restored from)."""
        return max([self.low_water + 1] + [self.log_start[s] for s in self.slices])

    def replay_behind(self, stage_id: int, target: int, next_epoch: int,
                      progress: dict[int, dict[int, list[int]]], upto: int) -> dict[int, EpochMessage]:
        """The replay a recovered container owes consumer ``target`` of ``stage_id``, at
        ``next_epoch`` with ``progress`` per slice: its logged epochs from there (or its
        ``replay_floor``) up to ``upto``, its resume epoch (recovery step 3b); empty when the
        consumer is not behind."""
        first = max(next_epoch, self.replay_floor())
        if first >= upto or not progress:
            return {}
        slices = sorted(progress)
        return self.replay_epochs(stage_id, slices, target, progress, {s: first for s in slices}, upto)

    def progress_of(self, slice_id: int) -> dict[int, list[int]]:
        """A local slice's progress vector as plain data (stream id -> out_seq per producer slice)."""
        return {sid: arr.tolist() for sid, arr in self.slices[slice_id].progress.consumed.items()}

    def reroute(self, stage_id: int, slices: list[int], target: int,
                progress: dict[int, dict[int, list[int]]], resume: dict[int, int],
                dual: bool = False) -> dict[int, EpochMessage]:
        """Send ``stage_id``'s ``slices`` to container ``target`` from now on; return the replay.

        ``progress`` is each moved slice's restored progress vector and
        ``resume`` the first epoch it processes again. The replay holds, for
        every epoch from the earliest resume epoch up to this core's next
        epoch, one message for ``target`` with the logged rows of this
        core's slices that the moved slices have not consumed: read from the
        output log per (stream, producer slice), filtered by consumer slice
        and progress vector with array operations, and cut into epochs by
        ``_order`` (an epoch is a source-order range). Later epochs are
        routed to ``target`` by ``step`` as usual. With ``dual`` (migration
        phase 2) the slices' owner keeps getting their rows too, until
        ``release_route``.
        """
        self.switch_route(stage_id, slices, target, dual)
        return self.replay_epochs(stage_id, slices, target, progress, resume, self.next_epoch)

    def switch_route(self, stage_id: int, slices: list[int], target: int, dual: bool = False) -> None:
        """From the next epoch on, route ``stage_id``'s ``slices`` to ``target`` (with ``dual``, to
        their owner as well). Call it at an epoch boundary (not during ``step``)."""
        route_ = self.routes[stage_id]
        moved = np.array(sorted(slices), dtype=np.int64)
        if dual:
            self.routes[stage_id] = OutputRoute(stage_id, route_.slice_to_container,
                                                {**route_.dual, **{int(s): target for s in moved}})
        else:
            table = route_.slice_to_container.copy()
            table[moved] = target
            self.routes[stage_id] = OutputRoute(stage_id, table, {s: c for s, c in route_.dual.items()
                                                                  if s not in set(moved.tolist())})
        self._refresh_destinations()

    def replay_epochs(self, stage_id: int, slices: list[int], target: int,
                      progress: dict[int, dict[int, list[int]]], resume: dict[int, int], upto: int,
                      since: int = 0, cursor: dict[tuple[int, int], int] | None = None) -> dict[int, EpochMessage]:
        """The replay for ``target`` of epochs [max(resume, since), upto): one message per epoch.

        Reads only the output log and the plan, so it may run in a worker
        thread while this core goes on stepping (a migration destination
        catches up in rounds, ``ResourceContainer.reroute``). ``cursor``
        ((stream, producer slice) -> last out_seq already replayed), kept by
        the caller across rounds, makes each round read only the log batches
        after the previous round's; this call advances it to ``upto``.
        """
        moved = np.array(sorted(slices), dtype=np.int64)
        first = max(since, min(resume[s] for s in slices))
        end = self.num_epochs if self.plan.num_epochs is None else None
        replay = {e: EpochMessage(end=end) for e in range(first, upto)}
        if not replay:
            return replay
        for p, start in self.log_start.items():
            start = max(start, self.low_water + 1)  # older rows were dropped by GC
            late = [s for s in slices if resume[s] < start]
            if late:
                raise ReplayUnavailable(
                    f"stage {self.plan.stages[stage_id].name!r} slices {late} resume at epoch "
                    f"{min(resume[s] for s in late)}, but the output of stage {self.stage.name!r} slice {p} "
                    f"before epoch {start} was lost with the container that hosted it or dropped by GC")
        rows = self._replay_rows(stage_id, slices, moved, progress, upto, cursor)
        # Route as if ``target`` owned the slices (whether or not the live route says so yet).
        table = self.routes[stage_id].slice_to_container.copy()
        table[moved] = target
        keep_route = OutputRoute(stage_id, table, {})
        for sid, t in rows.items():
            # One stable sort by epoch, then zero-copy slices: cost O(rows), not
            # O(rows x epochs) (a replay can span hundreds of epochs).
            epochs = np.asarray(t.column(ORDER)) // self.plan.epoch_events
            if len(epochs) > 1 and np.any(epochs[1:] < epochs[:-1]):
                by_epoch = np.argsort(epochs, kind="stable")
                t, epochs = t.take(pa.array(by_epoch)), epochs[by_epoch]
            uniq, starts = np.unique(epochs, return_index=True)
            ends = np.append(starts[1:], len(epochs))
            for e, lo, hi in zip(uniq.tolist(), starts.tolist(), ends.tolist()):
                if e in replay:
                    part = route(t.slice(lo, hi - lo), self.plan.streams[sid].key, keep_route,
                                 self.key_codes.get(stage_id, False))
                    if target in part:
                        replay[e].parts[sid] = part[target]
        return replay

    def _replay_rows(self, stage_id: int, slices: list[int], moved: np.ndarray,
                     progress: dict[int, dict[int, list[int]]], upto: int | None = None,
                     cursor: dict[tuple[int, int], int] | None = None) -> dict[int, pa.Table]:
        """Logged rows the moved slices have not consumed, per stream: derived from epochs before
        ``upto`` (all when None) and, with ``cursor``, after its out_seq per (stream, producer)."""
        if self.output_log is None:
            raise ReplayUnavailable(f"container {self.container_id} keeps no output log to replay from")
        n = self.plan.stages[stage_id].num_slices
        out: dict[int, pa.Table] = {}
        for sid in self.stage.produced:
            sp = self.plan.streams[sid]
            if not any(c == stage_id for c, _ in sp.consumers):
                continue
            parts = []
            for p in sorted(self.slices):
                # consumed[s]: highest out_seq of (sid, p) slice s has consumed.
                consumed = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
                for s in slices:
                    vec = progress.get(s, {}).get(sid, [])
                    consumed[s] = vec[p] if p < len(vec) else -1
                after = int(consumed[moved].min())
                if cursor is not None:
                    after = max(after, cursor.get((sid, p), -1))
                t = self.output_log.read(sid, p, after)
                if upto is not None and t.num_rows:
                    # A producer numbers its epochs in order: the rows before ``upto`` are a prefix.
                    cut = int(np.searchsorted(np.asarray(t.column(ORDER)) // self.plan.epoch_events, upto))
                    t = t.slice(0, cut)
                if t.num_rows == 0:
                    continue
                if cursor is not None:
                    cursor[(sid, p)] = int(np.asarray(t.column(SEQ))[-1])
                dst = consumer_slices(t, sp.key, n)
                keep = np.asarray(t.column(SEQ)) > consumed[dst]
                if keep.any():
                    parts.append(t.filter(pa.array(keep)))
            if parts:
                out[sid] = pa.concat_tables(parts, promote_options="permissive")
        return out

    # -- savepoints --------------------------------------------------------------

    def arm_savepoint(self, epoch: int) -> str:
        """Capture every slice's full state at the end of ``epoch`` (a savepoint; the delta chain
        of checkpoints is not touched). ``"taken"``: captured now (``epoch`` is the last one
        processed, or this container ended before it); ``"armed"``: captured after processing
        ``epoch``; ``"late"``: this container is past it, nothing is captured."""
        last = self.next_epoch - 1
        if epoch < last:
            return "late"
        if epoch == last or self.done:
            self._capture_savepoint(last)
            return "taken"
        self.savepoint_epoch, self.savepoint_taken = epoch, None
        return "armed"

    def _capture_savepoint(self, epoch: int) -> None:
        self.savepoint_epoch = None
        self.savepoint_taken = (epoch, [capture(rt, False, epoch=epoch, clear=False) for rt in self.slices.values()])

    def state_kinds(self) -> dict[str, str]:
        """Each key-value state the operator registers -> its kind: a state library handle's
        (``value``, ``list``, ``queue``, ``map``, ``topk``) or ``kv`` (``register_state``)."""
        rt = next(iter(self.slices.values()), None)
        if rt is None or rt.op is None:
            return {}
        return {n: rt.ctx.handles[n].kind if n in rt.ctx.handles else "kv" for n in rt.ctx.states}

    def check_state_names(self, slice_id: int, ckpt: Any, saved_kinds: dict[str, str] | None = None) -> None:
        """Refuse (``SavepointError``) a checkpoint holding a key-value state that the slice's
        operator no longer registers in ``setup()``, or registers as another kind than the
        savepoint's (``saved_kinds``): an upgraded operator that dropped, renamed or retyped one
        would silently lose or misread it (a state given up on purpose is dropped from the
        frames before: ``run(..., drop_states=...)``)."""
        rt = self.slices[slice_id]
        if rt.op is None:
            return
        held = [n for n, part in ckpt.state.items() if part.get("shape") == "kv" and not n.startswith("__op__")]
        unknown = sorted(n for n in held if n not in rt.ctx.states)
        hint = f"keep the name in setup(), or drop it: drop_states={{{self.stage.name!r}: [...]}}"
        if unknown:
            raise SavepointError(f"stage {self.stage.name!r} slice {slice_id}: the savepoint holds state "
                                 f"{', '.join(map(repr, unknown))}, which the operator no longer registers "
                                 f"(it registers {sorted(rt.ctx.states)}); {hint}")
        now = self.state_kinds()
        retyped = sorted(n for n in held if (saved_kinds or {}).get(n, now[n]) != now[n])
        if retyped:
            said = ", ".join(f"{n!r} (a {saved_kinds[n]} state there, a {now[n]} state now)" for n in retyped)
            raise SavepointError(f"stage {self.stage.name!r} slice {slice_id}: the savepoint holds state {said}: "
                                 f"its values would be misread; register it as it was, or drop it: "
                                 f"drop_states={{{self.stage.name!r}: [...]}}")

    def take_savepoint(self) -> tuple[int, list[Any]] | None:
        """The savepoint captured (epoch, one full ``SliceCheckpoint`` per slice), once; None before."""
        out, self.savepoint_taken = self.savepoint_taken, None
        return out

    # -- reading ---------------------------------------------------------------

    def statistics(self) -> ContainerStatistics:
        """A frozen snapshot of this container's counters."""
        stats = [rt.statistics() for rt in self.slices.values()]
        try:
            import psutil
            proc = psutil.Process(os.getpid())
            # Memory the process owns: file-backed pages (the lmdb maps of the output log and
            # the backups) sit in the page cache, which the kernel reclaims; they are not counted.
            mem = proc.memory_info()
            rss = mem.rss - mem.shared
            cpu = sum(proc.cpu_times()[:2])
        except Exception:  # noqa: BLE001 - metrics must never fail the job
            rss, cpu = 0, 0.0
        return ContainerStatistics(
            self.container_id, self.stage.name, tuple(self.slices), self.next_epoch, self.num_epochs,
            sum(s.events_in for s in stats), sum(s.events_out for s in stats),
            sum(s.duplicates_dropped for s in stats), self.messages_dropped, len(self.inbox),
            self.buffered_bytes(), self.busy_s, cpu, rss,
            self.checkpointer.taken if self.checkpointer is not None else 0,
            self.output_log.entries() if self.output_log is not None else 0,
            self.backup_store.total_bytes() if self.backup_store is not None else 0,
            tuple(sorted(self.released)), self.threads.threads, self.latency.to_plain(), self.backlog_events(),
            self.source_lag(), *self.host_gc_figures(),
            self.checkpointer.seeded if self.checkpointer is not None else 0, self.send_s, self.shm_parts,
            self.parts_node_unknown, self.backpressured_s,
            self.checkpointer.round_seconds.to_plain() if self.checkpointer is not None else {},
            self.checkpointer.round_bytes.to_plain() if self.checkpointer is not None else {},
            self.state_sizes.figures(self.slices, time.monotonic()))

    def host_gc_figures(self) -> tuple[int, float]:
        """(full collections, their total pause in s) of the host's ``CollectorPacing``, if it has one."""
        pacing = self.gc_pacing
        return (pacing.full_collections, pacing.full_pause_s) if pacing is not None else (0, 0.0)

    def slice_metrics(self) -> list[SliceMetrics]:
        """Per local slice: cumulative events in and busy time, events waiting, state size."""
        n = self.stage.num_slices
        waiting = np.zeros(n, dtype=np.int64)
        for msgs in self.inbox.values():
            for msg in msgs.values():
                for _table, dst in msg.parts.values():
                    if len(dst):
                        waiting += np.bincount(dst, minlength=n)[:n]
        out = []
        for s, rt in self.slices.items():
            keys, nbytes = rt.state_size()
            out.append(SliceMetrics(s, self.container_id, rt.events_in, rt.busy_s, int(waiting[s]), keys, nbytes,
                                    state_cold_keys=rt.cold_state_keys()))
        return out

    def source_lag(self) -> int:
        """A source container: global orders readable now but not read yet, times the share of
        the source's slices it runs (an estimate of its events waiting); 0 elsewhere."""
        if self.reader is None or not self.slices:
            return 0
        behind = self.reader.available_order() - self.next_epoch * self.plan.epoch_events
        return max(0, int(behind * len(self.slices) / self.stage.num_slices))

    def backlog_events(self) -> int:
        """Input rows received and not yet processed (the inbox)."""
        return sum(msg.rows() for msgs in self.inbox.values() for msg in msgs.values())

    def buffered_bytes(self) -> int:
        """Bytes of input held in the inbox (epochs received, not yet processed)."""
        return sum(msg.nbytes() for msgs in self.inbox.values() for msg in msgs.values())


def hand_over(sources: list[ContainerCore], dest: ContainerCore, epoch: int) -> dict[int, list[int]]:
    """Compaction's step without a copy: every slice of ``sources`` goes to ``dest``, all
    containers of one stage in this process, at the boundary before ``epoch``.

    Every source must have processed exactly the epochs before ``epoch`` (each stops there:
    ``stop_before``) and ``dest`` must be waiting for them (``awaiting_handover``); producers
    have sent ``dest`` the slices' rows (dual mode) since an epoch at or before ``epoch``, so
    it holds every epoch it needs. ``dest`` then processes from ``epoch`` on; epochs before it
    in its inbox are dropped. Returns source container -> the slices it gave.
    """
    for src in sources:
        if src.next_epoch != epoch or src.done:
            raise ValueError(f"container {src.container_id} is at epoch {src.next_epoch} (done: {src.done}), "
                             f"not at the handover epoch {epoch}")
    if not dest.awaiting_handover:
        raise ValueError(f"container {dest.container_id} is not waiting for a handover")
    # The groups the sources ran (one per thread, or their own cohorts) stay groups: a new group
    # over all the slices would be built at the first epoch, a sort of every key they hold.
    cohorts = [c for src in sources for g in src.threads.table.groups(list(src.slices))
               for c in src.threads.table.cohorts(g) if c]
    threads = max([dest.threads.planned_threads()] + [src.threads.planned_threads() for src in sources])
    given = {src.container_id: src.give_all_to(dest) for src in sources}
    dest.next_epoch = epoch
    for e in [e for e in dest.inbox if e < epoch]:
        del dest.inbox[e]
    dest.threads.install(ThreadControlTable.of_cohorts(cohorts, threads))
    dest.awaiting_handover = False
    return given


def encode_snapshot(captured: list[tuple[Any, Any]]) -> list[bytes]:
    """Bytes of a ``migration_capture``: each checkpoint frame, then its carried outputs."""

    blobs = []
    for ck, carried in captured:
        blobs.append(encode(ck))
        if carried is not None:
            blobs.append(encode_outputs(carried))
    return blobs
