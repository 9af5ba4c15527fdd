"""Specification of the simulator's random queries (chronostream.sim.queries) and their check.

Goal: a seed gives one query and one data set, always the same; the seeds cover every
operator kind and every listed Arrow type; almost every query runs; the in-process runtime
(the local executor) gives what the serial executor and the pandas oracle give; and
``check_outputs`` notices a dropped row, a duplicated row and a wrong aggregate.
Method: real runs of the serial and local executors (no Ray), seeds 0-39.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

import chronostream as cs
from chronostream.sim.queries import RandomQuery, SinkNode, StageNode, check_outputs, random_query
from chronostream.sim.stages import Aggregate

ROOT = Path(__file__).resolve().parent.parent
SEEDS = range(40)
#: Every operator kind the generator draws, as feature tags.
OPERATOR_TAGS = ("map", "filter", "flat_map", "map_batches", "filter_batches", "flat_map_batches", "key_by_fn",
                 "compound_key", "count", "sum", "min", "max", "mean", "shortcut", "op_value_state",
                 "op_list_state", "op_queue_state", "op_map_state", "op_topk_state", "op_end_hook", "op_vectorized",
                 "op_two_inputs", "join", "self_join", "window_sliding", "window_count", "window_tumbling",
                 "window_hopping", "window_close", "window_slice_clock", "window_multi", "window_distinct")
#: Shapes of the DAG.
SHAPE_TAGS = ("several_sources", "multi_input", "fan_out", "chain", "rekey_chain", "stateless_sink",
              "stages_1", "stages_2", "stages_3", "stages_4")
#: Every listed kind of column.
TYPE_TAGS = ("int_to_float", "int_to_float_aggregate", "timestamp_tz", "decimal", "unicode", "list", "struct",
             "nulls", "null_column", "null_key", "hot_keys", "str_key", "int_key", "temporal_key")

_queries: dict[int, RandomQuery] = {}
_serial: dict[int, dict[str, pa.Table] | Exception] = {}


def query(seed: int) -> RandomQuery:
    """``random_query(seed)``, drawn once per test session (its oracle's frames are computed once)."""
    if seed not in _queries:
        _queries[seed] = random_query(seed)
    return _queries[seed]


def serial_outputs(seed: int) -> dict[str, pa.Table] | Exception:
    """The serial executor's sinks of ``seed``'s query, or the ``ChronoStreamError`` refusing it
    (run once per test session)."""
    if seed not in _serial:
        rq = query(seed)
        try:
            job = cs.run(rq.build(), executor="serial")
            _serial[seed] = {name: job.results(name) for name in rq.sinks}
        except cs.ChronoStreamError as exc:
            _serial[seed] = exc
    return _serial[seed]


def test_a_seed_gives_the_same_query_data_and_output():
    """Two draws of one seed: the same description, features and source tables, and the same
    serial output bit for bit; another seed gives another query."""
    for seed in (3, 11):
        a, b = random_query(seed), random_query(seed)
        assert a.description == b.description and a.features == b.features and a.sinks == b.sinks
        tables = lambda rq: [n.table for n in rq.spec.nodes if hasattr(n, "table")]  # noqa: E731
        assert len(tables(a)) == len(tables(b)) >= 1
        assert all(x.equals(y) for x, y in zip(tables(a), tables(b)))
        first = cs.run(a.build(), executor="serial")
        second = cs.run(b.build(), executor="serial")
        for name in a.sinks:
            assert first.results(name).equals(second.results(name)), name
    assert random_query(3).description != random_query(4).description


def fingerprint(seed: int) -> str:
    """``seed``'s query description and a digest of its source tables' bytes (Arrow IPC)."""
    rq = random_query(seed)
    digest = hashlib.sha256()
    for node in rq.spec.nodes:
        if hasattr(node, "table"):
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, node.table.schema) as writer:
                writer.write_table(node.table)
            digest.update(sink.getvalue().to_pybytes())
    return f"{rq.description}\n{digest.hexdigest()}"


def test_a_seed_draws_the_same_query_in_another_process():
    """The draw depends on the seed alone: a process with other string hashing (PYTHONHASHSEED)
    draws the same description and the same table bytes."""
    seeds = tuple(range(12))
    code = f"from test_sim_queries import fingerprint; print('\\n'.join(fingerprint(s) for s in {seeds!r}))"
    env = {**os.environ, "PYTHONHASHSEED": "12345",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "\n".join(fingerprint(s) for s in seeds)


def test_build_gives_a_fresh_query_each_call():
    """A query is consumed by a run: ``build()`` makes a new one, with the same stages and sinks."""
    rq = random_query(5)
    q1, q2 = rq.build(), rq.build()
    assert q1 is not q2
    assert [s.name for s in q1.stages] == [s.name for s in q2.stages]
    assert [s.name for _, s in q1.sinks] == list(rq.sinks)


def test_seeds_cover_every_operator_kind_and_type():
    """Over 200 seeds every operator kind, DAG shape and listed column type appears at least 3 times."""
    seen = Counter(tag for seed in range(200) for tag in query(seed).features)
    rare = {tag: seen[tag] for tag in OPERATOR_TAGS + SHAPE_TAGS + TYPE_TAGS if seen[tag] < 3}
    assert not rare, f"seen fewer than 3 times in 200 seeds: {rare}"


def test_almost_every_query_runs():
    """At least 90% of the seeds' queries run on the serial executor; the others are refused
    with a ChronoStreamError (an error of another kind fails here)."""
    refused = {seed: out for seed in SEEDS if isinstance(out := serial_outputs(seed), Exception)}
    assert len(refused) <= 0.1 * len(SEEDS), refused


def test_the_oracle_agrees_with_the_serial_executor():
    """Most sinks have an oracle, and each agrees with the serial executor's rows."""
    with_oracle = 0
    for seed in SEEDS:
        serial = serial_outputs(seed)
        if isinstance(serial, Exception):
            continue
        rq = query(seed)
        with_oracle += sum(fn is not None for fn in rq.pandas_expected.values())
        assert check_outputs(rq, serial, serial) == [], rq.description
    assert with_oracle >= len(SEEDS)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_local_executor_gives_the_serial_output(seed: int):
    """The in-process runtime's sinks equal the serial executor's row for row, every producer
    slice's out_seq is dense, and the oracle agrees."""
    serial = serial_outputs(seed)
    if isinstance(serial, Exception):
        pytest.skip(f"refused: {serial}")
    rq = query(seed)
    job = cs.run(rq.build(), executor="local", seed=seed)
    problems = check_outputs(rq, {name: job.results(name) for name in rq.sinks}, serial)
    assert problems == [], f"{rq.description}\n" + "\n".join(problems)


def aggregate_sink() -> tuple:
    """The first seed with a sink right after a running aggregate: (query, sink, its key, serial output)."""
    for seed in SEEDS:
        rq = query(seed)
        nodes = rq.spec.nodes
        for node in nodes:
            target = nodes[node.stream] if isinstance(node, SinkNode) else None
            if isinstance(target, StageNode) and isinstance(target.stage, Aggregate):
                serial = serial_outputs(seed)
                if not isinstance(serial, Exception) and serial[node.name].num_rows > 2:
                    return rq, node.name, list(target.stage.key), serial
    raise AssertionError("no seed of SEEDS has a sink after an aggregate")


def with_table(outputs: dict[str, pa.Table], name: str, table: pa.Table) -> dict[str, pa.Table]:
    return {**outputs, name: table}


@pytest.mark.parametrize("damage", ["dropped", "duplicated"])
def test_check_outputs_reports_a_dropped_or_duplicated_row(damage: str):
    """A row missing from the middle of a slice's output, or delivered twice: unequal to the
    serial executor, a gap or a duplicate in that slice's out_seq, and the oracle's row count."""
    rq, name, _, serial = aggregate_sink()
    table = serial[name]
    if damage == "dropped":
        bad, said = pa.concat_tables([table.slice(0, 1), table.slice(2)]), "missing"
    else:
        bad, said = pa.concat_tables([table.slice(0, 2), table.slice(1)]), "1 duplicate"
    against_serial = check_outputs(rq, with_table(serial, name, bad), serial)
    assert any("differs from the serial executor" in p for p in against_serial), against_serial
    alone = check_outputs(rq, with_table(serial, name, bad), with_table(serial, name, bad))
    assert any("exactly once" in p and said in p for p in alone), alone
    assert any("oracle" in p and "rows, expected" in p for p in alone), alone


def test_check_outputs_reports_a_wrong_aggregate():
    """A key's last running value off by one: unequal to the serial executor, and the oracle
    (alone, with the serial output equally wrong) names the key whose last row differs."""
    rq, name, key, serial = aggregate_sink()
    table = serial[name]
    value = next(c for c in table.schema.names if c not in key and not c.startswith("_"))
    last = max(range(table.num_rows), key=lambda i: (table["_order"][i].as_py(), table["_sub"][i].as_py()))
    values = table[value].to_pylist()
    values[last] = values[last] + 1
    column = pa.array(values, table.schema.field(value).type)
    wrong = table.set_column(table.schema.get_field_index(value), value, column)
    against_serial = check_outputs(rq, with_table(serial, name, wrong), serial)
    assert any("differs from the serial executor" in p for p in against_serial), against_serial
    alone = check_outputs(rq, with_table(serial, name, wrong), with_table(serial, name, wrong))
    assert len(alone) == 1 and "oracle" in alone[0] and "last rows differ" in alone[0], alone
