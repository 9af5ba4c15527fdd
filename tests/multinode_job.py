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


def kill_a_node(cluster: Cluster, master_dies_at: str | None = None, one_host: bool = False,
                spares: int = 0) -> None:
    """A job on 3 nodes loses a worker node mid-stream (its processes and local stores); with
    ``master_dies_at`` (a ``master.recovery.RECOVERY_STEPS`` step) the master's process dies
    there in that recovery too. With ``one_host`` the source and ``running_sum`` run one
    container each (on two nodes) and the node lost is one of theirs: that stage's slices must
    come back from copies on other nodes (``restored_from_backup``). With ``spares`` the cluster
    keeps that many warm spare hosts (``cs.keep_warm_hosts``, spread over the nodes): the verdict
    says how many the job adopted, the pool's spares per node just before the kill, and the pool
    once refilled after it."""
    import shutil
    import time
    from pathlib import Path

    from chronostream.chaos import Fault, apply_schedule

    build, sinks, _ = QUERIES["running_sum"]
    query = build(7)
    query.epoch_events = 40
    containers = {"payments": 1, "running_sum": 1, "stats": 3} if one_host else 3
    if spares:
        cs.keep_warm_hosts(spares, wait_s=60, address=cluster.address)
    job = cs.run(query, containers=containers, address=cluster.address, checkpoint_every=2, heartbeat_timeout_s=5)
    apply_schedule(job, [Fault("delay", 0, stage="payments", seconds=0.08)])
    while job.progress()["min_epoch"] < 20:
        time.sleep(0.05)
    workers = cluster.list_all_nodes()[1:]  # (index 0 is the head)
    victim = workers[0]
    if master_dies_at is not None:  # the master must outlive the node to die in the recovery itself
        victim = next(n for n in workers if n.node_id != job.placement().master_node)
    if master_dies_at is not None:
        ray.get(job.master.crash_in_recovery.remote(master_dies_at))
    placement = job.placement()
    one_host_stage = None
    if one_host:  # (the two one-host stages sit on different nodes: at least one is a worker)
        worker_ids = {n.node_id: n for n in workers}

        def node_of(stage: str) -> str:
            (c,) = placement.stages[stage]
            return placement.nodes[placement.hosts[c]]

        one_host_stage = next(name for name in ("running_sum", "payments") if node_of(name) in worker_ids)
        victim = worker_ids[node_of(one_host_stage)]
    lost = sorted(h for h, node in placement.nodes.items() if node == victim.node_id)
    # The source slows to a crawl until the loss is recovered: on a loaded machine the job would
    # otherwise run out of input before the node is gone and no recovery would be needed.
    handles = ray.get(job.master.container_handles.remote())
    sources = [handles[c] for c in placement.stages["payments"]]
    ray.get([h.inject_delay.remote(0.5) for h in sources])
    pool_before = cs.keep_warm_hosts(spares, wait_s=60, address=cluster.address) if spares else None
    cluster.remove_node(victim)
    workdir = Path(job.workdir)
    for h in lost:  # the node's local store goes with it
        shutil.rmtree(workdir / f"host-{h}", ignore_errors=True)
    deadline = time.monotonic() + 300
    while (p := job.progress())["recoveries"] == 0 and not p["state"].terminal and time.monotonic() < deadline:
        time.sleep(0.1)
    for h in sources:  # (a source host that died with the node has a successor at full pace)
        try:
            ray.get(h.inject_delay.remote(0.08))
        except ray.exceptions.RayActorError:
            pass
    job.wait(timeout_s=300)
    same = all(job.results(s).to_pylist() == cs.run(build(7), executor="serial").results(s).to_pylist()
               for s in sinks)
    timeline = job.timeline()
    kinds = [k for _, k, _ in timeline]
    restored_from_backup = None
    if one_host_stage is not None:
        gone = set(placement.stages[one_host_stage])
        epochs = [e for _, k, i in timeline if k == "recovery_start" and i["container"] in gone
                  for e in i["backup_epochs"].values()]
        restored_from_backup = bool(epochs) and min(epochs) >= 0
    job.stop()
    pool = None
    if spares:
        after = cs.keep_warm_hosts(spares, wait_s=60, address=cluster.address)
        pool = {"victim_before": pool_before.by_node.get(victim.node_id, 0), "ready_after": after.ready,
                "pool_on_victim": pool_before.pool_node == victim.node_id,
                "victim_after": after.by_node.get(victim.node_id, 0), "dropped": after.dropped,
                "adopted": kinds.count("spare_adopted")}
        cs.keep_warm_hosts(0, address=cluster.address)
    print(json.dumps({"equal": same, "lost_hosts": len(lost), "recoveries": kinds.count("recovery_end"),
                      "resumed": kinds.count("recovery_resumed"), "crashes": kinds.count("master_crash_injected"),
                      "one_host_stage": one_host_stage, "restored_from_backup": restored_from_backup,
                      "pool": pool}))


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 150 * 2**20,
                                                            "_system_config": dict(cs.client.RAY_SYSTEM_CONFIG)})
    for _ in range(2):
        cluster.add_node(num_cpus=1, object_store_memory=150 * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", namespace=cs.client.RAY_NAMESPACE)
    if sys.argv[1:2] == ["kill-node"]:
        try:
            arg = sys.argv[2] if len(sys.argv) > 2 else None
            kill_a_node(cluster, None if arg in ("one-host", "spares") else arg, one_host=arg == "one-host",
                        spares=3 if arg == "spares" else 0)
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
        stage_nodes = {name: sorted({placement.nodes[c] for c in conts})
                       for name, conts in placement.stages.items()}
        job.stop()
        print(json.dumps({"equal": same, "nodes": len(ray.nodes()),
                          "stage_nodes": {k: len(v) for k, v in stage_nodes.items()}}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
