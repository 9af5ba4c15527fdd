"""Owns the placement of a job: which container hosts which slice of which stage.

Pure data and functions; no Ray. The master keeps one ``Placement`` and
derives every container's routing tables and sender sets from it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

from chronostream.slices.plan import JobPlan
from chronostream.slices.errors import QueryError
from chronostream.containers.routing import OutputRoute, place_slices_evenly


@dataclass
class Placement:
    """Containers per stage and the slice -> container map of every stage."""

    containers: dict[int, list[int]] = field(default_factory=dict)  # stage id -> container ids
    slice_to_container: dict[int, np.ndarray] = field(default_factory=dict)  # stage id -> array
    stage_of: dict[int, int] = field(default_factory=dict)  # container id -> stage id

    def slices_of(self, container_id: int) -> list[int]:
        """Slices hosted by ``container_id``."""
        stage = self.stage_of[container_id]
        return np.flatnonzero(self.slice_to_container[stage] == container_id).tolist()

    def routes_for(self, plan: JobPlan, stage_id: int) -> dict[int, OutputRoute]:
        """Output routing table of any container of ``stage_id``."""
        return {d: OutputRoute(d, self.slice_to_container[d]) for d in plan.downstream_stages(stage_id)}

    def senders_for(self, plan: JobPlan, stage_id: int) -> set[int]:
        """Containers that send to every container of ``stage_id`` each epoch."""
        return {c for u in plan.upstream_stages(stage_id) for c in self.containers[u]}

    def coverage(self, container_id: int) -> frozenset:
        """The (stage, slice) pairs whose rows ``container_id``'s messages carry."""
        stage = self.stage_of[container_id]
        return frozenset((stage, s) for s in self.slices_of(container_id))

    def sender_coverage(self, plan: JobPlan, stage_id: int) -> dict[int, frozenset]:
        """Senders of ``stage_id``'s containers with what each covers (see ``ContainerCore``)."""
        return {c: self.coverage(c) for c in self.senders_for(plan, stage_id)}

    def rehost(self, dead: int, new_id: int, slices: list[int]) -> None:
        """Move ``slices`` of dead container ``dead`` to the new container ``new_id`` (same stage)."""
        stage = self.stage_of[dead]
        self.stage_of[new_id] = stage
        arr = self.slice_to_container[stage].copy()
        if not np.all(arr[slices] == dead):
            raise ValueError(f"slices {slices} of stage {stage} are not all on container {dead}")
        arr[slices] = new_id
        self.slice_to_container[stage] = arr
        ids = self.containers[stage]
        if new_id not in ids:  # (a migration's new container takes the slices of several sources)
            ids.append(new_id)
        if not np.any(arr == dead) and dead in ids:
            ids.remove(dead)

    def as_dict(self, plan: JobPlan) -> dict[str, dict[int, list[int]]]:
        """Readable form: stage name -> container id -> slices."""
        return {plan.stages[s].name: {c: self.slices_of(c) for c in cs} for s, cs in self.containers.items()}


def initial_placement(plan: JobPlan, containers_per_stage: dict[int, int]) -> Placement:
    """Place every stage's slices evenly over its containers (ids dense from 0).

    A stage never gets more containers than slices (an empty container would
    idle); asking for more is capped, not an error.
    """
    p = Placement()
    next_id = 0
    for st in plan.stages:
        n = containers_per_stage.get(st.stage_id, 1)
        if n < 1:
            raise QueryError(f"stage {st.name!r}: containers must be >= 1, got {n}")
        n = min(n, st.num_slices)
        ids = list(range(next_id, next_id + n))
        next_id += n
        p.containers[st.stage_id] = ids
        p.slice_to_container[st.stage_id] = place_slices_evenly(st.num_slices, ids)
        for c in ids:
            p.stage_of[c] = st.stage_id
    return p


def containers_per_stage(plan: JobPlan, containers: int | dict[str, int]) -> dict[int, int]:
    """Resolve the user's ``containers=`` (one number, or stage name -> number).

    A stage never runs more containers than it has slices (``initial_placement``). One
    number for every stage is capped quietly (a one-slice source is common); a number
    asked for a stage by name that exceeds its slices warns, naming both.
    """
    if isinstance(containers, int) and not isinstance(containers, bool):
        if containers < 1:
            raise QueryError(f"containers={containers!r}: every stage needs at least 1 container")
        return {s.stage_id: containers for s in plan.stages}
    if not isinstance(containers, dict):
        raise QueryError(f"containers= takes a number or {{stage name: number}}, got {containers!r}")
    unknown = set(containers) - {s.name for s in plan.stages}
    if unknown:
        raise QueryError(f"containers= names unknown stages {sorted(unknown)}; stages: {[s.name for s in plan.stages]}")
    bad = {k: v for k, v in containers.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
    if bad:
        raise QueryError(f"containers={bad!r}: a stage needs a whole number of containers, at least 1")
    for s in plan.stages:
        if containers.get(s.name, 1) > s.num_slices:
            warnings.warn(f"containers={{{s.name!r}: {containers[s.name]}}}: stage {s.name!r} has "
                          f"{s.num_slices} slices, so it runs {s.num_slices} containers (give it more "
                          f"slices to spread it wider)", UserWarning, stacklevel=3)
    return {s.stage_id: containers.get(s.name, 1) for s in plan.stages}
