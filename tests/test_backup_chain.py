"""Specification of where a stage's slices are backed up (master.recovery.host_backup_peers)."""

from __future__ import annotations

import numpy as np

from chronostream.master.placement import Placement
from chronostream.master.recovery import host_backup_peers


def placement(containers: dict[int, int], slices: int = 4) -> Placement:
    """Stage 0 of ``slices`` slices over ``containers`` (container -> host), slice s on container s % n."""
    ids = sorted(containers)
    arr = np.array([ids[s % len(ids)] for s in range(slices)])
    return Placement({0: ids}, {0: arr}, {c: 0 for c in ids})


def test_a_stage_on_more_hosts_than_the_backup_factor_is_chained_over_its_own_hosts_only():
    p = placement({0: 0, 1: 1, 2: 2}, slices=6)
    peers = host_backup_peers(p, {0: 0, 1: 1, 2: 2}, 0, backup_factor=2, job_hosts=[0, 1, 2, 3, 4])
    for home, chains in peers.items():
        for s, hosts in chains.items():
            assert len(hosts) == 2 and home not in hosts and set(hosts) <= {0, 1, 2}, (s, hosts)


def test_a_stage_on_too_few_hosts_for_the_backup_factor_goes_on_over_the_jobs_other_hosts():
    p = placement({0: 0, 1: 1})
    peers = host_backup_peers(p, {0: 0, 1: 1}, 0, backup_factor=2, job_hosts=[0, 1, 2, 3])
    # Its own other host first (a restore there keeps the stage where it was), then one of the
    # other stages' hosts, spread over them: both hosts dying at once leave every slice a copy.
    assert peers == {0: {0: [1, 2], 2: [1, 3]}, 1: {1: [0, 2], 3: [0, 3]}}


def test_a_stage_on_too_few_hosts_keeps_what_its_own_hosts_give_in_a_job_without_others():
    p = placement({0: 0, 1: 1})
    assert host_backup_peers(p, {0: 0, 1: 1}, 0, backup_factor=2, job_hosts=[0, 1]) == \
        {0: {0: [1], 2: [1]}, 1: {1: [0], 3: [0]}}


def test_a_stage_on_one_host_backs_up_to_the_jobs_other_hosts():
    p = placement({4: 4})
    peers = host_backup_peers(p, {4: 4}, 0, backup_factor=2, job_hosts=[1, 2, 3, 4])[4]
    # Chained as over a stage's own peers: each slice's copies on distinct hosts, the first
    # copies spread (each of the other hosts rebuilds a share when host 4 dies).
    assert peers == {0: [1, 2], 1: [2, 3], 2: [3, 1], 3: [1, 2]}


def test_a_stage_on_one_host_prefers_hosts_on_other_nodes():
    p = placement({4: 4})
    nodes = {1: "a", 2: "b", 3: "a", 4: "a"}
    peers = host_backup_peers(p, {4: 4}, 0, backup_factor=1, job_hosts=[1, 2, 3, 4], node_of=nodes)[4]
    assert peers[0] == [2], "the one host on another node holds the first slice's copy"


def test_a_stage_on_one_host_of_a_one_host_job_has_no_backups():
    p = placement({0: 0})
    assert host_backup_peers(p, {0: 0}, 0, backup_factor=2, job_hosts=[0]) == {0: {s: [] for s in range(4)}}
    assert host_backup_peers(p, {0: 0}, 0, backup_factor=2) == {0: {s: [] for s in range(4)}}
