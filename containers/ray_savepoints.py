"""Owns a host's reading of its slices' state for the master: a savepoint's part (freezing a
source between epochs, arming its containers at the savepoint's epoch and handing over their
slices' full checkpoints, encoded: ``ContainerCore.arm_savepoint``) and point queries of live
state (``Job.query_state``: ``slices.state_query``).

The master picks the epoch and writes the files (``master.ray_savepoints``); this module
changes no state of its own and never touches the checkpoint chain or the backups.
"""

from __future__ import annotations

import asyncio
from typing import Any

from chronostream.slices.checkpoint import encode
from chronostream.slices.errors import QueryError, SavepointError
from chronostream.slices.state_query import query_slice

#: The holder a restore from a savepoint names for every slice (no host has this id): the
#: master's ``SavepointReader``, which hands out the savepoint's frames as a backup holder would.
SAVEPOINT_HOLDER = -1


class HostSavepoints:
    """The savepoint calls of one ``ResourceContainer`` (``h``)."""

    def __init__(self, host: Any) -> None:
        self.h = host

    async def freeze(self, container_id: int, on: bool) -> int:
        """Pause (or resume) a hosted container between epochs (a savepoint's cut; the stop-copy
        baseline of ``benchmarks.migration``); returns its next epoch."""
        h = self.h
        async with h.conds[container_id]:
            (h.frozen.add if on else h.frozen.discard)(container_id)
            h.conds[container_id].notify_all()
            return h.cores[container_id].next_epoch

    async def query(self, wanted: dict[int, dict[int, list[tuple]]]) -> dict[int, dict[str, Any]]:
        """Container -> slice -> keys: slice -> ``query_slice``'s answer, each container read
        between two of its epochs (under its condition, which every epoch's step holds)."""
        h, out = self.h, {}
        for c, by_slice in wanted.items():
            if c not in h.cores:
                raise QueryError(f"query_state: container {c} is not on this host any more (it moved); ask again")
            async with h.conds[c]:
                core = h.cores[c]
                for s, keys in by_slice.items():
                    out[s] = query_slice(core.slices[s], keys)
        return out

    async def arm(self, container_ids: list[int], epoch: int) -> dict[int, str]:
        """Arm each hosted container at ``epoch``: container id -> taken / armed / late."""
        h, out = self.h, {}
        for c in container_ids:
            async with h.conds[c]:
                out[c] = h.cores[c].arm_savepoint(epoch)
        return out

    async def frames(self, container_ids: list[int], timeout_s: float
                     ) -> tuple[list[bytes], dict[int, dict[str, str]]]:
        """The encoded full checkpoints of every slice of ``container_ids``, once each container
        has captured them (``SavepointError`` after ``timeout_s``, or when the host stops), and
        stage id -> the kinds of its key-value states (``ContainerCore.state_kinds``)."""
        h = self.h
        frames: list[bytes] = []
        kinds: dict[int, dict[str, str]] = {}
        loop = asyncio.get_running_loop()
        for c in container_ids:
            core, cond = h.cores[c], h.conds[c]
            async with cond:
                try:
                    await asyncio.wait_for(cond.wait_for(
                        lambda: core.savepoint_taken is not None or h.stopped or h.failed is not None), timeout_s)
                except asyncio.TimeoutError:
                    raise SavepointError(f"savepoint: container {c} did not reach epoch {core.savepoint_epoch} "
                                         f"within {timeout_s:g} s (at epoch {core.next_epoch})") from None
                taken = core.take_savepoint()
            if taken is None:
                raise SavepointError(f"savepoint: container {c}'s host stopped before its slices were captured")
            _, checkpoints = taken
            kinds[core.stage.stage_id] = core.state_kinds()
            frames.extend(await loop.run_in_executor(None, lambda cks=checkpoints: [bytes(encode(ck)) for ck in cks]))
        return frames, kinds
