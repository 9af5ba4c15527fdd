"""Word-count throughput: runtime (vectorized and per-event) vs serial executor vs hand-written Arrow.

Input: seeded Zipf text (chronostream.datasets.zipf_text: 50,000-word
vocabulary, exponent 1.2, 10 words per line, seed 42). Every configuration
computes the same thing: one running-count update per word.

- runtime: Ray, 2 containers per stage (source: 4 slices; count: 32 slices),
  vectorized split (flat_map_batches) + built-in keyed count;
- runtime_per_event: the same with a per-event flat_map and a per-event
  ``Operator.consume`` counter;
- serial: the serial executor (one event at a time; run on a smaller input);
- handwritten: one process, Arrow/numpy, no framework.

Each runtime model runs twice per repeat, in one process and alternating:
without checkpoints and with a checkpoint every ``--checkpoint-interval``
seconds (default 1) to ``--backup-factor`` copies a slice (default 2: with 2
containers a stage, one on the stage's other host and one on another
stage's host); ``ft_ratio`` is the median with checkpoints over the median
without, per model. ``--checkpoint-every K`` checkpoints the second run every
K epochs instead.

The counts go to a memory sink; with checkpoints, a memory sink's rows
reach the master's catalog every round (so they outlive their host), which
is part of what checkpoints cost here. ``--sink parquet`` writes them to a
Parquet sink instead (files the hosts write, in a temporary directory).

``--no-shm`` sends every epoch message through Ray's object store
(``shm_transport=False``); by default
large parts between hosts of one node go as files in shared memory
(``containers/shm_transport.py``).

Runtime rates are taken over the job's processing time (from the moment all
containers are started to the last epoch; actor start-up excluded and
reported separately as ``deploy_s``), and over the wall time from ``cs.run``
to the job's end (``wall_words_per_s``). Medians of --repeat runs.

    python -m benchmarks.throughput --json
"""

from __future__ import annotations

import shutil
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import chronostream as cs
from benchmarks.common import emit, median, parser
from chronostream.datasets import split_words, zipf_text


class PerEventCount(cs.Operator):
    """Word count written with the per-event operator model."""

    def setup(self) -> None:
        self.counts = self.register_state("counts")

    def consume(self, stream_id: str, event: dict) -> None:
        w = event["word"]
        n = self.counts.get(w, 0) + 1
        self.counts.set(w, n)
        self.produce("out", {"word": w, "count": n})


def build(lines: pa.Table, per_event: bool, slices: int = 32, epoch_events: int = 16384,
          parquet_dir: str | None = None) -> cs.Query:
    """The word-count query (vectorized or per-event), into a memory sink or, with ``parquet_dir``,
    a Parquet sink there."""
    q = cs.Query(epoch_events=epoch_events)
    src = q.source("lines", lines)
    if per_event:
        words = src.flat_map(lambda e: [{"word": w} for w in e["line"].split()])
        counts = words.key_by("word").apply(PerEventCount, slices=slices, name="count")
    else:
        counts = src.flat_map_batches(split_words).key_by("word").count(slices=slices, name="count")
    counts.sink(cs.ParquetSink(parquet_dir, name="counts", overwrite=True) if parquet_dir else None, name="counts")
    return q


def handwritten(lines: pa.Table) -> int:
    """Running word counts in plain Arrow/numpy, one process (the no-framework baseline)."""
    words = pc.list_flatten(pc.utf8_split_whitespace(lines["line"].combine_chunks()))
    enc = pc.dictionary_encode(words)
    codes = np.asarray(enc.indices)
    order = np.argsort(codes, kind="stable")
    sc = codes[order]
    starts = np.ones(len(sc), dtype=bool)
    starts[1:] = sc[1:] != sc[:-1]
    start_pos = np.flatnonzero(starts)
    seg = np.cumsum(starts) - 1
    running = np.empty(len(sc), dtype=np.int64)
    running[order] = np.arange(len(sc)) - start_pos[seg] + 1
    out = pa.table({"word": words, "count": running})
    return out.num_rows


def run_runtime(lines: pa.Table, per_event: bool, words: int, checkpoint_every: int = 0,
                checkpoint_interval_s: float = 0.0, backup_factor: int = 2,
                shm_transport: bool = True, parquet: bool = False) -> tuple[float, float, float]:
    """(words/s over processing time, words/s from ``cs.run`` to the end, deploy seconds) of one
    runtime run (``parquet``: into a Parquet sink in a temporary directory)."""
    out = tempfile.mkdtemp(prefix="throughput-sink-") if parquet else None
    try:
        t0 = time.perf_counter()
        job = cs.run(build(lines, per_event, parquet_dir=out), containers=2, checkpoint_every=checkpoint_every,
                     checkpoint_interval_s=checkpoint_interval_s, backup_factor=backup_factor,
                     shm_transport=shm_transport)
        deploy = time.perf_counter() - t0
        try:
            st = job.wait()
            wall = time.perf_counter() - t0
            n = sum(s.events_out for s in job.statistics().values() if s.stage == "count")
        finally:
            job.stop()
    finally:
        if out is not None:
            shutil.rmtree(out, ignore_errors=True)
    assert n == words, f"counted {n} of {words} words"
    return words / st.elapsed_s, words / wall, deploy


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--checkpoint-interval", type=float, default=1.0,
                   help="the checkpointed runs take a checkpoint every this many seconds (default 1)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="the checkpointed runs checkpoint every K epochs instead (default 0: by time)")
    p.add_argument("--backup-factor", type=int, default=2, help="copies a slice with checkpoints (default 2)")
    p.add_argument("--no-shm", action="store_true",
                   help="epoch messages through Ray's object store only (no shared-memory files)")
    p.add_argument("--sink", choices=("memory", "parquet"), default="memory",
                   help="where the runtime's counts go (default memory: with checkpoints its rows reach the "
                        "master's catalog every round; parquet: files the hosts write)")
    args = p.parse_args()
    on = {"checkpoint_every": args.checkpoint_every,
          "checkpoint_interval_s": 0.0 if args.checkpoint_every else args.checkpoint_interval,
          "backup_factor": args.backup_factor, "shm_transport": not args.no_shm, "parquet": args.sink == "parquet"}
    off = {"checkpoint_every": 0, "checkpoint_interval_s": 0.0, "backup_factor": args.backup_factor,
           "shm_transport": not args.no_shm, "parquet": args.sink == "parquet"}
    n_lines = 20_000 if args.quick else 200_000
    lines = zipf_text(n_lines)
    words = int(pc.sum(pc.list_value_length(pc.utf8_split_whitespace(lines["line"]))).as_py())
    cs.ensure_ray()
    hand, deploys = [], []
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for i in range(args.repeat):
        t = time.perf_counter()
        handwritten(lines)
        hand.append(words / (time.perf_counter() - t))
        for model, per_event in (("vectorized", False), ("per_event", True)):
            # (alternating which goes first: a noisy machine's drift falls on both)
            for ckpt, opts in ((("off", off), ("on", on)) if i % 2 == 0 else (("on", on), ("off", off))):
                rate, wall, deploy = run_runtime(lines, per_event, words, **opts)
                runs.setdefault((model, ckpt), []).append((rate, wall))
                deploys.append(deploy)
    small = lines.slice(0, min(5_000, n_lines))
    small_words = int(pc.sum(pc.list_value_length(pc.utf8_split_whitespace(small["line"]))).as_py())
    t = time.perf_counter()
    cs.run(build(small, False), executor="serial")
    serial = small_words / (time.perf_counter() - t)

    def rate(model: str, ckpt: str, wall: bool = False) -> float:
        return median([r[1] if wall else r[0] for r in runs[(model, ckpt)]])

    rows = []
    for model in ("vectorized", "per_event"):
        for ckpt in ("off", "on"):
            rows.append({"config": f"runtime_{model}" + ("_checkpoints" if ckpt == "on" else ""),
                         "checkpoints": ckpt == "on", "words_per_s": round(rate(model, ckpt)),
                         "wall_words_per_s": round(rate(model, ckpt, wall=True)),
                         "runs": [round(r[0]) for r in runs[(model, ckpt)]]})
    result = {
        "events": words,
        "lines": n_lines,
        "runtime_words_per_s": round(rate("vectorized", "off")),
        "runtime_per_event_words_per_s": round(rate("per_event", "off")),
        "ft_ratio": round(rate("vectorized", "on") / rate("vectorized", "off"), 3),
        "ft_ratio_per_event": round(rate("per_event", "on") / rate("per_event", "off"), 3),
        "serial_words_per_s": round(serial),
        "handwritten_words_per_s": round(median(hand)),
        "runtime_vs_handwritten": round(rate("vectorized", "off") / median(hand), 3),
        "deploy_s": round(median(deploys), 2),
        "containers_per_stage": 2,
        "checkpoint_interval_s": on["checkpoint_interval_s"],
        "checkpoint_every": 0,
        "checkpointed_every": args.checkpoint_every,
        "backup_factor": args.backup_factor,
        "shm_transport": not args.no_shm,
        "sink": args.sink,
        "repeat": args.repeat,
        "rows": rows + [
            {"config": "serial", "words_per_s": round(serial), "runs": [round(serial)]},
            {"config": "handwritten_arrow", "words_per_s": round(median(hand)), "runs": [round(x) for x in hand]},
        ],
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
