"""The public API: clear errors for malformed queries, sinks, the CLI and the demo.

Each test states one promise of the user-facing surface.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

import chronostream as cs


def test_query_without_sink_is_refused():
    """Compiling a query with no sink raises QueryError saying so."""
    q = cs.Query()
    q.source("s", [{"a": 1}])
    with pytest.raises(cs.QueryError, match="no sink"):
        cs.run(q, executor="serial")


def test_aggregate_needs_a_keyed_stream():
    """aggregate() on an unkeyed stream raises QueryError pointing to key_by()."""
    q = cs.Query()
    with pytest.raises(cs.QueryError, match="key_by"):
        q.source("s", [{"a": 1}]).count()


def test_sink_names_must_be_unique():
    """Two sinks with one name are refused when the second is added."""
    q = cs.Query()
    s = q.source("s", [{"a": 1}])
    s.sink(name="x")
    with pytest.raises(cs.QueryError, match="unique"):
        s.sink(name="x")


def test_a_sink_named_like_the_dead_letter_sink_is_refused():
    """``results(name)`` could read only one of a sink and the dead-letter sink of one name:
    adding such a sink fails, naming it."""
    q = cs.Query()
    q.dead_letters()  # a memory sink named "dead_letters"
    src = q.source("s", [{"a": 1}])
    with pytest.raises(cs.QueryError, match="'dead_letters'"):
        src.sink(name="dead_letters")


def test_order_by_must_be_declared_by_all_sources_or_none():
    """Mixing sources with and without order_by is refused (the global order would be undefined)."""
    q = cs.Query()
    a = q.source("a", [{"t": 1}], order_by="t")
    b = q.source("b", [{"t": 1}])
    a.sink(name="a")
    b.sink(name="b")
    with pytest.raises(cs.QueryError, match="order_by"):
        cs.compile_query(q)


def test_system_column_names_are_reserved():
    """A source column starting with '_' is refused."""
    with pytest.raises(cs.QueryError, match="reserved"):
        cs.Query().source("s", pa.table({"_x": [1]}))


def test_global_order_interleaves_sources_by_event_time():
    """Two sources with order_by interleave by time, ties by declaration order."""
    q = cs.Query()
    q.source("a", pa.table({"t": [1, 3, 5]}), order_by="t").sink(name="a")
    q.source("b", pa.table({"t": [2, 3, 4]}), order_by="t").sink(name="b")
    job = cs.run(q, executor="serial")
    assert sorted(job.results("a")["_order"].to_pylist()) == [0, 2, 5]
    assert sorted(job.results("b")["_order"].to_pylist()) == [1, 3, 4]


def test_a_single_source_stores_no_order_or_sub_column_and_its_epochs_read_as_before():
    """One source's compiled table holds the user's columns only (its order is its row number);
    the reader gives each epoch's rows ``_order`` and ``_sub`` as a stored column would."""
    from chronostream.slices.readers import make_reader

    user = pa.table({"t": [5, 1, 4, 1, 3]}).replace_schema_metadata({"mine": "kept"})
    q = cs.Query(epoch_events=2)
    q.source("a", user, order_by="t").sink(name="a")
    plan, sources = cs.compile_query(q)
    table = sources[0]
    assert table.column_names == ["t"]
    assert table["t"].to_pylist() == [1, 1, 3, 4, 5]  # sorted by t, ties in row order
    reader = make_reader(table, plan.order_end)
    epochs = [reader.rows(e * 2, e * 2 + 2) for e in range(3)]
    assert [t.to_pydict() for t in epochs] == [
        {"t": [1, 1], "_order": [0, 1], "_sub": [0, 0]},
        {"t": [3, 4], "_order": [2, 3], "_sub": [0, 0]},
        {"t": [5], "_order": [4], "_sub": [0]}]
    assert epochs[0].schema.metadata == {b"mine": b"kept"}  # the marker does not leak into rows
    assert reader.rows(10, 12).num_rows == 0


def test_several_sources_keep_an_order_column_and_no_sub_column():
    """With two sources the interleaved order is stored per source; ``_sub`` is added by the reader."""
    from chronostream.slices.readers import make_reader

    q = cs.Query(epoch_events=3)
    q.source("a", pa.table({"t": [1, 3, 5]}), order_by="t").sink(name="a")
    q.source("b", pa.table({"t": [2, 3, 4]}), order_by="t").sink(name="b")
    plan, sources = cs.compile_query(q)
    assert [t.column_names for t in sources.values()] == [["t", "_order"], ["t", "_order"]]
    rows = make_reader(sources[0], plan.order_end).rows(0, 3)
    assert rows.to_pydict() == {"t": [1, 3], "_order": [0, 2], "_sub": [0, 0]}


def test_unknown_executor_is_refused():
    """run() names the valid executors when given an unknown one."""
    q = cs.Query()
    q.source("s", [{"a": 1}]).sink(name="x")
    with pytest.raises(ValueError, match="serial"):
        cs.run(q, executor="spark")


def test_parquet_sink_on_ray_reads_back_like_the_serial_run(ray_session, tmp_path):
    """A ParquetSink directory written by the runtime reads back equal to the serial output."""
    from queries import running_sum

    def build(path: Path) -> cs.Query:
        q = running_sum(5)
        # replace the memory sink of the running sums by a Parquet sink
        stream, _ = q.sinks[0]
        q.sinks[0] = (stream, cs.ParquetSink(str(path), name="sums"))
        return q

    job = cs.run(build(tmp_path / "ray"), containers=2)
    try:
        got = job.results("sums")
        assert job.sink_path("sums") == str(tmp_path / "ray")
    finally:
        job.stop()
    expected = cs.run(build(tmp_path / "serial"), executor="serial").results("sums")
    assert got.num_rows > 0
    assert got.to_pylist() == expected.to_pylist()


def test_cli_run_executes_a_query_file(tmp_path):
    """`chronostream run file.py --executor serial` prints each sink's row count as JSON."""
    f = tmp_path / "q.py"
    f.write_text(
        "import chronostream as cs\n"
        "def build():\n"
        "    q = cs.Query()\n"
        "    q.source('w', [{'w': 'a'}, {'w': 'b'}, {'w': 'a'}]).key_by('w').count(slices=2).sink(name='c')\n"
        "    return q\n")
    out = subprocess.run([sys.executable, "-m", "chronostream", "run", str(f), "--executor", "serial"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["c"] == 3


@pytest.mark.ray
def test_ray_started_by_the_runtime_is_its_own_even_when_ray_names_a_dead_cluster_as_the_latest():
    """Ray's default joins the cluster named in its ``ray_current_cluster`` file, which a killed
    cluster leaves behind: ``ensure_ray`` without an address then failed with Ray's 'num_cpus
    must not be provided' ValueError. It starts a Ray of its own instead."""
    from ray._common.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    before = path.read_text() if path.exists() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("127.0.0.1:9")  # nothing listens there
    try:
        out = subprocess.run([sys.executable, "-c", "import chronostream as cs, ray; cs.ensure_ray(num_cpus=1); "
                              "print(ray.cluster_resources()['CPU']); ray.shutdown()"],
                             capture_output=True, text=True, timeout=120)
    finally:
        if before is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(before)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1.0"


def test_demo_on_a_flights_subset_validates(ray_session, tmp_path, capsys):
    """The demo's job, run on 240,000 flights (paced), kills a container, scales out and in,
    merges the containers on each host into one, and passes its own validation."""
    from chronostream.demo import run_demo

    assert run_demo(containers=2, rows=240_000, out=tmp_path / "demo", pace_s=0.4) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s*validation\s+PASS", out, re.M), out
    assert re.search(r"^\s*fault\s+killed container", out, re.M), out
    assert re.search(r"^\s*scale_out 1\s+slices \[", out, re.M), out
    assert re.search(r"^\s*pause per slice\s+median \d+ ms", out, re.M), out
    assert re.search(r"^\s*scale_in 1\s+slices \[.*released hosts", out, re.M), out
    assert re.search(r"^\s*compact\s+(slices \[|\d+ slices)", out, re.M), out
    assert re.search(r"^\s*containers\s+.*route_delays: 2 \(at the end\)", out, re.M), out


def test_one_stream_as_both_inputs_of_a_join_matches_serial():
    """A self-join (the same stream object as left and right) gives the oracle's output."""
    def build() -> cs.Query:
        q = cs.Query(epoch_events=7)
        s = q.source("s", [{"k": i % 3, "v": i} for i in range(20)]).key_by("k")
        cs.join(s, s, slices=3).sink(name="j")
        return q
    expected = cs.run(build(), executor="serial").results("j").to_pylist()
    assert len(expected) > 20
    assert cs.run(build(), executor="local", containers=2).results("j").to_pylist() == expected


def test_a_join_of_joins_keeps_every_column_under_its_own_name():
    """Joining a self-join with itself: each side's ``right_k`` clashes again and is prefixed
    again (``right_right_k``) instead of overwriting the left side's column."""
    q = cs.Query(epoch_events=4)
    s = q.source("s", [{"k": i % 2, "v": i} for i in range(4)]).key_by("k")
    j = cs.join(s, s, slices=2).key_by("k")
    cs.join(j, j, slices=2).sink(name="jj")
    rows = cs.run(q, executor="serial").results("jj").to_pylist()
    assert rows and all(set(r) >= {"k", "v", "right_k", "right_v", "right_right_k", "right_right_v",
                                   "right_right_right_k", "right_right_right_v"} for r in rows)
    # the left pair's own columns survive: (v, right_v) is a pair of the first join
    assert all(r["k"] == r["right_k"] == r["right_right_k"] == r["right_right_right_k"] for r in rows)
    lefts = {(r["v"], r["right_v"]) for r in rows}
    rights = {(r["right_right_v"], r["right_right_right_v"]) for r in rows}
    assert lefts == rights and len(lefts) == 8  # 2 keys x 2 x 2 pairs


class Tagger(cs.Operator):
    """Answers every event with one row through ``produce_update`` (a one-to-one operator)."""

    def consume(self, stream_id, event):
        self.produce_update("out", {"k": event["k"], "tag": event["k"] * 10})


class Stray(cs.Operator):
    def consume(self, stream_id, event):
        self.produce_update("nowhere", {"k": event["k"]})


def test_produce_update_keeps_each_events_place_in_the_output():
    """A one-to-one operator's rows keep the input's lineage: the same order in every executor."""
    rows = [{"k": k} for k in (3, 1, 2, 3, 1)]

    def query():
        q = cs.Query(epoch_events=2)
        q.source("s", rows).key_by("k").apply(Tagger, slices=2).sink(name="out")
        return q

    serial = cs.run(query(), executor="serial").results("out")
    local = cs.run(query(), executor="local", containers=2).results("out")
    assert sorted(serial.column("tag").to_pylist()) == [10, 10, 20, 30, 30]
    assert local.to_pylist() == serial.to_pylist()


def test_produce_update_to_an_undeclared_output_names_the_stage():
    q = cs.Query()
    q.source("s", [{"k": 1}]).key_by("k").apply(Stray, slices=1, name="stray").sink(name="out")
    with pytest.raises(Exception, match="stray.*undeclared output 'nowhere'"):
        cs.run(q, executor="serial")


def _counts_to_parquet(path: Path, slices: int, overwrite: bool = False) -> cs.Query:
    q = cs.Query(epoch_events=10)
    q.source("w", [{"w": f"w{i % 3}"} for i in range(40)]).key_by("w") \
        .count(slices=slices).sink(cs.ParquetSink(str(path), name="c", overwrite=overwrite))
    return q


def test_a_parquet_sink_refuses_a_directory_holding_an_earlier_runs_output(tmp_path):
    """A second run into the same directory (here with other slice counts, whose files would not
    be overwritten) is refused with an error naming the sink and the way out, and writes nothing."""
    out = tmp_path / "out"
    cs.run(_counts_to_parquet(out, slices=4), executor="local")
    before = sorted(p.relative_to(out) for p in out.rglob("*.parquet"))
    with pytest.raises(FileExistsError, match=r"ParquetSink 'c'.*overwrite=True"):
        cs.run(_counts_to_parquet(out, slices=2), executor="local")
    assert sorted(p.relative_to(out) for p in out.rglob("*.parquet")) == before


def test_a_parquet_sink_with_overwrite_reads_back_only_its_own_run(tmp_path):
    """With ``overwrite=True`` the earlier run's files go first: the output read back is this run's
    alone, equal to the serial executor's; files that are not the sink's stay."""
    out = tmp_path / "out"
    cs.run(_counts_to_parquet(out, slices=4), executor="local")
    (out / "notes.txt").write_text("mine")
    job = cs.run(_counts_to_parquet(out, slices=2, overwrite=True), executor="local")
    serial = cs.run(_counts_to_parquet(tmp_path / "serial", slices=2), executor="serial")
    assert job.results("c").to_pylist() == serial.results("c").to_pylist()
    assert job.results("c").num_rows == 40
    assert (out / "notes.txt").read_text() == "mine"


def test_asking_a_named_stage_for_more_containers_than_slices_warns_and_caps():
    """``containers={"count": 5}`` for a 2-slice stage warns, naming stage and slice count, and the
    stage runs 2 containers; one number for every stage caps quietly (a 1-slice source is common)."""
    import warnings

    from chronostream.dag import compile_query
    from chronostream.master.placement import containers_per_stage, initial_placement

    q = cs.Query()
    q.source("w", [{"w": "a"}], slices=1).key_by("w").count(slices=2, name="count").sink(name="c")
    plan, _ = compile_query(q)
    with pytest.warns(UserWarning, match=r"stage 'count' has 2 slices, so it runs 2 containers"):
        per_stage = containers_per_stage(plan, {"count": 5})
    assert len(initial_placement(plan, per_stage).containers[plan.stage("count").stage_id]) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        containers_per_stage(plan, 5)
