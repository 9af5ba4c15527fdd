"""Owns what a job's master is launched with: the plan, the containers per stage, the options,
the autoscaling policy, which stages read in-memory tables and the savepoint to start from
(``JobLaunch``), and the plan's
fingerprint (``plan_fingerprint``: which job a catalog belongs to).

The client packs it (cloudpickle, with the user's code by value) and hands it to the master's
``deploy``; the master keeps the bytes in its catalog, authenticated (``master.catalog``: HMAC
under a per-job key), so a restarted master reads the same job back. It must not hold object references: those die with their owner and Ray restarts the
master with its constructor's arguments only (ray-project/ray#53727). Knows no actor.

>>> launch = JobLaunch(plan=None, containers_per_stage={0: 2}, source_stages=[0])
>>> JobLaunch.unpack(launch.pack()).containers_per_stage
{0: 2}
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from ray import cloudpickle

from chronostream.slices.plan import JobPlan
from chronostream.containers.options import JobOptions


@dataclass
class JobLaunch:
    """A job as its master starts it (``JobMaster.deploy``)."""

    plan: JobPlan
    containers_per_stage: dict[int, int]
    options: JobOptions | None = None
    policy: Any = None  # an autoscaling policy (chronostream.master.policies), or None
    source_stages: list[int] = field(default_factory=list)  # stages reading in-memory tables
    restore_from: str | None = None  # a savepoint directory every slice starts from (``slices.savepoint``)
    drop_states: dict[str, list[str]] | None = None  # stage name -> savepoint states the restore leaves behind
    # Stage id -> a source that is no table (a ``LogSource``: where to read), kept for a resume;
    # tables are copied into the work directory instead (``master.source_copies``).
    source_readers: dict[int, Any] = field(default_factory=dict)

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


def _name_of(obj: Any) -> str | None:
    """``module.qualname`` of a function or class (None for None)."""
    if obj is None:
        return None
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def plan_fingerprint(plan: JobPlan) -> str:
    """A hex digest of the plan's shape: stages (name, kind, slices, outputs, operator class,
    inputs, source rows, log directory), streams (producer, key, the steps of their chain by kind
    and function name), sinks (name, kind, stream), epoch size and input size. The same query
    built again gets the same fingerprint in any process; a query that differs in any of these
    gets another (the functions' bodies are not compared: a resumed job runs the code it was
    launched with, from its catalog).

    >>> from chronostream.dag import Query, compile_query
    >>> def plan(slices):
    ...     q = Query()
    ...     _ = q.source("w", [{"w": "a"}]).key_by("w").count(slices=slices).sink(name="c")
    ...     return compile_query(q)[0]
    >>> plan_fingerprint(plan(2)) == plan_fingerprint(plan(2)), plan_fingerprint(plan(2)) == plan_fingerprint(plan(3))
    (True, False)
    """
    shape = {
        "stages": [[st.name, st.kind, st.num_slices, list(st.outputs),
                    _name_of(st.factory[0]) if st.factory else None,
                    [[i.name, i.stream_id, i.index] for i in st.inputs], st.source_rows, st.log_dir]
                   for st in plan.stages],
        "streams": [[sp.name, sp.stage_id, sp.output, list(sp.key) if sp.key else None,
                     [[type(step).__name__, _name_of(getattr(step, "fn", None))] for step in sp.chain]]
                    for sp in plan.streams],
        "sinks": [[sk.name, type(sk.sink).__name__, sk.stream_id] for sk in plan.sinks],
        "epoch_events": plan.epoch_events, "total_events": plan.total_events, "order_end": plan.order_end,
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:32]
