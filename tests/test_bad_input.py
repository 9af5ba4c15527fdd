"""Bad input: a clear error naming stage, slice and source order; or a dead letter, losing nothing.

Covers a row that breaks the declared schema, a key function that raises,
an operator that raises, and a vectorized transform that raises, on the
serial executor, the in-process runtime and Ray.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

import chronostream as cs

SCHEMA = pa.schema([("user", pa.string()), ("amount", pa.int64())])


def rows_with_poison() -> list[dict]:
    rows = [{"user": f"u{i % 7}", "amount": i} for i in range(200)]
    rows[57] = {"user": "u1", "amount": "not a number"}
    return rows


class Fussy(cs.Operator):
    """Raises on amount 113, sums otherwise."""

    def setup(self) -> None:
        self.total = self.register_state("total")

    def consume(self, stream_id: str, event: dict) -> None:
        if event["amount"] == 113:
            raise ValueError("113 is unlucky")
        t = self.total.get(event["user"], 0) + event["amount"]
        self.total.set(event["user"], t)
        self.produce("out", {"user": event["user"], "total": t})


def good_rows() -> list[dict]:
    return [{"user": f"u{i % 7}", "amount": i} for i in range(200)]


def test_schema_violation_names_source_and_row():
    """A source row that breaks the declared schema fails the build, naming source and row."""
    q = cs.Query()
    with pytest.raises(cs.EventError) as err:
        q.source("payments", rows_with_poison(), schema=SCHEMA)
    assert err.value.stage == "payments"
    assert err.value.order == 57
    assert "not a number" in str(err.value)


def test_schema_violation_goes_to_dead_letters_and_the_rest_is_processed():
    """With a dead-letter sink the bad row is kept there and every other row is processed."""
    q = cs.Query()
    q.dead_letters()
    q.source("payments", rows_with_poison(), schema=SCHEMA).key_by("user").sum("amount", slices=3).sink(name="s")
    job = cs.run(q, executor="local", containers=2)
    dead = job.dead_letters().to_pylist()
    assert [d["source_row"] for d in dead] == [57]
    assert job.results("s").num_rows == 199


@pytest.mark.parametrize("executor", ["serial", "local"])
def test_key_function_error_names_stage_slice_and_order(executor):
    """A key function that raises fails the job with stage, slice and the event's source order."""
    q = cs.Query()
    src = q.source("payments", good_rows(), slices=2)
    src.key_by(lambda e: 1 // (e["amount"] - 42)).count(slices=3).sink(name="c")
    with pytest.raises(cs.EventError) as err:
        cs.run(q, executor=executor, containers=2)
    assert err.value.stage == "payments"
    assert err.value.slice_id == 42 % 2
    assert err.value.order == 42
    assert "ZeroDivisionError" in str(err.value)


@pytest.mark.parametrize("executor", ["serial", "local"])
def test_operator_error_names_stage_slice_and_order(executor):
    """An operator that raises fails the job naming its stage, its slice and the source order."""
    q = cs.Query()
    q.source("payments", good_rows()).key_by("user").apply(Fussy, slices=5, name="fussy").sink(name="t")
    with pytest.raises(cs.EventError) as err:
        cs.run(q, executor=executor, containers=2)
    assert err.value.stage == "fussy"
    assert err.value.order == 113
    assert err.value.slice_id == cs.slice_of([pa.array(["u1"])], 5)[0]  # 113 % 7 == 1
    assert "113 is unlucky" in str(err.value)


def test_operator_error_on_ray_fails_the_job_with_the_event_error(ray_session):
    """On Ray the job fails and wait() raises JobFailed carrying the EventError."""
    q = cs.Query(epoch_events=50)
    q.source("payments", good_rows()).key_by("user").apply(Fussy, slices=5, name="fussy").sink(name="t")
    job = cs.run(q, containers=2)
    try:
        with pytest.raises(cs.JobFailed) as err:
            job.wait(timeout_s=60)
        cause = err.value.error
        assert isinstance(cause, cs.EventError)
        assert (cause.stage, cause.order) == ("fussy", 113)
    finally:
        job.stop()


def _dead_letter_query() -> cs.Query:
    q = cs.Query(epoch_events=50)
    q.dead_letters()
    q.source("payments", good_rows()).key_by("user").apply(Fussy, slices=5, name="fussy").sink(name="t")
    return q


def test_operator_error_routes_to_dead_letters_and_nothing_else_is_lost(ray_session):
    """Dead-letter mode on Ray: the poison event is a dead letter; every other event has its output."""
    serial = cs.run(_dead_letter_query(), executor="serial")
    job = cs.run(_dead_letter_query(), containers=2)
    try:
        got = job.results("t")
        dead = job.dead_letters().to_pylist()
    finally:
        job.stop()
    assert [(d["stage"], d["order"]) for d in dead] == [("fussy", 113)]
    assert "113 is unlucky" in dead[0]["error"]
    assert got.num_rows == 199
    assert got.to_pylist() == serial.results("t").to_pylist()


def test_vectorized_transform_error_isolates_the_poison_row():
    """A raising vectorized transform is retried row by row: only the bad row is a dead letter."""
    import pyarrow.compute as pc

    def checked(t: pa.Table) -> pa.Table:
        if pc.any(pc.equal(t["amount"], 99)).as_py():
            raise RuntimeError("99 rejected")
        return t

    q = cs.Query(epoch_events=40)
    q.dead_letters()
    q.source("payments", good_rows()).map_batches(checked).key_by("user").count(slices=3).sink(name="c")
    local = cs.run(q, executor="local", containers=2)
    dead = local.dead_letters().to_pylist()
    assert [d["order"] for d in dead] == [99]
    assert local.results("c").num_rows == 199


def test_missing_key_column_is_a_clear_error():
    """Keying by a column the stream does not have names the stream, when the query is built."""
    q = cs.Query()
    with pytest.raises(cs.QueryError, match="'nope'.*'payments'"):
        q.source("payments", good_rows()).key_by("nope")


class HalfThenFail(cs.Operator):
    """Vectorized: produces its batch, then raises if the batch holds amount 77."""

    def consume_batch(self, stream_id: str, batch: pa.Table) -> None:
        import pyarrow.compute as pc

        self.produce_batch("out", batch.select(["user", "_order", "_sub"]))
        if pc.any(pc.equal(batch["amount"], 77)).as_py():
            raise ValueError("77")


def test_failed_vectorized_call_keeps_none_of_its_outputs():
    """A consume_batch that raised after producing leaves no output behind; the retry produces once."""
    def build() -> cs.Query:
        q = cs.Query(epoch_events=50)
        q.dead_letters()
        q.source("p", good_rows()).key_by("user").apply(HalfThenFail, slices=2, name="h").sink(name="o")
        return q
    local = cs.run(build(), executor="local", containers=2)
    serial = cs.run(build(), executor="serial")
    assert local.results("o").num_rows == 199
    assert local.results("o").to_pylist() == serial.results("o").to_pylist()
    assert [d["order"] for d in local.dead_letters().to_pylist()] == [77]


def _two_stage_poison_query(dead_letter_sink) -> cs.Query:
    """Row 150 fails a vectorized transform of the source stage and row 113 the ``fussy`` stage
    downstream, both in epoch 0 and both in slice 0 of their stage."""
    import pyarrow.compute as pc

    def checked(t: pa.Table) -> pa.Table:
        if pc.any(pc.equal(t["amount"], 150)).as_py():
            raise RuntimeError("150 rejected")
        return t

    q = cs.Query(epoch_events=500)
    q.dead_letters(dead_letter_sink)
    q.source("payments", good_rows(), slices=1).map_batches(checked).key_by("user") \
        .apply(Fussy, slices=1, name="fussy").sink(name="t")
    return q


def _poison(dead: pa.Table) -> list[tuple]:
    return [(d["stage"], d["order"], d["error"]) for d in dead.to_pylist()]


def test_a_parquet_dead_letter_sink_is_read_back_by_dead_letters(tmp_path):
    """Dead letters written to a ParquetSink come back from ``job.dead_letters()``, every stage's
    (two stages refusing a row in the same slice id and epoch do not overwrite each other's file),
    sorted by source order, as the serial executor lists them."""
    serial = cs.run(_two_stage_poison_query(cs.ParquetSink(str(tmp_path / "serial"), name="dl")), executor="serial")
    local = cs.run(_two_stage_poison_query(cs.ParquetSink(str(tmp_path / "local"), name="dl")),
                   executor="local", containers=1)
    want = _poison(serial.dead_letters())
    assert [(stage, order) for stage, order, _ in want] == [("fussy", 113), ("payments", 150)]
    assert _poison(local.dead_letters()) == want
    assert len(list((tmp_path / "local").glob("stage=*/slice=*/epoch-*.parquet"))) == 2


def test_dead_letters_come_back_sorted_by_source_order_from_a_memory_sink():
    """Containers write dead letters as they meet them (here the source stage's container, with
    the later row, first); ``dead_letters()`` sorts them by source order (then sub-order, stage,
    slice), as the serial executor lists them."""
    serial = cs.run(_two_stage_poison_query(None), executor="serial")
    local = cs.run(_two_stage_poison_query(None), executor="local", containers=2)
    assert _poison(local.dead_letters()) == _poison(serial.dead_letters())


def test_a_parquet_dead_letter_sink_is_read_back_on_ray(ray_session, tmp_path):
    """The same on Ray: the containers write the files, ``Job.dead_letters()`` reads them back."""
    serial = cs.run(_two_stage_poison_query(cs.ParquetSink(str(tmp_path / "serial"), name="dl")), executor="serial")
    job = cs.run(_two_stage_poison_query(cs.ParquetSink(str(tmp_path / "ray"), name="dl")), containers=1)
    try:
        got = _poison(job.dead_letters())
    finally:
        job.stop()
    assert got == _poison(serial.dead_letters())


def test_memory_sink_dead_letters_of_two_stages_in_one_slice_and_epoch_both_come_back_on_ray(ray_session):
    """Dead-letter parts travel to the master under one sink id per stage: the two stages' parts
    of slice 0, epoch 0 are different rows, and both come back (keyed by (slice, epoch) alone,
    one replaced the other), sorted as the serial executor lists them."""
    serial = cs.run(_two_stage_poison_query(None), executor="serial")
    job = cs.run(_two_stage_poison_query(None), containers=1)
    try:
        got = _poison(job.dead_letters())
    finally:
        job.stop()
    assert got == _poison(serial.dead_letters())
