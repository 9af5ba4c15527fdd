"""PySpark feeds the input and validates the output: the round trips and the validator's teeth.

Method: real Spark (local[2], one session for the suite) feeds DataFrames
into source logs; jobs read them on Ray; Spark validates the Parquet output
against Spark SQL computing the same query in batch. Flights tests use a
deterministic subset to keep the suite fast; the demo and the example run
the full data.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import chronostream as cs
from chronostream.slices.sourcelog import SourceLog
from chronostream.spark import feed, validate, with_order

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples import flights as fx  # noqa: E402

N_FLIGHTS = 6000


@pytest.fixture(scope="module")
def flights_df(spark):
    return fx.flights_frame(spark, N_FLIGHTS).cache()


def read_log(log_dir, stream):
    return SourceLog(log_dir).read(stream)


def test_sequence_does_not_depend_on_spark_partitioning(spark, flights_df, tmp_path):
    """Feeding the same flights with 1, 3 and 8 partitions gives identical logs."""
    logs = []
    for parts in (1, 3, 8):
        feed(flights_df.repartition(parts), tmp_path / str(parts), stream="flights", order_by=["sched_ts"])
        logs.append(read_log(tmp_path / str(parts), "flights"))
    assert logs[0]["_order"].to_pylist() == list(range(N_FLIGHTS))
    assert logs[0].equals(logs[1])
    assert logs[0].equals(logs[2])


def test_micro_batches_fed_into_an_open_log_continue_its_order_and_can_trim_it(spark, flights_df, tmp_path):
    """Three feeds into one open log (by scheduled time thirds): the log equals one feed of the
    whole; the last call trims it below its second batch."""
    from pyspark.sql import functions as F

    cuts = flights_df.approxQuantile("sched_ts", [1 / 3, 2 / 3], 0.0)
    ts = F.col("sched_ts")
    batches = [flights_df.where(ts < cuts[0]), flights_df.where((ts >= cuts[0]) & (ts < cuts[1])),
               flights_df.where(ts >= cuts[1])]
    sizes = [b.count() for b in batches]
    feed(batches[0], tmp_path / "micro", stream="flights", order_by=["sched_ts"], seal=False, segment_rows=500)
    feed(batches[1], tmp_path / "micro", stream="flights", order_by=["sched_ts"], seal=False, segment_rows=500)
    report = feed(batches[2], tmp_path / "micro", stream="flights", order_by=["sched_ts"], trim_below=sizes[0])
    feed(flights_df, tmp_path / "whole", stream="flights", order_by=["sched_ts"])
    assert report.segments_trimmed >= 1
    micro = SourceLog(tmp_path / "micro")
    assert micro.sealed and micro.low_water == sizes[0] and micro.high_water == N_FLIGHTS
    # (the batches' sched_ts is non-null after the filters, the whole's nullable: the log keeps its first schema)
    assert micro.read("flights", sizes[0]).to_pydict() == SourceLog(tmp_path / "whole").read("flights", sizes[0]).to_pydict()


def test_several_dataframes_get_one_dense_global_order(spark, flights_df, tmp_path):
    """Flights and weather fed together: one dense order by event time; each stream dense too."""
    wdf = fx.weather_frame(spark, flights_df)
    frames = {"weather": (wdf, ["obs_ts"]), "flights": (flights_df, ["sched_ts"])}
    feed(frames, tmp_path)
    f, w = read_log(tmp_path, "flights"), read_log(tmp_path, "weather")
    orders = np.sort(np.concatenate([np.asarray(f["_order"]), np.asarray(w["_order"])]))
    assert np.array_equal(orders, np.arange(len(orders)))
    assert f["_stream_seq"].to_pylist() == list(range(f.num_rows))
    # Event time never goes backwards along the global order.
    t = np.concatenate([np.asarray(f["sched_ts"]), np.asarray(w["obs_ts"])])
    o = np.concatenate([np.asarray(f["_order"]), np.asarray(w["_order"])])
    assert np.all(np.diff(t[np.argsort(o)]) >= 0)
    # Spark computes the very same order (used for expected results).
    expected = with_order(wdf, ["obs_ts"], others=frames, stream="weather").select("_order").toPandas()
    assert sorted(expected["_order"].tolist()) == w["_order"].to_pylist()


def test_route_statistics_round_trip_validates(ray_session, spark, flights_df, tmp_path):
    """Feed -> run -> validate: running delay statistics per route equal Spark SQL's, row for row."""
    feed(flights_df, tmp_path / "log", stream="flights", order_by=["sched_ts"])
    job = cs.run(fx.route_stats_query(str(tmp_path / "log"), str(tmp_path / "out"), slices=8), containers=2)
    try:
        job.wait(timeout_s=300)
    finally:
        job.stop()
    report = validate(tmp_path / "out", fx.route_stats_expected(flights_df), key=["_order"], spark=spark, show=False)
    assert report.ok, report.summary()
    assert report.output_rows == report.expected_rows > 0


def test_flights_weather_join_round_trip_validates(ray_session, spark, flights_df, tmp_path):
    """Feed both streams -> keyed join on (origin, time_hour) -> equals Spark SQL's inner join."""
    wdf = fx.weather_frame(spark, flights_df)
    feed({"weather": (wdf, ["obs_ts"]), "flights": (flights_df, ["sched_ts"])}, tmp_path / "log")
    job = cs.run(fx.weather_join_query(str(tmp_path / "log"), str(tmp_path / "out"), slices=8), containers=2)
    try:
        job.wait(timeout_s=300)
    finally:
        job.stop()
    expected = fx.weather_join_expected(flights_df, wdf)
    report = validate(tmp_path / "out", expected, key=["sched_ts"], spark=spark, show=False)
    assert report.ok, report.summary()
    assert report.output_rows > N_FLIGHTS // 2


def word_lines(spark):
    from queries import zipf_lines

    return spark.createDataFrame([(i, r["line"]) for i, r in enumerate(zipf_lines(800))], ["line_no", "line"])


def test_word_count_round_trip_validates(ray_session, spark, tmp_path):
    """Feed lines -> split + running count on Ray -> equals Spark's exploded running count."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from chronostream.datasets import split_words

    lines = word_lines(spark)
    feed(lines, tmp_path / "log", stream="lines", order_by=["line_no"])
    q = cs.Query(epoch_events=100)
    q.source_log(str(tmp_path / "log"), "lines").flat_map_batches(split_words) \
        .key_by("word").count(slices=7, name="count").sink(cs.ParquetSink(str(tmp_path / "out"), name="counts"))
    job = cs.run(q, containers=2)
    try:
        job.wait(timeout_s=300)
    finally:
        job.stop()
    words = with_order(lines, ["line_no"]).where(F.length("line") > 0) \
        .select("_order", F.posexplode(F.split("line", " ")).alias("pos", "word"))
    w = Window.partitionBy("word").orderBy("_order", "pos").rowsBetween(Window.unboundedPreceding, 0)
    expected = words.select("word", "_order", F.count(F.lit(1)).over(w).alias("count"))
    report = validate(tmp_path / "out", expected, key=["_order"], spark=spark, show=False)
    assert report.ok, report.summary()


@pytest.fixture()
def small_output(spark, tmp_path):
    """A validated job output (running sums) and its expected DataFrame."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    df = spark.createDataFrame([(i, f"k{i % 4}", i * 10) for i in range(60)], ["t", "k", "v"])
    feed(df, tmp_path / "log", stream="s", order_by=["t"])
    q = cs.Query(epoch_events=16)
    q.source_log(str(tmp_path / "log"), "s").key_by("k").sum("v", slices=3, name="sum") \
        .sink(cs.ParquetSink(str(tmp_path / "out"), name="sums"))
    cs.run(q, executor="local", containers=2)
    w = Window.partitionBy("k").orderBy("_order").rowsBetween(Window.unboundedPreceding, 0)
    expected = with_order(df, ["t"]).select("k", "_order", F.sum("v").over(w).alias("sum_v"))
    assert validate(tmp_path / "out", expected, key=["_order"], spark=spark, show=False).ok
    return tmp_path / "out", expected


def _rewrite_first_file(out_dir: Path, change) -> None:
    f = sorted(out_dir.glob("part-*.parquet"))[0]
    pq.write_table(change(pq.read_table(f)), f)


def test_validator_catches_an_injected_duplicate(spark, small_output):
    """A row written twice is reported with its (slice, out_seq) identity."""
    out, expected = small_output
    _rewrite_first_file(out, lambda t: pa.concat_tables([t, t.slice(0, 1)]))
    report = validate(out, expected, key=["_order"], spark=spark, show=False)
    assert not report.ok
    first = pq.read_table(sorted(out.glob("part-*.parquet"))[0]).slice(0, 1).to_pylist()[0]
    assert report.duplicate_identities == [(first["_slice"], first["_seq"])]
    assert report.n_unexpected == 1


def test_validator_catches_an_injected_missing_row(spark, small_output):
    """A lost row is reported as a gap in its slice's out_seq and as an expected row missing."""
    out, expected = small_output
    f = sorted(out.glob("part-*.parquet"))[0]
    dropped = pq.read_table(f).slice(1, 1).to_pylist()[0]
    _rewrite_first_file(out, lambda t: pa.concat_tables([t.slice(0, 1), t.slice(2)]))
    report = validate(out, expected, key=["_order"], spark=spark, show=False)
    assert not report.ok
    assert report.missing_identities == [(dropped["_slice"], dropped["_seq"])]
    assert report.n_missing == 1 and report.missing_rows[0]["_order"] == dropped["_order"]


def test_validator_catches_a_wrong_value(spark, small_output):
    """A wrong value (identities intact) shows as one unexpected and one missing row."""
    out, expected = small_output

    def corrupt(t: pa.Table) -> pa.Table:
        vals = t["sum_v"].to_pylist()
        vals[0] += 1
        return t.set_column(t.schema.get_field_index("sum_v"), "sum_v", pa.array(vals, t.schema.field("sum_v").type))

    _rewrite_first_file(out, corrupt)
    report = validate(out, expected, key=["_order"], spark=spark, show=False)
    assert not report.ok
    assert report.n_duplicates == 0 and report.n_missing_identities == 0
    assert report.n_unexpected == 1 and report.n_missing == 1
    assert report.unexpected_rows[0]["sum_v"] == report.missing_rows[0]["sum_v"] + 1
    assert "FAIL" in report.summary()


def test_cli_validate_passes_on_good_output_and_fails_on_bad(spark, small_output, tmp_path, capsys):
    """`chronostream validate OUT --expected FILE` exits 0 on valid output, 1 after a corruption.
    The first run is the real command in its own process; the second calls the same entry point
    in this one (with the session's Spark: a second JVM start cost the test about 25 s)."""
    import subprocess

    from chronostream.cli import main

    out, expected = small_output
    exp_path = tmp_path / "expected.parquet"
    expected.toPandas().to_parquet(exp_path)
    args = ["validate", str(out), "--expected", str(exp_path), "--key", "_order"]
    ok = subprocess.run([sys.executable, "-m", "chronostream", *args], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "validation: PASS" in ok.stdout
    _rewrite_first_file(out, lambda t: pa.concat_tables([t, t.slice(0, 1)]))
    assert main(args) == 1
    printed = capsys.readouterr().out
    assert "validation: FAIL" in printed and "duplicated identities" in printed
