"""Owns the shape of one epoch message: what one container sends one downstream container per epoch.

Routed parts (one per physical stream with rows for the receiver) travel
beside a few control fields, each None when the sender has nothing to say.
The core (``containers.core``) builds and reads messages; the actor shell
and the in-process driver only move them; ``containers.shm_transport``
swaps large parts for files while they travel. Knows no Ray and no slices:
a plain, picklable value (Ray pickles it into every push).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pyarrow as pa

from chronostream.containers.routing import RoutedPart
from chronostream.slices.types import SLICE


@dataclass(slots=True)
class EpochMessage:
    """One container-to-container message of one epoch: routed parts and control fields.

    Every downstream container gets one message per epoch, empty or not (an
    empty one still says the epoch's input from this sender is complete).

    >>> import pickle, numpy as np, pyarrow as pa
    >>> m = EpochMessage({0: (pa.table({"x": [1, 2, 3]}), np.array([0, 1, 1]))}, ingest=12.5)
    >>> m.rows(), m.end, m.ingest
    (3, None, 12.5)
    >>> notice = EpochMessage(end=7)
    >>> notice.parts, notice.rows(), pickle.loads(pickle.dumps(notice)) == notice
    ({}, 0, True)
    """

    #: Stream id -> the part of the stream's rows for the receiver (``route``: rows sorted by
    #: consumer slice, and that slice per row). While a message travels between two hosts on one
    #: node a part may be a ``shm_transport.ShmPart`` instead; the receiver reads it back first.
    parts: dict[int, RoutedPart] = field(default_factory=dict)
    #: The number of epochs of the input, once a followed source log is sealed (None: not known
    #: yet, or a bounded input whose plan knows it). A message with only ``end`` and no parts,
    #: sent at epoch -1, tells a receiver the end without giving it an epoch (``deliver``).
    end: int | None = None
    #: The sender's coverage for this epoch, as (stage id, slice id) pairs: set once the sender
    #: released slices by migration (None: its coverage is the one the master gave the receiver).
    coverage: frozenset[tuple[int, int]] | None = None
    #: Slices of the receiver's stage the sender routes elsewhere from this epoch on (migration:
    #: the receiver releases them before processing the epoch); None when there are none.
    release: tuple[int, ...] | None = None
    #: Wall time (``time.time()``) the epoch's source rows were read, for end-to-end latency at
    #: the sinks; None when unknown (a replayed epoch).
    ingest: float | None = None

    def restricted(self, producer_slices: frozenset[tuple[int, int]]) -> "EpochMessage":
        """This message with only the rows of ``producer_slices`` ((stage id, slice id) pairs of
        the sender's stage), declaring them as its coverage.

        A receiver takes part of a message when another sender already gave it the rest (a
        migration's destination after its source died mid-release: see
        ``ContainerCore._epoch_messages``). Each routed row names its producer slice (``SLICE``).

        >>> m = EpochMessage({0: (pa.table({"_slice": [0, 1, 0], "x": [1, 2, 3]}), np.array([0, 0, 1]))})
        >>> r = m.restricted(frozenset({(5, 0)}))
        >>> r.parts[0][0].column("x").to_pylist(), r.parts[0][1].tolist(), sorted(r.coverage)
        ([1, 3], [0, 1], [(5, 0)])
        """
        keep = np.array(sorted(s for _stage, s in producer_slices), dtype=np.int64)
        parts: dict[int, RoutedPart] = {}
        for sid, (table, dst) in self.parts.items():
            mask = np.isin(np.asarray(table.column(SLICE)), keep)
            if mask.any():
                parts[sid] = (table.filter(pa.array(mask)), dst[mask])
        return replace(self, parts=parts, coverage=frozenset(producer_slices))

    def rows(self) -> int:
        """Rows over all parts (the parts must be read back: no ``ShmPart``)."""
        return sum(table.num_rows for table, _dst in self.parts.values())

    def nbytes(self) -> int:
        """Bytes of the parts' tables (the parts must be read back: no ``ShmPart``)."""
        return sum(table.nbytes for table, _dst in self.parts.values())
