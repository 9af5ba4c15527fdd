"""What a stage costs split over more containers: why ``Job.compact`` merges them.

Recoveries and scale-ins leave a stage's slices on a host spread over
several containers; each is its own epoch loop with its own messages from
every producer and its own slice group (docs/design.md section 7f,
"Compaction"). This measures that cost in one process (the runtime's
container cores, ``executor="local"``): the word count of
``benchmarks.slices`` (seeded Zipf text, vectorized split, the built-in
``count`` with 16 slices) with its counting stage in 1, 2, 4, 8 and 16
containers. Reported per container count: words/s (median of ``--repeat``
runs, configurations interleaved run by run) and the overhead against one
container. On Ray each extra container also costs its messages' trips
between processes, which this does not count.

    python -m benchmarks.containers --json
    python -m benchmarks.containers --json --counts 1,8 --repeat 9
"""

from __future__ import annotations

import time

import chronostream as cs
from benchmarks.common import emit, median, parser
from benchmarks.slices import word_count
from chronostream.datasets import zipf_text

SLICES = 16
COUNTS = (1, 2, 4, 8, 16)


def one_run(table, containers: int, epoch: int) -> float:
    """Seconds for the whole job with the counting stage in ``containers`` containers."""
    t0 = time.perf_counter()
    job = cs.run(word_count(table, SLICES, epoch), executor="local", containers={"lines": 1, "count": containers},
                 checkpoint_interval_s=0)
    elapsed = time.perf_counter() - t0
    assert job.results("counts").num_rows > 0
    return elapsed


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--words", type=int, default=2_000_000, help="words of text (default 2,000,000)")
    p.add_argument("--epoch", type=int, default=16384, help="lines per epoch (default 16384)")
    p.add_argument("--counts", default=",".join(map(str, COUNTS)),
                   help="container counts, comma-separated; 1 is always run (the baseline)")
    args = p.parse_args()
    counts = sorted({1} | {int(x) for x in args.counts.split(",")})
    if counts[0] < 1 or counts[-1] > SLICES:
        raise SystemExit(f"--counts: each count must be in 1..{SLICES}, got {counts}")
    words = 100_000 if args.quick else args.words
    table = zipf_text(words // 10, seed=1)  # 10 words per line
    n_words = sum(len(line.split()) for line in table.column("line").to_pylist())
    times: dict[int, list[float]] = {n: [] for n in counts}
    one_run(table, 1, args.epoch)  # warm-up (imports, first allocations): not timed
    for r in range(1 if args.quick else args.repeat):
        for n in (counts if r % 2 == 0 else counts[::-1]):
            times[n].append(one_run(table, n, args.epoch))
    base = median(times[1])
    rows = [{"containers": n, "slices_each": SLICES / n, "events_per_s": round(n_words / median(times[n])),
             "overhead_pct": round((median(times[n]) / base - 1) * 100, 1),
             "runs_s": [round(t, 3) for t in times[n]]} for n in counts]
    emit({"words": n_words, "lines": table.num_rows, "epoch_lines": args.epoch, "slices": SLICES, "rows": rows},
         args.json)


if __name__ == "__main__":
    main()
