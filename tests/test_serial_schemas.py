"""Specification: the serial executor (the oracle) gives vectorized code the schemas the runtime gives it.

The runtime runs a ``*_batches`` transform and a vectorized operator on
tables in the schema of their stream (a source's, a declared one, the table
the step before returned); the serial executor runs them on one row at a
time, and that row must be a table of the same schema, not one inferred from
the row alone (a null would make a null-typed column). Both refuse the same
tables, with the same error.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import chronostream as cs
from chronostream.dag import compile_query
from chronostream.slices.errors import EventError
from chronostream.master.local import collect, run_local
from chronostream.master.placement import containers_per_stage, initial_placement

ROWS = [{"k": i % 3, "v": None if i % 4 == 1 else i} for i in range(14)]


def local(query: cs.Query, containers: int = 2) -> pa.Table:
    plan, sources = compile_query(query)
    cores = run_local(plan, initial_placement(plan, containers_per_stage(plan, containers)), sources)
    return collect(plan, cores, "o")


def serial(query: cs.Query) -> pa.Table:
    return cs.run_serial(query).results("o")


def fill_query() -> cs.Query:
    q = cs.Query(epoch_events=4)
    q.source("s", ROWS).map_batches(lambda t: t.set_column(1, "v", pc.fill_null(t["v"], -1))).sink(name="o")
    return q


def test_a_batch_transform_sees_a_null_as_a_value_of_its_columns_type():
    """Regression (issue 59, the serial oracle's schemas): ``pc.fill_null(t["v"], -1)`` in a
    ``map_batches`` over a source whose ``v`` is null in some rows runs on the serial executor
    (it rebuilt each row by inference, a null-typed ``v`` there, and raised) and gives the
    local executor's rows."""
    got = serial(fill_query())
    assert got.to_pylist() == local(fill_query()).to_pylist()
    assert sorted(got.column("v").to_pylist()) == sorted(-1 if r["v"] is None else r["v"] for r in ROWS)


class FillNulls(cs.Operator):
    """A vectorized operator that fills nulls with Arrow: it needs ``v``'s declared type."""

    def consume_batch(self, stream_id, batch):
        self.produce_batch("out", batch.set_column(batch.schema.get_field_index("v"), "v",
                                                   pc.fill_null(batch["v"], -1)))


def test_declared_schemas_reach_batch_transforms_and_vectorized_operators():
    """A ``map`` with a declared schema (its rows conformed to it: ``v`` float, the undeclared
    column dropped), a ``filter_batches`` and a ``flat_map_batches`` after it, then a vectorized
    operator: each sees a null ``v`` as a float64 null, and the serial executor's rows equal
    the local executor's."""
    schema = pa.schema([("k", pa.int64()), ("v", pa.float64())])

    def twice(t: pa.Table) -> tuple[pa.Table, list[int]]:  # each row, then it with its null filled
        filled = t.set_column(1, "v", pc.fill_null(t["v"], 0.5))
        rows = [j for i in range(t.num_rows) for j in (i, t.num_rows + i)]
        return pa.concat_tables([t, filled]).take(pa.array(rows)), [i for i in range(t.num_rows) for _ in (0, 1)]

    def build() -> cs.Query:
        q = cs.Query(epoch_events=5)
        s = q.source("s", ROWS).map(lambda e: {**e, "extra": "x"}, schema=schema)
        s = s.filter_batches(lambda t: pc.not_equal(pc.fill_null(t["v"], 0.0), 3.0)).flat_map_batches(twice)
        q.operator(FillNulls, {"in": s.key_by("k")}, slices=2).sink(name="o")
        return q

    got = serial(build())
    assert got.to_pylist() == local(build()).to_pylist()
    assert got.schema.field("v").type == pa.float64() and "extra" not in got.schema.names
    values = got.column("v").to_pylist()
    assert got.num_rows == 2 * (len(ROWS) - 1) and 3.0 not in values and -1.0 in values and 0.5 in values


@pytest.mark.parametrize("kind", ["map_batches", "flat_map_batches"])
def test_a_table_with_a_column_name_twice_is_refused_alike(kind):
    """Regression (issue 59, the serial oracle's schemas): a ``*_batches`` function that returns
    a table with a column name twice fails the job with the same ``EventError`` (same stage,
    order and cause) on the serial and the local executor (the serial executor accepted it;
    the runtime failed only when its results were read, with Arrow's error)."""
    def dup(t: pa.Table) -> pa.Table:
        return pa.Table.from_arrays([t["k"], t["v"], t["v"]], names=["k", "v", "v"])

    def build() -> cs.Query:
        q = cs.Query(epoch_events=4)
        s = q.source("s", ROWS)
        s = s.map_batches(dup) if kind == "map_batches" else s.flat_map_batches(lambda t: (dup(t), range(t.num_rows)))
        s.sink(name="o")
        return q

    errors = []
    for run in (serial, local):
        with pytest.raises(EventError, match="more than once") as info:
            run(build())
        errors.append((info.value.stage, info.value.order, info.value.cause))
    assert errors[0] == errors[1]
    assert errors[0][0] == "s" and "['v']" in errors[0][2]
