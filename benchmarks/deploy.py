"""Deploy: how long a small job takes from ``cs.run`` to its first output, on a running Ray and from a cold process.

The job: a 2-stage running word count (a source of 1,000 words, ``key_by``,
the built-in ``count`` on 8 slices, a memory sink), 2 containers a stage,
checkpoints every second.

- warm: in this process, Ray already started (``cs.ensure_ray()``), ``--runs``
  jobs one after another (default 10), each timed from the call to ``cs.run``
  to the wall time its first sink part was written (``job.sink_write_times``);
  also to the job's end (``job.wait()``);
- cold: ``--cold-runs`` new processes (default 3), each timed from its creation
  (interpreter start, imports and Ray's start included) to the first output.

    python -m benchmarks.deploy --json
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import psutil

import chronostream as cs
from benchmarks.common import emit, last_json_line, median, parser

WORDS = 1_000


def build() -> cs.Query:
    """The small job every run deploys."""
    words = [{"word": f"w{i % 37}"} for i in range(WORDS)]
    q = cs.Query(epoch_events=100)
    q.source("words", words).key_by("word").count(slices=8, name="count").sink(name="counts")
    return q


def one_job(t0: float) -> dict[str, float]:
    """Run the job (``cs.run`` called at ``t0``, wall time): seconds to its first output and to its end."""
    job = cs.run(build(), containers=2, checkpoint_interval_s=1.0)
    try:
        job.wait()
        done = time.time()
        first = min(job.sink_write_times("counts").values())
        n = job.results("counts").num_rows
    finally:
        job.stop()
    assert n == WORDS, f"the job wrote {n} of {WORDS} rows"
    return {"first_output_s": first - t0, "done_s": done - t0}


def cold_child() -> None:
    """A new process's run, timed from the process's creation; its figures as the last line."""
    print(json.dumps(one_job(psutil.Process().create_time())))


def main() -> None:
    if sys.argv[1:2] == ["--cold-child"]:
        cold_child()
        return
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10, help="warm runs (default 10)")
    p.add_argument("--cold-runs", type=int, default=3, help="cold runs, each a new process (default 3)")
    args = p.parse_args()
    runs, cold_runs = (3, 1) if args.quick else (args.runs, args.cold_runs)
    cold = []
    for _ in range(cold_runs):  # before this process starts Ray: each child starts its own
        out = subprocess.run([sys.executable, "-m", "benchmarks.deploy", "--cold-child"], check=True,
                             stdout=subprocess.PIPE, text=True).stdout
        cold.append(last_json_line(out))
    t = time.perf_counter()
    cs.ensure_ray()
    ray_start = time.perf_counter() - t
    warm = [one_job(time.time()) for _ in range(runs)]
    firsts = [r["first_output_s"] for r in warm]
    rows = [{"config": "warm", "first_output_s_p50": round(median(firsts), 3),
             "first_output_s_max": round(max(firsts), 3), "done_s_p50": round(median([r["done_s"] for r in warm]), 3),
             "runs": [round(x, 3) for x in firsts]},
            {"config": "cold", "first_output_s_p50": round(median([r["first_output_s"] for r in cold]), 3),
             "first_output_s_max": round(max(r["first_output_s"] for r in cold), 3),
             "done_s_p50": round(median([r["done_s"] for r in cold]), 3),
             "runs": [round(r["first_output_s"], 3) for r in cold]}]
    emit({"warm_first_output_s_p50": rows[0]["first_output_s_p50"],
          "warm_first_output_s_max": rows[0]["first_output_s_max"],
          "warm_first_output_s_p90": round(float(np.percentile(firsts, 90)), 3),
          "cold_first_output_s_p50": rows[1]["first_output_s_p50"],
          "ray_start_s": round(ray_start, 2), "containers_per_stage": 2, "words": WORDS, "runs": runs,
          "cold_runs": cold_runs, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
