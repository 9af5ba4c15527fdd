"""Errors a user meets: the project's own (``ChronoStreamError``), named, and raised early.

Covers an unknown stage given to a rescale, ``containers=`` below one, column names a
source's known schema lacks, a ``flat_map_batches`` function with the wrong return, a lone
surrogate in a string, sink names, and the one error a failed Ray job prints.
"""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import chronostream as cs
import chronostream.client as client
from chronostream.client import Job
from chronostream.master.migration import MigrationError, stage_id_of


def payments(n: int = 40) -> list[dict]:
    return [{"card": f"c{i % 5}", "amount": i} for i in range(n)]


# --- rescaling an unknown stage ----------------------------------------------------------


def test_rescaling_an_unknown_stage_names_the_known_stages():
    """Regression (issue 59, errors: unknown stage): ``scale_out``/``scale_in``/``migrate``/
    ``compact`` of a stage the job lacks raise ``QueryError`` naming the job's stages, before
    asking the master (no master here: any call to it would fail otherwise); the master's own
    ``MigrationError`` is a ``ChronoStreamError``."""
    q = cs.Query()
    q.source("pay", payments()).key_by("card").count(slices=2).sink(name="c")
    plan, _ = cs.compile_query(q)
    job = Job(plan, master=None, placement={})
    for call in (lambda: job.scale_out("no-such-stage"), lambda: job.scale_in("no-such-stage"),
                 lambda: job.migrate("no-such-stage", 0), lambda: job.compact("no-such-stage")):
        with pytest.raises(cs.QueryError, match=r"no stage 'no-such-stage'.*\['pay', 'pay.aggregate'\]"):
            call()
    assert issubclass(MigrationError, cs.ChronoStreamError)
    with pytest.raises(cs.ChronoStreamError, match="no-such-stage"):
        stage_id_of(plan, "no-such-stage")


# --- containers= ---------------------------------------------------------------------------


@pytest.mark.parametrize("executor", ["serial", "local", "ray"])
@pytest.mark.parametrize("containers", [0, {"pay.aggregate": 0}])
def test_containers_below_one_is_refused_before_anything_runs(executor, containers, monkeypatch):
    """Regression (issue 59, errors: containers=0): ``containers=0`` (or a stage given 0) is
    refused with a ``QueryError`` by every executor (the serial one ignored it; Ray failed
    remotely after deploy), before Ray is started or joined."""
    def no_ray(*_a, **_k):
        raise AssertionError("Ray was started for a job that should have been refused")

    monkeypatch.setattr(client, "ensure_ray", no_ray)
    q = cs.Query()
    q.source("pay", payments()).key_by("card").count(slices=2).sink(name="c")
    with pytest.raises(cs.QueryError, match="at least 1"):
        cs.run(q, executor=executor, containers=containers)


# --- column names checked against a known schema -------------------------------------------


@pytest.mark.parametrize("build, named", [
    (lambda s: s.key_by("crad"), r"key_by\('crad'\): no column 'crad' in stream 'pay'"),
    (lambda s: s.key_by("card").aggregate(sum=["amonut"]), r"stage 'pay.aggregate': sum='amonut'"),
    (lambda s: s.filter(lambda e: True).key_by("card").mean("amonut", name="m"), r"stage 'm': mean='amonut'"),
    (lambda s: s.key_by("card").window(cs.SlidingWindow(10, time="tss"), count=True, name="w"),
     r"stage 'w': window time='tss'"),
    (lambda s: s.map(lambda e: e, schema=pa.schema([("card", pa.string())])).key_by("card").sum("amount"),
     r"sum='amount'.*its columns are \['card'\]"),
    (lambda s: s.key_by("card").count(name="n").key_by("amount"), r"no column 'amount' in stream 'n'"),
])
def test_unknown_columns_of_a_known_schema_fail_when_the_query_is_built(build, named):
    """Regression (issue 59, errors: unknown column): a column a source's known schema (as
    filters, keyings, a map's ``schema=`` and an aggregate's output carry it) lacks is refused
    while the query is built, with a ``QueryError`` naming stage, column and the columns there
    are; it used to fail after deploy (a bare ``KeyError`` on the serial executor)."""
    q = cs.Query()
    src = q.source("pay", payments())
    with pytest.raises(cs.QueryError, match=named) as err:
        build(src)
    assert "its columns are" in str(err.value)


@pytest.mark.parametrize("executor", ["serial", "local"])
def test_an_unknown_key_column_after_a_map_is_a_query_error_at_run_time(executor):
    """Regression (issue 59, errors: unknown column): where no schema is known at build time (a
    map without ``schema=``), a missing key column is a ``QueryError`` naming the stages and the
    column on every executor (a bare ``KeyError`` on the serial one)."""
    q = cs.Query()
    q.source("pay", payments()).map(lambda e: {"card": e["card"]}).key_by("crad").count(slices=2).sink(name="c")
    with pytest.raises(cs.QueryError, match=r"stage 'pay'.*'crad'"):
        cs.run(q, executor=executor, containers=1)


# --- flat_map_batches' return --------------------------------------------------------------


@pytest.mark.parametrize("executor", ["serial", "local"])
def test_flat_map_batches_returning_a_table_says_what_is_expected(executor):
    """Regression (issue 59, errors: flat_map_batches): a function that returns a table instead
    of ``(table, parent_indices)`` fails with an ``EventError`` naming the stage and saying what
    is expected (it said "not enough values to unpack", or worse)."""
    q = cs.Query()
    q.source("lines", [{"line": "a b"}, {"line": "c"}]).flat_map_batches(
        lambda t: pa.table({"word": pc.list_flatten(pc.utf8_split_whitespace(t["line"]))})).sink(name="w")
    with pytest.raises(cs.EventError, match=r"flat_map_batches function must return \(table, parent_indices\)") \
            as err:
        cs.run(q, executor=executor, containers=1)
    assert err.value.stage == "lines"
    assert "got Table" in str(err.value)


# --- a lone surrogate ----------------------------------------------------------------------


def _surrogate_query(where: str, dead: bool) -> cs.Query:
    q = cs.Query(epoch_events=4)
    if dead:
        q.dead_letters()
    rows = [{"card": c, "amount": i} for i, c in enumerate(["a", "b", "x", "a", "b", "c"])]
    if where == "source":
        rows[2]["card"] = "\ud800"
        s = q.source("pay", rows)
    else:
        s = q.source("pay", rows).map(lambda e: {**e, "card": "\ud800" if e["card"] == "x" else e["card"]})
    s.key_by("card").count(slices=2).sink(name="c")
    return q


@pytest.mark.parametrize("executor", ["serial", "local"])
@pytest.mark.parametrize("where", ["source", "map"])
def test_a_lone_surrogate_is_an_event_error_naming_the_event(executor, where):
    """Regression (issue 59, errors: surrogate): a string holding a lone surrogate (in a source
    row, or made by a map) fails with an ``EventError`` naming stage and order, not a raw
    ``UnicodeEncodeError``."""
    if where == "source":
        with pytest.raises(cs.EventError) as err:
            _surrogate_query(where, dead=False)
    else:
        with pytest.raises(cs.EventError) as err:
            cs.run(_surrogate_query(where, dead=False), executor=executor, containers=1)
    assert err.value.stage == "pay"
    assert err.value.order == 2
    assert "surrogates not allowed" in str(err.value)


@pytest.mark.parametrize("executor", ["serial", "local"])
@pytest.mark.parametrize("where", ["source", "map"])
def test_a_lone_surrogate_goes_to_the_dead_letters(executor, where):
    """Regression (issue 59, errors: surrogate): with a dead-letter sink, the event with a lone
    surrogate is a dead letter and every other event is processed."""
    job = cs.run(_surrogate_query(where, dead=True), executor=executor, containers=1)
    dead = job.dead_letters().to_pylist()
    assert len(dead) == 1
    assert dead[0]["stage"] == "pay"
    assert (dead[0]["source_row"] if where == "source" else dead[0]["order"]) == 2
    assert "surrogates not allowed" in dead[0]["error"]
    assert sorted(job.results("c")["card"].to_pylist()) == ["a", "a", "b", "b", "c"]


class Unstorable(cs.Operator):
    """Produces a lone surrogate for amount 2."""

    def consume(self, stream_id: str, event: dict) -> None:
        self.produce("out", {"card": "\ud800" if event["amount"] == 2 else event["card"]})


@pytest.mark.parametrize("executor", ["serial", "local"])
def test_an_operator_producing_a_lone_surrogate_fails_naming_the_event(executor):
    """Regression (issue 59, errors: surrogate): an operator that produces a string holding a
    lone surrogate fails the job with an ``EventError`` naming its stage and the order of the
    event it derives from (a raw ``UnicodeEncodeError`` before)."""
    q = cs.Query(epoch_events=4)
    q.source("pay", payments(6)).key_by("card").apply(Unstorable, slices=2, name="op").sink(name="c")
    with pytest.raises(cs.EventError, match="cannot be stored") as err:
        cs.run(q, executor=executor, containers=1)
    assert (err.value.stage, err.value.order) == ("op", 2)


# --- sink names ----------------------------------------------------------------------------


def test_two_sinks_of_the_default_name_are_refused_when_added(tmp_path):
    """Regression (issue 59, errors: sink names): two ``ParquetSink``s left at the default name
    ``out`` are refused when the second is added, naming the name and ``name=``."""
    q = cs.Query()
    s = q.source("pay", payments())
    s.sink(cs.ParquetSink(str(tmp_path / "a")))
    with pytest.raises(cs.QueryError, match=r"'out' already exists.*name="):
        s.key_by("card").count(slices=2).sink(cs.ParquetSink(str(tmp_path / "b")))


@pytest.mark.parametrize("executor", ["serial", "local"])
def test_sink_name_names_a_parquet_sink(executor, tmp_path):
    """Regression (issue 59, errors: sink names): ``.sink(ParquetSink(p), name="x")`` names the
    sink ``x`` (``name`` was ignored: the sink stayed ``out``)."""
    q = cs.Query()
    spec = q.source("pay", payments()).key_by("card").count(slices=2).sink(cs.ParquetSink(str(tmp_path)), name="x")
    assert spec.name == "x"
    job = cs.run(q, executor=executor, containers=1)
    assert job.results("x").num_rows == 40


# --- Ray: the error printed once -----------------------------------------------------------


def test_a_failed_ray_job_prints_its_error_once(ray_session, capfd):
    """Regression (issue 59, errors: traceback once): a job failing on a poison event raises
    ``JobFailed`` and the driver's stderr holds no worker traceback (the container logged 45-110
    lines of it); an unknown stage to rescale is refused naming the stages."""
    q = cs.Query(epoch_events=20)
    q.source("pay", payments(200), slices=2).map(
        lambda e: {**e, "r": 1 // (e["amount"] - 150)}).key_by("card").count(slices=2).sink(name="c")
    job = cs.run(q, containers=1)
    try:
        with pytest.raises(cs.QueryError, match=r"no stage 'no-such-stage'.*'pay'"):
            job.scale_out("no-such-stage")
        with pytest.raises(cs.JobFailed, match="source order 150"):
            job.wait(timeout_s=60)
        time.sleep(2.0)  # Ray forwards the workers' stderr to the driver's within about a second
    finally:
        job.stop()
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert "ZeroDivisionError" not in err
