"""Owns one slice's progress vector and the dedup it implies. Knows no Ray.

The progress vector maps each input channel (physical stream, producer
slice) to the highest ``out_seq`` this slice has consumed from it. Anything
at or below it is a duplicate (a replay, a dual-mode copy, a re-delivered
message) and is dropped: first write wins. Stored as one int64 array per
stream indexed by producer slice, so admitting a batch is a few numpy ops
whatever the number of channels.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from chronostream.slices.types import SEQ, SLICE

Channel = tuple[int, int]  # (stream id, producer slice)


class ProgressVector:
    """Per-channel highest consumed ``out_seq``; invariant: values only grow.

    >>> pv = ProgressVector()
    >>> t = pa.table({"_slice": [0, 0, 1], "_seq": [0, 1, 0]})
    >>> pv.admit(7, t).num_rows, pv.admit(7, t).num_rows
    (3, 0)
    >>> pv.admit(7, pa.table({"_slice": [0, 0, 1], "_seq": [1, 2, 1]}))["_seq"].to_pylist()
    [2, 1]
    >>> pv.get((7, 0))
    2
    """

    __slots__ = ("consumed",)

    def __init__(self, consumed: dict[int, np.ndarray] | None = None) -> None:
        # stream id -> highest consumed out_seq per producer slice (-1 = none)
        self.consumed: dict[int, np.ndarray] = {k: v.copy() for k, v in (consumed or {}).items()}

    def get(self, channel: Channel) -> int:
        """Highest consumed out_seq on ``channel`` (-1 when none)."""
        arr = self.consumed.get(channel[0])
        if arr is None or channel[1] >= len(arr):
            return -1
        return int(arr[channel[1]])

    def array(self, stream_id: int, size: int) -> np.ndarray:
        """The live array of ``stream_id`` (highest consumed out_seq per producer slice, -1 for
        none), grown to at least ``size``: a slice group admits against many slices' arrays at
        once (``slices.group``) and writes the result back into them."""
        arr = self.consumed.get(stream_id)
        if arr is None or len(arr) < size:
            grown = np.full(max(size, 1), -1, dtype=np.int64)
            if arr is not None:
                grown[: len(arr)] = arr
            self.consumed[stream_id] = arr = grown
        return arr

    def admit(self, stream_id: int, table: pa.Table) -> pa.Table:
        """Return the rows of ``table`` not yet consumed and advance the vector.

        ``table`` may mix producer slices; within one producer slice its rows
        must be in increasing out_seq (a producer numbers them in order).
        """
        n = table.num_rows
        if n == 0:
            return table
        prod = np.asarray(table.column(SLICE), dtype=np.int64)
        seq = np.asarray(table.column(SEQ), dtype=np.int64)
        arr = self.array(stream_id, int(prod.max()) + 1)
        keep = seq > arr[prod]
        np.maximum.at(arr, prod, seq)
        if keep.all():
            return table
        return table.filter(pa.array(keep))

    def copy(self) -> "ProgressVector":
        """An independent copy (for checkpoint headers)."""
        return ProgressVector(self.consumed)

    def as_dict(self) -> dict[str, int]:
        """Plain-data form ("stream:slice" -> out_seq) for msgpack and logs."""
        return {f"{s}:{p}": int(v) for s, arr in sorted(self.consumed.items())
                for p, v in enumerate(arr) if v >= 0}
