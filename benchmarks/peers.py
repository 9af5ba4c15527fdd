"""Peers: a running word count and a keyed running sum through this runtime, Spark Structured Streaming and Bytewax.

The same generated data goes through every system in one run: seeded Zipf
text (``chronostream.datasets.zipf_text``: 50,000-word vocabulary, exponent
1.2, 10 words a line, seed 42), ``--words`` words in all (default
20,000,000, so that start-up is amortized), written once by this process as
Parquet files (20 of them) that every system reads. Two queries:

- ``wordcount``: split each line into words; the running count of each word;
- ``keyed_sum``: rows ``(word, amount)`` (the same words, amounts 1..100 drawn
  with seed 7); the running sum of ``amount`` per word.

Systems and configurations, each run in its own process:

- ``chronostream``: Ray, 2 containers a stage (32 slices for the keyed
  stage), vectorized (``flat_map_batches`` split, built-in ``count``/``sum``),
  without checkpoints (``checkpoints_off``) and with a checkpoint every second
  to 2 backup copies (``checkpoints_on``, the default). It emits one running
  value per input word (20,000,000 output rows) into its memory sink.
- ``spark``: Structured Streaming, ``local[2]`` (4 shuffle partitions), the
  Parquet files as a file stream (one file a micro-batch, trigger
  ``availableNow``), ``groupBy(word).count()`` / ``sum(amount)``, update mode,
  the default state store, a checkpoint location, the ``noop`` sink. Update
  mode emits one row per changed key per micro-batch, not per input word:
  less output than the other two.
- ``bytewax`` (when installed: ``pip install -e '.[peers]'``): 2 processes of
  one worker each, each reading every other file in batches; ``flat_map_batch``
  split, ``key_on``, ``stateful_map`` (its per-item model), a sink that counts
  what it is given; without recovery and with recovery (snapshots every
  second into sqlite partitions, ``checkpoints_on``).

Figures: ``words_per_s`` is words (rows, for ``keyed_sum``) over the
processing time (this runtime: the job's own, from all containers started to
its end; Spark: from the query's start to its end; Bytewax: from the dataflow's
start to its end); ``wall_words_per_s`` is over the whole process's life, from
its creation (interpreter, imports, Ray or Spark or Bytewax start, reading the
files) to the end. ``vs_best_peer`` is a chronostream row's figure over the
best peer's on the same query and column. Medians of ``--repeat`` runs.

    python -m benchmarks.peers --json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import chronostream as cs
from benchmarks.common import emit, last_json_line, median, parser
from chronostream.datasets import split_words, zipf_text

QUERIES = ("wordcount", "keyed_sum")
FILES = 20
WORDS_PER_LINE = 10


def prepare(data_dir: str, words: int) -> dict[str, int]:
    """Write both queries' input as ``FILES`` Parquet files each under ``data_dir``; their sizes."""
    lines = zipf_text(max(1, words // WORDS_PER_LINE), words_per_line=WORDS_PER_LINE)
    flat = pc.list_flatten(pc.utf8_split_whitespace(lines["line"]))
    amounts = np.random.default_rng(7).integers(1, 101, size=len(flat), dtype=np.int64)
    pairs = pa.table({"word": flat, "amount": amounts})
    for query, table in (("wordcount", lines), ("keyed_sum", pairs)):
        os.makedirs(os.path.join(data_dir, query))
        step = -(-table.num_rows // FILES)
        for i in range(FILES):
            pq.write_table(table.slice(i * step, step), os.path.join(data_dir, query, f"part-{i:03d}.parquet"))
    return {"lines": lines.num_rows, "words": len(flat)}


def _files(data_dir: str, query: str) -> list[str]:
    d = os.path.join(data_dir, query)
    return [os.path.join(d, f) for f in sorted(os.listdir(d))]


def _since_creation() -> float:
    """Seconds since this process was created (its whole life, interpreter start included)."""
    return time.time() - psutil.Process().create_time()


def child_chronostream(query: str, data_dir: str, checkpoints: bool) -> dict[str, Any]:
    """One run of this runtime on ``query``: its processing seconds and the rows it counted."""
    table = pa.concat_tables(pq.read_table(f) for f in _files(data_dir, query))
    q = cs.Query(epoch_events=16384)
    src = q.source("input", table)
    if query == "wordcount":
        keyed = src.flat_map_batches(split_words).key_by("word")
        keyed.count(slices=32, name="agg").sink(name="out")
    else:
        src.key_by("word").sum("amount", slices=32, name="agg").sink(name="out")
    cs.ensure_ray()
    opts = {"checkpoint_interval_s": 1.0, "backup_factor": 2} if checkpoints else {"checkpoint_interval_s": 0.0}
    job = cs.run(q, containers=2, **opts)
    try:
        st = job.wait()
        wall = _since_creation()
        n = sum(s.events_out for s in job.statistics().values() if s.stage == "agg")
    finally:
        job.stop()
    return {"processing_s": st.elapsed_s, "wall_s": wall, "rows_out": n}


def child_spark(query: str, data_dir: str) -> dict[str, Any]:
    """One run of Spark Structured Streaming on ``query`` (see the module doc)."""
    from pyspark.sql import functions as F

    from chronostream.spark import spark_session

    spark = spark_session("local[2]", app="peers")
    src = os.path.join(data_dir, query)
    schema = pq.read_schema(_files(data_dir, query)[0])
    stream = (spark.readStream.schema(_spark_schema(schema))
              .option("maxFilesPerTrigger", 1).parquet(src))
    if query == "wordcount":
        agg = stream.select(F.explode(F.split("line", " ")).alias("word")).groupBy("word").count()
    else:
        agg = stream.groupBy("word").agg(F.sum("amount").alias("sum"))
    ckpt = tempfile.mkdtemp(prefix="peers-spark-ckpt-")
    try:
        t0 = time.perf_counter()
        sq = (agg.writeStream.outputMode("update").format("noop").option("checkpointLocation", ckpt)
              .trigger(availableNow=True).start())
        sq.awaitTermination()
        processing = time.perf_counter() - t0
        wall = _since_creation()
        rows_in = sum(p["numInputRows"] for p in sq.recentProgress)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
        spark.stop()
    return {"processing_s": processing, "wall_s": wall, "rows_in": rows_in}


def _spark_schema(schema: pa.Schema) -> Any:
    from pyspark.sql import types as T

    kinds = {pa.string(): T.StringType(), pa.large_string(): T.StringType(), pa.int64(): T.LongType()}
    return T.StructType([T.StructField(f.name, kinds[f.type]) for f in schema])


def child_bytewax(query: str, data_dir: str, checkpoints: bool, proc_id: int, addresses: list[str],
                  recovery_dir: str) -> dict[str, Any]:
    """One of Bytewax's processes on ``query`` (see the module doc)."""
    import bytewax.operators as op
    from bytewax.dataflow import Dataflow
    from bytewax.inputs import FixedPartitionedSource, StatefulSourcePartition
    from bytewax.outputs import DynamicSink, StatelessSinkPartition
    from bytewax.recovery import RecoveryConfig
    from bytewax.testing import cluster_main

    files = _files(data_dir, query)
    counted = [0]

    class FilePart(StatefulSourcePartition):
        def __init__(self, paths: list[str], at: int) -> None:
            self.paths, self.at = paths, at

        def next_batch(self) -> list[Any]:
            if self.at >= len(self.paths):
                raise StopIteration()
            t = pq.read_table(self.paths[self.at])
            self.at += 1
            if query == "wordcount":
                return t["line"].to_pylist()
            return list(zip(t["word"].to_pylist(), t["amount"].to_pylist()))

        def snapshot(self) -> int:
            return self.at

    class Files(FixedPartitionedSource):
        def list_parts(self) -> list[str]:
            return [str(p) for p in range(len(addresses))]

        def build_part(self, step_id: str, for_part: str, resume_state: Any) -> FilePart:
            return FilePart(files[int(for_part)::len(addresses)], resume_state or 0)

    class CountPart(StatelessSinkPartition):
        def write_batch(self, items: list[Any]) -> None:
            counted[0] += len(items)

    class CountSink(DynamicSink):
        def build(self, step_id: str, worker_index: int, worker_count: int) -> CountPart:
            return CountPart()

    def add(state: Any, value: int) -> tuple[int, int]:
        total = (state or 0) + value
        return total, total

    flow = Dataflow("peers")
    stream = op.input("input", flow, Files())
    if query == "wordcount":
        words = op.flat_map_batch("split", stream, lambda lines: [w for ln in lines for w in ln.split()])
        keyed = op.map_value("one", op.key_on("key", words, lambda w: w), lambda w: 1)
    else:
        keyed = op.map_value("amount", op.key_on("key", stream, lambda p: p[0]), lambda p: p[1])
    op.output("out", op.stateful_map("agg", keyed, add), CountSink())
    kwargs: dict[str, Any] = {}
    if checkpoints:
        kwargs = {"epoch_interval": datetime.timedelta(seconds=1), "recovery_config": RecoveryConfig(recovery_dir)}
    t0 = time.perf_counter()
    cluster_main(flow, addresses, proc_id, worker_count_per_proc=1, **kwargs)
    return {"processing_s": time.perf_counter() - t0, "wall_s": _since_creation(), "rows_out": counted[0]}


def _child_result(cmd: list[str]) -> dict[str, Any]:
    return last_json_line(subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout)


def _child_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.peers", "--child", *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_bytewax(query: str, data_dir: str, checkpoints: bool) -> dict[str, Any]:
    """Bytewax's two processes at once; the slower one's times and both sinks' counts."""
    from bytewax.recovery import init_db_dir

    addresses = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    recovery = tempfile.mkdtemp(prefix="peers-bytewax-")
    try:
        if checkpoints:
            init_db_dir(Path(recovery), len(addresses))
        procs = [subprocess.Popen(_child_cmd("bytewax", query, data_dir, str(int(checkpoints)), str(i),
                                             ",".join(addresses), recovery), stdout=subprocess.PIPE, text=True)
                 for i in range(len(addresses))]
        results = []
        for p in procs:
            out, _ = p.communicate()
            if p.returncode:
                raise RuntimeError(f"bytewax process exited with {p.returncode}")
            results.append(last_json_line(out))
    finally:
        shutil.rmtree(recovery, ignore_errors=True)
    return {"processing_s": max(r["processing_s"] for r in results), "wall_s": max(r["wall_s"] for r in results),
            "rows_out": sum(r["rows_out"] for r in results)}


def configurations(systems: list[str]) -> list[tuple[str, str]]:
    """(system, config) pairs to run, in order."""
    out = []
    if "chronostream" in systems:
        out += [("chronostream", "checkpoints_off"), ("chronostream", "checkpoints_on")]
    if "spark" in systems:
        out.append(("spark", "update_mode_checkpointed"))
    if "bytewax" in systems:
        out += [("bytewax", "checkpoints_off"), ("bytewax", "checkpoints_on")]
    return out


def run_one(system: str, config: str, query: str, data_dir: str, sizes: dict[str, int]) -> dict[str, Any]:
    """One run of one configuration, checked: every system saw every input row."""
    on = config == "checkpoints_on"
    if system == "chronostream":
        r = _child_result(_child_cmd("chronostream", query, data_dir, str(int(on))))
        assert r["rows_out"] == sizes["words"], f"{system} {query}: {r['rows_out']} of {sizes['words']} rows"
    elif system == "spark":
        r = _child_result(_child_cmd("spark", query, data_dir))
        want = sizes["lines"] if query == "wordcount" else sizes["words"]
        assert r["rows_in"] == want, f"spark {query}: read {r['rows_in']} of {want} rows"
    else:
        r = run_bytewax(query, data_dir, on)
        assert r["rows_out"] == sizes["words"], f"{system} {query}: {r['rows_out']} of {sizes['words']} rows"
    return r


def child_main(argv: list[str]) -> None:
    """``--child SYSTEM ...``: one run in this process; its result as the last line."""
    system, query, data_dir = argv[:3]
    if system == "chronostream":
        r = child_chronostream(query, data_dir, bool(int(argv[3])))
    elif system == "spark":
        r = child_spark(query, data_dir)
    else:
        r = child_bytewax(query, data_dir, bool(int(argv[3])), int(argv[4]), argv[5].split(","), argv[6])
    print(json.dumps(r))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child_main(sys.argv[2:])
        return
    p: argparse.ArgumentParser = parser(__doc__.splitlines()[0])
    p.add_argument("--words", type=int, default=20_000_000, help="words in the input (default 20,000,000)")
    p.add_argument("--systems", default="chronostream,spark,bytewax",
                   help="comma-separated: chronostream, spark, bytewax (default all; bytewax when installed)")
    p.add_argument("--queries", default=",".join(QUERIES), help="comma-separated: wordcount, keyed_sum")
    args = p.parse_args()
    words = 200_000 if args.quick else args.words
    systems = [s for s in args.systems.split(",") if s]
    skipped = []
    if "bytewax" in systems and importlib.util.find_spec("bytewax") is None:
        systems.remove("bytewax")
        skipped.append("bytewax (not installed: pip install -e '.[peers]')")
    queries = [q for q in args.queries.split(",") if q]
    data_dir = tempfile.mkdtemp(prefix="peers-data-")
    try:
        sizes = prepare(data_dir, words)
        runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        for i in range(args.repeat):
            for query in queries:
                confs = configurations(systems)
                for system, config in (confs if i % 2 == 0 else confs[::-1]):
                    runs.setdefault((query, system, config), []).append(
                        run_one(system, config, query, data_dir, sizes))
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    rows = []
    for (query, system, config), rs in runs.items():
        n = sizes["words"]
        rows.append({"query": query, "system": system, "config": config,
                     "words_per_s": round(median([n / r["processing_s"] for r in rs])),
                     "wall_words_per_s": round(median([n / r["wall_s"] for r in rs])),
                     "runs": [round(n / r["processing_s"]) for r in rs]})
    for row in rows:
        peers = [r for r in rows if r["query"] == row["query"] and r["system"] != "chronostream"]
        if row["system"] == "chronostream" and peers:
            for col in ("words_per_s", "wall_words_per_s"):
                best = max(r[col] for r in peers)
                row[f"vs_best_peer{'' if col == 'words_per_s' else '_wall'}"] = round(row[col] / best, 2)
    emit({"words": sizes["words"], "lines": sizes["lines"], "files": FILES, "containers_per_stage": 2,
          "spark_master": "local[2]", "bytewax_processes": 2, "checkpoint_interval_s": 1.0, "backup_factor": 2,
          "skipped": skipped, "repeat": args.repeat, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
