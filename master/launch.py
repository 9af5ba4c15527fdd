"""Owns what a job's master is launched with: the plan, the containers per stage, the options,
the autoscaling policy and which stages read in-memory tables (``JobLaunch``).

The client packs it (cloudpickle, with the user's code by value) and hands it to the master's
``deploy``; the master keeps the bytes in its catalog, so a restarted master reads the same job
back. It must not hold object references: those die with their owner and Ray restarts the
master with its constructor's arguments only (ray-project/ray#53727). Knows no actor.

>>> launch = JobLaunch(plan=None, containers_per_stage={0: 2}, source_stages=[0])
>>> JobLaunch.unpack(launch.pack()).containers_per_stage
{0: 2}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray import cloudpickle

from chronostream.dag import JobPlan
from chronostream.options import JobOptions


@dataclass
class JobLaunch:
    """A job as its master starts it (``JobMaster.deploy``)."""

    plan: JobPlan
    containers_per_stage: dict[int, int]
    options: JobOptions | None = None
    policy: Any = None  # an autoscaling policy (chronostream.autoscale), or None
    source_stages: list[int] = field(default_factory=list)  # stages reading in-memory tables

    def pack(self) -> bytes:
        """The launch as bytes (the catalog checksums them)."""
        return cloudpickle.dumps(self)

    @staticmethod
    def unpack(data: bytes) -> "JobLaunch":
        """The launch ``pack`` made."""
        launch = cloudpickle.loads(data)
        if not isinstance(launch, JobLaunch):
            raise TypeError(f"not a job launch: {type(launch).__name__}")
        return launch
