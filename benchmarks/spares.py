"""Warm spare hosts: what a job's deploy and a scale-out wait for, with and without spares.

A host is a Python process (a Ray actor); a new one imports Ray, Arrow and
the runtime before it can run a slice, a second or two of CPU each. With
``cs.keep_warm_hosts(n)`` the cluster keeps ``n`` spares started ahead and a
master adopts them (``master.host_pool``). Per configuration (no pool; a
pool as large as the job's hosts plus the scale-out's, filled before each
run), on Ray with ``num_cpus`` 2: the seconds ``cs.run`` takes to deploy a
keyed count (``--hosts`` hosts for the count, one for the source, plus the
master's own process, which is never a spare) and the seconds a
``job.scale_out(stage, 1)`` call takes while the job runs (phase 0 starts
or adopts the new host; then the slices move). Medians of ``--repeat``
runs, the configurations interleaved run by run. Every run's output row
count is checked.

    python -m benchmarks.spares --json
    python -m benchmarks.spares --json --hosts 4 --repeat 5
"""

from __future__ import annotations

import time

import chronostream as cs
from benchmarks.common import emit, median, parser
from chronostream.chaos import Fault, apply_schedule
from chronostream.datasets import payments

EPOCH = 100


def payment_count(n: int, slices: int) -> cs.Query:
    """Payments counted per card in ``slices`` slices (stage ``count``), into sink ``counts``."""
    q = cs.Query(epoch_events=EPOCH)
    q.source("payments", payments(n, seed=3)).key_by("card").count(slices=slices, name="count").sink(name="counts")
    return q


def one_run(n: int, hosts: int, spares: int) -> tuple[float, float, int]:
    """(deploy s, scale-out call s, spares adopted) for one job; ``spares`` filled first (0: none)."""
    cs.keep_warm_hosts(spares, wait_s=120 if spares else 0)
    q = payment_count(n, slices=4 * hosts)
    t0 = time.perf_counter()
    job = cs.run(q, containers={"payments": 1, "count": hosts}, checkpoint_every=2)
    deploy_s = time.perf_counter() - t0
    try:
        apply_schedule(job, [Fault("delay", at_epoch=0, stage="payments", seconds=0.02)])
        time.sleep(1.0)
        t1 = time.perf_counter()
        job.scale_out("count", 1)
        scale_s = time.perf_counter() - t1
        job.wait(timeout_s=600)
        rows = job.results("counts").num_rows
        adopted = sum(1 for _, k, _ in job.timeline() if k == "spare_adopted")
    finally:
        job.stop()
    if rows != n:
        raise AssertionError(f"the count's sink has {rows} rows, not {n}")
    return deploy_s, scale_s, adopted


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=3, help="the count's hosts at deploy (default 3)")
    p.add_argument("--events", type=int, default=30_000, help="payments (default 30,000: 300 epochs)")
    args = p.parse_args()
    n = 6_000 if args.quick else args.events
    cs.ensure_ray(num_cpus=2)
    pool = args.hosts + 2  # the source's host, the count's hosts, the scale-out's host
    configs = [0, pool]
    one_run(n, args.hosts, 0)  # warm-up (the driver's imports, Ray's first workers): not counted
    runs: dict[int, list[tuple[float, float, int]]] = {c: [] for c in configs}
    for r in range(1 if args.quick else args.repeat):
        for c in (configs if r % 2 == 0 else configs[::-1]):
            runs[c].append(one_run(n, args.hosts, c))
    cs.keep_warm_hosts(0)
    rows = [{"spares": c, "deploy_s": round(median([d for d, _, _ in runs[c]]), 2),
             "scale_out_s": round(median([s for _, s, _ in runs[c]]), 2),
             "adopted": [a for _, _, a in runs[c]],
             "deploy_runs_s": [round(d, 2) for d, _, _ in runs[c]],
             "scale_out_runs_s": [round(s, 2) for _, s, _ in runs[c]]} for c in configs]
    emit({"events": n, "hosts": args.hosts, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
