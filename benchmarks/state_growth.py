"""State growth: throughput of a word count and a keyed sum as the number of distinct keys grows (10^4, 10^6, 10^7).

Input: ``--rows`` rows (default 10,000,000) of ``(key, amount)``, keys drawn
uniformly from ``K`` distinct values (seed 42; a word count's keys are
strings ``k<i>``, a keyed sum's int64), amounts 1..100. Every key count
gets the same rows, so what changes is only the state each slice holds and
the share of keys an epoch touches (uniform keys: at 10^7 nearly every row
is a new key, the worst case for the key index, the state and the delta
checkpoints).

The job: 2 containers a stage, the keyed stage on 32 slices, checkpoints
every second to 2 backup copies: ``word_count`` is
``key_by(key).count()`` over string keys, ``keyed_sum`` is
``key_by(key).sum(amount)`` over int keys. Rows per second over the job's
processing time, medians of ``--repeat``; ``vs_smallest`` is a key count's
rate over the smallest key count's, per query (target at 10^7 keys: at least
0.7).

    python -m benchmarks.state_growth --json
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import chronostream as cs
from benchmarks.common import emit, median, parser

KEY_COUNTS = (10_000, 1_000_000, 10_000_000)
QUERIES = ("word_count", "keyed_sum")


def rows_of(query: str, n: int, keys: int) -> pa.Table:
    """``n`` rows over ``keys`` distinct keys (strings for the word count, ints for the sum)."""
    rng = np.random.default_rng(42)
    k = rng.integers(0, keys, size=n, dtype=np.int64)
    amount = rng.integers(1, 101, size=n, dtype=np.int64)
    if query == "word_count":
        key = pc.binary_join_element_wise("k", pa.array(k).cast(pa.string()), "")
        return pa.table({"key": key})
    return pa.table({"key": pa.array(k), "amount": pa.array(amount)})


def build(table: pa.Table, query: str) -> cs.Query:
    """The job over ``table``."""
    q = cs.Query(epoch_events=16384)
    keyed = q.source("rows", table).key_by("key")
    agg = keyed.count(slices=32, name="agg") if query == "word_count" else keyed.sum("amount", slices=32, name="agg")
    agg.sink(name="out")
    return q


def run_once(table: pa.Table, query: str) -> float:
    """Rows per second over one job's processing time (checked: every row counted)."""
    job = cs.run(build(table, query), containers=2, checkpoint_interval_s=1.0, backup_factor=2)
    try:
        st = job.wait()
        n = sum(s.events_out for s in job.statistics().values() if s.stage == "agg")
    finally:
        job.stop()
    assert n == table.num_rows, f"counted {n} of {table.num_rows} rows"
    return table.num_rows / st.elapsed_s


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000_000, help="rows per run (default 10,000,000)")
    p.add_argument("--keys", default=",".join(str(k) for k in KEY_COUNTS),
                   help="comma-separated distinct key counts (default 10000,1000000,10000000)")
    args = p.parse_args()
    n = 200_000 if args.quick else args.rows
    key_counts = [int(k) for k in args.keys.split(",")]
    if args.quick:
        key_counts = [min(k, n) for k in key_counts]
    cs.ensure_ray()
    runs: dict[tuple[str, int], list[float]] = {}
    for i in range(args.repeat):
        for query in QUERIES:
            tables = {k: rows_of(query, n, k) for k in key_counts}
            # (alternating the order: a noisy machine's drift falls on every key count)
            for k in (key_counts if i % 2 == 0 else key_counts[::-1]):
                runs.setdefault((query, k), []).append(run_once(tables[k], query))
    rows = []
    for query in QUERIES:
        base = median(runs[(query, key_counts[0])])
        for k in key_counts:
            rate = median(runs[(query, k)])
            rows.append({"query": query, "keys": k, "rows_per_s": round(rate), "vs_smallest": round(rate / base, 3),
                         "runs": [round(r) for r in runs[(query, k)]]})
    emit({"rows_per_run": n, "containers_per_stage": 2, "slices": 32, "checkpoint_interval_s": 1.0, "backup_factor": 2,
          "repeat": args.repeat, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
