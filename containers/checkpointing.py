"""Owns when a container checkpoints its slices and where the bytes go (chained backups).

Every ``every_epochs`` epochs (and after the last one) each local slice is
checkpointed: a full checkpoint first (and after the backup peers change),
deltas of what changed afterwards (the backup side merges them, so restore
cost stays bounded; ``full_every`` > 0 adds a periodic full one, the
synchronous baseline of the benchmark). A slice restored from a backup
starts with a delta instead, shipped after the frames it was restored
from (``SliceCheckpointer.seed``). A checkpoint goes through three
explicit phases, logged with its slice and epoch:

1. ``CAPTURE`` (in the epoch, synchronous): a frozen copy of what changed
   (dirty slots/keys) and the progress vector; the slice's dirty sets start
   afresh, so updates of the next epochs go to the next delta (the paper's
   overlay). Cost proportional to the delta.
2. ``ENCODE`` (a background thread, when ``async_encode``): Arrow IPC,
   msgpack and checksums of the frozen copy, while the container goes on
   with the next epochs. Arrow and zlib release the GIL for large buffers.
3. ``SHIP``: the encoded bytes, in capture order per slice (a delta must
   follow its base), are handed to the container shell, which sends them to
   the peers after the pushes of a later epoch were accepted.

Knows no Ray.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from chronostream.containers.metrics import CHECKPOINT_BYTES_BOUNDS, CHECKPOINT_SECONDS_BOUNDS, BoundedHistogram
from chronostream.containers.thread_priority import background_pool
from chronostream.slices.checkpoint import CarriedOutputs, SliceCheckpoint, capture, encode, encode_outputs
from chronostream.slices.slice import SliceRuntime

log = logging.getLogger("chronostream.checkpoint")


class CheckpointPhase(enum.Enum):
    """Where a slice checkpoint is in its life (see the module docstring)."""

    CAPTURE = "capture"
    ENCODE = "encode"
    SHIP = "ship"

#: One slice's capture: checkpoint, carried outputs, peers, seed frames to ship first (``seed``).
Captured = tuple[SliceCheckpoint, "CarriedOutputs | None", list[int], list[bytes]]
#: One encoded round: (peer, frame) in shipping order, encoding seconds, capture and encoding
#: seconds, encoded bytes (one copy of each slice's frames).
EncodedRound = tuple[list[tuple[int, bytes]], float, float, int]

#: (slice, full, checkpoint epoch, previous checkpoint epoch) -> the outputs to carry, or None.
CarryOutputs = Callable[[int, bool, int, int], "CarriedOutputs | None"]


@dataclass
class ChainHandover:
    """What a checkpointer hands over with its slices (``give_chains``, then ``take_chains``): per
    slice its backup peers, schedule and seed, and the rounds captured and not yet handed out
    (they must reach the peers before the receiver's next deltas)."""

    peers: dict[int, list[int]]
    last_epoch: dict[int, int]
    since_full: dict[int, int]
    seeds: dict[int, list[bytes]]
    encoded: list
    pending: deque


@dataclass
class CheckpointSchedule:
    """Per-slice bookkeeping: last checkpoint epoch and deltas since the last full one."""

    last_epoch: dict[int, int] = field(default_factory=dict)
    since_full: dict[int, int] = field(default_factory=dict)


class SliceCheckpointer:
    """Takes a container's slice checkpoints at epoch boundaries and addresses them to backups."""

    def __init__(self, slices: dict[int, SliceRuntime], backup_peers: dict[int, list[int]],
                 every_epochs: int, full_every: int = 0, async_encode: bool = True,
                 max_pending: int = 2, every_s: float = 0.0) -> None:
        if every_epochs < 0 or every_s < 0 or not (every_epochs or every_s):
            raise ValueError("checkpoint every K >= 1 epochs or every T > 0 seconds")
        self.slices = slices
        self.backup_peers = backup_peers
        self.every_epochs = every_epochs
        self.every_s = every_s
        self._last_round_at = time.monotonic()
        self._decided: tuple[int, bool] = (-1, False)
        self.full_every = max(0, full_every)
        self.schedule = CheckpointSchedule()
        self.taken = 0
        self.full_taken = 0  # of them full checkpoints (the others deltas)
        self.bytes_out = 0
        self.encode_s = 0.0  # time spent encoding (in the background thread when async)
        # Rounds handed to the shell and not yet accepted by the peers (the shell keeps
        # it up to date); with the rounds still encoding, at most ``max_unshipped``.
        self.unshipped = 0
        self.max_unshipped = 3
        self.deferred = 0  # rounds skipped because backups were behind
        # Checkpoint rounds waiting to be encoded, oldest first; at most
        # ``max_pending`` rounds queue before capture waits (backpressure).
        self.max_pending = max(1, max_pending)
        self._pending: deque[Future] = deque()
        self._encoded: list[EncodedRound] = []  # rounds waited for by backpressure
        # Each round's capture and encoding seconds, and its encoded bytes (one copy of each
        # slice's frames): Prometheus' checkpoint histograms (master.ray_prometheus).
        self.round_seconds = BoundedHistogram(CHECKPOINT_SECONDS_BOUNDS)
        self.round_bytes = BoundedHistogram(CHECKPOINT_BYTES_BOUNDS)
        self._pool = background_pool(1, "checkpoint-encode") if async_encode else None
        # slice -> the encoded frames it was restored from, to ship before its first delta (seed()).
        self._seeds: dict[int, list[bytes]] = {}
        self.seeded = 0  # checkpoints that went out as a seed plus a delta instead of a full one
        self.seed_bytes = 0

    def seed(self, slice_id: int, epoch: int, frames: list[bytes]) -> None:
        """``slice_id`` was restored from ``frames`` (a backup chain ending at ``epoch``, then its
        carried outputs): its next checkpoint is a delta since ``epoch``, shipped after them.

        A restored slice's state is the chain's state at ``epoch`` with empty
        dirty sets, so what it changes from then on is exactly a delta on that
        chain, and any peer that receives the chain first can apply it. The
        frames are already encoded and verified: shipping them costs no
        capture and no encoding, where a full checkpoint of a 500 MB slice
        took about 1.6 s of CPU on the host that had just taken the slice
        over (the migration's post-move stall). A peer that refuses the delta
        anyway makes the next checkpoint a full one (``force_full``).
        """
        if not frames:
            return
        self._seeds[slice_id] = list(frames)
        self.schedule.last_epoch[slice_id] = epoch
        self.schedule.since_full[slice_id] = 0
        log.info("checkpoint slice %s: restored at epoch %s, next checkpoint a delta after %d seed frames "
                 "(%d bytes)", slice_id, epoch, len(frames), sum(len(f) for f in frames))

    def retarget(self, backup_peers: dict[int, list[int]]) -> list[int]:
        """New backup peers (placement changed); returns the slices whose peers changed.

        Their next checkpoint is a full one: a new peer holds no chain to
        apply a delta to. Slices whose peers stay go on with deltas: after a
        migration, full checkpoints of every slice of the stage at once (a
        whole container's state copied in one epoch, encoded and shipped)
        stalled the job for hundreds of ms. A peer that kept the slice's
        peers but lost its chain refuses the next delta, which forces a
        full one (``force_full``). A restored slice whose seed has not gone
        out yet keeps it: the new peers get the seed, then the delta.
        """
        changed = sorted(s for s in set(backup_peers) | set(self.backup_peers)
                         if sorted(backup_peers.get(s, [])) != sorted(self.backup_peers.get(s, [])))
        self.backup_peers = backup_peers
        full = []
        for s in changed:
            if s in self._seeds and backup_peers.get(s):
                continue  # the seed goes to the new peers before the first delta
            self._seeds.pop(s, None)
            self.schedule.since_full.pop(s, None)
            self.schedule.last_epoch.pop(s, None)
            if s in backup_peers:  # (a slice left out has left this container: no more checkpoints of it here)
                full.append(s)
        if full:
            log.info("checkpoint slices %s: new backup peers, next checkpoint full", full)
        return changed

    def give_chains(self, slices: list[int]) -> ChainHandover:
        """Hand over ``slices``' backup chains and every round not handed out yet (the giver
        hands over all its slices: a compaction; its own later rounds would have none)."""
        sch = self.schedule
        out = ChainHandover({s: list(self.backup_peers.get(s, [])) for s in slices},
                            {s: sch.last_epoch.pop(s) for s in slices if s in sch.last_epoch},
                            {s: sch.since_full.pop(s) for s in slices if s in sch.since_full},
                            {s: self._seeds.pop(s) for s in slices if s in self._seeds},
                            self._encoded, self._pending)
        self._encoded, self._pending = [], deque()
        return out

    def take_chains(self, given: ChainHandover) -> list[int]:
        """Go on with chains another checkpointer gave (``give_chains``): a slice whose backup
        peers here are the ones it had goes on with deltas (its dirty sets moved with its
        state); one whose peers changed follows ``retarget``'s rule (its seed still goes out
        first, else its next checkpoint is full). The giver's rounds are handed out before
        this one's. Returns the slices whose next checkpoint is full."""
        self._encoded[:0] = given.encoded
        self._pending.extendleft(reversed(given.pending))
        full = []
        for s, peers in given.peers.items():
            same = sorted(self.backup_peers.get(s, [])) == sorted(peers)
            if s in given.seeds and self.backup_peers.get(s):
                self._seeds[s] = given.seeds[s]
            elif not same:
                full.append(s)
                continue
            if s in given.last_epoch:
                self.schedule.last_epoch[s] = given.last_epoch[s]
                self.schedule.since_full[s] = given.since_full.get(s, 0)
        return full

    def force_full(self, slices: list[int]) -> None:
        """The next checkpoint of each of ``slices`` is a full one (a backup refused a delta)."""
        for s in slices:
            self._seeds.pop(s, None)
            if self.schedule.last_epoch.pop(s, None) is not None:
                log.info("checkpoint slice %s: a backup asked for a full checkpoint", s)
            self.schedule.since_full.pop(s, None)

    def due(self, epoch: int, last: bool) -> bool:
        """True when the end of ``epoch`` is a checkpoint boundary: every K epochs, the
        first epoch boundary after T seconds since the last round, and the last epoch.

        Decided once per epoch (a time trigger must not change its mind between calls).
        """
        if self._decided[0] == epoch:
            return last or self._decided[1]
        hit = bool(self.every_epochs) and (epoch + 1) % self.every_epochs == 0
        hit = hit or (self.every_s > 0 and time.monotonic() - self._last_round_at >= self.every_s)
        if hit and self.pending + self.unshipped >= self.max_unshipped:
            # Backups fall behind (slow peers, busy network): skip this round. The next
            # delta holds both periods' changes; the chain never grows unbounded.
            hit = False
            self.deferred += 1
        self._decided = (epoch, hit)
        return last or hit

    def _delta_next(self, s: int) -> bool:
        sch = self.schedule
        if sch.last_epoch.get(s, -1) < 0:
            return False
        return self.full_every == 0 or sch.since_full.get(s, 0) + 1 < self.full_every

    def after_epoch(self, epoch: int, last: bool = False, carry: CarryOutputs | None = None) -> dict[int, list[bytes]]:
        """Capture every local slice if ``epoch`` ends a period; return the checkpoints ready to ship.

        Returns peer -> encoded checkpoints: with ``async_encode``, those of
        earlier rounds whose encoding has finished (all of them, waiting,
        when ``last``); otherwise this round's. ``carry`` gives the outputs
        each checkpoint carries (see ``slices.checkpoint.CarriedOutputs``);
        their frame follows the checkpoint's.
        """
        if self.due(epoch, last):
            self._last_round_at = time.monotonic()
            t0 = time.perf_counter()
            captured = self._capture_round(epoch, carry)
            capture_s = time.perf_counter() - t0
            if captured:
                if self._pool is None:
                    self._pending.append(_done(_encode_round(captured, capture_s)))
                else:
                    while len(self._pending) >= self.max_pending:  # backpressure: encoding fell behind
                        self._encoded.append(self._pending.popleft().result())
                    self._pending.append(self._pool.submit(_encode_round, captured, capture_s))
        return self.ready(wait=last)

    def _capture_round(self, epoch: int, carry: CarryOutputs | None) -> list[Captured]:
        sch = self.schedule
        captured = []
        for s, rt in self.slices.items():
            peers = self.backup_peers.get(s, [])
            if not peers:
                continue
            prev = sch.last_epoch.get(s, -1)
            delta = self._delta_next(s)
            ckpt = capture(rt, delta=delta, prev_epoch=prev, epoch=epoch)
            carried = carry(s, not delta, ckpt.epoch, prev) if carry is not None else None
            # A slice restored from a newer checkpoint than ``epoch`` is captured
            # at its own epoch; the next delta must name that one.
            sch.last_epoch[s] = ckpt.epoch
            sch.since_full[s] = sch.since_full.get(s, 0) + 1 if delta else 0
            self.taken += 1
            self.full_taken += not delta
            seed = self._seeds.pop(s, [])
            if seed:
                self.seeded += 1
                self.seed_bytes += sum(len(f) for f in seed)
            log.debug("checkpoint %s: %s -> peers %s%s", ckpt.describe(), CheckpointPhase.CAPTURE.value, peers,
                      f" after {len(seed)} seed frames" if seed else "")
            captured.append((ckpt, carried, list(peers), seed))
        return captured

    def ready(self, wait: bool = False) -> dict[int, list[bytes]]:
        """Encoded checkpoints whose rounds are done (all of them with ``wait``), by peer, in capture order."""
        out: dict[int, list[bytes]] = {}
        rounds, self._encoded = self._encoded, []  # (older than every pending round)
        while self._pending and (wait or self._pending[0].done()):
            rounds.append(self._pending.popleft().result())
        for blobs, seconds, round_s, nbytes in rounds:
            self.encode_s += seconds
            self.round_seconds.observe(round_s)
            self.round_bytes.observe(nbytes)
            for peer, data in blobs:
                self.bytes_out += len(data)
                out.setdefault(peer, []).append(data)
        return out

    @property
    def pending(self) -> int:
        """Checkpoint rounds captured but not yet handed out for shipping."""
        return len(self._pending) + len(self._encoded)

    def close(self) -> None:
        """Stop the encoding thread (pending rounds are dropped: a dying container's are lost anyway)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _done(value: object) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _encode_round(captured: list[Captured], capture_s: float = 0.0) -> EncodedRound:
    """ENCODE phase of one round: bytes per peer (seed frames, checkpoint frame, then its carried outputs)."""
    t0 = time.perf_counter()
    blobs: list[tuple[int, bytes]] = []
    nbytes = 0
    for ckpt, carried, peers, seed in captured:
        log.debug("checkpoint %s: %s", ckpt.describe(), CheckpointPhase.ENCODE.value)
        data = encode(ckpt)
        extra = encode_outputs(carried) if carried is not None else None
        for p in peers:
            blobs.extend((p, f) for f in seed)
            blobs.append((p, data))
            if extra is not None:
                blobs.append((p, extra))
        size = len(data) + (len(extra) if extra is not None else 0)
        nbytes += size
        log.debug("checkpoint %s: %s (%d bytes per peer)", ckpt.describe(), CheckpointPhase.SHIP.value, size)
    seconds = time.perf_counter() - t0
    return blobs, seconds, capture_s + seconds, nbytes
