"""The operator model: the ``Operator`` base class and the built-in operators.

Owns: what a user subclasses (``consume``/``consume_batch``, ``produce``,
``register_state``), the per-slice ``OperatorContext`` that collects produced
events with their lineage, the built-in vectorized keyed aggregation and the
keyed stream join. Knows no executor: the runtime slice and the serial
executor both drive operators through ``OperatorContext``.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from chronostream.slices.errors import EventError
from chronostream.slices.hashing import binary_fingerprint, hash_columns
from chronostream.slices.keyindex import KeyIndex, KeyIndexGroup
from chronostream.slices.slot_arrays import (ARENA_MAX_BYTES, SPREAD_MIN, SlotArena, SpreadGrowth, doubled_capacity,
                                      should_start_spread)
from chronostream.slices.sorting import stable_argsort
from chronostream.slices.statelib import HANDLE_KINDS, ListState, MapState, QueueState, TopKState, ValueState
from chronostream.slices.state import NAN_KEY, KeyValueState, canonical_key, check_hot_limit  # noqa: F401 - re-exported
from chronostream.slices.types import KEY_HASHES_META, ORDER, SUB, extend_sub_order, key_codes_column
from chronostream.slices.checkpoint import frozen_table_part, read_table_part


class OperatorContext:
    """Collects what one slice's operator produces while it consumes an epoch.

    Per-event produce() calls are stamped with the lineage of the event being
    consumed (its source order and sub-order) and a counter ``k`` of outputs
    made from it, which becomes the output's sub-order position.
    """

    def __init__(self, stage: str, slice_id: int, output_names: Sequence[str]) -> None:
        self.stage = stage
        self.slice_id = slice_id
        self.output_names = tuple(output_names)
        self.states: dict[str, Any] = {}
        self.handles: dict[str, Any] = {}  # state-library handles by name, each over states[name]
        self.cold_tiers: Any = None  # state name -> cold tier (the host's spill store), or None
        self._order = 0
        self._sub = 0
        self._k = 0
        self._ending = False  # in the end-of-input hook: batches may come without lineage
        self.reset()

    def reset(self) -> None:
        """Drop collected outputs (start of an epoch)."""
        self.events: dict[str, list[dict]] = {n: [] for n in self.output_names}
        self.lineage: dict[str, list[tuple[int, int, int]]] = {n: [] for n in self.output_names}
        self.batches: dict[str, list[pa.RecordBatch | pa.Table]] = {n: [] for n in self.output_names}
        # Produced events already built into tables (``seal``), in production order, before
        # those still in ``events``; for an output without a declared schema, also the events
        # and lineage each table was built from (``_built`` may have to infer from all of them).
        self.sealed: dict[str, list[pa.Table]] = {n: [] for n in self.output_names}
        self._raw: dict[str, list[tuple[list[dict], list[tuple[int, int, int]]]]] = {n: [] for n in self.output_names}

    def unsealed_rows(self) -> int:
        """Produced events not built into a table yet (every output)."""
        return sum(len(v) for v in self.events.values())

    def seal(self, schemas: dict[str, pa.Schema | None]) -> None:
        """Build the events produced so far into a table per output now, while they are still
        in the CPU's caches; ``take_outputs`` joins the tables with the rest. (One table built
        from a whole epoch's events at its end walked tens of MB no cache held: 3x the time
        per row.)

        Without a declared schema Arrow infers each table's types from its own events; the
        tables are joined only when all inferred the same schema, and else the output's table
        is inferred from all its events at once (``_built``), as if never sealed."""
        for name in self.output_names:
            events, schema = self.events[name], schemas.get(name)
            if not events:
                continue
            self.sealed[name].append(_events_table(events, self.lineage[name], schema, [(self, len(events))]))
            if schema is None:
                self._raw[name].append((events, self.lineage[name]))
            self.events[name], self.lineage[name] = [], []

    def settle_inferred(self, schemas: dict[str, pa.Schema | None]) -> None:
        """Build every output without a declared schema into its one table now (``_built``:
        pieces joined, or inferred again from all events when they disagree) and drop the
        events it was built from. A slice group calls this after each slice's loop: holding
        every slice's events until the epoch's end made freeing them, cold, cost as much as a
        tenth of a per-event count's epoch with 64 slices. Call it once the context produces
        no more events before ``take_outputs``: a later piece inferred differently could not be
        inferred again with the settled events (``_built`` refuses that)."""
        for name in self.output_names:
            if schemas.get(name) is None and (self.events[name] or self.sealed[name]):
                self.sealed[name] = [self._built(name, None)]  # type: ignore[list-item]
                self.events[name], self.lineage[name], self._raw[name] = [], [], []

    @staticmethod
    def seal_together(ctxs: Sequence["OperatorContext"], schemas: dict[str, pa.Schema | None]) -> None:
        """``seal`` for the outputs with a declared schema of several contexts (a slice
        group's), one table per output; each context keeps its rows of it."""
        for name in ctxs[0].output_names if ctxs else ():
            schema = schemas.get(name)
            counts = [len(c.events[name]) for c in ctxs]
            if schema is None or not sum(counts):
                continue
            table = _events_table(list(itertools.chain.from_iterable(c.events[name] for c in ctxs)),
                                  list(itertools.chain.from_iterable(c.lineage[name] for c in ctxs)), schema,
                                  list(zip(ctxs, counts)))
            at = 0
            for c, k in zip(ctxs, counts):
                if k:
                    c.sealed[name].append(table.slice(at, k))
                    c.events[name], c.lineage[name] = [], []
                    at += k

    def _built(self, name: str, schema: pa.Schema | None) -> pa.Table | None:
        """This context's events of output ``name`` as one table: the sealed ones, then the
        rest; None when there are none."""
        events, sealed = self.events[name], self.sealed[name]
        if not events and not sealed:
            return None
        pieces = sealed + ([_events_table(events, self.lineage[name], schema, [(self, len(events))])]
                           if events else [])
        if len(pieces) == 1:
            return pieces[0]
        if schema is None and any(not t.schema.equals(pieces[0].schema) for t in pieces[1:]):
            # Arrow inferred different types for different pieces (an int column, then a
            # float one): infer from every event at once, as with no piece built before.
            raw = self._raw[name] + [(events, self.lineage[name])]
            if sum(len(ev) for ev, _ in raw) != sum(t.num_rows for t in pieces):
                raise RuntimeError(f"stage {self.stage!r} slice {self.slice_id}: output {name!r} got events "
                                   "after it was settled, of other inferred types; its settled events are "
                                   "gone, so it cannot be inferred again whole")
            every = [e for ev, _ in raw for e in ev]
            return _events_table(every, [x for _, lin in raw for x in lin], None, [(self, len(every))])
        return pa.concat_tables(pieces)

    def begin_event(self, order: int, sub: int) -> None:
        """Set the lineage stamped on the next produce() calls."""
        self._order = order
        self._sub = sub
        self._k = 0
        self._ending = False

    def begin_end(self, end_order: int) -> None:
        """Set the lineage of the end-of-input hook's rows (``Operator.on_end``): ``(end_order,
        0)``, as an event's; there, a produced batch without lineage columns gets it too."""
        self.begin_event(end_order, 0)
        self._ending = True

    def _undeclared(self, stream_id: str) -> KeyError:
        return KeyError(f"stage {self.stage!r} produced to undeclared output {stream_id!r}; "
                        f"declared outputs: {list(self.output_names)}")

    def produce(self, stream_id: str, event: dict) -> None:
        """Record one produced event under the current lineage."""
        events = self.events.get(stream_id)
        if events is None:
            raise self._undeclared(stream_id)
        # Per-stream outputs keep production order; mixing per-event and batch
        # produce on one stream is refused in take_outputs().
        events.append(event)
        self.lineage[stream_id].append((self._order, self._sub, self._k))
        self._k += 1

    def produce_update(self, stream_id: str, event: dict) -> None:
        """Record the one output of a one-to-one operator: it keeps the input's lineage."""
        if stream_id not in self.events:
            raise self._undeclared(stream_id)
        self.events[stream_id].append(event)
        self.lineage[stream_id].append((self._order, self._sub, -1))

    def produce_batch(self, stream_id: str, batch: pa.RecordBatch | pa.Table) -> None:
        """Record a produced batch; it must carry the ``_order``/``_sub`` columns, except in the
        end-of-input hook, where a batch without both gets the hook's lineage: the end order,
        and sub-orders counting on from the hook's rows before it (as ``produce`` numbers them)."""
        if stream_id not in self.batches:
            raise self._undeclared(stream_id)
        names = batch.schema.names
        if self._ending and ORDER not in names and SUB not in names:
            n = batch.num_rows
            sub = extend_sub_order(np.full(n, self._sub, dtype=np.int64), np.arange(self._k, self._k + n))
            batch = (batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])) \
                .append_column(ORDER, pa.array(np.full(n, self._order, dtype=np.int64))) \
                .append_column(SUB, pa.array(sub, pa.int64()))
            self._k += n
        elif ORDER not in names or SUB not in names:
            raise ValueError(
                f"stage {self.stage!r}: produce_batch() needs the {ORDER!r} and {SUB!r} columns "
                "of the input rows each output row derives from (keep them when you take/filter, "
                "or compute them with chronostream.extend_sub_order for fan-out; in on_end() a "
                "batch without both gets the end-of-input lineage)"
            )
        self.batches[stream_id].append(batch)

    def take_outputs(self, schemas: dict[str, pa.Schema | None]) -> dict[str, pa.Table]:
        """Return each output stream's produced rows as a table with lineage columns."""
        out: dict[str, pa.Table] = {}
        for name in self.output_names:
            events, batches, sealed = self.events[name], self.batches[name], self.sealed[name]
            if (events or sealed) and batches:
                raise ValueError(
                    f"stage {self.stage!r} mixed produce() and produce_batch() on output {name!r}"
                )
            if batches:
                tables = [b if isinstance(b, pa.Table) else pa.Table.from_batches([b]) for b in batches]
                out[name] = pa.concat_tables(tables, promote_options="permissive")
            elif events or sealed:
                out[name] = self._built(name, schemas.get(name))  # type: ignore[assignment]
        self.reset()
        return out

    @staticmethod
    def take_outputs_together(ctxs: Sequence["OperatorContext"], schemas: dict[str, pa.Schema | None]
                              ) -> dict[str, tuple[pa.Table, np.ndarray]] | None:
        """Every context's per-event outputs as one table per output stream, ``ctxs[i]``'s rows
        at ``bounds[i]:bounds[i + 1]`` (a slice group's), as ``(table, bounds)``; or None, with
        nothing taken, when a context produced batches, or when an output without a declared
        schema came out of different contexts with different inferred schemas (then each
        context holds that output's table as ``take_outputs`` would build it, as a batch).

        A declared schema builds one table for all contexts. Without one each context's rows
        are built on their own, as ``take_outputs`` builds them (Arrow infers each one's types:
        an int column in one slice, a float one in another), and joined only when every
        context's inferred schema is the same, so no row's type depends on its neighbours."""
        names = ctxs[0].output_names if ctxs else ()
        if any(c.batches[n] for c in ctxs for n in names):
            return None
        out: dict[str, tuple[pa.Table, np.ndarray]] = {}
        OperatorContext.seal_together(ctxs, schemas)  # the rest of every declared output's rows
        for name in names:
            if schemas.get(name) is not None:
                counts = np.array([sum(t.num_rows for t in c.sealed[name]) for c in ctxs], dtype=np.int64)
                if counts.sum():
                    pieces = [t for c in ctxs for t in c.sealed[name]]
                    table = pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces).combine_chunks()
                    out[name] = (table, np.concatenate(([0], np.cumsum(counts))))
                continue
            tables = [c._built(name, None) for c in ctxs]
            built = [(c, t) for c, t in zip(ctxs, tables) if t is not None]
            if not built:
                continue
            if any(t.schema != built[0][1].schema for _, t in built[1:]):
                for c, t in built:  # each context keeps its table: the per-slice emit does not build it again
                    c.events[name], c.lineage[name], c.sealed[name], c._raw[name] = [], [], [], []
                    c.batches[name].append(t)
                return None
            counts = np.array([0 if t is None else t.num_rows for t in tables], dtype=np.int64)
            out[name] = (pa.concat_tables([t for _, t in built]), np.concatenate(([0], np.cumsum(counts))))
        for c in ctxs:
            c.reset()
        return out


def _events_table(events: list[dict], lineage: list[tuple[int, int, int]], schema: pa.Schema | None,
                  owners: Sequence[tuple["OperatorContext", int]] = ()) -> pa.Table:
    """Produced events as a table with their ``_order``/``_sub`` columns (see ``produce``).

    An event whose text cannot be stored (a lone surrogate in a string) fails with an
    ``EventError`` naming the stage, slice and order it derives from; ``owners``: the
    contexts that produced the events, in order, each with how many it produced."""
    try:
        table = pa.Table.from_pylist(events, schema=schema)
    except UnicodeEncodeError as exc:
        _raise_unstorable(events, lineage, schema, owners, exc)
    lin = np.array(lineage, dtype=np.int64).reshape(-1, 3)
    table = table.append_column(ORDER, pa.array(lin[:, 0], pa.int64()))
    keep = lin[:, 2] < 0  # produce_update(): one-to-one, lineage unchanged
    sub = lin[:, 1].copy()
    sub[~keep] = extend_sub_order(lin[~keep, 1], lin[~keep, 2])
    return table.append_column(SUB, pa.array(sub, pa.int64()))


def _raise_unstorable(events: list[dict], lineage: list[tuple[int, int, int]], schema: pa.Schema | None,
                      owners: Sequence[tuple["OperatorContext", int]], exc: UnicodeEncodeError) -> None:
    """Raise an ``EventError`` for the first of ``events`` that cannot be stored (only called
    once their bulk conversion failed: one conversion per event finds it)."""
    ends = np.cumsum([k for _, k in owners])
    for j, e in enumerate(events):
        try:
            pa.Table.from_pylist([e], schema=schema)
        except UnicodeEncodeError as one:
            at = int(np.searchsorted(ends, j, side="right"))
            stage, slice_id = (owners[at][0].stage, owners[at][0].slice_id) if at < len(owners) else ("?", -1)
            raise EventError(stage, slice_id, lineage[j][0], f"produced an event that cannot be stored: {one}",
                             e) from None
    raise exc


class Operator:
    """Base class of user operators (the ChronoStream operator model).

    Subclass it and implement ``consume(stream_id, event)`` (per event) or
    ``consume_batch(stream_id, batch)`` (vectorized, Arrow in and out). Call
    ``self.produce(stream_id, event)`` / ``self.produce_batch(...)`` to emit,
    and ``self.register_state(name)`` in ``setup()`` for keyed state (or a
    state-library handle: ``register_value``, ``register_map``,
    ``register_list``, ``register_queue``, ``register_topk``).

    Call order per slice: ``__init__(*args)`` once, ``setup()`` once, then
    ``consume``/``consume_batch`` for every input event in the deterministic
    merge order. Rules that keep the runtime exact:

    - never read wall-clock time or unseeded randomness (use event time);
    - keep all state in registered state (it is what checkpoints and migration move);
    - ``consume_batch`` must be row-wise: its output for a batch must equal the
      concatenation of its outputs for each row alone, in order.

    >>> class Count(Operator):
    ...     def setup(self):
    ...         self.counts = self.register_state("counts")
    ...     def consume(self, stream_id, event):
    ...         n = self.counts.get(event["word"], 0) + 1
    ...         self.counts.set(event["word"], n)
    ...         self.produce("out", {"word": event["word"], "n": n})
    """

    #: Output schemas by output name (optional; inferred per epoch otherwise).
    output_schemas: dict[str, pa.Schema] = {}

    _ctx: OperatorContext

    def bind(self, ctx: OperatorContext) -> None:
        """Attach the slice context (done by the executor before ``setup``)."""
        self._ctx = ctx

    def setup(self) -> None:
        """Register state here. Called once per slice before any input."""

    def consume(self, stream_id: str, event: dict) -> None:
        """Handle one input event from input ``stream_id``."""
        raise NotImplementedError(f"{type(self).__name__} implements neither consume nor consume_batch")

    def consume_batch(self, stream_id: str, batch: pa.Table) -> None:
        """Handle a batch of input events (with ``_order``/``_sub`` columns) from ``stream_id``."""
        raise NotImplementedError

    def produce(self, stream_id: str, event: dict) -> None:
        """Emit ``event`` (a dict of plain values) to output ``stream_id``."""
        self._ctx.produce(stream_id, event)

    def produce_update(self, stream_id: str, event: dict) -> None:
        """Emit the one output of the current event, in its place: it keeps the event's lineage.

        For operators that answer every input event with exactly one row (a
        window's aggregate, a lookup): the output is numbered like the input
        instead of as a new event derived from it. Call it at most once per
        event and stream; use ``produce`` for zero or several outputs.
        """
        self._ctx.produce_update(stream_id, event)

    def produce_batch(self, stream_id: str, batch: pa.Table | pa.RecordBatch) -> None:
        """Emit a batch that keeps the ``_order``/``_sub`` columns of its input rows."""
        self._ctx.produce_batch(stream_id, batch)

    def register_state(self, name: str, hot_entries: int | None = None) -> KeyValueState:
        """Return this slice's key-value state called ``name`` (created on first call).

        ``hot_entries``: keep at most that many values in memory; the values written longest
        ago go to the host's spill store (lmdb) and are read back when asked for (see
        ``chronostream.slices.state``). None (the default): everything in memory.
        """
        states = self._ctx.states
        if name in self._ctx.handles:
            raise ValueError(f"state {name!r} is already a {self._ctx.handles[name].kind} state")
        if name not in states:
            tiers = self._ctx.cold_tiers
            states[name] = KeyValueState(name, cold=tiers(name) if tiers is not None else None)
        if hot_entries is not None:
            states[name].hot_limit = check_hot_limit(name, hot_entries)
        return states[name]

    # -- the state library (slices/statelib.py): handles over a key-value state --

    def _register_handle(self, kind: str, name: str, **options: Any) -> Any:
        handles = self._ctx.handles
        if name in handles:
            h = handles[name]
            if h.kind != kind or any(getattr(h, k) != v for k, v in options.items()):
                raise ValueError(f"state {name!r} is already registered as a {h.kind} state")
            return h
        if name in self._ctx.states:
            raise ValueError(f"state {name!r} is already a key-value state")
        h = HANDLE_KINDS[kind](self.register_state(name), **options)
        handles[name] = h
        return h

    def register_value(self, name: str, hot_entries: int | None = None) -> ValueState:
        """One value per key (``get/set/clear``); see ``chronostream.slices.statelib``. ``hot_entries``:
        at most that many values in memory, the rest in the host's spill store."""
        return self._register_handle("value", name, hot_entries=hot_entries)

    def register_map(self, name: str, page_size: int = 64, hot_entries: int | None = None) -> MapState:
        """A map per key, one state entry per map entry (``get/set/delete/items/len``).
        ``hot_entries``: at most that many state entries in memory, the rest in the host's
        spill store (a map of millions of entries per slice)."""
        return self._register_handle("map", name, page_size=page_size, hot_entries=hot_entries)

    def register_list(self, name: str, chunk_size: int = 64, hot_entries: int | None = None) -> ListState:
        """A list per key, stored in chunks of ``chunk_size`` items (``append/get/set/pop/items``).
        ``hot_entries``: at most that many chunks and headers in memory, the rest spilled."""
        return self._register_handle("list", name, chunk_size=chunk_size, hot_entries=hot_entries)

    def register_queue(self, name: str, chunk_size: int = 64, hot_entries: int | None = None) -> QueueState:
        """A FIFO queue per key, chunked like a list (``append/popleft/peekleft/peek/pop``).
        ``hot_entries``: at most that many chunks and headers in memory, the rest spilled."""
        return self._register_handle("queue", name, chunk_size=chunk_size, hot_entries=hot_entries)

    def register_topk(self, name: str, k: int) -> TopKState:
        """The ``k`` best-scored items per key (``offer(key, score, item)``, ``items``)."""
        return self._register_handle("topk", name, k=k)

    def on_end(self) -> None:
        """Called once per slice when the input ends, after the slice's last input event: rows
        ``produce``d here follow every other output of the slice (a window that closes only on a
        later event emits what is still open). Not overridden: never called.

        Runs in the job's last epoch (a bounded input, or a followed source log once sealed; an
        input that fills its last epoch gets one more, empty, epoch for the hooks:
        ``JobPlan.epochs_until``). The rows' lineage is ``(end order, 0)``, the end order the
        last of that epoch, above every source row's (``JobPlan.end_order``), so downstream
        stages consume them after all others, then run their own ``on_end``. Iterate state in a
        deterministic order (sorted keys): insertion order differs after a restore. A vectorized
        operator may ``produce_batch`` here without ``_order``/``_sub`` columns: its rows get
        that lineage, sub-orders counting on in production order.
        """

    @classmethod
    def has_end_hook(cls) -> bool:
        """True when the class overrides ``on_end``."""
        return cls.on_end is not Operator.on_end

    @classmethod
    def is_vectorized(cls) -> bool:
        """True when the class overrides ``consume_batch`` (the fast path)."""
        return cls.consume_batch is not Operator.consume_batch

    @classmethod
    def fuses_slices(cls) -> bool:
        """True when the class runs many slices' batches in one call (``consume_slices``):
        the class whose ``consume_batch`` is used also defines ``consume_slices``, so a
        subclass that overrides only ``consume_batch`` is never fused behind its back."""
        for klass in cls.__mro__:
            if "consume_batch" in vars(klass):
                return "consume_slices" in vars(klass)
        return False

    @classmethod
    def reads_key_codes(cls) -> bool:
        """True when the class groups rows by the stream's one key column and can take routing's
        dictionary codes of it (column ``key_codes_column(key)``) instead of encoding it again."""
        return False

    @classmethod
    def is_per_event(cls) -> bool:
        """True when the class overrides ``consume``."""
        return cls.consume is not Operator.consume


AGGREGATES = ("count", "sum", "min", "max", "mean")

def _segmented_cumsum_f(values: np.ndarray, start_pos: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Per-group cumulative sum in float64 (approximate; used for overflow checks only)."""
    cs = np.cumsum(values.astype(np.float64))
    base = np.where(start_pos > 0, cs[start_pos - 1], 0.0)
    return cs - base[seg]


def _routed_key_codes(batch: pa.Table, key_columns: Sequence[str]
                      ) -> tuple[np.ndarray, list[pa.Array], np.ndarray | None] | None:
    """Routing's dictionary codes of a batch's one key column, as dense group ids:
    (each row's id, [the distinct keys, one per id], their hashes or None); None when
    the batch has none.

    Routing encoded the producer's whole epoch, so a slice's rows use a part of
    the dictionary: ids are renumbered over the keys present. Rows from a
    sender that shipped no codes (null after the merge) void them. The hashes
    come from the column's metadata (``KEY_HASHES_META``) when they were
    computed for this very dictionary (same length and fingerprint: parts of
    several senders merge into one dictionary); else the caller hashes the keys.
    """
    if len(key_columns) != 1:
        return None
    name = key_codes_column(key_columns[0])
    if name not in batch.schema.names:
        return None
    col = batch.column(name)
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if col.null_count or not pa.types.is_dictionary(col.type):
        return None
    hashes = _routed_hashes(batch.schema.field(name).metadata, col.dictionary)
    codes = np.asarray(col.indices, dtype=np.int64)
    present = np.zeros(len(col.dictionary), dtype=bool)
    present[codes] = True
    if present.all():
        return codes, [col.dictionary], hashes
    dense = np.cumsum(present) - 1
    return dense[codes], [col.dictionary.filter(pa.array(present))], None if hashes is None else hashes[present]


def _routed_hashes(metadata: dict[bytes, bytes] | None, dictionary: pa.Array) -> np.ndarray | None:
    """The hashes routing shipped for ``dictionary`` (``KEY_HASHES_META``), or None when the
    metadata is missing or was computed for another dictionary."""
    tagged = (metadata or {}).get(KEY_HASHES_META)
    if tagged is None or len(tagged) != 8 * (len(dictionary) + 1):
        return None
    values = np.frombuffer(tagged, dtype=np.uint64)
    if int(values[0]) != binary_fingerprint(dictionary):
        return None
    return values[1:]


def _segmented_scan(values: np.ndarray, group_starts: np.ndarray, op: np.ufunc) -> np.ndarray:
    """Inclusive scan of ``op`` (min/max) restarting at each group start; rows sorted by group.

    Hillis-Steele doubling: log2(n) vectorized passes, exact for any dtype
    because min/max do not depend on evaluation order.
    """
    v = values.copy()
    n = len(v)
    seg = np.cumsum(group_starts) - 1  # segment id per row
    d = 1
    while d < n:
        same = seg[d:] == seg[:-d]
        cand = op(v[d:], v[:-d])
        v[d:] = np.where(same, cand, v[d:])
        d *= 2
    return v


#: The dirty mask's name among an aggregate's slot arrays (no state array has it).
_DIRTY = "__dirty__"


def _state_array_name(agg: str, col: str, kind: str) -> str:
    """Name of the aggregate's running-value array of ``agg`` (sum/min/max) over ``col``, in its
    int (``kind`` "i") or float ("f") variant: ``sum_v_i``; ``_float_flag_name`` names the one
    flag array of ``col``. ``count`` is the one other array."""
    return f"{agg}_{col}_{kind}"


def _value_arrays(col: str, kind: str) -> list[str]:
    """The sum, min and max arrays of ``col`` in one variant (``_state_array_name``)."""
    return [_state_array_name(a, col, kind) for a in ("sum", "min", "max")]


def _float_flag_name(col: str) -> str:
    """Name of the int8 array that is 1 for the keys whose ``col`` values are in the float variant."""
    return f"float_{col}_b"


def _is_state_array(name: str) -> bool:
    """Whether a column of an aggregate's checkpoint table is one of its running-value arrays."""
    return name == "count" or name.endswith(("_i", "_f", "_b"))


def _state_array_dtype(name: str) -> type:
    """The numpy dtype of a running-value array, from its name's variant."""
    return np.float64 if name.endswith("_f") else np.int8 if name.endswith("_b") else np.int64


def _arrays_read(ops: Sequence["KeyedAggregate"], col: str, as_float: bool) -> list[str]:
    """The arrays of value column ``col`` a batch reads: with the column float, the float
    variant and flag, and the int variant when an op has one (keys it holds as int move to
    float: ``_running_values``); with the column int, the int variant, and the float
    variant and flag when an op has them (keys already in float stay there)."""
    ints, floats, flag = _value_arrays(col, "i"), _value_arrays(col, "f"), _float_flag_name(col)
    if as_float:
        return floats + [flag] + (ints if any(ints[0] in op.arrays for op in ops) else [])
    return ints + (floats + [flag] if any(flag in op.arrays for op in ops) else [])


def _running_values(col: str, v_sorted: np.ndarray, as_float: bool, prior: dict[str, np.ndarray], seg: np.ndarray,
                    starts: np.ndarray, start_pos: np.ndarray, last_rows: np.ndarray, first_seen: np.ndarray
                    ) -> tuple[dict[str, np.ndarray], list[tuple[str, np.ndarray]]]:
    """Each row's running sum/min/max of value column ``col`` (rows sorted by segment, a
    segment one key of one op; ``prior``: each segment's arrays before the batch) as
    ``{"sum_<col>": ...}``, and the arrays to store: ``(name, each segment's last value)``.

    A key's values are exact int64 until its column first comes as float (types are inferred
    per epoch: an epoch of nulls mapped to 1 gives int64, the others double). Then the key's
    int sum/min/max are folded into the float variant (``float(sum)``, as Python adds an int
    to a float) and flagged (``_float_flag_name``), and the key goes on in float whatever
    type later epochs infer. Rows come out float64 when any of the batch's keys is in float:
    one Arrow column holds them all (an int key's stored sum stays exact)."""
    ints, floats, flag = _value_arrays(col, "i"), _value_arrays(col, "f"), _float_flag_name(col)
    n, nseg = len(v_sorted), len(start_pos)
    was_float = prior[flag].astype(bool) if flag in prior else np.zeros(nseg, dtype=bool)
    in_float = np.ones(nseg, dtype=bool) if as_float else was_float
    any_float, all_float = bool(in_float.any()), bool(in_float.all())
    run_f: list[np.ndarray] = []
    run_i: list[np.ndarray] = []
    if any_float:
        p_sum, p_min, p_max = (prior[name] for name in floats)
        if ints[0] in prior:  # keys held as int until now move to float
            p_sum, p_min, p_max = (np.where(was_float, pf, prior[pi].astype(np.float64))
                                   for pf, pi in zip((p_sum, p_min, p_max), ints))
        v = v_sorted.astype(np.float64)
        # Sums sequential per key, so the result is bit-identical to one-at-a-time addition
        # (per distinct key, not per event).
        run_sum = np.zeros(n, dtype=np.float64)
        for j in np.flatnonzero(in_float).tolist():
            s, e = int(start_pos[j]), int(last_rows[j])
            run_sum[s:e + 1] = np.cumsum(np.concatenate(([p_sum[j]], v[s:e + 1])))[1:]
        run_f = [run_sum, *_running_min_max(v, p_min, p_max, seg, starts, first_seen)]
    if not all_float:
        v = v_sorted.astype(np.int64)
        p_sum = prior[ints[0]]
        if any_float:  # keys in float take no part (their int arrays are stale)
            v = np.where(in_float[seg], 0, v)
            p_sum = np.where(in_float, 0, p_sum)
        # int64 must not wrap. A cheap bound first; the per-key running
        # sums (float64) only when the bound cannot rule overflow out.
        bound = float(np.abs(p_sum).max()) + float(np.abs(v.astype(np.float64)).sum())
        if bound >= 2.0**62:
            approx = p_sum[seg].astype(np.float64) + _segmented_cumsum_f(v, start_pos, seg)
            if float(np.abs(approx).max()) >= 2.0**63 * 0.999:
                raise OverflowError(f"running int64 sum of column {col!r} overflows")
        cs = np.cumsum(v)
        base = np.where(start_pos > 0, cs[start_pos - 1], 0)
        run_i = [p_sum[seg] + cs - base[seg],
                 *_running_min_max(v, prior[ints[1]], prior[ints[2]], seg, starts, first_seen)]
    if all_float:
        rows = run_f
        updates = [(name, r[last_rows]) for name, r in zip(floats, run_f)]
        if not bool(was_float.all()):
            updates.append((flag, np.ones(nseg, dtype=np.int8)))
    elif not any_float:
        rows = run_i
        updates = [(name, r[last_rows]) for name, r in zip(ints, run_i)]
    else:  # an int batch, some keys in float: each variant written for its keys, the other kept
        rows_f = in_float[seg]
        rows = [np.where(rows_f, f, i.astype(np.float64)) for f, i in zip(run_f, run_i)]
        updates = ([(name, np.where(in_float, f[last_rows], prior[name])) for name, f in zip(floats, run_f)]
                   + [(name, np.where(in_float, prior[name], i[last_rows])) for name, i in zip(ints, run_i)])
    return {f"{a}_{col}": r for a, r in zip(("sum", "min", "max"), rows)}, updates


def _running_min_max(v: np.ndarray, p_min: np.ndarray, p_max: np.ndarray, seg: np.ndarray, starts: np.ndarray,
                     first_seen: np.ndarray) -> list[np.ndarray]:
    """Each row's running min and max of ``v`` (rows sorted by segment) from each segment's prior
    ones (ignored for keys not seen before)."""
    prior_min = np.where(first_seen, v, p_min[seg])
    prior_max = np.where(first_seen, v, p_max[seg])
    return [_segmented_scan(np.minimum(v, prior_min), starts, np.minimum),
            _segmented_scan(np.maximum(v, prior_max), starts, np.maximum)]


class KeyedAggregate(Operator):
    """Built-in vectorized running aggregation per key (count, sum, min, max, mean).

    For every input row it emits one update row: the key columns and the
    running aggregates of that key including the row. Build it with
    ``stream.key_by(...).aggregate(...)`` or the ``count()``/``sum()``/...
    shortcuts rather than directly.

    A key's sum/min/max of a column are exact int64 while every value it saw
    was an int, and float64 from its first float value on, whatever types later
    epochs infer (``_running_values``); an output batch holding a key in float
    has the column as float64.
    """

    def __init__(self, key_columns: Sequence[str], specs: Sequence[tuple[str, str | None]]) -> None:
        self.key_columns = list(key_columns)
        self.specs = list(specs)
        for agg, col in self.specs:
            if agg not in AGGREGATES:
                raise ValueError(f"unknown aggregate {agg!r}; choose from {AGGREGATES}")
            if agg != "count" and col is None:
                raise ValueError(f"aggregate {agg!r} needs a column")

    @staticmethod
    def output_name(agg: str, col: str | None) -> str:
        """Column name of one aggregate in the output (``count``, ``sum_amount``...)."""
        return agg if agg == "count" else f"{agg}_{col}"

    def setup(self) -> None:
        # Dense per-slice arrays indexed by a key slot; the KeyIndex maps keys to
        # slots with vectorized lookups (no Python per key or per event).
        self.key_index = KeyIndex()
        self._key_group: KeyIndexGroup | None = None  # see consume_slices
        self.arrays: dict[str, np.ndarray] = {}
        # Slots changed since the last checkpoint: each listed once (the mask says which are
        # listed), so a capture needs no sort or unique of them inside the epoch.
        self._dirty_slots: list[np.ndarray] = []
        self._dirty_mask = np.zeros(0, dtype=bool)
        self._growth: SpreadGrowth | None = None  # the arrays' next doubling, copied a share per batch
        # (kept on a group's first op: its slot arena, the ops it was built for, the ``arrays``
        # dict and dirty mask it gave each, which arrays each dict holds; see ``_group_arena``)
        self._arena: tuple[SlotArena, list, list, list, dict] | None = None
        self._arena_refused: list | None = None  # (the ops whose state was too large for one)

    def _value_columns(self) -> list[str]:
        return sorted({c for a, c in self.specs if c is not None})

    @classmethod
    def reads_key_codes(cls) -> bool:
        return cls.fuses_slices()  # a subclass with its own consume_batch gets plain rows

    def consume_batch(self, stream_id: str, batch: pa.Table) -> None:
        if batch.num_rows:
            out, _bounds = type(self).consume_slices([self], stream_id, batch,
                                                     np.array([0, batch.num_rows]))["out"]
            self.produce_batch("out", out)

    @classmethod
    def consume_slices(cls, ops: Sequence["KeyedAggregate"], stream_id: str, batch: pa.Table,
                       bounds: np.ndarray) -> dict[str, tuple[pa.Table, np.ndarray]]:
        """Many slices' batches in one vectorized pass: ``ops[i]`` (one slice's operator)
        consumes rows ``bounds[i]:bounds[i + 1]`` of ``batch``.

        Returns the ``out`` rows (one per input row, in input order) with their bounds
        per op. The heavy work (key encoding, hashing, the per-key scans, the output
        table) is done once for the whole batch, and so are the key lookups
        (``KeyIndexGroup``) and, while the ops' arrays share a slot arena
        (``_group_arena``), their state's gathers and scatters; otherwise each op gathers
        and scatters its own. All or nothing: when it raises, no
        op's running values changed (a key index may hold new keys with zero counts,
        which read as unseen), so the caller can retry per slice or row by row.
        """
        agg = ops[0]
        n = batch.num_rows
        keys = [batch.column(c) for c in agg.key_columns]
        keys = [k.combine_chunks() if isinstance(k, pa.ChunkedArray) else k for k in keys]
        # Float keys: -0.0 + 0.0 == 0.0, and every NaN one value, as in canonical_key().
        keys = [pc.if_else(pc.is_nan(k), float("nan"), pc.add(k, 0.0)) if pa.types.is_floating(k.type) else k
                for k in keys]
        routed = _routed_key_codes(batch, agg.key_columns)
        key_hashes = None  # of unique_keys, when routing shipped them
        if routed is not None:
            inverse, unique_keys, key_hashes = routed
        elif len(keys) == 1:
            # One key column: dictionary codes are dense group ids, and the
            # dictionary holds each distinct key once.
            enc = pc.dictionary_encode(keys[0], null_encoding="encode")
            inverse = np.asarray(enc.indices, dtype=np.int64)
            unique_keys = [enc.dictionary]
        else:
            combined = np.zeros(n, dtype=np.int64)
            for col in keys:
                enc = pc.dictionary_encode(col, null_encoding="encode")
                combined = combined * (len(enc.dictionary) + 1) + np.asarray(enc.indices, dtype=np.int64)
            _uniq, first, inverse = np.unique(combined, return_index=True, return_inverse=True)
            first_rows = pa.array(first)
            unique_keys = [col.take(first_rows) for col in keys]
        # Sort rows by key (stable: keeps merge order within a key, and, since the batch
        # is grouped by op, op order within a key). A segment is one (key, op) pair: one
        # slot of one op's state. A key normally lives in one slice; kept apart if not.
        order = stable_argsort(inverse)
        g_sorted = inverse[order]
        owner_sorted = np.repeat(np.arange(len(ops)), np.diff(bounds))[order] if len(ops) > 1 else None
        starts = np.ones(n, dtype=bool)
        starts[1:] = g_sorted[1:] != g_sorted[:-1]
        if owner_sorted is not None:
            starts[1:] |= owner_sorted[1:] != owner_sorted[:-1]
        start_pos = np.flatnonzero(starts)
        seg = np.cumsum(starts) - 1
        last_rows = np.append(start_pos[1:] - 1, n - 1)
        seg_key = g_sorted[start_pos]
        # Each op's slots for its segments; then its prior values, gathered per segment.
        hashes = hash_columns(unique_keys, distinct=True) if key_hashes is None else key_hashes
        # One lookup for all ops' keys: a group over their key indexes, kept on the first op
        # between calls; when the ops changed, the group that still holds theirs (slices
        # left: a migration, a thread reschedule), else a new one. One op whose keys no
        # group holds uses its own index.
        indexes = [op.key_index for op in ops]
        group = agg._key_group
        if group is None or not group.matches(indexes):
            group = agg._key_group = KeyIndexGroup.covering(indexes) or (
                KeyIndexGroup(indexes) if len(ops) > 1 else None)
        if owner_sorted is None:  # one op: its segments are the distinct keys, in order
            by_owner, cut = np.arange(len(start_pos)), np.array([0, len(start_pos)])
            seg_slots = agg.key_index.slots(unique_keys, hashes=hashes) if group is None else group.slots(
                np.full(len(start_pos), group.positions(indexes)[0]), unique_keys, hashes)
        else:
            seg_owner = owner_sorted[start_pos]
            assert group is not None
            if len(start_pos) == len(unique_keys[0]):
                # Each key in one slice (the usual case: routing hashed it there): the segments
                # are the distinct keys in order, no take needed.
                seg_keys, seg_hashes = list(unique_keys), hashes
            else:
                take = pa.array(seg_key)
                seg_keys, seg_hashes = [col.take(take) for col in unique_keys], hashes[seg_key]
            seg_slots = group.slots(group.positions(indexes)[seg_owner], seg_keys, seg_hashes)
        value_cols = agg._value_columns()
        as_float = {col: pa.types.is_floating(batch.column(col).type) for col in value_cols}
        needed = ["count"] + [name for col in value_cols for name in _arrays_read(ops, col, as_float[col])]
        # Many ops whose state fits one slot arena: one gather per array for all of them, at each
        # segment's place in the arena (``at``). Otherwise each op gathers its own.
        arena = cls._group_arena(ops, needed, seg_owner, seg_slots) if owner_sorted is not None else None
        per_op: list[tuple[KeyedAggregate, int, int]] = []  # (op, its stretch of by_owner)
        if arena is not None:
            at = arena.offsets[seg_owner] + seg_slots
            prior = {name: arena.arrays[name][at] for name in needed}
        else:
            # Segments in op order (``by_owner``): op i's are ``cut[i]:cut[i + 1]`` of it, so each
            # op reads and writes a contiguous stretch (a view), not a fancy-indexed subset of its own.
            # (One op: both were set with its segments above.)
            if owner_sorted is not None:
                by_owner = stable_argsort(seg_owner)
                cut = np.searchsorted(seg_owner[by_owner], np.arange(len(ops) + 1))
            slots_by_op = seg_slots[by_owner]
            prior_by_op = {name: np.empty(len(start_pos), dtype=_state_array_dtype(name)) for name in needed}
            bounds_by_op = cut.tolist()
            needed_set = frozenset(needed)
            for i, op in enumerate(ops):
                lo, hi = bounds_by_op[i], bounds_by_op[i + 1]
                if hi == lo:
                    continue
                if op._must_grow(needed_set):
                    op._grow(len(op.key_index), needed)
                slots = slots_by_op[lo:hi]
                for name in needed:
                    prior_by_op[name][lo:hi] = op.arrays[name][slots]
                per_op.append((op, lo, hi))
            prior = {}
            for name, values in prior_by_op.items():
                prior[name] = np.empty_like(values)
                prior[name][by_owner] = values
        # Running count.
        pos_in_group = np.arange(n) - start_pos[seg]
        running_count = prior["count"][seg] + pos_in_group + 1
        first_seen = (prior["count"] == 0)[seg]
        results: dict[str, np.ndarray] = {}
        updates: list[tuple[str, np.ndarray]] = []  # (array, each segment's last running value)
        for col in value_cols:
            arr = batch.column(col)
            if arr.null_count:
                raise ValueError(f"column {col!r} has a null value; aggregates need non-null values")
            vals = np.asarray(arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr)
            res, upd = _running_values(col, vals[order], as_float[col], prior, seg, starts, start_pos,
                                       last_rows, first_seen)
            results.update(res)
            updates += upd
        # State changes only after every check passed: a batch that raises
        # leaves the state untouched, so it can be retried row by row.
        updates.append(("count", running_count[last_rows]))
        if arena is not None:
            cls._write_arena(ops, arena, at, seg_owner, seg_slots, updates)
        else:
            updates_by_op = [(name, values[by_owner]) for name, values in updates]
            for op, lo, hi in per_op:
                slots = slots_by_op[lo:hi]
                listed = op._dirty_mask[slots]
                if not listed.all():  # (all listed: the usual case once the keys are warm)
                    fresh = slots[~listed]
                    op._dirty_mask[fresh] = True
                    op._dirty_slots.append(fresh)
                for name, values in updates_by_op:
                    op.arrays[name][slots] = values[lo:hi]
                if op._growth is not None:
                    op._growth.mirror(op._slot_arrays(), slots)
        inv = np.empty(n, dtype=np.int64)
        inv[order] = np.arange(n)
        cols: dict[str, pa.Array] = {c: batch.column(c) for c in agg.key_columns}
        for a, col in agg.specs:
            name = cls.output_name(a, col)
            if a == "count":
                cols[name] = pa.array(running_count[inv], pa.int64())
            elif a == "mean":
                cols[name] = pa.array(results[f"sum_{col}"][inv] / running_count[inv], pa.float64())
            else:
                cols[name] = pa.array(results[f"{a}_{col}"][inv])
        cols[ORDER] = batch.column(ORDER)
        cols[SUB] = batch.column(SUB)
        return {"out": (pa.table(cols), np.asarray(bounds))}

    @classmethod
    def _group_arena(cls, ops: Sequence["KeyedAggregate"], names: list[str], seg_owner: np.ndarray,
                     seg_slots: np.ndarray) -> SlotArena | None:
        """The slot arena holding ``ops``' arrays for this batch (``seg_owner``/``seg_slots``: the
        op and slot of each segment): kept on the first op while every op still has the arrays
        it gave it and room for these slots, else built anew; None when their state is too
        large for one (``ARENA_MAX_BYTES``, or an op's arrays doubling a share at a time).

        An op is given the arrays it had, and the arrays ``names`` once it has rows: as alone,
        an op without rows makes no arrays (its checkpoints carry none)."""
        kept = ops[0]._arena
        if kept is not None:
            arena, members, dicts, masks, given = kept
            if (len(members) == len(ops) and all(
                    op is m and op.arrays is d and op._dirty_mask is k and op._growth is None
                    for op, m, d, k in zip(ops, members, dicts, masks))
                    and arena.arrays.keys() >= set(names)
                    and not bool(np.any(seg_slots >= arena.capacities[seg_owner]))):
                cls._give_arrays(arena, dicts, given, names, seg_owner)
                return arena
        refused = ops[0]._arena_refused
        if refused is not None and len(refused) == len(ops) and all(a is b for a, b in zip(refused, ops)):
            return None  # (these ops' state was too large: it does not shrink)
        ops[0]._arena = ops[0]._arena_refused = None
        sizes = [len(op.key_index) for op in ops]
        # Room for twice the keys: members grow alike (keys hash evenly), so the arena is rebuilt
        # about once per doubling of the group's keys, a copy of all of it each time.
        caps = [max(len(op._dirty_mask), 2 * size, 64) for op, size in zip(ops, sizes)]
        names_all = list(dict.fromkeys([*names, *(name for op in ops for name in op.arrays)]))
        itemsizes = [np.dtype(_state_array_dtype(name)).itemsize for name in names_all] + [1]
        if (max(caps) >= SPREAD_MIN or any(op._growth is not None for op in ops)
                or SlotArena.bytes_for(caps, itemsizes) > ARENA_MAX_BYTES):
            ops[0]._arena_refused = list(ops)
            return None
        empty = {name: np.zeros(0, _state_array_dtype(name)) for name in names_all}
        arena = SlotArena([{**empty, **op.arrays, _DIRTY: op._dirty_mask} for op in ops], caps)
        given = {name: np.array([name in op.arrays for op in ops]) for name in names_all}
        dicts, masks = [], []
        for op, view in zip(ops, arena.views):
            op.arrays = {name: view[name] for name in op.arrays}
            op._dirty_mask = view[_DIRTY]
            dicts.append(op.arrays)
            masks.append(op._dirty_mask)
        cls._give_arrays(arena, dicts, given, names, seg_owner)
        ops[0]._arena = (arena, list(ops), dicts, masks, given)
        return arena

    @staticmethod
    def _give_arrays(arena: SlotArena, dicts: list[dict[str, np.ndarray]], given: dict[str, np.ndarray],
                     names: list[str], seg_owner: np.ndarray) -> None:
        """Put the arena's arrays ``names`` into the ``arrays`` dict of each op with rows here that
        lacks them (the dict the arena gave it: changed in place, so it stays the op's)."""
        has_rows = np.bincount(seg_owner, minlength=len(dicts)) > 0
        for name in names:
            for i in np.flatnonzero(has_rows & ~given[name]).tolist():
                dicts[i][name] = arena.views[i][name]
                given[name][i] = True

    @staticmethod
    def _write_arena(ops: Sequence["KeyedAggregate"], arena: SlotArena, at: np.ndarray, seg_owner: np.ndarray,
                     seg_slots: np.ndarray, values: list[tuple[str, np.ndarray]]) -> None:
        """Write each segment's last running values at its place ``at`` in the arena; list the
        slots written for the first time since the ops' last checkpoint with their op."""
        dirty = arena.arrays[_DIRTY]
        listed = dirty[at]
        if not listed.all():  # (all listed: the usual case once the keys are warm)
            fresh = ~listed
            dirty[at[fresh]] = True
            owner = seg_owner[fresh]
            slots = seg_slots[fresh][stable_argsort(owner)]  # by op, segment order within one
            counts = np.bincount(owner, minlength=len(ops))
            ends = np.cumsum(counts).tolist()
            for i in np.flatnonzero(counts).tolist():
                ops[i]._dirty_slots.append(slots[ends[i] - int(counts[i]):ends[i]])
        for name, v in values:
            arena.arrays[name][at] = v

    def _must_grow(self, names: frozenset[str]) -> bool:
        """False when ``_grow(len(self.key_index), names)`` would do nothing (checked inline: a group
        of 64 slices asks every slice every batch)."""
        count = self.arrays.get("count")
        if self._growth is not None or count is None:
            return True
        cap, size = len(count), len(self.key_index)
        return size > cap or should_start_spread(size, cap) or not self.arrays.keys() >= names

    def _grow(self, size: int, names: Sequence[str] = ()) -> None:
        """Room for ``size`` slots in every array, and arrays ``names`` (zeros: never written) made.

        A value column's sum/min/max exist in an int and a float variant (a float one with
        its flag of the keys in it: ``_running_values``); only the variants a batch used are
        made, so an int column's state, checkpoints and backups carry no all-zero float
        arrays (4 of an aggregate's 8 arrays per value column). Large arrays
        double ahead of need, a share of the copy per batch (``chronostream.slices.slot_arrays``).
        """
        cur = len(self.arrays.get("count", ()))
        missing = [name for name in names if name not in self.arrays]
        if self._growth is not None:  # (only a batch grows the arrays meanwhile: ``size`` is the slots in use)
            if size > cur or missing or self._growth.step(self._slot_arrays(), size):
                self._take_doubled(self._growth.finish(self._slot_arrays(), size))
                cur = len(self.arrays["count"])
        if size <= cur and not missing:
            if self._growth is None and should_start_spread(size, cur):
                self._growth = SpreadGrowth(self._slot_arrays(), doubled_capacity(size, cur))
            return
        new = cur if size <= cur else doubled_capacity(size, cur)

        def grow(a: np.ndarray | None, dtype) -> np.ndarray:
            if a is not None and len(a) == new:
                return a
            out = np.zeros(new, dtype=dtype)
            if a is not None:
                out[: len(a)] = a
            return out

        self._dirty_mask = grow(self._dirty_mask, bool)
        # A new dict, not the old one changed: a group's slot arena knows its members' arrays by
        # the dict it gave them (``_group_arena``).
        self.arrays = {name: grow(self.arrays.get(name), _state_array_dtype(name))
                       for name in dict.fromkeys(["count", *self.arrays, *missing])}  # each once, count first

    def _slot_arrays(self) -> dict[str, np.ndarray]:
        """Every array indexed by slot: the running values and the dirty mask (``_DIRTY``)."""
        return {**self.arrays, _DIRTY: self._dirty_mask}

    def _take_doubled(self, arrays: dict[str, np.ndarray]) -> None:
        self._dirty_mask = arrays.pop(_DIRTY)
        self.arrays = arrays
        self._growth = None

    # -- checkpoints (see slices/checkpoint.py) ----------------------------------

    def state_bytes(self) -> tuple[int, int]:
        """(keys, bytes) of the running values (metrics)."""
        n = len(self.key_index)
        return n, sum(int(a[:n].nbytes) for a in self.arrays.values())

    def checkpoint_state(self, delta: bool, clear: bool = True) -> dict[str, dict]:
        """The running values as a slot table: every slot, or the slots changed since the last call."""
        # slices imports operators, not the reverse at load

        n = len(self.key_index)
        if delta:
            slots = np.concatenate(self._dirty_slots) if self._dirty_slots else np.zeros(0, np.int64)
        else:
            slots = np.arange(n, dtype=np.int64)
        if clear:
            self.forget_dirty()
        cols: dict[str, pa.Array] = {"slot": pa.array(slots, pa.int64())}
        for i, k in enumerate(self.key_index.take(slots) if n else []):
            cols[f"key{i}"] = k
        for name, arr in sorted(self.arrays.items()):
            # Copies (fancy indexing / copy()): the part is encoded later, off the epoch,
            # while this operator goes on updating its arrays.
            cols[name] = pa.array((arr[:n].copy() if not delta else arr[:n][slots]) if n else arr[:0].copy())
        return {"__op__aggregate": frozen_table_part(pa.table(cols))}

    def forget_dirty(self) -> None:
        """Start the next delta here: what changed so far is covered (or deliberately not kept)."""
        for slots in self._dirty_slots:
            self._dirty_mask[slots] = False
            if self._growth is not None:
                self._growth.new[_DIRTY][slots] = False
        self._dirty_slots = []

    def restore_state(self, parts: dict[str, dict]) -> None:
        """Rebuild the key index and the running values from a full slot table."""

        t = read_table_part(parts["__op__aggregate"])
        slots = np.asarray(t.column("slot"))
        assert np.array_equal(slots, np.arange(len(slots))), "a full aggregate snapshot holds every slot"
        self.key_index = KeyIndex()
        self.arrays = {}
        self._dirty_slots = []
        self._dirty_mask = np.zeros(0, dtype=bool)
        self._growth = None
        if len(slots) == 0:
            return
        key_cols = [t.column(f"key{i}").combine_chunks() for i in range(len(self.key_columns))]
        got = self.key_index.slots(key_cols)
        assert np.array_equal(got, slots)
        names = [n for n in t.schema.names if _is_state_array(n)]
        # Room for as many keys again: sized to the state alone, the arrays doubled at the first
        # new key after a migration or a recovery, on the epoch's thread (a 1 GB slice: 141 ms
        # instead of 11, one process). The room is zero pages (np.zeros) until keys use it.
        self._grow(2 * len(slots), names)
        for name in names:
            # A variant first used after the chain's full checkpoint is null in the older rows:
            # those slots never had a value of that kind (zero, as in the live arrays).
            self.arrays[name][: len(slots)] = np.asarray(t.column(name).fill_null(0))

    def consume_serial(self, stream_id: str, event: dict) -> None:
        """Reference per-event implementation used by the serial executor (the oracle)."""
        key = tuple(canonical_key(event[c]) for c in self.key_columns)
        key = key if len(key) > 1 else key[0]
        st = self.register_state("__serial__")
        cur = st.get(key)
        if cur is None:
            cur = {"count": 0}
        cur = dict(cur)
        cur["count"] += 1
        for col in self._value_columns():
            v = event[col]
            if v is None:
                raise ValueError(f"column {col!r} has a null value; aggregates need non-null values")
            # As the vectorized path: a key's values are exact ints until the first float one,
            # then floats from there on (the running int values promoted once).
            if isinstance(v, float) or f"float_{col}" in cur:
                v = float(v)
                if f"float_{col}" not in cur:
                    cur[f"float_{col}"] = True
                    for a in ("sum", "min", "max"):
                        if f"{a}_{col}" in cur:
                            cur[f"{a}_{col}"] = float(cur[f"{a}_{col}"])
            cur[f"sum_{col}"] = cur.get(f"sum_{col}", 0.0 if isinstance(v, float) else 0) + v
            cur[f"min_{col}"] = v if f"min_{col}" not in cur else min(cur[f"min_{col}"], v)
            cur[f"max_{col}"] = v if f"max_{col}" not in cur else max(cur[f"max_{col}"], v)
        st.set(key, cur)
        out = {c: event[c] for c in self.key_columns}
        for agg, col in self.specs:
            name = self.output_name(agg, col)
            if agg == "count":
                out[name] = cur["count"]
            elif agg == "mean":
                out[name] = float(cur[f"sum_{col}"]) / cur["count"]  # as the vectorized path: float64(sum) / count
            else:
                out[name] = cur[f"{agg}_{col}"]
        # One update per input row: the output keeps the input's lineage (no fan-out).
        self.produce_update("out", out)


class KeyedJoin(Operator):
    """Built-in symmetric keyed equi-join of two input streams, ``left`` and ``right``.

    Every event is stored under its key; it is joined with every event of the
    other side seen so far for that key and each pair is emitted as one row:
    the left columns, then the right columns prefixed ``right_`` when names
    clash (prefixed again while the name is taken: a join of joins keeps
    every column). Build it with ``cs.join(left.key_by(k), right.key_by(k))``.
    """

    def __init__(self, left_key: Sequence[str], right_key: Sequence[str], how: str = "inner") -> None:
        if how != "inner":
            raise ValueError("only inner joins are supported")
        self.left_key = list(left_key)
        self.right_key = list(right_key)

    def setup(self) -> None:
        self.left = self.register_state("left")
        self.right = self.register_state("right")

    @staticmethod
    def _key(event: dict, cols: list[str]) -> Any:
        return event[cols[0]] if len(cols) == 1 else tuple(event[c] for c in cols)

    def consume(self, stream_id: str, event: dict) -> None:
        is_left = stream_id == "left"
        own, other = (self.left, self.right) if is_left else (self.right, self.left)
        key = self._key(event, self.left_key if is_left else self.right_key)
        rows = own.get(key) or []
        rows.append(event)
        own.set(key, rows)
        for match in other.get(key) or ():
            self.produce("out", _merge(event, match) if is_left else _merge(match, event))


def _merge(left: dict, right: dict) -> dict:
    out = dict(left)
    for k, v in right.items():
        out[joined_name(k, out)] = v
    return out


def joined_name(name: str, taken: Any) -> str:
    """The output name of a join's right column ``name`` when the names in ``taken`` are used:
    itself, or prefixed ``right_`` until it is free (no right column overwrites another one).

    >>> joined_name("k", {"k", "right_k"}), joined_name("v", {"k"})
    ('right_right_k', 'v')
    """
    while name in taken:
        name = "right_" + name
    return name
