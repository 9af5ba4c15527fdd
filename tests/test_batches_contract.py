"""The contract of a ``*_batches`` function (``map_batches``, ``filter_batches``, ``flat_map_batches``), as
docs/guide.md states it.

Covers what the function receives (user columns only, never an empty table), what it must return
and what a wrong return becomes (the same ``EventError`` or dead letter on the serial and the local
executor), the row-by-row retry after a failed call, and the calls that repeat rows (recovery)
or run on several threads of one host. Method: small queries on the serial executor and the
runtime's containers in this process (``executor="local"``, ``LocalCluster``).
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import chronostream as cs
from chronostream.dag import compile_query
from chronostream.master.local import LocalCluster
from chronostream.master.placement import containers_per_stage, initial_placement

EXECUTORS = ["serial", "local"]
SYSTEM = {"_order", "_sub", "_slice", "_seq"}


def rows(n: int = 24) -> list[dict]:
    return [{"id": i, "k": f"k{i % 3}", "v": i} for i in range(n)]


def run(q: cs.Query, executor: str) -> cs.CompletedJob:
    return cs.run(q, executor=executor, containers=2)


def results(q: cs.Query, executor: str, sink: str = "o") -> list[dict]:
    return run(q, executor).results(sink).to_pylist()


# --- what the function receives ----------------------------------------------------------------


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_batches_function_sees_the_user_columns_only_before_and_after_a_stateful_stage(executor):
    """Each of the three kinds gets a table of the stream's user columns: no ``_order``, ``_sub``,
    ``_slice``, ``_seq`` (nor any other name beginning with ``_``), at a source and after an
    aggregate; the sink's rows still carry all four."""
    seen: list[list[str]] = []

    def note(t: pa.Table) -> pa.Table:
        seen.append(t.column_names)
        return t

    q = cs.Query(epoch_events=8)
    s = q.source("s", rows())
    s = s.map_batches(note).filter_batches(lambda t: note(t) and pc.greater_equal(t["v"], 0)) \
        .flat_map_batches(lambda t: (note(t), np.arange(t.num_rows)))
    s.key_by("k").count(slices=3, name="n").map_batches(note).sink(name="o")
    out = results(q, executor)
    assert seen and {tuple(c) for c in seen} == {("id", "k", "v"), ("k", "count")}
    assert len(out) == 24 and SYSTEM <= set(out[0])


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_batches_function_is_never_called_with_an_empty_table(executor):
    """A filter that empties whole batches (every row of the first half) leaves the steps after it
    uncalled for those batches: no call gets zero rows."""
    sizes: list[int] = []

    def counted(t: pa.Table) -> pa.Table:
        sizes.append(t.num_rows)
        return t

    q = cs.Query(epoch_events=4)
    q.source("s", rows()).filter_batches(lambda t: pc.greater_equal(t["id"], 12)).map_batches(counted) \
        .flat_map_batches(lambda t: (counted(t), np.arange(t.num_rows))).sink(name="o")
    assert sorted(r["id"] for r in results(q, executor)) == list(range(12, 24))
    assert sizes and min(sizes) >= 1


# --- what it must return, and a wrong return ---------------------------------------------------


def _wrong(kind: str):
    """A function of ``kind`` whose return is wrong for the row with id 5 only."""
    if kind == "map_batches":
        return lambda t: t.filter(pc.not_equal(t["id"], 5))  # one row fewer
    if kind == "filter_batches":
        return lambda t: pc.cast(pc.not_equal(t["id"], 5), pa.int64()) \
            if 5 in t["id"].to_pylist() else pc.not_equal(t["id"], 5)  # not booleans
    return lambda t: (t, np.where(np.asarray(t["id"]) == 5, t.num_rows, np.arange(t.num_rows)))  # not a row


CAUSES = {"map_batches": "ValueError: map_batches returned 0 rows for 1",
          "filter_batches": "ValueError: filter_batches returned a mask of int64, not of booleans",
          "flat_map_batches": "ValueError: flat_map_batches: parent index 1 is not a row of the batch of 1"}


@pytest.mark.parametrize("kind", sorted(CAUSES))
@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_wrong_return_is_the_events_error_naming_stage_slice_and_order(executor, kind):
    """A return that breaks the contract fails the job with an ``EventError`` for the one event
    whose row breaks it alone (the batch is retried row by row), naming stage, source order and
    the cause, alike on both executors."""
    q = cs.Query(epoch_events=8)
    getattr(q.source("s", rows()), kind)(_wrong(kind)).sink(name="o")
    with pytest.raises(cs.EventError) as err:
        run(q, executor)
    assert (err.value.stage, err.value.order, err.value.cause) == ("s", 5, CAUSES[kind])


@pytest.mark.parametrize("kind", sorted(CAUSES))
@pytest.mark.parametrize("executor", EXECUTORS)
def test_with_dead_letters_a_wrong_return_drops_only_that_event(executor, kind):
    """With ``q.dead_letters()`` the event whose row breaks the contract becomes a dead letter with
    that cause and every other row goes on."""
    q = cs.Query(epoch_events=8)
    q.dead_letters()
    getattr(q.source("s", rows()), kind)(_wrong(kind)).sink(name="o")
    job = run(q, executor)
    dead = job.dead_letters().to_pylist()
    assert [(d["stage"], d["order"], d["error"]) for d in dead] == [("s", 5, CAUSES[kind])]
    assert sorted(r["id"] for r in job.results("o").to_pylist()) == [i for i in range(24) if i != 5]


@pytest.mark.parametrize("mask", [
    pytest.param(lambda t: np.asarray(t["v"]) % 2 == 0, id="numpy"),
    pytest.param(lambda t: [v % 2 == 0 for v in t["v"].to_pylist()], id="list"),
    pytest.param(lambda t: pa.chunked_array([pc.equal(pc.bit_wise_and(t["v"], 1), 0)]), id="chunked"),
    pytest.param(lambda t: pc.equal(pc.bit_wise_and(pc.field("v"), 1), 0), id="expression"),
    pytest.param(lambda t: pa.array([None if v % 2 else True for v in t["v"].to_pylist()], pa.bool_()),
                 id="nulls-drop"),
])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_filter_batches_takes_any_boolean_mask_or_an_expression(executor, mask):
    """A numpy array, a list, a chunked array, an Arrow expression: the same rows kept; a null
    drops its row."""
    q = cs.Query(epoch_events=8)
    q.source("s", rows()).filter_batches(mask).sink(name="o")
    assert sorted(r["id"] for r in results(q, executor)) == list(range(0, 24, 2))


@pytest.mark.parametrize("executor", EXECUTORS)
def test_filter_batches_refuses_a_mask_of_another_length_alike(executor):
    """A mask one value longer than the batch is the event's error on both executors (the serial
    one read its first value only)."""
    q = cs.Query(epoch_events=8)
    q.source("s", rows()).filter_batches(lambda t: np.ones(t.num_rows + 1, dtype=bool)).sink(name="o")
    with pytest.raises(cs.EventError, match="filter_batches returned a mask of 2 values for a batch of 1") as err:
        run(q, executor)
    assert err.value.order == 0


@pytest.mark.parametrize("executor", EXECUTORS)
def test_flat_map_batches_refuses_parent_indices_that_do_not_match_its_rows_alike(executor):
    """One parent index too many is the event's error on both executors (the serial one ignored
    the indices)."""
    q = cs.Query(epoch_events=8)
    q.source("s", rows()).flat_map_batches(lambda t: (t, np.zeros(t.num_rows + 1, np.int64))).sink(name="o")
    with pytest.raises(cs.EventError, match="parent_index needs one value per output row: 2 for 1"):
        run(q, executor)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_flat_map_batches_may_give_a_row_no_outputs_and_numbers_each_rows_outputs(executor):
    """A row may have zero outputs; a row's k-th output gets ``_sub`` k (one fan-out level), its
    parent's ``_order``; a returned ``_order`` column is replaced by the lineage."""
    def repeat(t: pa.Table):
        times = np.asarray(t["v"]) % 3  # 0, 1 or 2 outputs
        parent = np.repeat(np.arange(t.num_rows), times)
        out = t.take(pa.array(parent))
        return out.append_column("_order", pa.array(np.zeros(len(parent), np.int64))), parent

    q = cs.Query(epoch_events=8)
    q.source("s", rows()).flat_map_batches(repeat).sink(name="o")
    got = sorted((r["_order"], r["_sub"], r["id"]) for r in results(q, executor))
    assert got == [(i, k, i) for i in range(24) for k in range(i % 3)]


def test_a_return_wrong_for_the_batch_but_right_row_by_row_costs_a_retry_not_an_error():
    """Parent indices in decreasing order (each row one output, the batch reversed) fail the
    batch's call; the runtime calls the function again on each row alone, where they are right:
    the output equals the serial executor's, and the function ran once more per row."""
    calls: list[int] = []

    def reversed_rows(t: pa.Table):
        calls.append(t.num_rows)
        back = np.arange(t.num_rows)[::-1]
        return t.take(pa.array(back)), back

    def build() -> cs.Query:
        q = cs.Query(epoch_events=24)
        q.source("s", rows(), slices=1).flat_map_batches(reversed_rows).sink(name="o")
        return q

    local = results(build(), "local")
    assert calls == [24] + [1] * 24
    assert local == results(build(), "serial")


# --- calls that repeat rows, and threads ---------------------------------------------------------


def _cluster(q: cs.Query, containers: dict[str, int], **kw) -> LocalCluster:
    plan, sources = compile_query(q)
    return LocalCluster(plan, initial_placement(plan, containers_per_stage(plan, containers)), sources, **kw)


def test_recovery_calls_the_function_again_on_rows_it_already_saw():
    """A host of the counting stage dies mid-stream and is rebuilt from its checkpoint: the
    ``map_batches`` after the count runs again on rows it saw before the kill (so it must be a
    pure function of its rows), and the output equals the serial executor's."""
    seen: list[int] = []

    def tagged(t: pa.Table) -> pa.Table:
        seen.extend(t["count"].to_pylist())
        return t.append_column("twice", pc.multiply(t["count"], 2))

    def build() -> cs.Query:
        q = cs.Query(epoch_events=4)
        q.source("s", rows(60)).key_by("k").count(slices=4, name="n").map_batches(tagged).sink(name="o")
        return q

    cl = _cluster(build(), {"s": 1, "n": 2}, checkpoint_every=2, output_logs=True)
    victim = cl.hosts[cl.placement.containers[cl.stage_id("n")][0]]
    cl.run(kills={6: [victim]})
    assert any(kind == "recovery_end" for _, kind, _ in cl.timeline)
    assert len(seen) > 60, "rows of the epochs since the checkpoint went through the function twice"
    seen.clear()
    assert cl.results("o").to_pylist() == results(build(), "serial")


def test_a_host_with_two_threads_calls_the_function_from_both():
    """A host scaled up to two threads runs its slices' chains on both: the function is called
    from two threads (and may be at the same time); the output equals the serial executor's."""
    threads: set[str] = set()
    lock = threading.Lock()

    def noted(t: pa.Table) -> pa.Table:
        with lock:
            threads.add(threading.current_thread().name)
        return t

    def build() -> cs.Query:
        q = cs.Query(epoch_events=6)
        q.source("s", rows(60)).key_by("k").count(slices=4, name="n").map_batches(noted).sink(name="o")
        return q

    cl = _cluster(build(), {"s": 1, "n": 1})
    (c,) = cl.placement.containers[cl.stage_id("n")]
    cl.run(faults={0: lambda cl: cl.cores[c].set_threads(2)})
    assert len(threads) >= 2, threads
    threads.clear()
    assert cl.results("o").to_pylist() == results(build(), "serial")
