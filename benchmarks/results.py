"""Reading a memory sink back on Ray: how long ``job.results()`` takes and how many bytes it reads.

A keyed count over seeded random rows (``--rows``, keys uniform over 50,000, seed 7) runs on Ray
with 2 containers a stage, with checkpoints (every 4 epochs of 20,000 rows) and without; once it
has finished, the client reads the sink: the first read (what a user waits for) and ``--repeat``
more with the client's cache cleared (median). Also reported: the packed parts the reads fetch
(``parts_mb``, ``packs``: one from the master, one from each host still holding rows), to be set
against the sink's own size (``sink_mb``).

    python -m benchmarks.results --json
    python -m benchmarks.results --json --rows 4000000 --slices 8,64 --repeat 5
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

import chronostream as cs
from benchmarks.common import emit, median, parser

EPOCH_ROWS = 20_000
KEYS = 50_000


def build(rows: int, slices: int) -> cs.Query:
    """The job: a count per key of ``rows`` seeded random rows, into memory sink ``out``."""
    rng = np.random.default_rng(7)
    table = pa.table({"k": rng.integers(0, KEYS, rows), "v": rng.integers(0, 1000, rows)})
    q = cs.Query(epoch_events=EPOCH_ROWS)
    q.source("s", table).key_by("k").count(slices=slices, name="count").sink(name="out")
    return q


def one_run(rows: int, slices: int, checkpoint_every: int, repeat: int) -> dict:
    """One job, then its sink read ``1 + repeat`` times: the figures of one row."""
    import ray

    job = cs.run(build(rows, slices), containers=2, checkpoint_every=checkpoint_every)
    try:
        assert job.wait(timeout_s=600).state == "finished"
        times = []
        for _ in range(1 + repeat):  # the first read first: nothing has packed or touched the rows
            job._result_cache.clear()
            t = time.perf_counter()
            table = job.results("out")
            times.append(time.perf_counter() - t)
        where = ray.get(job.master.sink_part_refs.remote("out"))
        parts_mb = sum(g.nbytes for pack in ray.get(list(where.refs)) for _, g, _ in pack.groups) / 1e6
        if table.num_rows != rows:
            raise AssertionError(f"the sink holds {table.num_rows} rows, {rows} expected")
        return {"rows_in_sink": table.num_rows, "slices": slices, "checkpoint_every": checkpoint_every,
                "sink_mb": round(table.nbytes / 1e6, 1), "parts_mb": round(parts_mb, 1), "packs": len(where.refs),
                "first_read_s": round(times[0], 3), "read_s": round(median(times[1:]), 3),
                "read_runs_s": [round(x, 3) for x in times[1:]]}
    finally:
        job.stop()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_000_000, help="input rows = sink rows (default 2,000,000)")
    p.add_argument("--slices", default="8", help="slice counts of the count stage, comma-separated (default 8)")
    args = p.parse_args()
    rows = 200_000 if args.quick else args.rows
    cs.ensure_ray()
    out = [one_run(rows, int(s), ckpt, args.repeat) for s in args.slices.split(",") for ckpt in (4, 0)]
    emit({"rows_in": rows, "containers_per_stage": 2, "repeat": args.repeat, "rows": out}, args.json)


if __name__ == "__main__":
    main()
