"""Sink files: how many files a job's Parquet sink leaves, and what its commit costs.

A word count over ``--rows`` words (default 10,000,000; 10^5 distinct, Zipf-like draws, seed
7) on Ray, 2 containers a stage, the count stage on 64 slices, epochs of 16,384 words,
checkpoints every second to 2 copies, its running counts into a ``ParquetSink``: every word is
one output row. While the job runs, its hosts stage one part per slice and epoch, and every
``max_age_s`` (``--max-age``: one configuration each; 0: never) the master commits the parts of
the epochs every slice has checkpointed; when it has finished, the last commit takes the rest,
into files of about 128 MiB (``ParquetSink``). Reported per run: the staged parts, the committed
files and their size, the job's time to ``finished`` and the last commit's time after it (from
the job's timeline), the commits made while it ran, and a check that the directory read with
pyarrow holds every row once; medians of ``--repeat``.

    python -m benchmarks.sink_files --json
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import chronostream as cs
from benchmarks.common import emit, median, parser


def words(n: int) -> pa.Table:
    """``n`` words over 10^5 distinct ones (Zipf-like: a few frequent, a long tail)."""
    rng = np.random.default_rng(7)
    ids = np.minimum(rng.zipf(1.3, n), 100_000)
    return pa.table({"word": pa.array(ids.astype(np.int64)).cast(pa.string())})


def run_once(table: pa.Table, out: Path, max_age_s: float) -> dict:
    """One job into ``out``: parts, files, megabytes, seconds to finished and of the last commit."""
    q = cs.Query(epoch_events=16384)
    q.source("words", table).key_by("word").count(slices=64, name="count") \
        .sink(cs.ParquetSink(str(out), name="counts", max_age_s=max_age_s))
    job = cs.run(q, containers=2, checkpoint_interval_s=1.0, backup_factor=2)
    try:
        job.wait()
        timeline = job.timeline()
        events = {kind: t for t, kind, _ in timeline if kind in ("job_running", "job_finished", "sinks_committed")}
        running_commits = sum(kind == "sink_committed" for _, kind, _ in timeline)
    finally:
        job.stop()
    files = sorted(out.glob("part-*.parquet"))
    got = pq.read_table(out)  # (what any reader of the directory sees)
    ids = got.select(["_slice", "_seq"]).to_pandas()
    assert got.num_rows == table.num_rows and not ids.duplicated().any(), "every row once"
    return {"staged_parts": json.loads((out / "_committed.json").read_text())["staged_parts"],
            "files": len(files), "mb": round(sum(f.stat().st_size for f in files) / 1e6, 1),
            "job_s": events["job_finished"] - events["job_running"],
            "commit_s": events["sinks_committed"] - events["job_finished"], "commits_while_running": running_commits}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000_000, help="words per run (default 10,000,000)")
    p.add_argument("--max-age", default="0,5", help="ParquetSink max_age_s per configuration (default 0,5)")
    args = p.parse_args()
    n = 200_000 if args.quick else args.rows
    table = words(n)
    cs.ensure_ray()
    rows = []
    for max_age_s in [float(a) for a in args.max_age.split(",")]:
        runs = []
        for _ in range(args.repeat):  # (configurations one after another: each on a machine as quiet)
            out = Path(tempfile.mkdtemp(prefix="chronostream-sink-files-")) / "out"
            try:
                runs.append(run_once(table, out, max_age_s))
            finally:
                shutil.rmtree(out.parent, ignore_errors=True)
        rows.append({"rows": n, "max_age_s": max_age_s, "staged_parts": runs[0]["staged_parts"],
                     "files": runs[0]["files"], "mb": runs[0]["mb"],
                     "commits_while_running": runs[0]["commits_while_running"],
                     "job_s": round(median([r["job_s"] for r in runs]), 2),
                     "commit_s": round(median([r["commit_s"] for r in runs]), 2),
                     "runs": [{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()} for r in runs]})
    emit({"containers_per_stage": 2, "slices": 64, "epoch_events": 16384, "checkpoint_interval_s": 1.0,
          "repeat": args.repeat, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
