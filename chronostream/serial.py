"""The serial executor: the oracle of the test suite and the local debug mode.

Owns: running a query in one process, one source event at a time in global
source order, with plain Python dicts. It shares the plan, the operators and
the hash with the runtime, and nothing else: no Arrow batching, no merge
code, no containers. Within one source event, derived events reach each
slice in the order (sub-order, input index, producer slice, out_seq): the
depth-first order of their lineage, which is the order the runtime's merge
reproduces.

Each event travels with the schema of the table the runtime holds it in where
that schema does not depend on the epoch's other rows: a source's, a
transform's or an operator output's declared schema, the table a vectorized
transform or operator returned. A vectorized transform or operator gets its
one-row table in that schema (a null stays a value of its column's type); an
event whose table the runtime infers per epoch gets one inferred from itself.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute

from chronostream.dag import (Filter, FilterBatches, FlatMap, FlatMapBatches, JobPlan, Map, MapBatches,
                              Query, batch_table, compile_query)
from chronostream.slices.errors import EventError, QueryError
from chronostream.slices.hashing import slice_of_scalar
from chronostream.slices.operators import Operator, OperatorContext
from chronostream.slices.plan import filter_rows, parent_rows
from chronostream.slices.readers import LogReader, LogSource
from chronostream.slices.sinks import MemorySink, sort_output
from chronostream.slices.sources import source_orders
from chronostream.slices.types import END_OF_INPUT, ORDER, SEQ, SLICE, SUB, SUB_FANOUT_BITS


class SerialResult:
    """Output of a serial run: sink tables and dead letters."""

    def __init__(self, plan: JobPlan, rows: dict[str, list[dict]], dead: list[dict],
                 schemas: dict[str, pa.Schema | None] | None = None) -> None:
        self.plan = plan
        self._rows = rows
        self._dead = dead
        self._schemas = schemas or {}

    def results(self, name: str) -> pa.Table:
        """The rows of sink ``name`` sorted by (producer slice, out_seq), in the schema of the
        runtime's tables when all had the same one not inferred per epoch (``Event``)."""
        if name not in self._rows:
            raise KeyError(f"no sink named {name!r}; sinks: {sorted(self._rows)}")
        rows = self._rows[name]
        return sort_output(_sink_table(rows, self._schemas.get(name))) if rows else pa.table({})

    def rows(self, name: str) -> list[dict]:
        """The rows of sink ``name`` as dicts, in (producer slice, out_seq) order."""
        return sorted(self._rows[name], key=lambda r: (r[SLICE], r[SEQ]))

    def dead_letters(self) -> list[dict]:
        """Poison events, when the query routes them to a dead-letter sink."""
        return list(self._dead)


def _sub_child(sub: int, k: int) -> int:
    return (sub << SUB_FANOUT_BITS) | k


#: An event on its way: its values, its sub-order, and the schema of the table the runtime holds
#: it in, or None where the runtime infers that table's types from the epoch's rows.
Event = tuple[dict, int, "pa.Schema | None"]


class _SerialRun:
    def __init__(self, plan: JobPlan, sources: dict[int, pa.Table]) -> None:
        self.plan = plan
        self.sources = sources
        self.dead_mode = plan.dead_letter_sink is not None
        self.ops: dict[tuple[int, int], tuple[Operator, OperatorContext]] = {}
        self.seq: dict[tuple[int, int], int] = defaultdict(int)
        self.sink_rows: dict[str, list[dict]] = {s.name: [] for s in plan.sinks}
        # Each sink's one schema while every row it took had that same one (``Event``), else None.
        self.sink_schemas: dict[str, pa.Schema | None] = {}
        self.dead: list[dict] = list(plan.source_dead_letters)

    def op(self, stage_id: int, slice_id: int) -> tuple[Operator, OperatorContext]:
        key = (stage_id, slice_id)
        if key not in self.ops:
            st = self.plan.stages[stage_id]
            cls, args, kwargs = st.factory  # type: ignore[misc]
            ctx = OperatorContext(st.name, slice_id, st.outputs)
            op = cls(*args, **kwargs)
            op.bind(ctx)
            op.setup()
            self.ops[key] = (op, ctx)
        return self.ops[key]

    def fail(self, stage: str, slice_id: int, order: int, sub: int, exc: BaseException, event: Any) -> None:
        if not self.dead_mode:
            raise EventError(stage, slice_id, order, f"{type(exc).__name__}: {exc}", event) from exc
        self.dead.append({"stage": stage, "slice": slice_id, "order": order, "sub": sub,
                          "error": f"{type(exc).__name__}: {exc}", "event": repr(event)})

    def chain(self, stage: str, slice_id: int, order: int, events: list[Event], chain: tuple) -> list[Event]:
        for step in chain:
            out: list[Event] = []
            for ev, sub, schema in events:
                try:
                    if isinstance(step, Map):
                        out.append((_conform(_storable(step.fn(ev)), step.schema), sub, step.schema))
                    elif isinstance(step, Filter):
                        if step.fn(ev):
                            out.append((ev, sub, schema))
                    elif isinstance(step, FlatMap):
                        made = [_storable(e) for e in step.fn(ev)]
                        out.extend((_conform(e, step.schema), _sub_child(sub, k), step.schema)
                                   for k, e in enumerate(made))
                    elif isinstance(step, MapBatches):
                        t = batch_table(step, step.fn(_one_table(ev, schema)))
                        out.append((_one_row(t), sub, _user_schema(t)))
                    elif isinstance(step, FilterBatches):
                        one = _one_table(ev, schema)
                        if filter_rows(one, step.fn(one)).num_rows:
                            out.append((ev, sub, schema))
                    elif isinstance(step, FlatMapBatches):
                        t, parents = step.call(_one_table(ev, schema))
                        t = batch_table(step, t)
                        parent_rows(parents, t.num_rows, 1)  # (checked as the runtime checks them)
                        out.extend((e, _sub_child(sub, k), _user_schema(t)) for k, e in enumerate(_rows(t)))
                    else:
                        raise TypeError(f"unknown transform {step!r}")
                except Exception as exc:  # noqa: BLE001 - user code
                    self.fail(stage, slice_id, order, sub, exc, ev)
            events = out
        return events

    def emit(self, stage_id: int, slice_id: int, output: str, order: int, events: list[Event],
             pending: dict[int, dict[int, list]]) -> None:
        st = self.plan.stages[stage_id]
        for sid in st.produced:
            sp = self.plan.streams[sid]
            if sp.output != output:
                continue
            rows = self.chain(st.name, slice_id, order, events, sp.chain)
            for ev, sub, schema in rows:
                seq = self.seq[(sid, slice_id)]
                self.seq[(sid, slice_id)] = seq + 1
                for k in sp.sinks:
                    name = self.plan.sinks[k].name
                    known = self.sink_schemas.get(name, schema)
                    self.sink_schemas[name] = known if schema is known or (
                        schema is not None and known is not None and schema.equals(known)) else None
                    self.sink_rows[name].append(
                        {**ev, ORDER: order, SUB: sub, SLICE: slice_id, SEQ: seq})
                for consumer, in_name in sp.consumers:
                    cst = self.plan.stages[consumer]
                    if sp.key is None:
                        target = slice_of_scalar([order], cst.num_slices)
                    else:
                        missing = [c for c in sp.key if c not in ev]
                        if missing:  # a key column the build could not check (its schema was unknown)
                            raise QueryError(f"stage {st.name!r}, stream {sp.name!r} -> stage {cst.name!r}: key "
                                             f"column(s) {missing} not in the stream's columns {list(ev)}")
                        target = slice_of_scalar([ev[c] for c in sp.key], cst.num_slices)
                    idx = next(i.index for i in cst.inputs if i.stream_id == sid)
                    pending[consumer][target].append((sub, idx, slice_id, seq, in_name, ev, schema))

    def run(self) -> SerialResult:
        plan = self.plan
        feed: list[tuple[int, int, dict]] = []
        order_end = plan.order_end or 0
        schemas: dict[int, pa.Schema] = {}  # each source's, as its slices' batches have it
        for stage_id, table in self.sources.items():
            if isinstance(table, LogSource):
                table, log_end = _read_log_source(table)
                order_end = max(order_end, log_end)
            user = table.select([c for c in table.schema.names if not c.startswith("_")])
            schemas[stage_id] = user.schema
            for o, ev in zip(source_orders(table).tolist(), user.to_pylist()):
                feed.append((o, stage_id, ev))
        feed.sort(key=lambda x: x[0])
        for order, stage_id, ev in feed:
            pending: dict[int, dict[int, list]] = defaultdict(lambda: defaultdict(list))
            n_src = plan.stages[stage_id].num_slices
            self.emit(stage_id, order % n_src, "out", order, [(ev, 0, schemas[stage_id])], pending)
            self.deliver(order, pending)
        if plan.has_end_hooks:  # (the runtime's epoch count: ContainerCore._source_ready)
            self.end_of_input(plan.end_order(plan.epochs_until(order_end)))
        self.write_file_sinks()
        return SerialResult(plan, self.sink_rows, self.dead, self.sink_schemas)

    def deliver(self, order: int, pending: dict[int, dict[int, list]], end: bool = False) -> None:
        """Run every operator stage, in plan order, on the events ``pending`` for it (those the
        stages before it add included); with ``end``, then each of its slices' end hook."""
        for st in self.plan.stages:
            if st.kind != "operator":
                continue
            for slice_id in sorted(pending.get(st.stage_id, ())):
                items = sorted(pending[st.stage_id][slice_id], key=lambda x: x[:4])
                self.consume(st.stage_id, slice_id, order, items, pending)
            if end and st.ends:
                for slice_id in range(st.num_slices):
                    self.finish(st.stage_id, slice_id, order, pending)

    def end_of_input(self, end_order: int) -> None:
        """The end of the input: every stage's end hook (``Operator.on_end``), in plan order, each
        after the rows the hooks before it made for it (lineage ``(end_order, ...)``)."""
        self.deliver(end_order, defaultdict(lambda: defaultdict(list)), end=True)

    def write_file_sinks(self) -> None:
        """Write the rows of non-memory sinks (Parquet...) through their writers, one part per slice."""
        for sp in self.plan.sinks:
            if isinstance(sp.sink, MemorySink) or not self.sink_rows[sp.name]:
                continue
            writer = sp.sink.writer("serial")
            table = sort_output(_sink_table(self.sink_rows[sp.name], self.sink_schemas.get(sp.name)))
            slices = table.column(SLICE).to_pylist()
            for s in sorted(set(slices)):
                writer.write(0, s, table.filter(pa.compute.equal(table[SLICE], s)))
            writer.close()

    def consume(self, stage_id: int, slice_id: int, order: int, items: list, pending) -> None:
        st = self.plan.stages[stage_id]
        op, ctx = self.op(stage_id, slice_id)
        cls = type(op)
        for sub, _idx, _ps, _seq, in_name, ev, schema in items:
            ctx.reset()
            ctx.begin_event(order, sub)
            try:
                if hasattr(op, "consume_serial"):
                    op.consume_serial(in_name, ev)
                elif cls.is_per_event():
                    op.consume(in_name, ev)
                else:
                    one = _one_table(ev, schema)
                    one = one.append_column(ORDER, pa.array([order], pa.int64())) \
                        .append_column(SUB, pa.array([sub], pa.int64()))
                    op.consume_batch(in_name, one)
            except Exception as exc:  # noqa: BLE001 - user code
                ctx.reset()
                self.fail(st.name, slice_id, order, sub, exc, ev)
                continue
            self.emit_produced(stage_id, slice_id, order, pending)

    def finish(self, stage_id: int, slice_id: int, end_order: int, pending) -> None:
        """One slice's end hook, with lineage ``(end_order, 0)``, as ``SliceRuntime.finish``."""
        op, ctx = self.op(stage_id, slice_id)
        ctx.reset()
        ctx.begin_end(end_order)
        try:
            op.on_end()
        except Exception as exc:  # noqa: BLE001 - user code
            ctx.reset()
            self.fail(self.plan.stages[stage_id].name, slice_id, end_order, 0, exc, END_OF_INPUT)
            return
        self.emit_produced(stage_id, slice_id, end_order, pending)

    def emit_produced(self, stage_id: int, slice_id: int, order: int, pending) -> None:
        """Emit what the slice's operator produced for the current event, then forget it."""
        op, ctx = self.op(stage_id, slice_id)
        stage = self.plan.stages[stage_id]
        for out_name in stage.outputs:
            produced: list[Event] = []
            declared = stage.output_schemas.get(out_name)
            for e, (_o, s, k) in zip(ctx.events[out_name], ctx.lineage[out_name]):
                try:
                    _storable(e)
                except UnicodeEncodeError as exc:  # fails the job, as the runtime's _events_table
                    raise EventError(stage.name, slice_id, order,
                                     f"produced an event that cannot be stored: {exc}", e) from None
                produced.append((_conform(e, declared), s if k < 0 else _sub_child(s, k), declared))
            for b in ctx.batches[out_name]:
                t = b if isinstance(b, pa.Table) else pa.Table.from_batches([b])
                subs = t.column(SUB).to_pylist()
                user = t.select([c for c in t.schema.names if not c.startswith("_")])
                produced.extend((e, s, user.schema) for e, s in zip(user.to_pylist(), subs))
            if produced:
                self.emit(stage_id, slice_id, out_name, order, produced, pending)
        ctx.reset()


def _read_log_source(spec: LogSource, poll_s: float = 0.05) -> tuple[pa.Table, int]:
    """All rows of a log source (waiting for a followed log to be sealed), and its end order."""
    import time

    reader = LogReader(spec)
    while reader.end_order() is None:
        time.sleep(poll_s)
        reader.refresh()
    return reader.rows(0, reader.end_order()), reader.end_order()


def _one_table(ev: dict, schema: pa.Schema | None) -> pa.Table:
    """The one-row table a vectorized transform or operator gets for ``ev``: in the schema of the
    runtime's table (see the module's docstring), else inferred from the event alone."""
    return pa.Table.from_pylist([ev], schema=schema)


def _conform(ev: dict, schema: pa.Schema | None) -> dict:
    """``ev`` as the runtime's table of a declared schema holds it: that schema's columns, of its
    types; unchanged without one."""
    return ev if schema is None else pa.Table.from_pylist([ev], schema=schema).to_pylist()[0]


def _user_schema(t: pa.Table) -> pa.Schema:
    """The schema of ``t``'s user columns (the system ones, ``_order``..., dropped)."""
    return pa.schema([f for f in t.schema if not f.name.startswith("_")])


def _sink_table(rows: list[dict], schema: pa.Schema | None) -> pa.Table:
    """A sink's rows (user columns, then ``_order``, ``_sub``, ``_slice``, ``_seq``) as a table: of
    ``schema`` and int64 system columns, or inferred without one."""
    if schema is None:
        return pa.Table.from_pylist(rows)
    system = [pa.field(c, pa.int64()) for c in (ORDER, SUB, SLICE, SEQ)]
    return pa.Table.from_pylist(rows, schema=pa.schema([*schema, *system]))


def _storable(value: Any) -> Any:
    """``value`` (an event a per-event function made), once its text is known to encode as
    UTF-8, as the runtime's Arrow conversion needs: a lone surrogate raises
    ``UnicodeEncodeError`` here, in the event's own step, as it does in the runtime."""
    if isinstance(value, str):
        value.encode("utf-8")
    elif isinstance(value, dict):
        for v in value.values():
            _storable(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _storable(v)
    return value


def _rows(t: pa.Table | pa.RecordBatch) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in t.to_pylist()]


def _one_row(t: pa.Table | pa.RecordBatch) -> dict:
    rows = _rows(t)
    if len(rows) != 1:
        raise ValueError(f"map_batches returned {len(rows)} rows for 1")
    return rows[0]


def run_serial(query: Query) -> SerialResult:
    """Run ``query`` in this process, one source event at a time, and return its output.

    >>> q = Query()
    >>> _ = q.source("w", [{"word": "a"}, {"word": "a"}]).key_by("word").count(slices=1).sink(name="c")
    >>> [r["count"] for r in run_serial(q).rows("c")]
    [1, 2]
    """
    plan, sources = compile_query(query)
    return _SerialRun(plan, sources).run()
