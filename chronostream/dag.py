"""The query builder: ``Query`` and ``Stream`` (what users build), ``join``, and ``compile_query``.

``compile_query`` turns a query into the executor-neutral plan of
``chronostream.slices.plan`` (stages, physical streams, sinks); the
stateless transforms ``key_by``/``map``/``filter``/``flat_map`` and their
``*_batches`` forms become the plan's fused chains. Knows no executor.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, is_dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

import pyarrow as pa

from chronostream.slices.errors import QueryError
from chronostream.slices.operators import AGGREGATES, KeyedAggregate, KeyedJoin, Operator
from chronostream.slices.sinks import MemorySink, Sink
from chronostream.slices.readers import LogSource
from chronostream.slices.sourcelog import SourceLog
from chronostream.slices.sources import SourceData, assign_global_order, to_table
from chronostream.slices.state import check_hot_limit
from chronostream.slices.windows import ClosingWindowAggregate, WindowAggregate, WindowSpec, plan_windows
from chronostream.slices.plan import (Filter, FilterBatches, FlatMap, FlatMapBatches, InputPlan, JobPlan, Map,
                                      MapBatches, SinkPlan, StagePlan, StreamPlan, Transform, batch_table)

#: Slices of a stateful stage when ``slices=`` is not given. Slices are the
#: unit of migration and recovery: more slices = finer elasticity, at a small
#: per-slice cost per epoch.
DEFAULT_SLICES = 32
#: Slices of a source stage (its stateless transforms run with that parallelism).
DEFAULT_SOURCE_SLICES = 4
#: Source events per epoch (the unit of progress, batching and backpressure).
DEFAULT_EPOCH_EVENTS = 16384


# --- builder ----------------------------------------------------------------


@dataclass(eq=False)
class StageNode:
    """A stage being built: a source or an operator with its inputs."""

    name: str
    kind: str  # "source" | "operator"
    slices: int
    outputs: tuple[str, ...]
    factory: tuple[type, tuple, dict] | None = None
    inputs: dict[str, "Stream"] = field(default_factory=dict)
    source: SourceData | None = None
    log: LogSource | None = None
    output_schemas: dict[str, pa.Schema] = field(default_factory=dict)


class Stream:
    """A stream of events in a query: transform it, key it, aggregate it, sink it.

    Streams are immutable: every method returns a new stream.
    """

    def __init__(self, query: "Query", stage: StageNode, output: str,
                 chain: tuple = (), key: tuple[str, ...] | None = None, name: str | None = None,
                 columns: tuple[str, ...] | None = None) -> None:
        self.query = query
        self.stage = stage
        self.output = output
        self.chain = chain
        self.key = key
        self.name = name or (stage.name if output == "out" else f"{stage.name}.{output}")
        #: The stream's user column names when known while the query is built (a source's
        #: table or log schema, through filters, keyings and maps given a ``schema``; an
        #: aggregate's output): column names are checked against them at build time. None
        #: after a transform whose output columns only its function knows.
        self.columns = columns

    def _derive(self, step: Any = None, key: tuple[str, ...] | None = None, name: str | None = None,
                columns: tuple[str, ...] | None | bool = True) -> "Stream":
        """A stream with ``step`` appended to the chain. ``columns`` True: derived from the step
        (kept by filters and keyings, a map's ``schema``, else unknown)."""
        chain = self.chain + ((step,) if step is not None else ())
        if columns is True:
            if step is None or isinstance(step, (Filter, FilterBatches)):
                columns = self.columns
            elif isinstance(step, (Map, FlatMap)) and step.schema is not None:
                columns = tuple(step.schema.names)
            else:
                columns = None
        return Stream(self.query, self.stage, self.output, chain, key, name or self.name, columns)

    def _check_columns(self, what: str, columns: Sequence[str]) -> None:
        """Refuse (``QueryError``) column names the stream is known not to have."""
        if self.columns is None:
            return
        missing = [c for c in columns if c not in self.columns]
        if missing:
            raise QueryError(f"{what}: no column{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(repr(c) for c in missing)} in stream {self.name!r}; "
                             f"its columns are {list(self.columns)}")

    # stateless, per event (user Python per event)
    def map(self, fn: Callable[[dict], dict], schema: pa.Schema | None = None) -> "Stream":
        """Transform each event with ``fn(event) -> event`` (dict in, dict out)."""
        return self._derive(Map(fn, schema))

    def filter(self, fn: Callable[[dict], bool]) -> "Stream":
        """Keep the events for which ``fn(event)`` is true."""
        return self._derive(Filter(fn), key=self.key)

    def flat_map(self, fn: Callable[[dict], Iterable[dict]], schema: pa.Schema | None = None) -> "Stream":
        """Replace each event with the events ``fn(event)`` yields (zero or more)."""
        return self._derive(FlatMap(fn, schema))

    # stateless, vectorized (the fast path). The ``fn`` of these must be row-wise: an output
    # row depends on its own input row only. Which rows share a batch is the runtime's choice
    # (a slice's rows of an epoch, or the rows of every slice a container runs as one group).
    def map_batches(self, fn: Callable[[pa.Table], pa.Table]) -> "Stream":
        """Transform whole batches: ``fn(table) -> table`` with as many rows, each computed
        from its own input row (how rows are batched is not defined; see the comment above)."""
        return self._derive(MapBatches(fn))

    def filter_batches(self, fn: Callable[[pa.Table], Any]) -> "Stream":
        """Filter whole batches: ``fn(table)`` returns a boolean mask."""
        return self._derive(FilterBatches(fn), key=self.key)

    def flat_map_batches(self, fn: Callable[[pa.Table], tuple[pa.Table, Any]]) -> "Stream":
        """Fan out whole batches: ``fn(table) -> (table, parent_index)``.

        >>> import pyarrow.compute as pc
        >>> def split(t):
        ...     words = pc.utf8_split_whitespace(t["line"])
        ...     return pa.table({"word": pc.list_flatten(words)}), pc.list_parent_indices(words)
        """
        return self._derive(FlatMapBatches(fn))

    def key_by(self, key: str | Sequence[str] | Callable[[dict], Any], name: str = "key") -> "Stream":
        """Key the stream by column(s), or by ``fn(event)`` stored in column ``name``.

        The key decides the slice of the next stateful stage:
        ``slice = stable_hash(key) % slices``.
        """
        if callable(key):
            fn = key
            columns = None if self.columns is None else tuple(dict.fromkeys((*self.columns, name)))
            return self._derive(Map(lambda e, _fn=fn, _n=name: {**e, _n: _fn(e)}), key=(name,), columns=columns)
        cols = (key,) if isinstance(key, str) else tuple(key)
        if not cols:
            raise QueryError("key_by needs at least one column")
        self._check_columns(f"key_by({key!r})", cols)
        return self._derive(None, key=cols)

    # stateful
    def apply(self, operator: type[Operator], *args: Any, outputs: Sequence[str] = ("out",),
              slices: int | None = None, name: str | None = None, input_name: str = "in",
              output_schemas: Mapping[str, pa.Schema] | None = None, **kwargs: Any) -> "Stream | dict[str, Stream]":
        """Run a user ``Operator`` over this stream (its input is called ``input_name``)."""
        return self.query.operator(operator, {input_name: self}, *args, outputs=outputs, slices=slices,
                                   name=name, output_schemas=output_schemas, **kwargs)

    def aggregate(self, *, count: bool = False, sum: Sequence[str] = (), min: Sequence[str] = (),
                  max: Sequence[str] = (), mean: Sequence[str] = (), slices: int | None = None,
                  name: str | None = None) -> "Stream":
        """Running keyed aggregates, vectorized: one update row per input row.

        Output columns: the key columns, then ``count``, ``sum_<col>``,
        ``min_<col>``, ``max_<col>``, ``mean_<col>`` as asked.
        """
        if self.key is None:
            raise QueryError("aggregate() needs a keyed stream: call key_by() first")
        specs: list[tuple[str, str | None]] = [("count", None)] if count else []
        for agg, cols in (("sum", sum), ("min", min), ("max", max), ("mean", mean)):
            for c in ([cols] if isinstance(cols, str) else cols):
                specs.append((agg, c))
        if not specs:
            raise QueryError(f"aggregate() needs at least one of {AGGREGATES}")
        stage = name or f"{self.name}.aggregate"
        for agg, c in specs:
            if c is not None:
                self._check_columns(f"stage {stage!r}: {agg}={c!r}", [c])
        out = self.query.operator(KeyedAggregate, {"in": self}, list(self.key), specs, slices=slices, name=stage)
        out.columns = tuple(dict.fromkeys([*self.key, *(KeyedAggregate.output_name(a, c) for a, c in specs)]))
        return out

    def window(self, windows: WindowSpec | Sequence[WindowSpec], *, count: bool = False,
               sum: str | Sequence[str] = (), mean: str | Sequence[str] = (), min: str | Sequence[str] = (),
               max: str | Sequence[str] = (), distinct: str | Sequence[str] = (),
               allowed_lateness: Any = None, hot_entries: int | None = None, slices: int | None = None,
               name: str | None = None) -> "Stream":
        """Per-key window aggregates, evaluated at every event (see ``chronostream.slices.windows``).

        ``windows``: a ``SlidingWindow(size, time=col)`` (exact: the key's
        events in ``(t - size, t]``), a ``CountWindow(n)``, a list of those
        (named; they share one event queue), or one ``TumblingWindow`` /
        ``HoppingWindow`` (``emit="close"``: one row per window when it closes;
        ``clock="slice"``: closed by the slice's event time, so an idle key's
        window closes once another key of its slice passes its end). Output:
        one row per event for sliding windows (the
        key columns, the time column, then ``count``, ``sum_<col>``,
        ``mean_<col>``, ``min_<col>``, ``max_<col>``, ``distinct_<col>``,
        suffixed ``_<name>`` with several windows); hopping windows add
        ``window_start``/``window_end`` and emit per window. An event older
        than its key's latest time by more than ``allowed_lateness`` (default
        0) is a bad input (``LateEventError``); within it, its time is clamped.
        ``hot_entries``: each of the window's states keeps at most that many
        entries per slice in memory (per-key headers, queue chunks, open
        windows), the ones written longest ago in the host's spill store
        (many keys, each idle most of the time). None: all in memory.

        >>> import chronostream as cs
        >>> q = cs.Query()
        >>> pay = q.source("p", [{"card": "a", "ts": t, "amount": 1} for t in (0, 100, 250, 400)])
        >>> _ = pay.key_by("card").window(cs.SlidingWindow(300, time="ts"), count=True, sum="amount",
        ...                               slices=2).sink(name="w")
        >>> [r["count"] for r in cs.run(q, executor="serial").results("w").to_pylist()]
        [1, 2, 3, 2]
        """
        if self.key is None:
            raise QueryError("window() needs a keyed stream: call key_by() first")
        specs: list[tuple[str, str | None]] = [("count", None)] if count else []
        for agg, cols in (("sum", sum), ("mean", mean), ("min", min), ("max", max), ("distinct", distinct)):
            for c in ([cols] if isinstance(cols, str) else cols):
                specs.append((agg, c))
        normalized, lateness = plan_windows(windows, specs, allowed_lateness)
        stage = name or f"{self.name}.window"
        for agg, c in specs:
            if c is not None:
                self._check_columns(f"stage {stage!r}: {agg}={c!r}", [c])
        for w in normalized:
            if w.time is not None:
                self._check_columns(f"stage {stage!r}: window time={w.time!r}", [w.time])
        try:
            check_hot_limit(stage, hot_entries, what="window")
        except ValueError as exc:
            raise QueryError(str(exc)) from None
        # Windows emitted on close also emit those still open at the end of the input.
        cls = ClosingWindowAggregate if normalized[0].kind == "hopping" and normalized[0].emit == "close" \
            else WindowAggregate
        return self.query.operator(cls, {"in": self}, list(self.key), normalized, specs, lateness, hot_entries,
                                   slices=slices, name=name or f"{self.name}.window")

    def count(self, slices: int | None = None, name: str | None = None) -> "Stream":
        """Running count per key."""
        return self.aggregate(count=True, slices=slices, name=name)

    def sum(self, column: str, slices: int | None = None, name: str | None = None) -> "Stream":
        """Running sum of ``column`` per key."""
        return self.aggregate(sum=[column], slices=slices, name=name)

    def min(self, column: str, slices: int | None = None, name: str | None = None) -> "Stream":
        """Running minimum of ``column`` per key."""
        return self.aggregate(min=[column], slices=slices, name=name)

    def max(self, column: str, slices: int | None = None, name: str | None = None) -> "Stream":
        """Running maximum of ``column`` per key."""
        return self.aggregate(max=[column], slices=slices, name=name)

    def mean(self, column: str, slices: int | None = None, name: str | None = None) -> "Stream":
        """Running mean of ``column`` per key."""
        return self.aggregate(mean=[column], slices=slices, name=name)

    def sink(self, sink: Sink | None = None, name: str | None = None) -> Sink:
        """Send this stream to ``sink`` (default: a ``MemorySink`` named ``name``, else the
        stream's name) and return the sink spec the query holds. ``name`` given with a ``sink``
        names that sink (a copy of the spec). Sink names are unique in a query
        (``Job.results(name)`` reads one): a taken name raises ``QueryError``."""
        if sink is None:
            sink = MemorySink(name or self.name)
        elif name is not None and sink.name != name:
            if is_dataclass(sink):
                sink = replace(sink, name=name)
            else:
                sink = copy.copy(sink)
                sink.name = name
        taken = {s.name for _, s in self.query.sinks}
        if self.query.dead_letter_sink is not None:
            taken.add(self.query.dead_letter_sink.name)
        if sink.name in taken:
            raise QueryError(f"stream {self.name!r}: a sink named {sink.name!r} already exists in this query "
                             f"(sink names are unique: results() reads a sink by name); name this one with "
                             f".sink(..., name=...)")
        self.query.sinks.append((self, sink))
        return sink

    def __repr__(self) -> str:
        return f"Stream({self.name!r}, key={self.key})"


class Query:
    """A query DAG under construction.

    >>> q = Query()
    >>> words = q.source("words", [{"word": "a"}, {"word": "b"}, {"word": "a"}])
    >>> sink = words.key_by("word").count().sink(name="counts")
    >>> [s.name for s in q.stages]
    ['words', 'words.aggregate']
    """

    def __init__(self, epoch_events: int = DEFAULT_EPOCH_EVENTS) -> None:
        if epoch_events < 1:
            raise QueryError("epoch_events must be >= 1")
        self.epoch_events = epoch_events
        self.stages: list[StageNode] = []
        self.sinks: list[tuple[Stream, Sink]] = []
        self.dead_letter_sink: Sink | None = None

    def _unique_name(self, name: str) -> str:
        taken = {s.name for s in self.stages}
        if name not in taken:
            return name
        i = 2
        while f"{name}#{i}" in taken:
            i += 1
        return f"{name}#{i}"

    def source(self, name: str, data: Any, *, schema: pa.Schema | None = None,
               order_by: str | None = None, slices: int = DEFAULT_SOURCE_SLICES) -> Stream:
        """Add a source: an Arrow table or an iterable of dicts (bounded).

        ``order_by`` names an event-time column that sets the global order
        over all sources (ties: source declaration order, then row); without
        it rows keep their position. Rows that break ``schema`` raise an
        error naming the source and row, or become dead letters when
        ``dead_letters()`` was configured.
        """
        if any(s.name == name for s in self.stages):
            raise QueryError(f"a stage named {name!r} already exists")
        if slices < 1:
            raise QueryError(f"source {name!r}: slices must be >= 1")
        table, dead = to_table(name, data, schema, dead_letter=self.dead_letter_sink is not None)
        if order_by is not None and order_by not in table.schema.names:
            raise QueryError(f"source {name!r}: order_by column {order_by!r} not in {table.schema.names}")
        node = StageNode(name, "source", slices, ("out",), source=SourceData(name, table, order_by, dead))
        self.stages.append(node)
        return Stream(self, node, "out", columns=tuple(table.schema.names))

    def source_log(self, log_dir: str, stream: str, *, follow: bool = False,
                   slices: int = DEFAULT_SOURCE_SLICES, name: str | None = None) -> Stream:
        """Add a source reading one stream of a source log (see ``chronostream.spark.feed``).

        Rows keep the log's global order, so several streams of one log
        interleave exactly as the feeder ordered them. ``follow=False`` reads
        what the log holds now (up to its high water mark); ``follow=True``
        tails the log while a writer appends and ends when it is sealed.
        """
        name = name or stream
        if any(s.name == name for s in self.stages):
            raise QueryError(f"a stage named {name!r} already exists")
        log = SourceLog(log_dir)
        schema = log.schema(stream)  # raises a clear error for an unknown stream
        spec = LogSource(str(log_dir), stream, None if follow else log.high_water)
        node = StageNode(name, "source", slices, ("out",), log=spec)
        self.stages.append(node)
        return Stream(self, node, "out", columns=tuple(c for c in schema.names if not c.startswith("_")))

    def operator(self, operator: type[Operator], inputs: Mapping[str, Stream], *args: Any,
                 outputs: Sequence[str] = ("out",), slices: int | None = None, name: str | None = None,
                 output_schemas: Mapping[str, pa.Schema] | None = None,
                 **kwargs: Any) -> "Stream | dict[str, Stream]":
        """Add a stateful operator stage consuming ``inputs`` (name -> stream).

        Returns the output stream, or a dict of them when there are several.
        ``slices`` is fixed for the life of the job (default ``DEFAULT_SLICES``).
        """
        if not (isinstance(operator, type) and issubclass(operator, Operator)):
            raise QueryError(f"{operator!r} is not an Operator subclass")
        if not inputs:
            raise QueryError("an operator needs at least one input stream")
        for n, s in inputs.items():
            if not isinstance(s, Stream) or s.query is not self:
                raise QueryError(f"input {n!r} is not a stream of this query")
        if not outputs:
            raise QueryError("an operator needs at least one output")
        n_slices = DEFAULT_SLICES if slices is None else slices
        if n_slices < 1:
            raise QueryError("slices must be >= 1")
        node = StageNode(self._unique_name(name or operator.__name__), "operator", n_slices, tuple(outputs),
                         factory=(operator, tuple(args), dict(kwargs)), inputs=dict(inputs),
                         output_schemas=dict(output_schemas or getattr(operator, "output_schemas", {}) or {}))
        self.stages.append(node)
        streams = {o: Stream(self, node, o, columns=tuple(c for c in node.output_schemas[o].names
                                                          if not c.startswith("_"))
                             if node.output_schemas.get(o) is not None else None) for o in outputs}
        return streams[outputs[0]] if len(outputs) == 1 else streams

    def dead_letters(self, sink: Sink | None = None) -> Sink:
        """Route poison events (a user function raised, a row broke the schema) to ``sink``.

        Without this, the first poison event fails the job with an error naming
        stage, slice and source order. Call it before adding sources.
        """
        self.dead_letter_sink = sink or MemorySink("dead_letters")
        return self.dead_letter_sink


def join(left: Stream, right: Stream, *, slices: int | None = None, name: str | None = None) -> Stream:
    """Symmetric keyed equi-join of two keyed streams (inputs ``left`` and ``right``).

    Each pair of events with equal keys is emitted once, when the later of
    the two arrives (in the deterministic merge order).
    """
    if left.key is None or right.key is None:
        raise QueryError("join() needs two keyed streams: call key_by() on both")
    if len(left.key) != len(right.key):
        raise QueryError("join keys must have the same number of columns")
    return left.query.operator(KeyedJoin, {"left": left, "right": right}, list(left.key), list(right.key),
                               slices=slices, name=name or "join")


def compile_query(query: Query) -> tuple[JobPlan, dict[int, Any]]:
    """Compile ``query`` into a ``JobPlan`` and each source stage's input by stage id.

    In-memory source tables get the global ``_order``/``_sub`` columns here;
    log sources are given as ``LogSource`` specs (read by the containers).
    """
    if not query.sinks:
        raise QueryError("the query has no sink: add .sink(...) to at least one stream")
    stage_ids = {id(node): i for i, node in enumerate(query.stages)}
    streams: list[StreamPlan] = []
    stream_of: dict[int, int] = {}

    def physical(s: Stream, fresh: bool = False) -> int:
        if fresh or id(s) not in stream_of:
            sid = len(streams)
            streams.append(StreamPlan(sid, s.name, stage_ids[id(s.stage)], s.output, s.chain, s.key))
            if not fresh:
                stream_of[id(s)] = sid
            return sid
        return stream_of[id(s)]

    stages: list[StagePlan] = []
    for i, node in enumerate(query.stages):
        inputs = []
        used: set[int] = set()
        for idx, (in_name, s) in enumerate(node.inputs.items()):
            if id(s.stage) not in stage_ids or stage_ids[id(s.stage)] >= i:
                raise QueryError(f"stage {node.name!r}: input {in_name!r} comes from a later stage")
            # One stream object feeding two inputs of one stage becomes two
            # physical streams, so each input has its own channels.
            sid = physical(s, fresh=id(s) in used)
            used.add(id(s))
            streams[sid].consumers.append((i, in_name))
            inputs.append(InputPlan(in_name, sid, idx))
        stages.append(StagePlan(i, node.name, node.kind, node.slices, node.outputs, node.factory, inputs, [],
                                dict(node.output_schemas)))
    sinks: list[SinkPlan] = []
    names: set[str] = set()
    for k, (s, sink) in enumerate(query.sinks):
        if sink.name in names:
            raise QueryError(f"two sinks are named {sink.name!r}; sink names must be unique")
        names.add(sink.name)
        sid = physical(s)
        streams[sid].sinks.append(k)
        sinks.append(SinkPlan(k, sink.name, sink, sid))
    if query.dead_letter_sink is not None and query.dead_letter_sink.name in names:
        raise QueryError(f"a sink and the dead-letter sink are both named {query.dead_letter_sink.name!r}; "
                         "results(name) would read only one of them: rename one")
    for sp in streams:
        stages[sp.stage_id].produced.append(sp.stream_id)
    source_nodes = [n for n in query.stages if n.kind == "source"]
    log_nodes = [n for n in source_nodes if n.log is not None]
    source_tables: dict[int, Any] = {}
    total = 0
    dead: list[dict] = []
    order_end: int | None
    if log_nodes:
        if len(log_nodes) != len(source_nodes):
            raise QueryError("a query reads either source logs or in-memory sources, not both "
                             "(the global order comes from one place)")
        dirs = {str(n.log.log_dir) for n in log_nodes}  # type: ignore[union-attr]
        if len(dirs) != 1:
            raise QueryError(f"all log sources of a query must read one source log, got {sorted(dirs)}")
        ends = {n.log.end_order for n in log_nodes}  # type: ignore[union-attr]
        order_end = None if None in ends else max(e for e in ends if e is not None)
        for node in log_nodes:
            sid = stage_ids[id(node)]
            source_tables[sid] = node.log
            stages[sid].log_dir = str(node.log.log_dir)  # type: ignore[union-attr]
    else:
        tables = assign_global_order([n.source for n in source_nodes])  # type: ignore[misc]
        for node, table in zip(source_nodes, tables):
            sid = stage_ids[id(node)]
            source_tables[sid] = table
            stages[sid].source_rows = table.num_rows
            total += table.num_rows
            dead.extend(node.source.dead_letters)  # type: ignore[union-attr]
        order_end = total
    plan = JobPlan(stages, streams, sinks, query.epoch_events, total, query.dead_letter_sink, dead, order_end)
    return plan, source_tables
