"""The compiled, executor-neutral plan of a query: what every layer below the query builder reads.

Owns: the stateless transforms fused into a producing stage (map, filter,
flat_map and their vectorized ``*_batches`` forms), ``batch_table`` (the one
check of a ``*_batches`` function's result), and the plan itself: ``JobPlan``
of ``StagePlan`` stages, ``StreamPlan`` physical streams and ``SinkPlan``
sinks. Built by ``chronostream.dag.compile_query``; knows no executor and no
builder.

A *stage* is a source or a stateful operator with a fixed slice count. A
*physical stream* is a stage output plus a chain of stateless transforms,
applied by the producing slice before it numbers the rows (``out_seq``) and
routes them by key to the consumer slices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from chronostream.slices.sinks import Sink


# --- stateless transforms (fused into the producing stage) -----------------


@dataclass(frozen=True)
class Map:
    """Per-event map: ``fn(event) -> event``."""

    fn: Callable[[dict], dict]
    schema: pa.Schema | None = None
    fan_out = False


@dataclass(frozen=True)
class Filter:
    """Per-event filter: keep events where ``fn(event)`` is true."""

    fn: Callable[[dict], bool]
    fan_out = False


@dataclass(frozen=True)
class FlatMap:
    """Per-event flat map: ``fn(event) -> iterable of events``."""

    fn: Callable[[dict], Iterable[dict]]
    schema: pa.Schema | None = None
    fan_out = True


@dataclass(frozen=True)
class MapBatches:
    """Vectorized map: ``fn(table) -> table`` with the same number of rows."""

    fn: Callable[[pa.Table], pa.Table]
    fan_out = False


@dataclass(frozen=True)
class FilterBatches:
    """Vectorized filter: ``fn(table) -> boolean array`` (true = keep)."""

    fn: Callable[[pa.Table], Any]
    fan_out = False


@dataclass(frozen=True)
class FlatMapBatches:
    """Vectorized flat map: ``fn(table) -> (table, parent_index)``.

    ``parent_index[i]`` is the input row output row ``i`` comes from; it must
    be non-decreasing (outputs grouped by parent, in parent order).
    """

    fn: Callable[[pa.Table], tuple[pa.Table, Any]]
    fan_out = True

    def call(self, table: pa.Table) -> tuple[pa.Table | pa.RecordBatch, Any]:
        """``fn(table)``, checked to be a ``(table, parent_indices)`` pair (a bare table would
        otherwise fail in the caller's unpacking with no word of what was expected)."""
        result = self.fn(table)
        if not (isinstance(result, (tuple, list)) and len(result) == 2
                and isinstance(result[0], (pa.Table, pa.RecordBatch))):
            got = type(result).__name__ if not isinstance(result, (tuple, list)) else \
                f"a {len(result)}-{type(result).__name__} of {[type(x).__name__ for x in result]}"
            raise TypeError(f"flat_map_batches function must return (table, parent_indices), got {got}")
        return result[0], result[1]


Transform = Map | Filter | FlatMap | MapBatches | FilterBatches | FlatMapBatches


def batch_table(step: MapBatches | FlatMapBatches, out: pa.Table | pa.RecordBatch) -> pa.Table:
    """The table a ``map_batches``/``flat_map_batches`` function returned (a record batch made a
    table), refused with ``ValueError`` (the event's error, as any the function raises) when a
    column name comes twice: a stream's rows are records, one value per name. Every executor
    checks it here, so all refuse the same tables.

    >>> t = pa.table({"v": [1]})
    >>> batch_table(MapBatches(lambda t: t), t.append_column("v", t["v"]))
    Traceback (most recent call last):
    ...
    ValueError: map_batches returned a table with the column name(s) ['v'] more than once (each column needs its own)
    """
    table = pa.Table.from_batches([out]) if isinstance(out, pa.RecordBatch) else out
    names = table.schema.names
    if len(set(names)) != len(names):
        kind = "map_batches" if isinstance(step, MapBatches) else "flat_map_batches"
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{kind} returned a table with the column name(s) {twice} more than once "
                         "(each column needs its own)")
    return table


def filter_rows(table: pa.Table, mask: Any) -> pa.Table:
    """The rows of ``table`` that the mask a ``filter_batches`` function returned keeps.

    The mask is one boolean per row (an Arrow array or chunked array, a numpy array, a list; a
    null drops its row) or an Arrow compute expression. Anything else is refused with
    ``ValueError`` (the event's error, as any the function raises); every executor filters
    here, so all keep and refuse the same rows.

    >>> t = pa.table({"v": [1, 2, 3]})
    >>> filter_rows(t, [True, None, True])["v"].to_pylist()
    [1, 3]
    >>> filter_rows(t, [True, False])
    Traceback (most recent call last):
    ...
    ValueError: filter_batches returned a mask of 2 values for a batch of 3
    """
    if isinstance(mask, pc.Expression):
        return table.filter(mask)
    if not isinstance(mask, (pa.Array, pa.ChunkedArray)):
        try:
            mask = pa.array(mask)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
            raise ValueError(f"filter_batches must return a boolean mask, got {type(mask).__name__} "
                             f"({exc})") from None
    if not pa.types.is_boolean(mask.type):
        raise ValueError(f"filter_batches returned a mask of {mask.type}, not of booleans")
    if len(mask) != table.num_rows:
        raise ValueError(f"filter_batches returned a mask of {len(mask)} values for a batch of {table.num_rows}")
    return table.filter(mask)


def parent_rows(parents: Any, out_rows: int, in_rows: int) -> np.ndarray:
    """The parent indices a ``flat_map_batches`` function returned with its ``out_rows`` rows for
    a batch of ``in_rows``, as int64, refused with ``ValueError`` unless there is one per output
    row, each an input row, in non-decreasing order (a parent's outputs together, parents in
    order: the lineage's sub-order counts each parent's outputs from there). Every executor
    checks them here.

    >>> parent_rows([0, 0, 2], 3, 3).tolist()
    [0, 0, 2]
    >>> parent_rows([1, 0], 2, 2)
    Traceback (most recent call last):
    ...
    ValueError: flat_map_batches: parent_index must be non-decreasing
    """
    try:
        p = np.asarray(parents, dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"flat_map_batches: parent_index must be integers, got {type(parents).__name__} "
                         f"({exc})") from None
    if p.ndim != 1 or len(p) != out_rows:
        raise ValueError(f"flat_map_batches: parent_index needs one value per output row: {p.size} for {out_rows}")
    if len(p) and (int(p.min()) < 0 or int(p.max()) >= in_rows):
        bad = int(p.min()) if int(p.min()) < 0 else int(p.max())
        raise ValueError(f"flat_map_batches: parent index {bad} is not a row of the batch of {in_rows}")
    if len(p) and np.any(p[1:] < p[:-1]):
        raise ValueError("flat_map_batches: parent_index must be non-decreasing")
    return p


# --- the compiled plan ------------------------------------------------------


@dataclass
class StreamPlan:
    """A physical stream: a stage output plus a stateless chain, numbered per producer slice."""

    stream_id: int
    name: str
    stage_id: int
    output: str
    chain: tuple
    key: tuple[str, ...] | None
    consumers: list[tuple[int, str]] = field(default_factory=list)  # (stage id, input name)
    sinks: list[int] = field(default_factory=list)


@dataclass
class InputPlan:
    """One input of a stage: its name, the physical stream and the input's index."""

    name: str
    stream_id: int
    index: int


@dataclass
class StagePlan:
    """One stage of the plan: a source or an operator, with its fixed slice count."""

    stage_id: int
    name: str
    kind: str
    num_slices: int
    outputs: tuple[str, ...]
    factory: tuple[type, tuple, dict] | None
    inputs: list[InputPlan]
    produced: list[int]  # physical stream ids this stage numbers and routes
    output_schemas: dict[str, pa.Schema]
    source_rows: int = 0
    log_dir: str | None = None  # a source stage reading a source log: its directory

    @property
    def ends(self) -> bool:
        """True when the stage's operator has an end-of-input hook (``Operator.on_end``)."""
        return self.factory is not None and self.factory[0].has_end_hook()


@dataclass
class SinkPlan:
    """A sink and the physical stream it reads."""

    sink_id: int
    name: str
    sink: Sink
    stream_id: int


@dataclass
class JobPlan:
    """Everything an executor needs, minus the source data (kept aside, see ``source_tables``)."""

    stages: list[StagePlan]
    streams: list[StreamPlan]
    sinks: list[SinkPlan]
    epoch_events: int
    total_events: int
    dead_letter_sink: Sink | None
    source_dead_letters: list[dict]
    order_end: int | None = None  # one past the last global order; None for followed logs

    @property
    def num_epochs(self) -> int | None:
        """Number of epochs of a bounded input (at least one); None while it may grow."""
        if self.order_end is None:
            return None
        return self.epochs_until(self.order_end)

    def epochs_until(self, order_end: int) -> int:
        """Number of epochs of an input that ends before ``order_end`` (at least one). With an
        end-of-input hook in the job the last epoch always has room after the input's last order
        for the hooks' rows (``end_order``): an input that fills its last epoch gets one more,
        empty, epoch.

        >>> plan = JobPlan([], [], [], epoch_events=10, total_events=0, dead_letter_sink=None,
        ...                source_dead_letters=[])
        >>> plan.epochs_until(20), plan.epochs_until(21), plan.epochs_until(0)
        (2, 3, 1)
        """
        if self.has_end_hooks:
            return order_end // self.epoch_events + 1
        return max(1, -(-order_end // self.epoch_events))

    def end_order(self, num_epochs: int) -> int:
        """The lineage order of rows made at the end of the input (``Operator.on_end``): the last
        order of the last epoch, above every source row's (``epochs_until``) and inside that
        epoch's range, as every row of an epoch is (replays cut epochs by order); the same in
        every executor."""
        return num_epochs * self.epoch_events - 1

    @property
    def has_end_hooks(self) -> bool:
        """True when some stage's operator has an end-of-input hook (``Operator.on_end``)."""
        return any(st.ends for st in self.stages)

    def upstream_stages(self, stage_id: int) -> list[int]:
        """Stages whose streams feed ``stage_id`` (sorted)."""
        st = self.stages[stage_id]
        return sorted({self.streams[i.stream_id].stage_id for i in st.inputs})

    def downstream_stages(self, stage_id: int) -> list[int]:
        """Stages fed by the streams of ``stage_id`` (sorted)."""
        out: set[int] = set()
        for sid in self.stages[stage_id].produced:
            out.update(c for c, _ in self.streams[sid].consumers)
        return sorted(out)

    def stage(self, name: str) -> StagePlan:
        """The stage called ``name``."""
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage named {name!r}; stages: {[s.name for s in self.stages]}")
