"""The seeded fault campaign the Ray test modules share (test_recovery_ray, test_campaign_shapes).

A campaign: the query's source paced by a ``delay`` fault at epoch 0, a
seeded schedule of ``n`` faults on its stateful stages
(``chaos.random_faults``), the run with the failure harness
(``chaos.run_with_faults``, a checkpoint every 2 epochs), and every sink
compared with the serial executor's, row for row. Each module keeps its own
queries, fault kinds and paces; only the shape is here, so a seed gives the
same schedule whichever module runs it.
"""

from __future__ import annotations

from typing import Any

from chronostream.chaos import ChaosReport, Fault, random_faults, run_with_faults


def seeded_campaign(query: Any, containers: dict[str, int], stages: list[str], seed: int, n: int,
                    max_epoch: int, kinds: tuple[str, ...], *, source_delay_s: float, settle_pace_s: float,
                    min_gap: int = 4, all_land: bool = True) -> ChaosReport:
    """Run ``n`` faults of ``kinds`` (seeded by ``seed``) at epochs below ``max_epoch`` on ``stages``
    of ``query``, placed on ``containers`` hosts a stage; its first stage (the source) passes an
    epoch every ``source_delay_s`` and one every ``settle_pace_s`` while a fault settles.

    ``all_land``: every fault must land before the job ends. Leave it False for kinds that may
    speed the job up (a producer killed in a recovery ends the source's pacing: its new host
    replays the input at full speed).
    """
    hosts = {containers[s] for s in stages}
    if len(hosts) != 1:
        raise ValueError(f"the faulted stages {stages} must start on as many hosts each, got {containers}")
    faults = random_faults(seed, n, stages, max_epoch, containers=hosts.pop(), kinds=kinds, min_gap=min_gap)
    slow = Fault("delay", at_epoch=0, stage=next(iter(containers)), seconds=source_delay_s)
    report = run_with_faults(query, [slow] + faults, settle_pace_s=settle_pace_s, containers=containers,
                             checkpoint_every=2)
    assert report.ok, (faults, report.mismatches)
    assert len(report.applied) == n + 1 or not all_land, "every fault landed mid-stream"
    return report
