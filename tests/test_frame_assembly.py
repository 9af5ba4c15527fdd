"""A host assembles backup frames shipped in pieces, and drops those whose sender went silent."""

from __future__ import annotations

import numpy as np
import pytest

from chronostream.containers.frame_assembly import FrameAssembly


def send(assembly: FrameAssembly, token, frame: np.ndarray, piece: int, now: float):
    """Every piece of ``frame`` in order; what ``filled`` returned after the last one."""
    whole = None
    for at in range(0, len(frame), piece):
        part = frame[at:at + piece]
        assembly.buffer_for(token, at, len(frame), now)[at:at + len(part)] = part
        whole = assembly.filled(token, at + len(part), now)
        assert (whole is None) == (at + len(part) < len(frame))
    return whole


def test_two_senders_frames_interleaved_come_out_whole_and_are_forgotten():
    a = FrameAssembly()
    f1, f2 = np.arange(10, dtype=np.uint8), np.arange(100, 107, dtype=np.uint8)
    a.buffer_for((1, 1), 0, 10, 0.0)[:4] = f1[:4]
    assert a.filled((1, 1), 4, 0.0) is None
    assert send(a, (2, 1), f2, 3, 0.5).tolist() == f2.tolist()
    a.buffer_for((1, 1), 4, 10, 1.0)[4:] = f1[4:]
    assert a.filled((1, 1), 10, 1.0).tolist() == f1.tolist()
    assert len(a) == 0


def test_a_frame_without_a_piece_for_idle_s_is_dropped_when_another_piece_arrives():
    a = FrameAssembly(idle_s=10.0)
    a.buffer_for((1, 7), 0, 8, now=0.0)
    a.filled((1, 7), 4, now=0.0)
    a.buffer_for((2, 1), 0, 8, now=5.0)  # within idle_s: both kept
    assert len(a) == 2 and a.dropped == 0
    a.buffer_for((2, 1), 4, 8, now=10.5)  # (1, 7) silent for 10.5 s: dropped
    assert len(a) == 1 and a.dropped == 1
    with pytest.raises(ValueError, match=r"piece at 4 of backup frame \(1, 7\)"):
        a.buffer_for((1, 7), 4, 8, now=11.0)


def test_a_piece_of_a_frame_never_begun_or_of_another_size_is_refused():
    a = FrameAssembly()
    with pytest.raises(ValueError, match="whose first piece never came"):
        a.buffer_for((3, 1), 64, 128, now=0.0)
    a.buffer_for((3, 2), 0, 128, now=0.0)
    with pytest.raises(ValueError, match=r"is 128 bytes, a piece says 256"):
        a.buffer_for((3, 2), 64, 256, now=0.0)
