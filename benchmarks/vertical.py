"""Vertical scaling (paper Fig. 16): the delay of rescheduling slices onto threads vs repartitioning state.

Part 1, the delay. A container holds 8 slices whose key-value state adds
up to ``state_mb``. Going from 1 to 2 threads:

- ``reschedule`` (ChronoStream): a new thread-control table is installed
  and picked up at the next epoch barrier; slices keep their state, so the
  delay is the barrier's work (start the threads, swap the table). We time
  the first epoch run under the new table minus a normal epoch (the work
  itself is empty, so only the rescheduling shows);
- ``repartition`` (the baseline of systems whose state belongs to threads
  or tasks): every key is re-hashed into the new threads' stores, so the
  delay grows with the state.

Part 2, what threads buy under the GIL, in one process (the runtime's
container cores, ``executor="local"``): a stage of 8 slices run with 1 and
with 2 threads, for a vectorized operator (the built-in aggregation: numpy
and Arrow kernels, which release the GIL on large arrays) and for a
per-event Python operator (which holds it). ``speedup`` = time with 1
thread / time with 2.

    python -m benchmarks.vertical --json
    python -m benchmarks.vertical --json --sizes 10,100,500
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

import chronostream as cs
from benchmarks.common import emit, median, parser
from chronostream.slices.state import KeyValueState
from chronostream.containers.threads import SliceThreads

SLICES = list(range(8))
BYTES_PER_ENTRY = 120  # an int key and a two-int list value in CPython dicts (measured: ~110-130 B)


def loaded_states(state_mb: int) -> list[KeyValueState]:
    per = state_mb * 1_000_000 // BYTES_PER_ENTRY // len(SLICES)
    states = []
    for s in SLICES:
        st = KeyValueState(f"s{s}")
        for k in range(s * per, (s + 1) * per):
            st.set(k, [k, 1])
        st.clear_dirty()
        states.append(st)
    return states


def reschedule_ms(repeat: int) -> float:
    runner = SliceThreads(SLICES, 1)
    noop = lambda s: None  # noqa: E731
    normal, switched = [], []
    for r in range(repeat * 5):
        t = time.perf_counter()
        runner.run_epoch(2 * r, SLICES, noop)
        normal.append(time.perf_counter() - t)
        runner.resize(SLICES, 2 if r % 2 == 0 else 1)
        t = time.perf_counter()
        runner.run_epoch(2 * r + 1, SLICES, noop)
        switched.append(time.perf_counter() - t)
    runner.close()
    return max(0.0, (median(switched) - median(normal)) * 1000)


def repartition_ms(states: list[KeyValueState], threads: int) -> float:
    t = time.perf_counter()
    parts: list[dict] = [{} for _ in range(threads)]
    for st in states:
        for k, v in st.items():
            parts[hash(k) % threads][k] = v
    return (time.perf_counter() - t) * 1000


class PerEventSum(cs.Operator):
    def setup(self) -> None:
        self.sums = self.register_state("sums")

    def consume(self, stream_id, event):
        total = self.sums.get(event["k"], 0) + event["v"]
        self.sums.set(event["k"], total)
        self.produce("out", {"k": event["k"], "total": total})


def job_seconds(kind: str, threads: int, n: int) -> float:
    from chronostream.dag import compile_query
    from chronostream.master.local import LocalCluster
    from chronostream.master.placement import containers_per_stage, initial_placement

    rng = np.random.default_rng(1)
    table = pa.table({"k": rng.integers(0, 100_000, n), "v": rng.integers(0, 100, n)})
    q = cs.Query(epoch_events=200_000 if kind == "vectorized" else 20_000)
    s = q.source("events", table, slices=1).key_by("k")
    if kind == "vectorized":
        s.aggregate(count=True, sum=["v"], min=["v"], max=["v"], mean=["v"], slices=8, name="op").sink(name="out")
    else:
        s.apply(PerEventSum, slices=8, name="op").sink(name="out")
    plan, sources = compile_query(q)
    cl = LocalCluster(plan, initial_placement(plan, containers_per_stage(plan, 1)), sources)
    for core in cl.cores.values():
        core.set_threads(threads)
    t = time.perf_counter()
    cl.run()
    return time.perf_counter() - t


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10,100,500", help="container state sizes in MB, comma-separated")
    args = p.parse_args()
    sizes = [5] if args.quick else [int(x) for x in args.sizes.split(",")]
    rows = []
    resched = [reschedule_ms(args.repeat) for _ in range(args.repeat)]
    for mb in sizes:
        states = loaded_states(mb)
        rows.append({"state_mb": mb, "reschedule_delay_ms": round(median(resched), 3),
                     "repartition_delay_ms": round(median([repartition_ms(states, 2) for _ in range(args.repeat)]), 1)})
        del states
    speed = {}
    for kind, n in (("vectorized", 4_000_000 if not args.quick else 400_000),
                    ("per_event", 200_000 if not args.quick else 20_000)):
        t1, t2 = [], []
        for _ in range(1 if args.quick else args.repeat):
            t1.append(job_seconds(kind, 1, n))
            t2.append(job_seconds(kind, 2, n))
        speed[kind] = {"events": n, "one_thread_s": round(median(t1), 3), "two_threads_s": round(median(t2), 3),
                       "speedup": round(median(t1) / median(t2), 2)}
    emit({"slices": len(SLICES), "threads_buy": speed, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
