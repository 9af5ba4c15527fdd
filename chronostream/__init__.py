"""ChronoStream for Python: elastic stateful stream processing on Ray.

Build a query DAG, run it::

    import chronostream as cs
    q = cs.Query()
    lines = q.source("lines", [{"line": "a b a"}])
    lines.flat_map(lambda e: [{"word": w} for w in e["line"].split()]) \\
         .key_by("word").count().sink(name="counts")
    job = cs.run(q, containers=2)          # or executor="serial"
    job.results("counts")

The public names are re-exported here. The layers below are internal and
import only downwards: ``chronostream.slices`` (the kernel: data model,
operator engines, slice runtime, checkpoint codec) <- ``chronostream.containers``
(the hosts) <- ``chronostream.master`` (coordination) <- this package.
"""

import os as _os

__version__ = "0.1.0"

# A source checkout keeps the layers below this package as top-level
# directories beside it (slices/, containers/, master/); an installed
# distribution has them inside it (pyproject's package-dir). Adding the
# checkout's root to this package's path gives both the same import names,
# chronostream.slices and so on; it must come before the imports below.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (not _os.path.isdir(_os.path.join(__path__[0], "slices"))
        and _os.path.isfile(_os.path.join(_checkout, "slices", "__init__.py"))
        and _os.path.isfile(_os.path.join(_checkout, "pyproject.toml"))):
    __path__.append(_checkout)

from chronostream.client import CompletedJob, Job, JobStatus, ensure_ray, keep_warm_hosts, resume, run, submit  # noqa: E402
from chronostream.containers.options import JobOptions  # noqa: E402
from chronostream.dag import (DEFAULT_EPOCH_EVENTS, DEFAULT_SLICES, DEFAULT_SOURCE_SLICES, Query,  # noqa: E402
                              Stream, compile_query, join)
from chronostream.master.catalog import CatalogError  # noqa: E402
from chronostream.master.host_pool import PoolStats  # noqa: E402
from chronostream.master.job_state import JobState  # noqa: E402
from chronostream.master.migration import MigrationError  # noqa: E402
from chronostream.master.policies import (CompactionRule, Decision, HotSliceRule, LatencyPolicy,  # noqa: E402
                                          Policies, RatePolicy, ScalingAction, ScheduledPolicy,
                                          UtilizationPolicy)
from chronostream.master.rpc_results import PlacementView  # noqa: E402
from chronostream.serial import SerialResult, run_serial  # noqa: E402
from chronostream.slices.errors import (ChronoStreamError, ClusterError, EventError, JobFailed,  # noqa: E402
                                        JobNotFound, QueryError, RecoveryError, RuntimeFault, SavepointError, SinkRowsLost,
                                        StateEncodingError, StoreFullError, WorkdirError)
from chronostream.slices.savepoint import read_state  # noqa: E402
from chronostream.slices.hashing import hash_array, hash_columns, slice_of  # noqa: E402
from chronostream.slices.operators import KeyedAggregate, KeyedJoin, Operator  # noqa: E402
from chronostream.slices.plan import JobPlan  # noqa: E402
from chronostream.slices.sinks import MemorySink, ParquetSink, Sink, read_parquet_sink  # noqa: E402
from chronostream.slices.sourcelog import SourceLog, SourceLogError, SourceLogWriter  # noqa: E402
from chronostream.slices.state import KeyValueState  # noqa: E402
from chronostream.slices.statelib import ListState, MapState, QueueState, TopKState, ValueState  # noqa: E402
from chronostream.slices.types import extend_sub_order  # noqa: E402
from chronostream.slices.windows import (CountWindow, HoppingWindow, LateEventError, SlidingWindow,  # noqa: E402
                                         TumblingWindow, WindowAggregate)

__all__ = [
    "CompletedJob", "Job", "JobState", "JobStatus", "PlacementView", "PoolStats", "ensure_ray", "keep_warm_hosts",
    "run", "submit", "resume", "JobOptions",
    "DEFAULT_EPOCH_EVENTS", "DEFAULT_SLICES", "DEFAULT_SOURCE_SLICES", "JobPlan", "Query", "Stream",
    "compile_query", "join",
    "ChronoStreamError", "ClusterError", "EventError", "JobNotFound", "JobFailed", "QueryError", "RecoveryError",
    "RuntimeFault", "SavepointError", "SinkRowsLost", "StateEncodingError", "StoreFullError", "WorkdirError", "CatalogError",
    "MigrationError",
    "SourceLogError", "LateEventError",
    "CompactionRule", "Decision", "HotSliceRule", "LatencyPolicy", "Policies", "RatePolicy", "ScalingAction",
    "ScheduledPolicy", "UtilizationPolicy",
    "hash_array", "hash_columns", "slice_of",
    "KeyedAggregate", "KeyedJoin", "Operator",
    "SerialResult", "run_serial",
    "MemorySink", "ParquetSink", "Sink", "read_parquet_sink", "read_state",
    "SourceLog", "SourceLogWriter",
    "KeyValueState", "extend_sub_order",
    "ListState", "MapState", "QueueState", "TopKState", "ValueState",
    "CountWindow", "HoppingWindow", "SlidingWindow", "TumblingWindow", "WindowAggregate",
]
