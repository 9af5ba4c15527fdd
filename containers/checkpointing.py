"""Owns when a container checkpoints its slices and where the bytes go (chained backups).

Every ``every_epochs`` epochs (and after the last one) each local slice is
captured: a full checkpoint first and then every ``full_every``-th time, a
delta of what changed in between otherwise. The encoded checkpoints are
returned grouped by the peer containers that back the slice up (the chain
computed by ``master.backups``); the actor shell sends them. Capture is
synchronous and proportional to what changed (dirty keys, dirty slots);
encoding happens right after, before the next epoch. Knows no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from slices.checkpoint import CarriedOutputs, capture, encode, encode_outputs
from slices.slice import SliceRuntime

#: (slice, full, checkpoint epoch, previous checkpoint epoch) -> the outputs to carry, or None.
CarryOutputs = Callable[[int, bool, int, int], "CarriedOutputs | None"]


@dataclass
class CheckpointSchedule:
    """Per-slice bookkeeping: last checkpoint epoch and deltas since the last full one."""

    last_epoch: dict[int, int] = field(default_factory=dict)
    since_full: dict[int, int] = field(default_factory=dict)


class SliceCheckpointer:
    """Takes a container's slice checkpoints at epoch boundaries and addresses them to backups."""

    def __init__(self, slices: dict[int, SliceRuntime], backup_peers: dict[int, list[int]],
                 every_epochs: int, full_every: int = 8) -> None:
        if every_epochs < 1:
            raise ValueError("every_epochs must be >= 1")
        self.slices = slices
        self.backup_peers = backup_peers
        self.every_epochs = every_epochs
        self.full_every = max(1, full_every)
        self.schedule = CheckpointSchedule()
        self.taken = 0
        self.bytes_out = 0

    def retarget(self, backup_peers: dict[int, list[int]]) -> None:
        """New backup peers (placement changed): every slice's next checkpoint is a full one,
        because the new peers hold no chain to apply a delta to."""
        self.backup_peers = backup_peers
        self.schedule.since_full.clear()
        self.schedule.last_epoch.clear()

    def due(self, epoch: int, last: bool) -> bool:
        """True when the end of ``epoch`` is a checkpoint boundary."""
        return last or (epoch + 1) % self.every_epochs == 0

    def after_epoch(self, epoch: int, last: bool = False, carry: CarryOutputs | None = None) -> dict[int, list[bytes]]:
        """Checkpoint every local slice if ``epoch`` ends a period; return peer -> encoded checkpoints.

        ``carry`` gives the outputs each checkpoint carries (see
        ``slices.checkpoint.CarriedOutputs``); their frame follows the checkpoint's.
        """
        out: dict[int, list[bytes]] = {}
        if not self.due(epoch, last):
            return out
        sch = self.schedule
        for s, rt in self.slices.items():
            peers = self.backup_peers.get(s, [])
            if not peers:
                continue
            prev = sch.last_epoch.get(s, -1)
            delta = prev >= 0 and sch.since_full.get(s, 0) + 1 < self.full_every
            ckpt = capture(rt, delta=delta, prev_epoch=prev, epoch=epoch)
            data = encode(ckpt)
            carried = carry(s, not delta, ckpt.epoch, prev) if carry is not None else None
            # A slice restored from a newer checkpoint than ``epoch`` is captured
            # at its own epoch; the next delta must name that one.
            sch.last_epoch[s] = ckpt.epoch
            sch.since_full[s] = sch.since_full.get(s, 0) + 1 if delta else 0
            self.taken += 1
            self.bytes_out += len(data) * len(peers)
            extra = encode_outputs(carried) if carried is not None else None
            if extra is not None:
                self.bytes_out += len(extra) * len(peers)
            for p in peers:
                out.setdefault(p, []).append(data)
                if extra is not None:
                    out[p].append(extra)
        return out
