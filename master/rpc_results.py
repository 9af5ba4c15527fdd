"""What the master's reading calls return: frozen dataclasses, one per call.

Owns: ``MasterStatus`` (``JobMaster.status``) and ``PlacementView``
(``JobMaster.placement_view``). The master builds them; the client, the CLI
and the failure harness read their fields by name, so a field renamed or
dropped here fails where it is read, not as a missing dictionary key
somewhere downstream. Knows no Ray: the values cross it pickled.

``dataclasses.asdict`` gives the plain form (the CLI prints it as JSON):

>>> from dataclasses import asdict
>>> view = PlacementView(stages={"count": {3: [0, 2]}}, nodes={3: "n0"}, hosts={3: 3}, master_node="n0",
...                      backup_copies={})
>>> view.containers_of("count")
[3]
>>> list(asdict(view))
['stages', 'nodes', 'hosts', 'master_node', 'backup_copies']
"""

from __future__ import annotations

from dataclasses import dataclass

from chronostream.master.job_state import JobState


@dataclass(frozen=True)
class MasterStatus:
    """The job's state and progress, as the master knows them now (``JobMaster.status``)."""

    state: JobState
    error: BaseException | None  # what failed the job (None unless ``state`` is failed)
    containers: int  # containers of the placement now
    done: int  # of them, those that processed their last epoch
    elapsed_s: float  # since the hosts started (to the job's end once it ended); 0 before
    epochs: int | None  # epochs of the input (None: a followed source log, no known end)
    min_epoch: int  # the lowest next epoch any container has reported
    recoveries: int  # recoveries ended so far (every one, also those the timeline pushed out)
    gc_dropped: int  # output-log entries the master's GC trimmed so far
    stale_backups_dropped: int  # backup copies off their slice's chain, dropped by GC
    wants_source_refs: bool  # a restarted master waits for the client's source table references
    metrics_url: str = ""  # the job's Prometheus endpoint ("" when it has none: master.ray_http)
    dashboard_url: str = ""  # the job's live dashboard ("" when it has none)


@dataclass(frozen=True)
class PlacementView:
    """Where the job runs (``JobMaster.placement_view``, ``Job.placement()``)."""

    stages: dict[str, dict[int, list[int]]]  # stage name -> container id -> its slices
    nodes: dict[int, str]  # host id -> Ray node id
    hosts: dict[int, int]  # container id -> host id (containers that left the placement too)
    master_node: str  # the Ray node the master runs on
    # Stage name -> the fewest backup copies a slice of it has now (fewer than ``backup_factor``
    # when the job has too few hosts); empty when the job takes no checkpoints.
    backup_copies: dict[str, int]

    def containers_of(self, stage: str) -> list[int]:
        """The ids of ``stage``'s containers, in order."""
        return sorted(self.stages[stage])
