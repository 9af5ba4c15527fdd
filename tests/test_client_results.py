"""Unit tests of ``chronostream.client.Job._read_memory_sink``'s retry: Ray's ``get`` and the
master handle are stand-ins here (the end-to-end behaviour, a real host killed after pointing
the client at its rows, is in tests/test_recovery_ray.py)."""

from __future__ import annotations

import pyarrow as pa
import pytest
import ray
from ray.exceptions import OwnerDiedError

from chronostream.client import Job
from chronostream.containers.sink_parts import pack_sink_parts
from chronostream.master.results import SinkPartRefs

SINK_ID = 0
ROWS = {(1, 0): pa.table({"_slice": [1], "_seq": [0], "x": [10]}),
        (0, 0): pa.table({"_slice": [0], "_seq": [0], "x": [20]})}


class FakeMaster:
    """Answers ``sink_part_refs`` with a ``SinkPartRefs`` whose refs are packs themselves."""

    def __init__(self) -> None:
        self.asked = 0
        self.sink_part_refs = self  # (``master.sink_part_refs.remote(name)``)

    def remote(self, sink_name: str) -> SinkPartRefs:
        self.asked += 1
        return SinkPartRefs([SINK_ID], [pack_sink_parts({SINK_ID: ROWS})], [])


def fake_get(dead_reads: int):
    """``ray.get`` that hands a master answer back as is and fails the first ``dead_reads`` reads of
    parts as a host that died after answering would (its references' owner is gone)."""
    left = [dead_reads]

    def get(what):
        if isinstance(what, SinkPartRefs):
            return what
        if left[0]:
            left[0] -= 1
            raise OwnerDiedError("ab" * 14, None, "")
        return what
    return get


def job_with(master: FakeMaster) -> Job:
    job = Job.__new__(Job)  # (no plan or actors: only the read path runs)
    job.master = master
    return job


def test_a_read_whose_host_died_after_answering_asks_the_master_again(monkeypatch):
    monkeypatch.setattr(ray, "get", fake_get(dead_reads=2))
    master = FakeMaster()
    table = job_with(master)._read_memory_sink("out")
    assert master.asked == 3
    assert table.to_pydict() == {"_slice": [0, 1], "_seq": [0, 0], "x": [20, 10]}


def test_a_read_that_keeps_failing_raises_the_last_error_after_its_attempts(monkeypatch):
    monkeypatch.setattr(ray, "get", fake_get(dead_reads=3))
    master = FakeMaster()
    with pytest.raises(OwnerDiedError):
        job_with(master)._read_memory_sink("out", attempts=3)
    assert master.asked == 3
