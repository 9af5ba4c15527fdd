"""Recovery time after a container kill (paper Fig. 19/20), on Ray, by lost state, peers and checkpoint interval.

A keyed aggregation (count, sum, min, max, mean per key) runs with
``peers + 1`` containers and 12 slices; the input first touches every key
once (loading the state) and then updates random keys (seeded). The source
is slowed down a little so the kill lands mid-stream, after the state is
loaded. The failure harness kills one container; we read the job's
recovery timeline and report, per configuration:

- ``recovery_s``: from the kill to the first output of every recovered slice;
- ``detect_s``: from the kill to its detection by the master;
- ``restore_s``: the slowest host's restore of its share (fetch + decode + load);
- ``fetch_s``: of which reading (or receiving) and decoding the checkpoints;
- ``caught_up_s``: from the kill until every container of the stage has
  processed the epoch the kill came at again (restore plus replay: what
  the job lost);
- ``lost_mb``: size of the checkpoints the dead container's slices were
  restored from (what had to be rebuilt).

``--peers 0`` runs the stage on one host: its backups are chained over the
job's other host (the source's), which rebuilds it; ``--backup-factor 0``
turns them off, so the dead slices are rebuilt from epoch 0 by replaying
the source's whole output log.

Lost state is set by ``--sizes`` (MB of the dead container's share; the
job's total state is ``(peers + 1)`` times that). Machines here have 2 cores
and every container shares them, so absolute times are pessimistic; the
ratios between peer counts are the point.

    python -m benchmarks.recovery --json                       # 25 and 100 MB, 1-3 peers, K = 4
    python -m benchmarks.recovery --json --sizes 100,500 --intervals 2,8
    python -m benchmarks.recovery --json --sizes 100 --peers 0 --backup-factor 1   # then 0: from epoch 0
"""

from __future__ import annotations


import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import chronostream as cs
from benchmarks.common import AGGREGATE_BYTES_PER_KEY, emit, median, parser
from chronostream.chaos import Fault, apply_schedule

SLICES = 12  # divisible by 2, 3 and 4 containers
EPOCH = 100_000


def make_query(n_keys: int, update_epochs: int, seed: int = 3) -> cs.Query:
    rng = np.random.default_rng(seed)
    updates = rng.integers(0, n_keys, update_epochs * EPOCH)
    keys = np.concatenate([np.arange(n_keys), updates])
    table = pa.table({"k": pa.array(keys, pa.int64()), "v": pa.array(rng.integers(0, 1000, len(keys)), pa.int64())})
    q = cs.Query(epoch_events=EPOCH)
    q.source("events", table).key_by("k").aggregate(count=True, sum=["v"], min=["v"], max=["v"], mean=["v"],
                                                    slices=SLICES, name="agg") \
        .filter_batches(lambda t: pc.equal(pc.bit_wise_and(t["k"], 1023), 0)).sink(name="sample")
    return q


def caught_up_at(job: cs.Job, stage: str, epoch: int, timeout_s: float = 900.0) -> float:
    """When every container of ``stage`` has processed ``epoch`` (polled every 50 ms; the job's
    end counts too)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = [s for s in job.statistics().values() if s.stage == stage]
        if stats and all(s.next_epoch > epoch or (s.num_epochs is not None and s.next_epoch >= s.num_epochs)
                         for s in stats):
            return time.time()
        time.sleep(0.05)
    raise TimeoutError(f"stage {stage!r} did not process epoch {epoch} again within {timeout_s} s")


def default_backup_factor(peers: int) -> int:
    """Copies per slice: one per peer up to 2; with no peer (one host) one, on the source's host."""
    return min(2, peers) or 1


def one_run(lost_mb: int, peers: int, interval: int, backup_factor: int) -> dict:
    n_keys = lost_mb * 1_000_000 * (peers + 1) // AGGREGATE_BYTES_PER_KEY
    load_epochs = -(-n_keys // EPOCH)
    query = make_query(n_keys, update_epochs=load_epochs + 40)
    job = cs.run(query, containers={"events": 1, "agg": peers + 1}, checkpoint_every=interval,
                 full_checkpoint_every=1000, backup_factor=backup_factor)
    try:
        kill_at = load_epochs + 2 * interval + 2  # the state is loaded and checkpointed
        applied = apply_schedule(job, [Fault("delay", 0, stage="events", seconds=0.15),
                                       Fault("kill", kill_at, stage="agg")],
                                 timeout_s=3600)  # loading 1 GB per container takes minutes here
        caught_up = caught_up_at(job, "agg", kill_at) if any(f.kind == "kill" for _, f, _ in applied) else 0.0
        job.wait(timeout_s=900)
        timeline = job.timeline()
    finally:
        job.stop()
    kills = [(t, hit) for t, f, hit in applied if f.kind == "kill"]
    if not kills:
        raise RuntimeError("the job finished before the kill: raise --update-epochs")
    t_kill = kills[0][0]
    end = next(i for t, k, i in timeline if k == "recovery_end" and t >= t_kill)
    recovered = set(end["new"])
    detect = min(t for t, k, _ in timeline if k == "fault_detected" and t >= t_kill)
    restored = [i for t, k, i in timeline if k == "slices_restored" and i["container"] in recovered]
    firsts = [t for t, k, i in timeline if k == "first_output" and i["container"] in recovered]
    n_slices = sum(len(i["slices"]) for i in restored)
    return {"recovery_s": max(firsts) - t_kill if len(firsts) == n_slices else float("nan"),
            "caught_up_s": caught_up - t_kill,
            "detect_s": detect - t_kill, "restore_s": max(i["seconds"] for i in restored),
            "fetch_s": max(i.get("fetch_s", 0.0) for i in restored),
            "lost_mb": sum(i.get("mb", 0.0) for i in restored), "hosts": len({i["host"] for i in restored})}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default="25,100", help="lost state in MB, comma-separated")
    p.add_argument("--peers", default="1,2,3", help="recovering peers, comma-separated")
    p.add_argument("--intervals", default="4", help="checkpoint intervals in epochs, comma-separated")
    p.add_argument("--backup-factor", type=int, default=None,
                   help="copies per slice (default: min(2, peers), 1 with --peers 0)")
    args = p.parse_args()
    sizes = [10] if args.quick else [int(x) for x in args.sizes.split(",")]
    peer_counts = [1, 2] if args.quick else [int(x) for x in args.peers.split(",")]
    intervals = [int(x) for x in args.intervals.split(",")]
    repeat = 1 if args.quick else args.repeat
    cs.ensure_ray(num_cpus=2)
    rows = []
    for mb in sizes:
        for interval in intervals:
            for peers in peer_counts:
                factor = default_backup_factor(peers) if args.backup_factor is None else args.backup_factor
                runs = [one_run(mb, peers, interval, factor) for _ in range(repeat)]
                rows.append({"lost_mb": round(median([r["lost_mb"] for r in runs]), 1), "target_mb": mb,
                             "peers": peers, "interval_epochs": interval,
                             "interval_s": round(interval * 0.15, 2),
                             "backup_factor": factor,
                             "recovery_s": round(median([r["recovery_s"] for r in runs]), 3),
                             "caught_up_s": round(median([r["caught_up_s"] for r in runs]), 3),
                             "detect_s": round(median([r["detect_s"] for r in runs]), 3),
                             "restore_s": round(median([r["restore_s"] for r in runs]), 3),
                             "fetch_s": round(median([r["fetch_s"] for r in runs]), 3),
                             "hosts_rebuilding": runs[0]["hosts"]})
    emit({"epoch_events": EPOCH, "slices": SLICES, "repeat": repeat, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
