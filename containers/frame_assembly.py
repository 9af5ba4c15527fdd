"""Owns the backup frames a host receives in pieces, until each is whole; knows no Ray.

A shipment above ``JobOptions.ship_piece_bytes`` travels in 64 MB pieces
(``CheckpointShipping.send_in_pieces``); the receiver copies each piece
into the frame's buffer in its own memory. A frame whose sender died half
way would otherwise stay here for the life of the host (up to a slice's
whole state): a frame that got no piece for ``idle_s`` (300 s) is dropped,
with a warning, when the next piece of any frame arrives. A sender still
alive after such a pause gets an error naming the frame for its next
piece (its shipment fails loudly; it is not retried).

    >>> a = FrameAssembly()
    >>> buf = a.buffer_for((1, 1), 0, 4, now=0.0)
    >>> buf[:2] = [7, 8]; a.filled((1, 1), 2, now=0.0) is None
    True
    >>> buf = a.buffer_for((1, 1), 2, 4, now=1.0); buf[2:] = [9, 10]
    >>> a.filled((1, 1), 4, now=1.0).tolist(), len(a)
    ([7, 8, 9, 10], 0)
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("chronostream.container")

Token = tuple[int, int]  # (sender host, frame number at that sender)


class FrameAssembly:
    """Buffers of frames being received in pieces, by token."""

    #: A frame that got no piece for this long is dropped (its sender is taken for dead).
    IDLE_S = 300.0

    def __init__(self, idle_s: float | None = None) -> None:
        self.idle_s = self.IDLE_S if idle_s is None else idle_s
        self._frames: dict[Token, tuple[np.ndarray, float]] = {}  # token -> (buffer, last piece time)
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._frames)

    def buffer_for(self, token: Token, offset: int, total: int, now: float) -> np.ndarray:
        """The whole buffer of frame ``token`` (``total`` bytes), for a piece at ``offset``; a new
        one for a first piece. A later piece of a frame not held (its first piece never came,
        or it was dropped as idle) raises ``ValueError`` naming it. Frames idle past ``idle_s``
        are dropped first."""
        self._drop_idle(now, keep=token)
        held = self._frames.get(token)
        if held is None:
            if offset != 0:
                raise ValueError(f"piece at {offset} of backup frame {token} whose first piece never came"
                                 " (or which was dropped after no piece came for a while)")
            held = (np.empty(total, np.uint8), now)
        elif len(held[0]) != total:
            raise ValueError(f"backup frame {token} is {len(held[0])} bytes, a piece says {total}")
        self._frames[token] = (held[0], now)
        return held[0]

    def filled(self, token: Token, upto: int, now: float) -> np.ndarray | None:
        """Note that frame ``token`` is filled up to ``upto`` bytes: its buffer when that is all of
        it (the frame is then forgotten here), else None."""
        buf, _ = self._frames[token]
        if upto < len(buf):
            self._frames[token] = (buf, now)
            return None
        del self._frames[token]
        return buf

    def _drop_idle(self, now: float, keep: Token) -> None:
        for token, (buf, last) in list(self._frames.items()):
            if token != keep and now - last > self.idle_s:
                del self._frames[token]
                self.dropped += 1
                log.warning("backup frame %s from host %s: no piece for %.0f s, dropped (%.0f MB)",
                            token, token[0], now - last, len(buf) / 1e6)
