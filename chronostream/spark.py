"""PySpark at both ends of a job: ``feed`` writes the sequence-numbered source log, ``validate`` checks the output.

Owns: turning Spark DataFrames into a source log with a dense, deterministic
order (independent of Spark's partitioning), computing that same order in
Spark for expected results (``with_order``), and validating a job's Parquet
output against an expected DataFrame (exactly-once identities + equality).
Knows no Ray and nothing of the runtime beyond the sink's system columns.

Order. One DataFrame: sorted by ``order_by``, ties broken by every other
column (by name), so only fully identical rows tie, and those are
interchangeable. Several DataFrames (``feed({"flights": (df, ["ts"]), ...})``):
one global order by (event time, stream declaration index, the stream's own
order); each stream also gets its own dense ``_stream_seq``.

Scale. Spark sorts (distributed); the driver receives one partition at a
time (``toLocalIterator``), each as Arrow IPC produced by ``mapInArrow``,
numbers it with numpy and appends it to the log: the data is never
collected whole on the driver.
"""

from __future__ import annotations

import io
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from chronostream.slices.sourcelog import ORDER, STREAM_SEQ, SourceLogWriter
from chronostream.slices.types import SEQ, SLICE

_T = "__cs_t"  # event time, as int64 or float64, for merging several streams


def spark_session(master: str = "local[2]", app: str = "chronostream") -> Any:
    """A SparkSession suited to feeding and validating on this machine (Arrow on, no UI).

    A ``local`` master's driver (its RPC endpoint and block manager) binds to loopback
    only: nothing on the network reaches it. A cluster master keeps Spark's own binding
    (secure that cluster: ``spark.authenticate``, docs/guide.md)."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.master(master).appName(app)
    if master == "local" or master.startswith("local["):
        builder = (builder.config("spark.driver.bindAddress", "127.0.0.1")
                   .config("spark.driver.host", "127.0.0.1"))
    session = (builder
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
            .config("spark.sql.session.timeZone", "UTC")
            # Directories of many small files (a dead-letter sink's, one per slice and epoch):
            # at the default 4 MB a file, Spark cut 1,888 files of 15 MB in all into 59 tasks;
            # reading them took 3.8 s warm, 1.9 s at 1 MB.
            .config("spark.sql.files.openCostInBytes", str(1 << 20))
            .config("spark.driver.memory", "2g")
            .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    return session


def _total_order(df: Any, order_by: Sequence[str]) -> list[Any]:
    """Sort columns: ``order_by`` first, then every other column by name (a total order)."""
    from pyspark.sql import functions as F

    missing = [c for c in order_by if c not in df.columns]
    if missing:
        raise ValueError(f"order_by column(s) {missing} not in the DataFrame columns {df.columns}")
    rest = sorted(c for c in df.columns if c not in order_by)
    return [F.col(f"`{c}`").asc_nulls_first() for c in list(order_by) + rest]


def _arrow_partitions(df: Any) -> Iterator[pa.Table]:
    """Yield ``df``'s rows as Arrow tables, partition by partition, in partition order."""
    from pyspark.sql.types import BinaryType, StructField, StructType

    def to_ipc(batches):
        for b in batches:
            if b.num_rows == 0:
                continue
            sink = io.BytesIO()
            with pa.ipc.new_stream(sink, b.schema) as w:
                w.write_batch(b)
            yield pa.RecordBatch.from_arrays([pa.array([sink.getvalue()], pa.binary())], ["ipc"])

    blobs = df.mapInArrow(to_ipc, StructType([StructField("ipc", BinaryType())]))
    for row in blobs.toLocalIterator(prefetchPartitions=False):
        yield pa.ipc.open_stream(pa.py_buffer(row["ipc"])).read_all()


def _event_time(table: pa.Table, col: str) -> np.ndarray:
    arr = table.column(col)
    if pa.types.is_timestamp(arr.type) or pa.types.is_date(arr.type):
        arr = arr.cast(pa.timestamp("us")) if pa.types.is_date(arr.type) else arr.cast(pa.timestamp("us", arr.type.tz), safe=False)
        return np.asarray(arr.cast(pa.int64()).fill_null(np.iinfo(np.int64).min), dtype=np.int64)
    if not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)):
        raise TypeError(f"event-time column {col!r} is {arr.type}; merging streams needs a number, "
                        "timestamp or date (convert strings with to_timestamp in Spark first)")
    return np.asarray(arr.cast(pa.float64()).fill_null(-np.inf), dtype=np.float64)


@dataclass
class FeedReport:
    """What ``feed`` wrote: rows per stream, segments, and the log directory."""

    log_dir: str
    rows: dict[str, int] = field(default_factory=dict)
    segments: int = 0
    segments_trimmed: int = 0  # with trim_below: segment files deleted

    @property
    def total_rows(self) -> int:
        """Rows over all streams."""
        return sum(self.rows.values())


def feed(df: Any, log_dir: str | os.PathLike, stream: str | None = None, order_by: Sequence[str] | None = None,
         *, seal: bool = True, segment_rows: int = 65536, trim_below: int | None = None) -> FeedReport:
    """Write Spark DataFrame(s) to a source log with a dense, deterministic order.

    ``feed(df, log_dir, stream="flights", order_by=["sched_ts"])`` feeds one
    DataFrame. ``feed({"flights": (df1, ["sched_ts"]), "weather": (df2, ["ts"])}, log_dir)``
    feeds several with one global order (each needs exactly one ``order_by``
    column, an event time: numbers, timestamps or dates). ``seal=False``
    leaves the log open for more: a later ``feed`` into it continues its
    global order and each stream's sequence (a micro-batch feeder: each
    call's rows come after the previous call's, whatever their event
    times). ``trim_below``: after appending, trim the log below that order
    (``SourceLogWriter.trim``; a running job's ``Job.source_log_floor()``).
    Works unchanged on a Spark cluster: only one partition at a time
    reaches the driver.
    """
    if isinstance(df, Mapping):
        frames = {name: (d, list(ob)) for name, (d, ob) in df.items()}
        if stream is not None or order_by is not None:
            raise ValueError("with several DataFrames, give order_by per DataFrame, not stream=/order_by=")
    else:
        if stream is None or order_by is None:
            raise ValueError("feed(df, log_dir, stream=..., order_by=[...]) needs a stream name and order_by")
        frames = {stream: (df, list(order_by))}
    if len(frames) > 1:
        for name, (_, ob) in frames.items():
            if len(ob) != 1:
                raise ValueError(f"stream {name!r}: feeding several DataFrames needs exactly one order_by "
                                 "column each (the event time that interleaves them)")
    writer = SourceLogWriter(log_dir)
    report = FeedReport(str(log_dir))
    iters = {name: _arrow_partitions(d.orderBy(*_total_order(d, ob))) for name, (d, ob) in frames.items()}
    names = list(frames)
    buffers: dict[str, list[pa.Table]] = {n: [] for n in names}
    last_t: dict[str, float] = {}
    exhausted: set[str] = set()
    # An open log fed before: continue its global order and each stream's sequence.
    seq = {n: writer.manifest["streams"].get(n, {}).get("rows", 0) for n in names}
    next_order = writer.next_order
    pending: dict[str, list[pa.Table]] = {n: [] for n in names}
    pending_rows = 0

    def flush(high_water: int) -> None:
        nonlocal pending_rows
        tables = {n: pa.concat_tables(ts) for n, ts in pending.items() if ts}
        if tables or high_water:
            writer.append(tables, high_water=high_water)
            report.segments += len(tables)
        for n in names:
            pending[n] = []
        pending_rows = 0

    while len(exhausted) < len(names):
        # Read from the live stream whose last event time is smallest.
        live = [n for n in names if n not in exhausted]
        n = min(live, key=lambda s: (last_t.get(s, -np.inf), names.index(s)))
        try:
            part = next(iters[n])
            # One stream: Spark's sort is the order; event time only merges streams.
            t = _event_time(part, frames[n][1][0]) if len(names) > 1 else np.zeros(part.num_rows)
            buffers[n].append(part.append_column(_T, pa.array(t)))
            last_t[n] = float(t[-1]) if len(t) else last_t.get(n, -np.inf)
        except StopIteration:
            exhausted.add(n)
        live = [s for s in names if s not in exhausted]
        bound = min((last_t.get(s, -np.inf) for s in live), default=np.inf)
        # Rows with event time < bound are final (== bound may still tie across streams).
        chunks, keys = [], []
        for i, s in enumerate(names):
            if not buffers[s]:
                continue
            buf = pa.concat_tables(buffers[s])
            t = np.asarray(buf.column(_T))
            k = int(np.searchsorted(t, bound, side="left")) if len(live) else len(t)
            if len(names) == 1:
                k = len(t)  # one stream: its own sort is the order
            ready, rest = buf.slice(0, k), buf.slice(k)
            buffers[s] = [rest] if rest.num_rows else []
            if ready.num_rows:
                chunks.append((s, ready))
                keys.append((np.asarray(ready.column(_T)), np.full(ready.num_rows, i),
                             np.arange(seq[s], seq[s] + ready.num_rows)))
                seq[s] += ready.num_rows
        if not chunks:
            continue
        t_all = np.concatenate([k[0] for k in keys])
        i_all = np.concatenate([k[1] for k in keys])
        s_all = np.concatenate([k[2] for k in keys])
        perm = np.lexsort((s_all, i_all, t_all))
        order = np.empty(len(perm), dtype=np.int64)
        order[perm] = np.arange(next_order, next_order + len(perm), dtype=np.int64)
        offset = 0
        for (s, ready), (_, _, sq) in zip(chunks, keys):
            n_rows = ready.num_rows
            out = ready.drop_columns([_T])
            out = out.append_column(ORDER, pa.array(order[offset:offset + n_rows], pa.int64()))
            out = out.append_column(STREAM_SEQ, pa.array(sq, pa.int64()))
            pending[s].append(out)
            offset += n_rows
            report.rows[s] = report.rows.get(s, 0) + n_rows
        next_order += len(perm)
        pending_rows += len(perm)
        if pending_rows >= segment_rows:
            flush(next_order)
    flush(next_order)
    if trim_below is not None:
        report.segments_trimmed = writer.trim(trim_below)
    if seal:
        writer.seal()
    return report


def with_order(df: Any, order_by: Sequence[str], others: Mapping[str, tuple[Any, Sequence[str]]] | None = None,
               stream: str | None = None) -> Any:
    """``df`` with the ``_order`` column ``feed`` gives it (computed in Spark, for expected results).

    For a single fed DataFrame: ``with_order(df, ["sched_ts"])``. When it was
    fed together with others, pass the whole mapping as ``others`` and its
    name as ``stream``. Uses a global window (one partition): meant for
    validation-sized data.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if others is None:
        w = Window.orderBy(*_total_order(df, order_by))
        return df.withColumn(ORDER, F.row_number().over(w) - 1)
    names = list(others)
    keyed = []
    for i, name in enumerate(names):
        d, ob = others[name]
        w = Window.orderBy(*_total_order(d, ob))
        t = F.col(f"`{ob[0]}`")
        t = F.unix_micros(t.cast("timestamp")) if dict(d.dtypes)[ob[0]] in ("timestamp", "date", "timestamp_ntz") else t.cast("double")
        keyed.append((name, d.withColumn("__seq", F.row_number().over(w) - 1).withColumn("__i", F.lit(i))
                      .withColumn(_T, t)))
    keys = None
    for name, k in keyed:
        part = k.select(_T, "__i", "__seq")
        keys = part if keys is None else keys.unionByName(part)
    w_all = Window.orderBy(F.col(_T).asc_nulls_first(), "__i", "__seq")
    keys = keys.withColumn(ORDER, F.row_number().over(w_all) - 1)
    mine = dict(keyed)[stream]
    return mine.join(keys, on=[_T, "__i", "__seq"]).drop(_T, "__i", "__seq")


@dataclass
class ValidationReport:
    """Outcome of ``validate``: exactly-once and equality checks, with examples."""

    output_rows: int
    expected_rows: int
    duplicate_identities: list[tuple[int, int]]
    missing_identities: list[tuple[int, int]]
    unexpected_rows: list[dict]
    missing_rows: list[dict]
    n_duplicates: int = 0
    n_missing_identities: int = 0
    n_unexpected: int = 0
    n_missing: int = 0

    @property
    def ok(self) -> bool:
        """True when the output is exactly-once and equal to the expected rows."""
        return not (self.n_duplicates or self.n_missing_identities or self.n_unexpected or self.n_missing)

    def summary(self) -> str:
        """A readable multi-line summary."""
        lines = [f"validation: {'PASS' if self.ok else 'FAIL'}",
                 f"  output rows {self.output_rows:,}, expected rows {self.expected_rows:,}",
                 f"  duplicated identities (slice, out_seq): {self.n_duplicates}"
                 + (f"  e.g. {self.duplicate_identities[:5]}" if self.duplicate_identities else ""),
                 f"  missing identities (slice, out_seq):    {self.n_missing_identities}"
                 + (f"  e.g. {self.missing_identities[:5]}" if self.missing_identities else ""),
                 f"  rows not expected: {self.n_unexpected}, expected rows missing: {self.n_missing}"]
        for title, rows in (("first rows not expected", self.unexpected_rows),
                            ("first expected rows missing", self.missing_rows)):
            if rows:
                lines.append(f"  {title}:")
                lines.extend(f"    {r}" for r in rows[:5])
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def validate(output_dir: str | os.PathLike, expected_df: Any, key: Sequence[str] | None = None, *,
             spark: Any = None, round_digits: int | None = None, show: bool = True,
             examples: int = 5) -> ValidationReport:
    """Check a job's Parquet sink output with Spark.

    (a) Exactly-once: every identity (producer slice, out_seq) appears once,
    and each slice's out_seq is dense from 0 (no gap = nothing lost).
    (b) Equality: the output rows, restricted to ``expected_df``'s columns,
    equal ``expected_df`` as multisets. ``key`` names the columns shown
    first in examples; ``round_digits`` rounds floating columns on both sides.
    """
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    spark = spark or spark_session()
    # Both sides are read several times (counts, the duplicate and gap checks, both
    # exceptAlls): kept once, an expected side of window functions is computed once, not
    # four times.
    out = spark.read.option("recursiveFileLookup", "true").parquet(str(output_dir)).persist(StorageLevel.MEMORY_AND_DISK)
    kept = [out]
    try:
        total = out.count()
        dup = (out.groupBy(SLICE, SEQ).count().where("count > 1").orderBy(SLICE, SEQ))
        n_dup = dup.count()
        dups = [(r[SLICE], r[SEQ]) for r in dup.limit(examples).collect()]
        per_slice = out.groupBy(SLICE).agg(F.max(SEQ).alias("mx"), F.countDistinct(SEQ).alias("n")).collect()
        n_missing_ids = sum(r["mx"] + 1 - r["n"] for r in per_slice)
        missing_ids: list[tuple[int, int]] = []
        if n_missing_ids:
            for r in sorted(per_slice, key=lambda r: r[SLICE]):
                if r["mx"] + 1 - r["n"] and len(missing_ids) < examples:
                    have = {x[SEQ] for x in out.where(F.col(SLICE) == r[SLICE]).select(SEQ).collect()}
                    missing_ids += [(r[SLICE], s) for s in range(r["mx"] + 1) if s not in have][: examples - len(missing_ids)]
        cols = list(expected_df.columns)
        absent = [c for c in cols if c not in out.columns]
        if absent:
            raise ValueError(f"expected columns {absent} are not in the output columns {out.columns}")
        got = out.select(*cols)
        exp = expected_df.select(*cols)
        if round_digits is not None:
            for name, typ in exp.dtypes:
                if typ in ("double", "float"):
                    got = got.withColumn(name, F.round(name, round_digits))
                    exp = exp.withColumn(name, F.round(name, round_digits))
        exp = exp.persist(StorageLevel.MEMORY_AND_DISK)
        kept.append(exp)
        unexpected = got.exceptAll(exp)
        missing = exp.exceptAll(got)
        order = [c for c in (key or []) if c in cols] or cols[:1]
        n_unexp, n_miss = unexpected.count(), missing.count()
        report = ValidationReport(
            output_rows=total, expected_rows=exp.count(), duplicate_identities=dups,
            missing_identities=missing_ids,
            unexpected_rows=[r.asDict() for r in unexpected.orderBy(*order).limit(examples).collect()] if n_unexp else [],
            missing_rows=[r.asDict() for r in missing.orderBy(*order).limit(examples).collect()] if n_miss else [],
            n_duplicates=n_dup, n_missing_identities=n_missing_ids, n_unexpected=n_unexp, n_missing=n_miss)
    finally:
        for df in kept:
            df.unpersist()
    if show:
        print(report.summary())
    return report
