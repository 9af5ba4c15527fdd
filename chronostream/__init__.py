"""ChronoStream for Python: elastic stateful stream processing on Ray.

Build a query DAG, run it::

    import chronostream as cs
    q = cs.Query()
    lines = q.source("lines", [{"line": "a b a"}])
    lines.flat_map(lambda e: [{"word": w} for w in e["line"].split()]) \\
         .key_by("word").count().sink(name="counts")
    job = cs.run(q, containers=2)          # or executor="serial"
    job.results("counts")

The public names are re-exported here; the layers below (``slices``,
``containers``, ``master``) are internal.
"""

from chronostream.client import CompletedJob, Job, JobStatus, ensure_ray, keep_warm_hosts, run
from chronostream.dag import (DEFAULT_EPOCH_EVENTS, DEFAULT_SLICES, DEFAULT_SOURCE_SLICES, JobPlan, Query,
                              Stream, compile_query, join)
from chronostream.errors import ChronoStreamError, EventError, JobFailed, QueryError
from chronostream.errors import StoreFullError, WorkdirError
from chronostream.hashing import hash_array, hash_columns, slice_of
from chronostream.operators import KeyedAggregate, KeyedJoin, Operator
from chronostream.serial import SerialResult, run_serial
from chronostream.sinks import MemorySink, ParquetSink, Sink, read_parquet_sink
from chronostream.state import KeyValueState
from chronostream.statelib import ListState, MapState, QueueState, TopKState, ValueState
from chronostream.types import extend_sub_order
from chronostream.windows import (CountWindow, HoppingWindow, LateEventError, SlidingWindow, TumblingWindow,
                                  WindowAggregate)

__all__ = [
    "CompletedJob", "Job", "JobStatus", "ensure_ray", "keep_warm_hosts", "run",
    "DEFAULT_EPOCH_EVENTS", "DEFAULT_SLICES", "DEFAULT_SOURCE_SLICES", "JobPlan", "Query", "Stream",
    "compile_query", "join",
    "ChronoStreamError", "EventError", "JobFailed", "QueryError",
    "StoreFullError", "WorkdirError",
    "hash_array", "hash_columns", "slice_of",
    "KeyedAggregate", "KeyedJoin", "Operator",
    "SerialResult", "run_serial",
    "MemorySink", "ParquetSink", "Sink", "read_parquet_sink",
    "KeyValueState", "extend_sub_order",
    "ListState", "MapState", "QueueState", "TopKState", "ValueState",
    "CountWindow", "HoppingWindow", "LateEventError", "SlidingWindow", "TumblingWindow", "WindowAggregate",
]
__version__ = "0.1.0"
