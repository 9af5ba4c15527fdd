"""One computation slice at run time. Knows no Ray; the container drives it.

Owns: the operator instance and its context, the progress vector (dedup),
the deterministic merge of an epoch's inputs, the output numbering
(``out_seq`` dense from 0 per produced stream) and the dead letters the
slice produced. Processing one epoch is four steps:

1. admit: drop every input row at or below the progress vector;
2. merge: order the rest by (source order, sub-order, input index,
   producer slice, out_seq) -- a key that does not depend on placement,
   container count, epoch arrival or Ray scheduling;
3. run the operator (per event, or vectorized on the merged batch);
4. emit: apply each produced stream's stateless chain, then number its rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from chronostream.slices import codec
from chronostream.slices.plan import JobPlan, StagePlan
from chronostream.slices.errors import EventError, RuntimeFault, StateEncodingError
from chronostream.slices.operators import Operator, OperatorContext
from chronostream.slices.types import END_OF_INPUT, ORDER, SEQ, SLICE, SUB
from chronostream.slices.chain import apply_chain
from chronostream.slices.progress import ProgressVector



@dataclass(frozen=True)
class SliceStatistics:
    """Counters of one slice (read by metrics and benchmarks)."""

    stage: str
    slice_id: int
    epoch: int
    events_in: int
    events_out: int
    duplicates_dropped: int
    dead_letters: int
    busy_s: float = 0.0  # time spent processing (admit, merge, operator, numbering)


def merge_order(order: np.ndarray, sub: np.ndarray, input_idx: np.ndarray,
                producer: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Permutation that puts rows in the deterministic merge order.

    >>> merge_order(np.array([1, 0, 0]), np.array([0, 1, 0]), np.zeros(3, int),
    ...             np.zeros(3, int), np.arange(3)).tolist()
    [2, 1, 0]
    """
    # Fast path, exact: a stable sort on the source order alone is the full
    # order whenever every run of equal source order ascends in (sub-order,
    # input, producer slice), rows equal in all three coming as they arrived,
    # which is out_seq order (one producer's rows of one input). Fan-out (a
    # line split into words) makes such runs common; routing sorts the rows of
    # a producer's many slices into them (containers.routing.by_consumer_slice).
    perm = np.argsort(order, kind="stable")
    if len(perm) > 1:
        o = order[perm]
        if not np.any((o[1:] == o[:-1]) & steps_back(sub[perm], producer[perm], input_idx[perm])):
            return perm
    return np.lexsort((seq, producer, input_idx, sub, order))


def steps_back(sub: np.ndarray, producer: np.ndarray, input_idx: np.ndarray | None = None) -> np.ndarray:
    """For each pair of adjacent rows of equal source order: whether the second comes first in
    merge order, by (sub-order, input, producer slice). Rows equal in all of them are one
    producer's rows of one input, which arrive in out_seq order: not a step back.

    >>> steps_back(np.array([0, 1, 1, 1]), np.array([5, 2, 3, 1])).tolist()
    [False, False, True]
    """
    back = producer[1:] < producer[:-1]
    if input_idx is not None:
        back = (input_idx[1:] < input_idx[:-1]) | ((input_idx[1:] == input_idx[:-1]) & back)
    return (sub[1:] < sub[:-1]) | ((sub[1:] == sub[:-1]) & back)


def event_dicts(table: pa.Table) -> list[dict]:
    """A table's rows as the dicts a per-event operator consumes (no runtime ``_`` columns)."""
    return table.select([c for c in table.schema.names if not c.startswith("_")]).to_pylist()


#: A per-event loop turns this many rows into dicts at a time, just before it consumes them,
#: and builds its produced events (of declared schema) into a table once this many wait
#: (``OperatorContext.seal``). Doing either for a whole epoch at once (40,000 rows: tens of
#: MB of dicts) walked memory no cache held: the word count of ``benchmarks.slices
#: --per-event`` ran faster with 64 slices alone (600 rows a slice) than with one slice.
EVENT_CHUNK = 1024


def chunk_events(tables: Sequence[pa.Table | list[dict]], inp: np.ndarray, local: np.ndarray) -> list[dict]:
    """The events ``tables[inp[j]]`` row ``local[j]`` as dicts (``event_dicts``), in ``j`` order.
    An input given as a list holds its rows as dicts already.

    >>> t = pa.table({"a": [0, 1, 2], "_order": [5, 6, 7]})
    >>> chunk_events([t, [{"b": 0}, {"b": 1}]], np.array([1, 0, 1]), np.array([1, 0, 0]))
    [{'b': 1}, {'a': 0}, {'b': 0}]
    """
    if len(inp) == 0:
        return []
    if all(isinstance(t, list) for t in tables):
        return [tables[i][r] for i, r in zip(inp.tolist(), local.tolist())]  # type: ignore[index]
    first = int(inp[0])
    if bool(np.all(inp == first)):
        return _events(tables[first], local)
    out: list[dict] = [{}] * len(inp)
    for k in np.unique(inp).tolist():
        where = np.flatnonzero(inp == k)
        for j, event in zip(where.tolist(), _events(tables[k], local[where])):
            out[j] = event
    return out


def _events(rows_of: pa.Table | list[dict], rows: np.ndarray) -> list[dict]:
    if isinstance(rows_of, list):
        return [rows_of[r] for r in rows.tolist()]
    return event_dicts(_rows(rows_of, rows))


def _rows(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """``table``'s ``rows`` in that order (a zero-copy slice when they are a run)."""
    lo = int(rows[0])
    if int(rows[-1]) - lo == len(rows) - 1 and bool(np.all(np.diff(rows) == 1)):
        return table.slice(lo, len(rows))
    return table.take(pa.array(rows))


class SliceRuntime:
    """A slice of one stage: feed it epochs, get numbered outputs per stream."""

    def __init__(self, plan: JobPlan, stage_id: int, slice_id: int, dead_letters: bool = False,
                 cold_tiers: Any = None) -> None:
        self.plan = plan
        self.stage: StagePlan = plan.stages[stage_id]
        self.slice_id = slice_id
        self.dead_letter_mode = dead_letters
        self.progress = ProgressVector()  # invariant: only grows
        self.next_seq: dict[int, int] = {sid: 0 for sid in self.stage.produced}  # invariant: only grows
        self.last_epoch = -1  # invariant: epochs processed in increasing order
        self.dead_letters: list[dict] = []
        self.events_in = 0
        self.events_out = 0
        self.duplicates_dropped = 0
        self.busy_s = 0.0
        self.op: Operator | None = None
        self.ctx: OperatorContext | None = None
        if self.stage.kind == "operator":
            cls, args, kwargs = self.stage.factory  # type: ignore[misc]
            self.ctx = OperatorContext(self.stage.name, slice_id, self.stage.outputs)
            self.ctx.cold_tiers = cold_tiers  # long queues' middle chunks go there (containers/spill.py)
            self.op = cls(*args, **kwargs)
            self.op.bind(self.ctx)
            self.op.setup()
        self._input_names = {i.stream_id: (i.index, i.name) for i in self.stage.inputs}

    # -- errors --------------------------------------------------------------

    def _fail_or_dead_letter(self, order: int, sub: int, exc: BaseException, event: Any) -> None:
        # A runtime fault (a full disk) would fail every event after this one too: dead
        # letters would swallow the rest of the input, so it fails the job in either mode.
        if not self.dead_letter_mode or isinstance(exc, RuntimeFault):
            raise EventError(self.stage.name, self.slice_id, order, f"{type(exc).__name__}: {exc}", event) from exc
        self.dead_letters.append({
            "stage": self.stage.name, "slice": self.slice_id, "order": int(order), "sub": int(sub),
            "error": f"{type(exc).__name__}: {exc}", "event": repr(event),
        })

    def _chain_error(self, table: pa.Table, i: int, exc: BaseException) -> None:
        row = table.slice(i, 1)
        event = {k: v[0] for k, v in row.to_pydict().items() if not k.startswith("_")}
        self._fail_or_dead_letter(int(row.column(ORDER)[0].as_py()), int(row.column(SUB)[0].as_py()), exc, event)

    # -- the four steps --------------------------------------------------------

    def process_source(self, epoch: int, rows: pa.Table) -> dict[int, pa.Table]:
        """Emit one epoch of a source slice (``rows`` carry ``_order``/``_sub``)."""
        t0 = time.perf_counter()
        self._begin(epoch)
        self.events_in += rows.num_rows
        out = self._emit({"out": rows})
        self.busy_s += time.perf_counter() - t0
        return out

    def process(self, epoch: int, inputs: dict[int, list[pa.Table]]) -> dict[int, pa.Table]:
        """Consume one epoch of input; return numbered outputs by stream id.

        ``inputs`` maps a stream id to tables of its rows for this slice; a
        table may mix producer slices (``_slice``), each in out_seq order.
        """
        t0 = time.perf_counter()
        self._begin(epoch)
        admitted = self._admit(inputs)
        outputs = self._run(admitted)
        out = self._emit(outputs)
        self.busy_s += time.perf_counter() - t0
        return out

    def finish(self, epoch: int, end_order: int) -> dict[int, pa.Table]:
        """The operator's end-of-input hook (``Operator.on_end``) in the last ``epoch``, after
        the slice's input of it; returns its rows chained and numbered after the epoch's others.
        A raising hook fails the job or becomes a dead letter, like a poison event."""
        assert self.op is not None and self.ctx is not None
        t0 = time.perf_counter()
        self.last_epoch = max(self.last_epoch, epoch)
        self.ctx.begin_end(end_order)
        try:
            self.op.on_end()
        except Exception as exc:  # noqa: BLE001 - user code
            self.ctx.reset()
            self._fail_or_dead_letter(end_order, 0, exc, END_OF_INPUT)
        out = self.emit_outputs()
        self.busy_s += time.perf_counter() - t0
        return out

    def state_size(self) -> tuple[int, int]:
        """(keys, approximate bytes) of the slice's state: registered states (sizes from a
        strided sample of up to 32 entries each, encoded by ``chronostream.slices.codec``; spilled entries counted at
        the sample's size) and an operator's own arrays."""
        keys, nbytes = 0, 0
        if self.ctx is not None:
            for st in self.ctx.states.values():
                n = len(st)
                keys += n
                if n:
                    sample = st.sample(32)  # spread over the state, in-memory entries only
                    try:
                        per = len(codec.packb(sample)) / len(sample) if sample else 64.0
                    except StateEncodingError:  # a bad value fails the next checkpoint, naming it
                        per = 64.0
                    nbytes += int(per * n)
        own = getattr(self.op, "state_bytes", None)
        if callable(own):
            k, b = own()
            keys, nbytes = keys + k, nbytes + b
        return keys, nbytes

    def state_keys(self) -> int:
        """Keys of the slice's state (registered states and an operator's own arrays), counted
        without ``state_size``'s pass over the entries."""
        keys = sum(len(st) for st in self.ctx.states.values()) if self.ctx is not None else 0
        own = getattr(self.op, "state_bytes", None)
        return keys + (own()[0] if callable(own) else 0)

    def cold_state_keys(self) -> int:
        """Entries of the slice's registered states in the host's spill store, not in memory."""
        if self.ctx is None:
            return 0
        return sum(len(st) - st.hot_len() for st in self.ctx.states.values())

    def _begin(self, epoch: int) -> None:
        assert epoch > self.last_epoch, f"{self.stage.name}[{self.slice_id}]: epoch {epoch} after {self.last_epoch}"
        self.last_epoch = epoch

    def _admit(self, inputs: dict[int, list[pa.Table]]) -> dict[int, list[pa.Table]]:
        by_stream: dict[int, list[pa.Table]] = {}
        for stream_id in sorted(inputs):
            if stream_id not in self._input_names:
                raise ValueError(f"{self.stage.name}[{self.slice_id}] got stream {stream_id}, not an input")
            for table in inputs[stream_id]:
                kept = self.progress.admit(stream_id, table)
                self.duplicates_dropped += table.num_rows - kept.num_rows
                if kept.num_rows:
                    by_stream.setdefault(stream_id, []).append(kept)
        return by_stream

    def _run(self, admitted: dict[int, list[pa.Table]]) -> dict[str, pa.Table]:
        assert self.op is not None and self.ctx is not None
        tables: list[tuple[int, str, pa.Table]] = []
        for stream_id, ts in admitted.items():
            idx, name = self._input_names[stream_id]
            t = ts[0] if len(ts) == 1 else pa.concat_tables(ts, promote_options="permissive")
            tables.append((idx, name, t))
        if not tables:
            return {}
        tables.sort(key=lambda x: x[0])
        n_total = sum(t.num_rows for _, _, t in tables)
        self.events_in += n_total
        cols = {k: np.concatenate([np.asarray(t.column(k)) for _, _, t in tables]) for k in (ORDER, SUB, SLICE, SEQ)}
        inp = np.concatenate([np.full(t.num_rows, j, dtype=np.int64) for j, (_, _, t) in enumerate(tables)])
        local = np.concatenate([np.arange(t.num_rows, dtype=np.int64) for _, _, t in tables])
        perm = merge_order(cols[ORDER], cols[SUB], inp, cols[SLICE], cols[SEQ])
        op, ctx = self.op, self.ctx
        if op.is_vectorized():
            self._run_vectorized(tables, inp[perm], local[perm])
        else:
            self._run_per_event(tables, inp[perm], local[perm], cols[ORDER][perm], cols[SUB][perm])
        return ctx.take_outputs(self.stage.output_schemas)

    def _run_per_event(self, tables, inp, local, order, sub) -> None:
        # One input: its rows in merge order are runs of its table, turned into dicts a chunk
        # at a time. Several (a join): as dicts at once, as a group does (``process_inputs``).
        rows = [t for _, _, t in tables] if len(tables) == 1 else [event_dicts(t) for _, _, t in tables]
        self.consume_events([name for _, name, _ in tables], rows, inp, local, order, sub)

    def consume_events(self, names: list[str], tables: Sequence[pa.Table | list[dict]], inp: np.ndarray,
                       local: np.ndarray, order: np.ndarray, sub: np.ndarray) -> None:
        """The per-event operator's loop: row ``local[j]`` of ``tables[inp[j]]`` (input
        ``names[inp[j]]``) as a dict, with lineage ``(order[j], sub[j])``, for every ``j`` in
        merge order; rows become dicts ``EVENT_CHUNK`` at a time. An event that raises loses
        what it produced and fails the job or becomes a dead letter; the loop goes on."""
        op, ctx = self.op, self.ctx
        consume = op.consume
        schemas = self.stage.output_schemas
        for a in range(0, len(inp), EVENT_CHUNK):
            if ctx.unsealed_rows() >= EVENT_CHUNK:
                ctx.seal(schemas)
            b = a + EVENT_CHUNK
            events = chunk_events(tables, inp[a:b], local[a:b])
            for event, i, o, s in zip(events, inp[a:b].tolist(), order[a:b].tolist(), sub[a:b].tolist()):
                ctx._order = o
                ctx._sub = s
                ctx._k = 0
                try:
                    consume(names[i], event)
                except Exception as exc:  # noqa: BLE001 - user code
                    self._drop_partial_outputs(o, s)
                    self._fail_or_dead_letter(o, s, exc, event)

    def _drop_partial_outputs(self, order: int, sub: int) -> None:
        ctx = self.ctx
        for name in ctx.output_names:
            lin, ev = ctx.lineage[name], ctx.events[name]
            while lin and lin[-1][0] == order and lin[-1][1] == sub:
                lin.pop()
                ev.pop()

    def _run_vectorized(self, tables, inp, local) -> None:
        # Runs of consecutive rows from one input, in merge order.
        n = len(inp)
        bounds = np.flatnonzero(np.diff(inp)) + 1
        starts = np.concatenate(([0], bounds))
        ends = np.concatenate((bounds, [n]))
        for s, e in zip(starts.tolist(), ends.tolist()):
            i = int(inp[s])
            _, name, t = tables[i]
            rows = local[s:e]
            identity = len(rows) == t.num_rows and bool(np.all(rows == np.arange(len(rows))))
            self._consume_batch(name, (t if identity else t.take(pa.array(rows))).drop_columns([SLICE, SEQ]))

    def consume_merged(self, name: str, rows: pa.Table) -> dict[int, pa.Table]:
        """A vectorized operator's epoch over ``rows`` of input ``name``, already admitted and in
        merge order (a slice group's share: ``slices.group``): one call, as ``process`` makes
        for them, then the chain and numbering; returns numbered outputs by stream id."""
        assert self.ctx is not None
        self.events_in += rows.num_rows
        self._consume_batch(name, rows.drop_columns([SLICE, SEQ]))
        return self.emit_outputs()

    def _consume_batch(self, name: str, batch: pa.Table) -> None:
        produced = {k: len(v) for k, v in self.ctx.batches.items()}
        try:
            self.op.consume_batch(name, batch)
        except Exception:  # noqa: BLE001 - isolate the poison rows (row-wise contract)
            # Drop what the failed call produced, then retry one row at a time.
            for k, m in produced.items():
                del self.ctx.batches[k][m:]
            self._consume_rows_one_by_one(name, batch)

    def _consume_rows_one_by_one(self, name: str, batch: pa.Table) -> None:
        for j in range(batch.num_rows):
            row = batch.slice(j, 1)
            produced = {k: len(v) for k, v in self.ctx.batches.items()}
            try:
                self.op.consume_batch(name, row)
            except Exception as exc:  # noqa: BLE001
                for k, m in produced.items():
                    del self.ctx.batches[k][m:]
                event = {k: v[0] for k, v in row.to_pydict().items() if not k.startswith("_")}
                self._fail_or_dead_letter(int(row.column(ORDER)[0].as_py()), int(row.column(SUB)[0].as_py()), exc, event)

    def emit_outputs(self) -> dict[int, pa.Table]:
        """What the operator produced since the last call, chained and numbered (``_emit``)."""
        assert self.ctx is not None
        return self._emit(self.ctx.take_outputs(self.stage.output_schemas))

    def _emit(self, outputs: dict[str, pa.Table]) -> dict[int, pa.Table]:
        result: dict[int, pa.Table] = {}
        for sid in self.stage.produced:
            sp = self.plan.streams[sid]
            base = outputs.get(sp.output)
            if base is None or base.num_rows == 0:
                continue
            t = apply_chain(base, sp.chain, self._chain_error)
            if t.num_rows == 0:
                continue
            start = self.next_seq[sid]
            t = t.append_column(SLICE, pa.array(np.full(t.num_rows, self.slice_id, dtype=np.int64)))
            t = t.append_column(SEQ, pa.array(np.arange(start, start + t.num_rows, dtype=np.int64)))
            self.next_seq[sid] = start + t.num_rows
            self.events_out += t.num_rows
            result[sid] = t
        return result

    def drop_cold(self) -> None:
        """Forget the state's spilled values on this host (the slice left it)."""
        if self.ctx is not None:
            for st in self.ctx.states.values():
                st.drop_cold()

    def statistics(self) -> SliceStatistics:
        """A frozen snapshot of this slice's counters."""
        return SliceStatistics(self.stage.name, self.slice_id, self.last_epoch, self.events_in,
                               self.events_out, self.duplicates_dropped, len(self.dead_letters), self.busy_s)

    def take_dead_letters(self) -> list[dict]:
        """Dead letters produced since the last call."""
        out, self.dead_letters = self.dead_letters, []
        return out

