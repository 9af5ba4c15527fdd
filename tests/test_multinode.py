"""Multi-node: the same job runs unchanged on a Ray cluster, spreads each stage over nodes, survives a node loss.

Method: a 3-node ``ray.cluster_utils.Cluster`` on this machine (in a
subprocess, apart from the session's Ray); the running-sum query with 3
containers per stage; the output is compared with the serial executor's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray  # each test runs a cluster of its own in a subprocess


def test_job_on_a_three_node_cluster_spreads_stages_and_matches_serial():
    """Containers of one stage land on several nodes and the output equals the oracle's."""
    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(here / "multinode_job.py")], capture_output=True, text=True,
                          timeout=600, env=env, cwd=here)
    assert proc.returncode == 0, proc.stderr[-4000:]
    verdict = last_json_line(proc.stdout)
    assert verdict["nodes"] == 3
    assert verdict["equal"] is True
    assert all(n >= 2 for n in verdict["stage_nodes"].values()), verdict


def run_node_kill(*args: str) -> dict:
    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(here / "multinode_job.py"), "kill-node", *args], capture_output=True,
                          text=True, timeout=600, env=env, cwd=here)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return last_json_line(proc.stdout)


def last_json_line(stdout: str) -> dict:
    """The script's verdict: its last line that is a JSON object (Ray's log monitor may print
    a worker's line to the driver's stdout after it)."""
    return json.loads(next(line for line in reversed(stdout.strip().splitlines()) if line.startswith("{")))


def test_a_node_killed_mid_stream_loses_one_container_per_stage_and_the_output_is_exact():
    """A worker node is removed (its hosts die, their local stores are deleted); one recovery
    rebuilds a container of every stage at once and the output equals the oracle's. The cluster
    keeps 3 warm spares, one a node: the job adopts some, and the pool drops the spare that died
    with the node and refills on the live ones (the other node-loss tests run without a pool)."""
    verdict = run_node_kill("spares")
    assert verdict["lost_hosts"] == 3 and verdict["recoveries"] >= 1
    assert verdict["equal"] is True
    pool = verdict["pool"]
    assert pool["adopted"] >= 1 and pool["victim_before"] >= 1 and not pool["pool_on_victim"], verdict
    assert pool["ready_after"] == 3 and pool["victim_after"] == 0 and pool["dropped"] >= 1, verdict


def test_a_master_dying_in_a_node_loss_recovery_finishes_it_once_restarted():
    """The same node loss, and the master's process dies once the slices of every stage are
    restored and before they start: the restarted master runs the same plan to its end."""
    verdict = run_node_kill("restored")
    assert verdict["crashes"] == 1 and verdict["resumed"] == 1, verdict
    assert verdict["lost_hosts"] == 3 and verdict["recoveries"] >= 1
    assert verdict["equal"] is True


def test_a_node_loss_restores_a_one_host_stage_from_its_copies_on_other_nodes():
    """A stage with one container backs up to hosts on other nodes first; the node running it is
    removed (with its local stores): its slices come back from checkpoints, not from epoch 0."""
    verdict = run_node_kill("one-host")
    assert verdict["one_host_stage"] in ("running_sum", "payments")
    assert verdict["restored_from_backup"] is True, verdict
    assert verdict["equal"] is True
