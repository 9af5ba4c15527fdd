"""Top-K frequent words per category over a sliding count window, by state size (ChronoStream paper Fig. 12).

The query is ``examples.topk`` (split and stop-word filter fused into the
source stage, a counting stage and a ranking stage, both keyed by category,
8 slices each), on Ray with one container per stage. Input: seeded
``topic_text`` lines (10 words a line, about half of them stop words, 8
Zipf-distributed categories). The state size is set by the window length
(words per category): the counting stage holds the window's words and their
counts, the ranking stage the counts by word and by count.

For each window length W the job gets a *prefill* (the first lines after
which every category has W words: every window is full, rounded up to
whole epochs) and then ``--lines`` measured lines (20,000 lines are about
100,000 word events, the events the two stateful stages process):

1. maximum throughput: prefill and measured lines in a sealed source log,
   read as fast as the job goes; ``seconds`` runs from the moment the last
   prefill epoch's output reached the sink to the moment the last epoch's
   did (``job.sink_write_times``), so it is the measured lines against full
   windows; lines and word events per second; ``state_mb``: the largest
   sum over both stages' slices in the live metrics (the runtime's
   estimate: msgpack size of each state's first 32 entries times its
   entry count);
2. latency: the prefill appended to a followed source log at once; once
   its output is all at the sink, the measured lines appended at 50% of
   the measured rate (50 ms chunks); p50/p99 over the measured lines'
   outputs of the time from the line's append to its part's sink write,
   and the runtime's own p99 (ingest -> sink, whole run).

    python -m benchmarks.topk --json                      # 20,000 lines, windows 1k/10k/50k words
    python -m benchmarks.topk --json --quick
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import chronostream as cs
from benchmarks.common import (
    append_to_sink_ms,
    emit,
    median,
    paced_run,
    parser,
    with_order,
    write_all,
)
from chronostream.datasets import topic_text
from chronostream.slices.sourcelog import SourceLogWriter
from examples.topk import split_category_words, topk_query

STATEFUL = ("counts", "rank")
CONTAINERS = {"text": 1, "counts": 1, "rank": 1}


def state_bytes(job: cs.Job) -> int:
    """Sum of the stateful stages' per-slice state sizes in the latest metrics snapshot (0 if none yet)."""
    stages = job.metrics()["snapshot"].get("stages", {})
    return sum(s["state_bytes"] for name in STATEFUL if name in stages for s in stages[name]["per_slice"])


def prefill_lines(table: pa.Table, window: int, epoch: int) -> int:
    """Lines after which every category holds ``window`` words, rounded up to whole epochs."""
    words, _ = split_category_words(table)
    cats = np.asarray(pc.dictionary_encode(words["category"]).combine_chunks().indices)
    line = np.asarray(words["id"])
    need = 0
    for c in np.unique(cats):
        ids = line[cats == c]
        if len(ids) < window:
            raise ValueError(f"the data never fills a {window}-word window: generate more lines")
        need = max(need, int(ids[window - 1]) + 1)
    return -(-need // epoch) * epoch


def _done_at(written: dict, last_epoch: int) -> float:
    return max(t for (_s, e), t in written.items() if e <= last_epoch)


def max_throughput(table: pa.Table, prefill: int, window: int, k: int, epoch: int, root: Path) -> dict:
    log_dir = str(root / f"bounded-{window}-{time.monotonic_ns()}")
    write_all(log_dir, "text", table)
    job = cs.run(topk_query(table.num_rows, window=window, k=k, epoch_events=epoch, log_dir=log_dir),
                 containers=CONTAINERS, checkpoint_interval_s=0)
    peak = 0
    try:
        while job.status().state == "running":
            peak = max(peak, state_bytes(job))
            time.sleep(0.5)
        job.wait(timeout_s=3600)
        words = job.results("topk").num_rows
        written = job.sink_write_times("topk")
    finally:
        job.stop()
    seconds = max(written.values()) - _done_at(written, prefill // epoch - 1)
    return {"seconds": seconds, "words": words, "state_mb": peak / 2**20}


def latency_run(table: pa.Table, prefill: int, window: int, k: int, epoch: int, rate: float, root: Path) -> dict:
    log_dir = str(root / f"followed-{window}-{time.monotonic_ns()}")
    w = SourceLogWriter(log_dir)
    w.append({"text": with_order(table, 0, prefill)}, high_water=prefill)
    appended: list[tuple[int, float]] = [(prefill - 1, time.time())]
    job = cs.run(topk_query(table.num_rows, window=window, k=k, epoch_events=epoch, log_dir=log_dir, follow=True),
                 containers=CONTAINERS, checkpoint_interval_s=0)
    last_prefill = prefill // epoch - 1

    def prefilled() -> bool:  # pace only once every epoch of the prefill has reached the sink
        return len({e for (_s, e) in job.sink_write_times("topk") if e <= last_prefill}) == last_prefill + 1

    rows, written, runtime = paced_run(job, w, "text", table, prefill, rate, "topk", appended, ready=prefilled)
    measured = rows.filter(pc.greater_equal(rows["_order"], prefill))
    lat = append_to_sink_ms(measured, written, appended, epoch)
    return {"p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "runtime_p99_ms": runtime["p99_ms"]}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=20_000)
    p.add_argument("--windows", default="1000,10000,50000", help="window lengths, words per category")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--epoch", type=int, default=500, help="source events (lines) per epoch")
    args = p.parse_args()
    n = 4_000 if args.quick else args.lines
    windows = [1000, 5000] if args.quick else [int(w) for w in args.windows.split(",")]
    repeat = 1 if args.quick else args.repeat
    cs.ensure_ray(num_cpus=2)
    rows = []
    root = Path(tempfile.mkdtemp(prefix="chronostream-topk-"))
    try:
        for window in windows:
            probe = topic_text(3 * window + n, categories=8, words_per_line=10, seed=42)
            prefill = prefill_lines(probe, window, args.epoch)
            table = probe.slice(0, prefill + n)
            measured = split_category_words(table.slice(prefill))[0].num_rows
            top = [max_throughput(table, prefill, window, args.k, args.epoch, root) for _ in range(repeat)]
            assert all(r["words"] == split_category_words(table)[0].num_rows for r in top), "every word ranked"
            secs = median([r["seconds"] for r in top])
            lat = latency_run(table, prefill, window, args.k, args.epoch, n / secs / 2, root)
            rows.append({"window": window, "prefill_lines": prefill, "events": n, "word_events": measured,
                         "seconds": round(secs, 2), "events_per_s": round(n / secs),
                         "word_events_per_s": round(measured / secs),
                         "state_mb": round(median([r["state_mb"] for r in top]), 2),
                         "offered_events_per_s": round(n / secs / 2),
                         "p50_ms": round(lat["p50_ms"], 1), "p99_ms": round(lat["p99_ms"], 1),
                         "runtime_p99_ms": lat["runtime_p99_ms"]})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    emit({"lines": n, "k": args.k, "epoch_events": args.epoch, "containers": CONTAINERS, "repeat": repeat,
          "rows": rows}, args.json)


if __name__ == "__main__":
    main()
