"""Feeding and validation speed with PySpark (local[2]) on the 2013 NYC flights.

- feed: Spark DataFrame (336,776 flights, 8 columns) -> sorted, numbered,
  written to the source log partition by partition (``chronostream.spark.feed``);
- validate: the route-statistics job's Parquet output (328,521 rows) checked
  by ``chronostream.spark.validate`` against Spark SQL window functions.

Rates are rows per second of wall time, medians of --repeat runs; the
DataFrame is cached first, so feeding time excludes reading the data.

    python -m benchmarks.feed --json
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import chronostream as cs
from benchmarks.common import emit, median, parser
from chronostream.spark import feed, spark_session, validate
from examples import flights as fx


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    rows = 50_000 if args.quick else 0
    spark = spark_session()
    df = fx.flights_frame(spark, rows).cache()
    n = df.count()
    root = Path(tempfile.mkdtemp(prefix="cs-bench-feed-"))
    feed_rates = []
    try:
        for i in range(args.repeat):
            d = root / f"log{i}"
            t = time.perf_counter()
            feed(df, d, stream="flights", order_by=["sched_ts"])
            feed_rates.append(n / (time.perf_counter() - t))
        cs.ensure_ray()
        job = cs.run(fx.route_stats_query(str(root / "log0"), str(root / "out")), containers=2)
        job.wait()
        job.stop()
        expected = fx.route_stats_expected(df)
        out_rows = 0
        val_rates = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            report = validate(root / "out", expected, key=["_order"], spark=spark, show=False)
            val_rates.append(report.output_rows / (time.perf_counter() - t))
            out_rows = report.output_rows
            assert report.ok, report.summary()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "feed_rows_per_s": round(median(feed_rates)),
        "validate_rows_per_s": round(median(val_rates)),
        "flights": n,
        "validated_rows": out_rows,
        "spark_master": "local[2]",
        "repeat": args.repeat,
        "rows": [
            {"step": "feed", "rows": n, "rows_per_s": round(median(feed_rates)), "runs": [round(x) for x in feed_rates]},
            {"step": "validate", "rows": out_rows, "rows_per_s": round(median(val_rates)),
             "runs": [round(x) for x in val_rates]},
        ],
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
