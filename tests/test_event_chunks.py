"""Specification of a per-event loop's chunks (slices/slice.py ``EVENT_CHUNK``).

A per-event operator's rows become dicts a chunk at a time, and what it
produces on an output with a declared schema is built into a table each
time a chunk's worth waits (``OperatorContext.seal``; a slice group seals
several slices' events together). None of that may show in the output: a
job's sinks and dead letters equal the serial run's row for row, with any
chunk size, one slice or a group, grouped or each slice alone, outputs
declared or inferred, an event raising midway.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import chronostream as cs
import chronostream.slices.group
import chronostream.slices.slice
from chronostream.slices.operators import OperatorContext
from chronostream.containers.core import ContainerCore

SCHEMA = pa.schema([("w", pa.string()), ("total", pa.int64())])


class OddTally(cs.Operator):
    """Per event: the key's running total of ``v`` on ``out`` (twice when odd), and odd totals
    again on ``odd`` (schema never declared); a total divisible by 7 raises after the state
    took it (a dead letter: what the event produced before raising is dropped)."""

    def setup(self) -> None:
        self.totals = self.register_state("totals")

    def consume(self, stream_id: str, event: dict) -> None:
        total = self.totals.get(event["w"], 0) + event["v"]
        self.totals.set(event["w"], total)
        for _ in range(1 + total % 2):
            self.produce("out", {"w": event["w"], "total": total})
        if total % 7 == 0:
            raise ValueError(f"total {total} of {event['w']!r}")
        if total % 2:
            self.produce("odd", {"w": event["w"], "total": total})


def tally_job(n_slices: int, declared: bool, n: int = 3000, epoch: int = 700) -> cs.Query:
    rng = np.random.default_rng(11)
    words = [f"w{i}" for i in rng.zipf(1.3, n) % 200]
    q = cs.Query(epoch_events=epoch)
    out = q.source("s", pa.table({"w": words, "v": rng.integers(1, 5, n)}), slices=1).key_by("w") \
        .apply(OddTally, outputs=("out", "odd"), slices=n_slices, name="tally",
               output_schemas={"out": SCHEMA} if declared else None)
    out["out"].sink(name="out")
    out["odd"].sink(name="odd")
    q.dead_letters()
    return q


def rows(job: cs.Job) -> dict[str, list[dict]]:
    return {name: job.results(name).to_pylist() for name in ("out", "odd")} | \
        {"dead": job.dead_letters().select(["order", "sub", "slice"]).to_pylist()}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 5 rows: a 700-event epoch seals and converts many times over."""
    monkeypatch.setattr(chronostream.slices.slice, "EVENT_CHUNK", 5)
    monkeypatch.setattr(chronostream.slices.group, "EVENT_CHUNK", 5)


@pytest.fixture
def seals(monkeypatch) -> list[int]:
    """The number of contexts of every seal that built a table (a probe: the chunked path must
    run); a slice's own seal counts 1."""
    made: list[int] = []
    real_together, real_seal = OperatorContext.seal_together, OperatorContext.seal

    def together(ctxs, schemas):
        if any(c.unsealed_rows() for c in ctxs):
            made.append(len(ctxs))
        return real_together(ctxs, schemas)

    def seal(self, schemas):
        before = self.unsealed_rows()
        real_seal(self, schemas)
        if self.unsealed_rows() < before:
            made.append(1)
    monkeypatch.setattr(OperatorContext, "seal_together", staticmethod(together))
    monkeypatch.setattr(OperatorContext, "seal", seal)
    return made


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("n_slices", [1, 6])
def test_outputs_built_a_chunk_at_a_time_equal_the_serial_run(small_chunks, seals, monkeypatch, n_slices, grouped):
    monkeypatch.setattr(ContainerCore, "GROUP_SLICES", grouped)
    want = rows(cs.run(tally_job(n_slices, declared=True), executor="serial"))
    got = rows(cs.run(tally_job(n_slices, declared=True), executor="local", containers=2))
    assert got == want
    assert len(want["out"]) > 3000 and len(want["odd"]) > 500 and len(want["dead"]) > 20
    assert len(seals) > 100  # sealed mid-epoch, not only at its end


def test_a_group_seals_several_slices_events_in_one_table(small_chunks, seals):
    """With 600 slices' worth of rows in 40 slices, a seal spans several slices' events."""
    want = rows(cs.run(tally_job(40, declared=True, n=2000, epoch=1000), executor="serial"))
    got = rows(cs.run(tally_job(40, declared=True, n=2000, epoch=1000), executor="local", containers=1))
    assert got == want
    assert max(seals) > 1


@pytest.mark.parametrize("grouped", [True, False])
def test_undeclared_outputs_built_a_chunk_at_a_time_equal_the_serial_run(small_chunks, seals, monkeypatch, grouped):
    monkeypatch.setattr(ContainerCore, "GROUP_SLICES", grouped)
    want = rows(cs.run(tally_job(6, declared=False), executor="serial"))
    got = rows(cs.run(tally_job(6, declared=False), executor="local", containers=1))
    assert got == want
    assert len(seals) > 100


def test_a_group_never_infers_one_table_for_several_slices(small_chunks, seals):
    """Arrow infers an undeclared output's types from one slice's rows (as alone): a group
    seals them slice by slice."""
    want = rows(cs.run(tally_job(40, declared=False, n=2000, epoch=1000), executor="serial"))
    got = rows(cs.run(tally_job(40, declared=False, n=2000, epoch=1000), executor="local", containers=1))
    assert got == want
    assert seals and max(seals) == 1


def test_pieces_inferred_alike_are_joined_and_pieces_inferred_apart_are_inferred_again_whole():
    """An int, then a float: chunk by chunk Arrow infers int64 and double; from every event at
    once, double, which the output gets, as without chunks."""
    ctx = OperatorContext("s", 0, ("out",))
    for i, x in enumerate([1, 2, 3.5]):
        ctx.begin_event(i, 0)
        ctx.produce("out", {"x": x})
        ctx.seal({"out": None})
    table = ctx.take_outputs({"out": None})["out"]
    assert table.schema.field("x").type == pa.float64() and table["x"].to_pylist() == [1.0, 2.0, 3.5]
    for i, x in enumerate([1, 2, 3]):
        ctx.begin_event(i, 0)
        ctx.produce("out", {"x": x})
        ctx.seal({"out": None})
    assert len(ctx.sealed["out"]) == 3
    table = ctx.take_outputs({"out": None})["out"]
    assert table.schema.field("x").type == pa.int64() and table["x"].to_pylist() == [1, 2, 3]


def test_sealed_rows_come_before_later_events_in_take_outputs():
    ctx = OperatorContext("s", 0, ("out",))
    schema = pa.schema([("x", pa.int64())])
    for x in range(3):
        ctx.begin_event(x, 0)
        ctx.produce("out", {"x": x})
        if x == 1:
            ctx.seal({"out": schema})
    table = ctx.take_outputs({"out": schema})["out"]
    assert table["x"].to_pylist() == [0, 1, 2] and table["_order"].to_pylist() == [0, 1, 2]
    assert ctx.sealed["out"] == [] and ctx.events["out"] == []


def test_mixing_batches_with_sealed_events_is_refused_as_with_events():
    ctx = OperatorContext("s", 0, ("out",))
    schema = pa.schema([("x", pa.int64())])
    ctx.produce("out", {"x": 1})
    ctx.seal({"out": schema})
    ctx.produce_batch("out", pa.table({"x": [2], "_order": [0], "_sub": [0]}))
    with pytest.raises(ValueError, match="mixed produce"):
        ctx.take_outputs({"out": schema})


def test_settling_an_undeclared_output_keeps_one_table_as_take_outputs_builds_it_and_drops_its_events():
    """A group settles each slice's undeclared outputs after its loop: an int piece, a float
    piece with a column more and a waiting event become the one table ``take_outputs`` would
    build (inferred from every event), and
    the events it was inferred from are let go; a declared output is left to ``seal_together``."""
    declared = pa.schema([("y", pa.int64())])
    schemas = {"out": None, "dec": declared}
    ctx = OperatorContext("s", 0, ("out", "dec"))
    for i, event in enumerate([{"x": 1}, {"x": 2.5, "z": 1}, {"x": 3}]):
        ctx.begin_event(i, 0)
        ctx.produce("out", event)
        ctx.produce("dec", {"y": i})
        if i < 2:
            ctx.seal(schemas)  # pieces: int64, then double; 3 still waits
    ctx.settle_inferred(schemas)
    assert len(ctx.sealed["out"]) == 1 and ctx.events["out"] == [] and ctx._raw["out"] == []
    assert len(ctx.sealed["dec"]) == 2 and len(ctx.events["dec"]) == 1  # untouched
    out = ctx.take_outputs(schemas)
    # From all events at once: the first event's columns (z dropped), x a double.
    assert out["out"].schema.names == ["x", "_order", "_sub"] and out["out"].schema.field("x").type == pa.float64()
    assert out["out"]["x"].to_pylist() == [1.0, 2.5, 3.0] and out["out"]["_order"].to_pylist() == [0, 1, 2]
    assert out["dec"]["y"].to_pylist() == [0, 1, 2]


def test_events_after_a_settle_that_infer_other_types_are_refused_not_dropped():
    """Settling lets the events go; a later piece of other types could only be inferred again
    without them, losing rows: refused with the stage, slice and output named."""
    ctx = OperatorContext("s", 3, ("out",))
    ctx.begin_event(0, 0)
    ctx.produce("out", {"x": 1})
    ctx.settle_inferred({"out": None})
    ctx.begin_event(1, 0)
    ctx.produce("out", {"x": 2})  # same types: joined
    assert ctx._built("out", None)["x"].to_pylist() == [1, 2]
    ctx.produce("out", {"x": 2.5})
    ctx.seal({"out": None})
    with pytest.raises(RuntimeError, match=r"stage 's' slice 3: output 'out' got events after it was settled"):
        ctx.take_outputs({"out": None})
