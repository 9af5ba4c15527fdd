"""The seeded fault campaign the Ray test modules share (test_recovery_ray, test_campaign_shapes).

A campaign: the query's source paced by a ``delay`` fault at epoch 0, a
seeded schedule of ``n`` faults on its stateful stages
(``chaos.random_faults``), the run with the failure harness
(``chaos.run_with_faults``, a checkpoint every 2 epochs), every sink
compared with the serial executor's, row for row, and every scheduled
fault judged on the job's timeline: each must have landed and done what
its kind says (``chaos.judge_landing``). Each module keeps its own
queries, fault kinds and paces; only the shape is here, so a seed gives the
same schedule whichever module runs it.
"""

from __future__ import annotations

from typing import Any

import chronostream as cs
from chronostream.chaos import ChaosReport, Fault, random_faults, run_with_faults


def recovery_roles(query: Any, stages: list[str]) -> dict[str, tuple[str, ...]]:
    """Stage -> the roles a host can have in a recovery of it (``master.recovery.RECOVERY_ROLES``):
    a producer needs a stage upstream, a consumer one downstream."""
    plan = cs.compile_query(query)[0]
    out = {}
    for name in stages:
        sid = plan.stage(name).stage_id
        out[name] = ("adopter",) + (("producer",) if plan.upstream_stages(sid) else ()) + \
            (("consumer",) if plan.downstream_stages(sid) else ())
    return out


def campaign_schedule(query: Any, containers: dict[str, int], stages: list[str], seed: int, n: int, max_epoch: int,
                      kinds: tuple[str, ...], *, source_delay_s: float, min_gap: int = 4) -> list[Fault]:
    """The schedule ``seeded_campaign`` runs: the source's pace at epoch 0, then the seeded faults."""
    hosts = {containers[s] for s in stages}
    if len(hosts) != 1:
        raise ValueError(f"the faulted stages {stages} must start on as many hosts each, got {containers}")
    # (a checkpoint every 2 epochs: by epoch 4 every slice's first checkpoint has reached its holders)
    faults = random_faults(seed, n, stages, max_epoch, containers=hosts.pop(), kinds=kinds, min_gap=min_gap,
                           roles=recovery_roles(query, stages), backups_from=4)
    return [Fault("delay", at_epoch=0, stage=next(iter(containers)), seconds=source_delay_s)] + faults


def seeded_campaign(query: Any, containers: dict[str, int], stages: list[str], seed: int, n: int,
                    max_epoch: int, kinds: tuple[str, ...], *, source_delay_s: float, settle_pace_s: float,
                    min_gap: int = 4) -> ChaosReport:
    """Run ``n`` faults of ``kinds`` (seeded by ``seed``) at epochs below ``max_epoch`` on ``stages``
    of ``query``, placed on ``containers`` hosts a stage; its first stage (the source) passes an
    epoch every ``source_delay_s`` and one every ``settle_pace_s`` while a fault settles. Every
    sink equals the serial run, and every scheduled fault landed."""
    faults = campaign_schedule(query, containers, stages, seed, n, max_epoch, kinds, source_delay_s=source_delay_s,
                               min_gap=min_gap)
    report = run_with_faults(query, faults, settle_pace_s=settle_pace_s, containers=containers,
                             checkpoint_every=2)
    assert report.ok, (faults, report.mismatches)
    assert not report.not_landed(), report.format_landings() + "\n" + report.format_timeline()
    return report
