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


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 150 * 2**20})
    for _ in range(2):
        cluster.add_node(num_cpus=1, object_store_memory=150 * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
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
