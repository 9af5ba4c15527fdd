"""Run a job on a 3-node ray.cluster_utils.Cluster (started here) and print a JSON verdict.

Run as a subprocess by test_multinode.py: a Cluster needs its own Ray, apart
from the test session's in-process one.
"""

from __future__ import annotations

import json
import sys

import ray
from ray.cluster_utils import Cluster

import chronostream as cs
from queries import QUERIES


def kill_a_node(cluster: Cluster, master_dies_at: str | None = None) -> None:
    """A job on 3 nodes loses a worker node mid-stream (its processes and local stores); with
    ``master_dies_at`` (a ``master.recovery.RECOVERY_STEPS`` step) the master's process dies
    there in that recovery too."""
    import shutil
    import time
    from pathlib import Path

    from chronostream.chaos import Fault, apply_schedule

    build, sinks, _ = QUERIES["running_sum"]
    query = build(7)
    query.epoch_events = 40
    job = cs.run(query, containers=3, address=cluster.address, checkpoint_every=2, heartbeat_timeout_s=5)
    apply_schedule(job, [Fault("delay", 0, stage="payments", seconds=0.08)])
    while job.progress()["min_epoch"] < 20:
        time.sleep(0.05)
    workers = cluster.list_all_nodes()[1:]  # (index 0 is the head)
    victim = workers[0]
    if master_dies_at is not None:  # the master must outlive the node to die in the recovery itself
        victim = next(n for n in workers if n.node_id != job.placement()["master_node"])
    if master_dies_at is not None:
        ray.get(job.master.crash_in_recovery.remote(master_dies_at))
    placement = job.placement()
    lost = sorted(h for h, node in placement["nodes"].items() if node == victim.node_id)
    cluster.remove_node(victim)
    workdir = Path(job.workdir)
    for h in lost:  # the node's local store goes with it
        shutil.rmtree(workdir / f"host-{h}", ignore_errors=True)
    job.wait(timeout_s=300)
    same = all(job.results(s).to_pylist() == cs.run(build(7), executor="serial").results(s).to_pylist()
               for s in sinks)
    kinds = [k for _, k, _ in job.timeline()]
    job.stop()
    print(json.dumps({"equal": same, "lost_hosts": len(lost), "recoveries": kinds.count("recovery_end"),
                      "resumed": kinds.count("recovery_resumed"), "crashes": kinds.count("master_crash_injected")}))


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 150 * 2**20,
                                                            "_system_config": dict(cs.client.RAY_SYSTEM_CONFIG)})
    for _ in range(2):
        cluster.add_node(num_cpus=1, object_store_memory=150 * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", namespace=cs.client.RAY_NAMESPACE)
    if sys.argv[1:2] == ["kill-node"]:
        try:
            kill_a_node(cluster, sys.argv[2] if len(sys.argv) > 2 else None)
        finally:
            ray.shutdown()
            cluster.shutdown()
        return
    try:
        build, sinks, _ = QUERIES["running_sum"]
        job = cs.run(build(7), containers=3, address=cluster.address)
        job.wait(timeout_s=180)
        placement = job.placement()
        same = all(job.results(s).to_pylist() == cs.run(build(7), executor="serial").results(s).to_pylist()
                   for s in sinks)
        stage_nodes = {name: sorted({placement["nodes"][c] for c in conts})
                       for name, conts in placement["stages"].items()}
        job.stop()
        print(json.dumps({"equal": same, "nodes": len(ray.nodes()),
                          "stage_nodes": {k: len(v) for k, v in stage_nodes.items()}}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
