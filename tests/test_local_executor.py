"""Specification of the container protocol, run in-process by master.local (no Ray).

The output of a job must not depend on how it is run: the message delivery
order (seeded shuffles), the number of containers per stage, re-delivered
messages, or the epoch size. The serial executor is the oracle: the local
executor's sinks must equal its sinks row for row, including the identity
(_slice, _seq) and lineage (_order, _sub) columns.
"""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import chronostream as cs
from chronostream.dag import compile_query
from chronostream.master.local import collect, run_local
from chronostream.master.placement import containers_per_stage, initial_placement
from queries import QUERIES, orders_and_customers, per_key_sequences

SLICES = 5
SMALL_EPOCH = 29  # several epochs per job, never aligned with the data


def small_join(slices: int) -> cs.Query:
    """Query (d) (queries.keyed_join) on a fifth of the data: orders x customer updates, in event-time order."""
    orders, cust = orders_and_customers(n_orders=180, n_customers=25)
    q = cs.Query()
    o = q.source("orders", orders, order_by="t").key_by("cust")
    c = q.source("customers", cust, order_by="t").key_by("cust")
    cs.join(o, c, slices=slices, name="join").sink(name="joined")
    return q


# name -> (builder taking slices, sinks, key columns)
BUILDERS = {
    "word_count": (lambda s: QUERIES["word_count"][0](s, n_lines=80), *QUERIES["word_count"][1:]),
    "running_sum": (lambda s: QUERIES["running_sum"][0](s, n=150), *QUERIES["running_sum"][1:]),
    "rekey": (lambda s: QUERIES["rekey"][0](s, n_lines=60), *QUERIES["rekey"][1:]),
    "join": (small_join, *QUERIES["join"][1:]),
}


def build(name: str, epoch_events: int = SMALL_EPOCH) -> cs.Query:
    q = BUILDERS[name][0](SLICES)
    q.epoch_events = epoch_events
    return q


_serial: dict = {}


def serial_sinks(name: str) -> dict[str, list[dict]]:
    if name not in _serial:
        res = cs.run_serial(build(name))
        _serial[name] = {s: res.results(s).to_pylist() for s in BUILDERS[name][1]}
    return _serial[name]


def local_run(query: cs.Query, containers, seed: int = 0, duplicate_every: int = 0):
    plan, sources = compile_query(query)
    placement = initial_placement(plan, containers_per_stage(plan, containers))
    cores = run_local(plan, placement, sources, seed=seed, duplicate_every=duplicate_every)
    return plan, cores


def local_sinks(query: cs.Query, containers, seed: int = 0, duplicate_every: int = 0) -> dict[str, list[dict]]:
    plan, cores = local_run(query, containers, seed, duplicate_every)
    return {s.name: collect(plan, cores, s.name).to_pylist() for s in plan.sinks}


@pytest.mark.parametrize("name", sorted(BUILDERS))
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), containers=st.sampled_from([1, 2, 3, 4]),
       duplicate_every=st.sampled_from([0, 2, 3]))
def test_local_output_equals_serial_oracle(name, seed, containers, duplicate_every):
    """Any delivery order, 1-4 containers per stage and re-delivered messages give the oracle's sinks."""
    expected = serial_sinks(name)
    got = local_sinks(build(name), containers, seed, duplicate_every)
    for sink, rows in expected.items():
        assert len(rows) > 0
        assert got[sink] == rows, f"sink {sink} differs"


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), data=st.data())
def test_local_output_equals_oracle_with_different_containers_per_stage(seed, data):
    """Stages may have different container counts (given by stage name); output still equals the oracle."""
    q = build("rekey")
    per_stage = {s.name: data.draw(st.sampled_from([1, 2, 3, 4]), label=s.name) for s in q.stages}
    assert local_sinks(q, per_stage, seed) == serial_sinks("rekey")


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_epoch_size_does_not_change_the_output(name):
    """epoch_events=1 and one epoch for the whole input give identical sinks and per-key sequences."""
    _, sinks, key = BUILDERS[name]
    tiny = local_sinks(build(name, epoch_events=1), 2, seed=3)
    huge = local_sinks(build(name, epoch_events=10**6), 2, seed=3)
    for sink in sinks:
        assert len(huge[sink]) > 0
        assert per_key_sequences(pa.Table.from_pylist(tiny[sink]), key) == \
            per_key_sequences(pa.Table.from_pylist(huge[sink]), key)
        assert tiny[sink] == huge[sink]


def test_duplicate_deliveries_are_dropped_by_the_containers():
    """With duplicate_every=2 some messages really arrive twice, and are dropped, not processed twice."""
    plan, cores = local_run(build("word_count"), 3, seed=1, duplicate_every=2)
    assert sum(c.messages_dropped for c in cores.values()) > 0
    assert collect(plan, cores, "counts").to_pylist() == serial_sinks("word_count")["counts"]


def test_every_container_finishes_every_epoch():
    """After run_local every core is done at the plan's epoch count, with an empty inbox."""
    plan, cores = local_run(build("join"), 3, seed=5)
    assert plan.num_epochs > 1
    assert all(c.done and c.next_epoch == plan.num_epochs and not c.inbox for c in cores.values())


def test_container_counts_are_capped_at_the_slice_count():
    """Asking for more containers than slices places one slice per container, none empty."""
    plan, _ = compile_query(build("word_count"))
    placement = initial_placement(plan, containers_per_stage(plan, 50))
    for st_ in plan.stages:
        ids = placement.containers[st_.stage_id]
        assert len(ids) == st_.num_slices
        assert all(placement.slices_of(c) for c in ids)


def test_local_run_without_output_log_leaves_no_temporary_directory(tmp_path, monkeypatch):
    """run_local (no output log) creates nothing in the temp directory."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    local_run(build("word_count"), 2)
    assert list(tmp_path.iterdir()) == []


def test_a_checkpointing_local_cluster_removes_its_temporary_directory_when_dropped(tmp_path, monkeypatch):
    """Backup stores and output logs live in a directory the cluster made; dropping the cluster
    removes it (a test session runs hundreds of them: they filled /tmp)."""
    import gc
    import tempfile

    from chronostream.master.local import LocalCluster

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    plan, sources = compile_query(build("word_count"))
    placement = initial_placement(plan, containers_per_stage(plan, 2))
    cluster = LocalCluster(plan, placement, sources, checkpoint_every=1).run()
    assert cluster.results("counts").num_rows > 0
    assert [p.name.startswith("chronostream-local-") for p in tmp_path.iterdir()] == [True]
    del cluster
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_cs_run_local_executor_equals_serial_executor():
    """The public cs.run(executor="local") gives the serial executor's sinks, each as one
    contiguous table (as on Ray), not one chunk per (slice, epoch) part."""
    job = cs.run(build("running_sum"), executor="local", containers=2, seed=9)
    for sink, rows in serial_sinks("running_sum").items():
        got = job.results(sink)
        assert got.to_pylist() == rows
        assert {c.num_chunks for c in got.columns} == {1}, sink


# -- keys the oracle and the runtime must route alike -------------------------------------


def count_query(table: pa.Table, key: str, epoch_events: int = 4) -> cs.Query:
    q = cs.Query(epoch_events=epoch_events)
    q.source("src", table).key_by(key).count(slices=5, name="count").sink(name="out")
    return q


def test_integer_key_of_narrow_type_routes_like_the_oracle():
    """An int32 key column (the oracle sees Python ints, i.e. int64) gives the oracle's output."""
    t = pa.table({"k": pa.array([i % 7 for i in range(30)], pa.int32())})
    expected = cs.run_serial(count_query(t, "k")).results("out").to_pylist()
    assert local_sinks(count_query(t, "k"), 2) == {"out": expected}


def test_timestamp_ms_key_gives_the_same_output_on_local_and_serial_executors():
    """A query keyed by a timestamp[ms] column gives identical sinks on both executors."""
    t = pa.table({"t": pa.array([dt.datetime(2024, 1, 1, 0, 0, i % 3) for i in range(9)], pa.timestamp("ms"))})
    expected = cs.run_serial(count_query(t, "t")).results("out").to_pylist()
    assert local_sinks(count_query(t, "t"), 2)["out"] == expected


def test_null_string_key_gives_the_same_output_on_local_and_serial_executors():
    """A query keyed by a string column with nulls runs on both executors with identical sinks."""
    t = pa.table({"k": pa.array(["a", None, "b", None], pa.string())})
    local = local_sinks(count_query(t, "k"), 2)["out"]
    assert [r["count"] for r in local if r["k"] is None] == [1, 2]
    assert local == cs.run_serial(count_query(t, "k")).results("out").to_pylist()


def test_negative_zero_float_key_gives_the_same_output_on_local_and_serial_executors():
    """A float key column holding 0.0 and -0.0 gives identical sinks on both executors."""
    t = pa.table({"x": [0.0, -0.0, 0.0, 1.0]})
    expected = cs.run_serial(count_query(t, "x")).results("out").to_pylist()
    assert local_sinks(count_query(t, "x"), 2)["out"] == expected
