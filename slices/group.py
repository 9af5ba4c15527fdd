"""Owns running one epoch of many slices of one stage in one vectorized pass (a slice group).

A container with 64 slices of a stage would otherwise pay every per-slice
step 64 times an epoch: the merge sort, the operator call, the numbering,
each a handful of Arrow and numpy calls whatever the slice's share of the
rows (paper Fig. 21; ``benchmarks.slices``). When the stage's operator can
take many slices' batches in one call (``Operator.fuses_slices``), the group
does those steps once for the container:

1. admit, once per sender's part: the slices' progress vectors as the rows
   of one matrix, each row's (slice, producer slice) channel looked up in it
   (a part stays whole: no cutting it by slice and joining it again);
2. merge, once: the admitted rows of every slice sorted by (slice, merge
   key) -- per slice exactly the order ``SliceRuntime`` gives it alone;
3. one ``consume_slices`` call, each slice's operator owning its rows;
4. each produced stream's stateless chain (``map``, ``filter``...), once over
   every slice's output, each row's slice carried through the steps;
5. number, once: ``_slice``/``out_seq`` per row from each slice's counter;
   each slice's output is a zero-copy slice of the one table.

Results equal running each slice alone, row for row: slices stay the units
of state, checkpoints and migration. A group epoch that raises (a poison
row) is rerun slice by slice from the admitted rows, where the row-by-row
isolation and dead letters live.

A vectorized operator with one input that does not fuse slices runs as a
group too: steps 1 and 2 once, then each slice's own call, chain and
numbering on its share of the merged rows (a zero-copy slice), exactly as
alone (the rerun path above, taken every epoch).

A per-event operator with one input (windows, most user operators) runs as
a group too: steps 1 and 2 once, then each slice's own per-event loop over
its share, turning it into dicts a chunk at a time (``SliceRuntime.consume_events``):
an event that raises is that slice's error or dead letter, as alone, and
nothing is rerun. Steps 4 and 5 run once when the stage declares its output
schemas; else each slice emits its own outputs. A per-event operator with
several inputs (a join) runs the same way (``process_inputs``): admission
once per input stream, one merge of all inputs' rows for every slice.

Senders' parts whose schemas differ are never joined into one table (Arrow
would promote every slice's rows to one schema): such an epoch runs each
slice alone on its rows of each part. Knows no Ray and no container.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pyarrow as pa

from chronostream.slices.plan import StagePlan
from chronostream.slices.operators import OperatorContext
from chronostream.slices.sorting import packed_merge_key, stable_argsort, take_permuted, tie_free_argsort
from chronostream.slices.types import ORDER, SEQ, SLICE, SUB
from chronostream.slices.chain import apply_chain
from chronostream.slices.slice import EVENT_CHUNK, SliceRuntime, event_dicts, steps_back

log = logging.getLogger("chronostream.slices")

#: Hidden column that carries a group output row's owner (index in the group) through a chain.
GROUP_OWNER = "_group_owner"


def _single_input_operator(stage: StagePlan) -> type | None:
    if stage.kind != "operator" or len(stage.inputs) != 1:
        return None
    return stage.factory[0]  # type: ignore[index]


def runs_grouped(stage: StagePlan) -> bool:
    """Whether a stage's slices can run as one group: any operator with one input, and
    per-event operators with several (joins: ``process_inputs``). One that fuses many slices'
    batches (``Operator.fuses_slices``) runs one call for the group, and stateless chains on
    its produced streams then run once over the group's output; a per-event one runs each
    slice's loop over its share of the group's rows; any other vectorized one runs each
    slice's call on its share (see ``process_parts``). Admission and merge are once per group
    in every case."""
    if stage.kind != "operator":
        return False
    return len(stage.inputs) == 1 or not stage.factory[0].is_vectorized()  # type: ignore[index]


def reads_key_codes(stage: StagePlan) -> bool:
    """Whether a stage's operator groups its one input by the stream key and reuses routing's
    dictionary codes of it (``Operator.reads_key_codes``; see ``containers.routing.route``)."""
    cls = _single_input_operator(stage)
    return cls is not None and bool(cls.reads_key_codes())


def grouped_merge_order(owner: np.ndarray, order: np.ndarray, sub: np.ndarray,
                        producer: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Permutation sorting rows by owning slice, then each slice's merge order (one input).

    >>> grouped_merge_order(np.array([1, 0, 0]), np.array([0, 5, 2]), np.zeros(3, int),
    ...                     np.zeros(3, int), np.arange(3)).tolist()
    [2, 1, 0]
    """
    # Same fast path as merge_order: stable sorts keep arrival order among equal
    # (slice, order), which is the full order unless a run steps back in
    # (sub-order, producer) (steps_back). Rows usually arrive grouped by slice (one
    # sender's part), each slice's in merge order (one producer, or routing sorted a
    # many-slice producer's rows so): nothing to sort. With several senders, one
    # radix sort by slice (stable_argsort) groups them.
    if in_grouped_merge_order(owner, order, sub, producer):
        return np.arange(len(owner))
    return _reordered(owner, order, sub, producer, seq)


def _reordered(owner: np.ndarray, order: np.ndarray, sub: np.ndarray, producer: np.ndarray,
               seq: np.ndarray) -> np.ndarray:
    """``grouped_merge_order`` of rows known not to be in that order already."""
    if not bool(np.all(owner[1:] >= owner[:-1])):
        perm = stable_argsort(owner)
        if _arrival_order_suffices(owner, order, perm, sub, producer):
            return perm
    # Rows of many producers interleave in each slice (a keyed stage fed by a stage of many
    # slices: one source event's rows come from several). (slice, order, sub) packed into one
    # integer sorts in one pass: 0.7 ms an epoch of 41,000 rows, where the lexsort took 5 and
    # the checks before it 5 more; ties among them (rows of one event and sub-order from two
    # producers: not seen in one-input stages) take the full sort.
    perm = tie_free_argsort(packed_merge_key(owner, order, sub))
    return perm if perm is not None else np.lexsort((seq, producer, sub, order, owner))


def in_grouped_merge_order(owner: np.ndarray, order: np.ndarray, sub: np.ndarray, producer: np.ndarray) -> bool:
    """Whether rows are grouped by owning slice and each slice's rows in merge order already
    (``grouped_merge_order`` would return the identity): one pass over adjacent rows, no copy.

    >>> in_grouped_merge_order(np.array([0, 0, 1]), np.array([2, 5, 0]), np.zeros(3, int), np.zeros(3, int))
    True
    """
    if len(owner) < 2:
        return True
    if not bool(np.all(owner[1:] >= owner[:-1])):
        return False
    return _arrival_order_suffices(owner, order, None, sub, producer)


def _arrival_order_suffices(owner: np.ndarray, order: np.ndarray, perm: np.ndarray | None, sub: np.ndarray,
                            producer: np.ndarray) -> bool:
    """Rows taken in ``perm`` (None: as they are), already grouped by owner: each owner's rows
    are in (``order``, ``sub``, ``producer``) order, rows equal in all three in arrival order,
    which is their out_seq order (they come from one producer, which numbers rows in order).
    Rows of one source event from several producers pass when their sub-orders differ and
    ascend: routing sorts a keyed stage's rows of a many-slice producer so
    (``containers.routing.route``)."""
    if perm is not None:
        owner, order, sub, producer = owner[perm], order[perm], sub[perm], producer[perm]
    if len(owner) < 2:
        return True
    same_owner = owner[1:] == owner[:-1]
    if not bool(np.all(~same_owner | (order[1:] >= order[:-1]))):
        return False
    same = same_owner & (order[1:] == order[:-1])
    return not bool(np.any(same & steps_back(sub, producer)))


#: One sender's rows for a stage, sorted by consumer slice, and that slice per row
#: (``containers.routing.RoutedPart``; slices do not import containers).
Part = tuple[pa.Table, np.ndarray]


def process_parts(runtimes: list[SliceRuntime], epoch: int, parts: list[Part]) -> dict[int, dict[int, pa.Table]]:
    """One epoch of the group ``runtimes`` in one pass, from the parts its senders routed to it.

    ``runtimes``: every local slice of the stage in a thread's group, in slice
    order (the same list epoch after epoch, so an operator can keep group-wide
    lookups between calls); ``parts``: the epoch's rows of the stage's one input
    stream, one per sender in sender order (rows of other slices, and of slices
    restored past ``epoch``, are skipped). Slices without rows sit the epoch
    out. Returns numbered outputs by slice, then stream id.
    """
    t0 = time.perf_counter()
    stage = runtimes[0].stage
    stream_id = stage.inputs[0].stream_id
    position = _positions(runtimes, epoch)
    admitted, owners = _admit_parts(runtimes, epoch, stream_id, parts, position)
    if not admitted:
        return {}
    if any(not t.schema.equals(admitted[0].schema) for t in admitted[1:]):
        # Senders' parts of different schemas (a column typed null in one, or missing): one
        # table would promote every slice's rows to one schema, where alone a slice joins
        # only its own parts. Each slice runs alone on its rows of each part.
        return _run_alone_from_parts(runtimes, {stream_id: (admitted, owners)}, time.perf_counter() - t0)
    combined = pa.concat_tables(admitted) if len(admitted) > 1 else admitted[0]
    owner = np.concatenate(owners) if len(owners) > 1 else owners[0]
    cols = {k: np.asarray(combined.column(k)) for k in (ORDER, SUB, SLICE)}
    if in_grouped_merge_order(owner, cols[ORDER], cols[SUB], cols[SLICE]):  # (the usual case: no copy)
        merged = combined
    else:
        perm = _reordered(owner, cols[ORDER], cols[SUB], cols[SLICE], np.asarray(combined.column(SEQ)))
        merged, owner = take_permuted(combined, perm), owner[perm]
    batch = merged.drop_columns([SLICE, SEQ])
    bounds = np.searchsorted(owner, np.arange(len(runtimes) + 1))
    name = stage.inputs[0].name
    cls = type(runtimes[0].op)
    if not cls.fuses_slices():
        if cls.is_vectorized():
            return _run_each(runtimes, merged, bounds, name, time.perf_counter() - t0)
        n = batch.num_rows
        order, sub = np.asarray(batch.column(ORDER)), np.asarray(batch.column(SUB))
        return _consume_events(runtimes, [name], [batch], np.zeros(n, dtype=np.int64), np.arange(n), order, sub,
                               bounds, time.perf_counter() - t0)
    try:
        outputs = type(runtimes[0].op).consume_slices([rt.op for rt in runtimes], name, batch, bounds)
    except Exception as exc:  # noqa: BLE001 - rerun per slice: row-by-row isolation, dead letters
        return _rerun_alone(runtimes, epoch, name, merged, bounds, exc, time.perf_counter() - t0)
    results = _chain_and_number(runtimes, outputs)
    # Busy time and counts per slice: its share of the group's rows.
    elapsed = time.perf_counter() - t0
    total = max(int(bounds[-1]), 1)
    for rt, n_in in zip(runtimes, np.diff(bounds).tolist()):
        if n_in:
            rt.events_in += n_in
            rt.busy_s += elapsed * n_in / total
    return results


def _positions(runtimes: list[SliceRuntime], epoch: int) -> np.ndarray:
    """Slice id -> index in ``runtimes``; -1 for other slices and slices restored past ``epoch``."""
    position = np.full(runtimes[0].stage.num_slices, -1, dtype=np.int64)
    for i, rt in enumerate(runtimes):
        if epoch > rt.last_epoch:
            position[rt.slice_id] = i
    return position


def _admit_parts(runtimes: list[SliceRuntime], epoch: int, stream_id: int, parts: list[Part],
                 position: np.ndarray, begin: bool = True) -> tuple[list[pa.Table], list[np.ndarray]]:
    """Every slice's progress-vector admission of the parts, in one pass per part: the kept
    rows and their owners (index in ``runtimes``), per part. Each slice with rows begins the
    epoch (``begin``; else the caller began it); its vector then holds what it consumed, and
    ``duplicates_dropped`` counts the rest.

    Per channel (owner, producer slice) this is ``ProgressVector.admit`` applied part after
    part: a part's rows of one channel come in increasing out_seq, and a copy of them in a
    later part (dual mode, a replay) is dropped: first write wins.
    """
    live = [(t, position[dst], np.asarray(t.column(SLICE), dtype=np.int64), np.asarray(t.column(SEQ), dtype=np.int64))
            for t, dst in parts if t.num_rows]
    begun = np.zeros(len(runtimes), dtype=bool)
    for _t, pos, _p, _s in live:
        begun[pos[pos >= 0]] = True
    users = np.flatnonzero(begun).tolist()
    if not users:
        return [], []
    for i in users if begin else ():
        runtimes[i]._begin(epoch)
    # The users' vectors of this stream as the rows of one matrix, all of one width.
    need = max(int(prod.max()) + 1 for _t, _pos, prod, _s in live)
    vectors = [runtimes[i].progress.array(stream_id, need) for i in users]
    width = max(len(v) for v in vectors)
    if any(len(v) != width for v in vectors):  # (a slice that once had more producers: rare)
        vectors = [runtimes[i].progress.array(stream_id, width) for i in users]
    consumed = np.full((len(runtimes), width), -1, dtype=np.int64)
    consumed[users] = np.stack(vectors)
    flat = consumed.reshape(-1)
    kept_tables: list[pa.Table] = []
    owners: list[np.ndarray] = []
    dropped = np.zeros(len(runtimes), dtype=np.int64)
    for table, pos, prod, seq in live:
        mine = pos >= 0  # usually all: a part holds only this container's slices
        # Flat index of each row's channel in ``consumed`` (1-D ufunc.at is fast); rows of
        # other slices point at row 0 and are masked out.
        channel = np.maximum(pos, 0) * width + prod
        keep = mine & (seq > flat[channel])
        if keep.all():
            np.maximum.at(flat, channel, seq)
            kept_tables.append(table)
            owners.append(pos)
            continue
        np.maximum.at(flat, channel[keep], seq[keep])
        dropped += np.bincount(pos[mine & ~keep], minlength=len(runtimes))
        if keep.any():
            kept_tables.append(table.filter(pa.array(keep)))
            owners.append(pos[keep])
    for i, v in zip(users, vectors):
        v[:] = consumed[i]
    if dropped.any():
        for i in np.flatnonzero(dropped).tolist():
            runtimes[i].duplicates_dropped += int(dropped[i])
    return kept_tables, owners


def _consume_events(runtimes: list[SliceRuntime], names: list[str], tables: list[pa.Table | list[dict]],
                    inp: np.ndarray, local: np.ndarray, order: np.ndarray, sub: np.ndarray, bounds: np.ndarray,
                    shared_s: float) -> dict[int, dict[int, pa.Table]]:
    """A per-event operator's epoch: the group's rows (``tables[k]``: input ``names[k]``'s, a
    table each slice's loop turns into dicts a chunk at a time, or its rows as dicts already),
    the group's merge order as (``inp``, ``local``) with each row's lineage (``order``,
    ``sub``), slice ``i`` owning ``bounds[i]:bounds[i+1]``. Each slice runs its own loop over
    its share (``SliceRuntime.consume_events``: the same calls, lineage, errors and
    dead letters as alone), then settles its undeclared outputs (``settle_inferred``). The
    outputs become one table per stream when the stage declares their schemas
    (``OperatorContext.take_outputs_together``), chained and numbered once as a fused
    group's; else each slice emits its own. ``shared_s`` (admission, merge) and the group's
    emitting are shared out by rows."""
    stage = runtimes[0].stage
    ran: list[int] = []
    unsealed: list[int] = []  # slices whose produced events wait to be built into a table
    waiting = 0  # their events
    for i, rt in enumerate(runtimes):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        if hi == lo:
            continue
        if waiting >= EVENT_CHUNK:
            # Build what the last slices produced while it is in the caches (EVENT_CHUNK).
            OperatorContext.seal_together([runtimes[j].ctx for j in unsealed], stage.output_schemas)  # type: ignore[misc]
            unsealed, waiting = [], 0
        t1 = time.perf_counter()
        rt.events_in += hi - lo
        try:
            rt.consume_events(names, tables, inp[lo:hi], local[lo:hi], order[lo:hi], sub[lo:hi])
        except Exception:
            # Alone, each slice emitted (ran its chain) before the next one's loop: a chain
            # error of an earlier slice is the one the job fails with.
            for j in ran:
                runtimes[j].emit_outputs()
            raise
        rt.busy_s += time.perf_counter() - t1
        ran.append(i)
        rt.ctx.settle_inferred(stage.output_schemas)  # type: ignore[union-attr]
        unsealed.append(i)
        waiting += rt.ctx.unsealed_rows()  # type: ignore[union-attr]
    t2 = time.perf_counter()
    together = OperatorContext.take_outputs_together([rt.ctx for rt in runtimes], stage.output_schemas)  # type: ignore[misc]
    if together is not None:
        results = _chain_and_number(runtimes, together)
    else:
        emitted = {runtimes[i].slice_id: runtimes[i].emit_outputs() for i in ran}
        results = {s: out for s, out in emitted.items() if out}
    shared_s += time.perf_counter() - t2
    total = max(int(bounds[-1]), 1)
    for i in ran:
        runtimes[i].busy_s += shared_s * int(bounds[i + 1] - bounds[i]) / total
    return results


def _chain_and_number(runtimes: list[SliceRuntime], outputs: dict[str, tuple[pa.Table, np.ndarray]]
                      ) -> dict[int, dict[int, pa.Table]]:
    """Each produced stream's rows of the whole group (``outputs``: output name -> rows, bounds
    per slice) through its chain once, then numbered per slice: numbered outputs by slice."""
    results: dict[int, dict[int, pa.Table]] = {}
    for sid in runtimes[0].stage.produced:
        produced = outputs.get(runtimes[0].plan.streams[sid].output)
        if produced is None or produced[0].num_rows == 0:
            continue
        table, out_bounds = _chained(runtimes, runtimes[0].plan.streams[sid].chain, produced[0],
                                     np.asarray(produced[1]))
        if table.num_rows:
            _number(runtimes, sid, table, out_bounds, results)
    return results


def _rerun_alone(runtimes: list[SliceRuntime], epoch: int, name: str, merged: pa.Table,
                 bounds: np.ndarray, exc: Exception, failed_s: float) -> dict[int, dict[int, pa.Table]]:
    """After a failed group call: each slice runs its admitted rows alone (``_run_each``, where
    row-by-row isolation and dead letters live); the failed call's time is shared."""
    log.info("stage %s epoch %s: group call failed (%s: %s); slices %s run one by one",
             runtimes[0].stage.name, epoch, type(exc).__name__, exc,
             [rt.slice_id for i, rt in enumerate(runtimes) if bounds[i + 1] > bounds[i]])
    return _run_each(runtimes, merged, bounds, name, failed_s)


def _run_alone_from_parts(runtimes: list[SliceRuntime], admitted: dict[int, tuple[list[pa.Table], list[np.ndarray]]],
                          shared_s: float) -> dict[int, dict[int, pa.Table]]:
    """Each slice runs alone (``SliceRuntime._run`` and ``_emit``) on its rows of every admitted
    part (``admitted``: stream id -> kept tables and their rows' owners), in sender order: the
    tables it would have admitted alone."""
    results = {}
    ran = sorted({int(i) for _, owners in admitted.values() for o in owners for i in np.unique(o)})
    for i in ran:
        rt = runtimes[i]
        t1 = time.perf_counter()
        inputs = {sid: [t.filter(pa.array(o == i)) for t, o in zip(tables, owners) if bool(np.any(o == i))]
                  for sid, (tables, owners) in admitted.items()}
        results[rt.slice_id] = rt._emit(rt._run({sid: ts for sid, ts in inputs.items() if ts}))
        rt.busy_s += time.perf_counter() - t1 + shared_s / len(ran)
    return {s: out for s, out in results.items() if out}


def process_inputs(runtimes: list[SliceRuntime], epoch: int, parts: list[tuple[int, Part]]
                   ) -> dict[int, dict[int, pa.Table]]:
    """One epoch of the group ``runtimes`` of a per-event operator with several inputs (a
    join): ``parts`` are (input stream id, part), senders in order. Admission once per stream
    (``_admit_parts``), one merge of every slice's rows of every input in each slice's
    ``merge_order``, the rows as dicts once per input, then each slice's own loop over its
    share (``_consume_events``). Returns numbered outputs by slice, then stream id.
    """
    t0 = time.perf_counter()
    stage = runtimes[0].stage
    inputs = {i.stream_id: i for i in stage.inputs}
    unknown = sorted({sid for sid, _ in parts} - set(inputs))
    if unknown:
        raise ValueError(f"{stage.name}: got stream(s) {unknown}, not inputs of the stage")
    position = _positions(runtimes, epoch)
    begun = np.zeros(len(runtimes), dtype=bool)
    for _sid, (t, dst) in parts:
        if t.num_rows:
            pos = position[dst]
            begun[pos[pos >= 0]] = True
    for i in np.flatnonzero(begun).tolist():
        runtimes[i]._begin(epoch)
    admitted = {}
    for sid in sorted(inputs, key=lambda k: inputs[k].index):
        kept = _admit_parts(runtimes, epoch, sid, [p for s, p in parts if s == sid], position, begin=False)
        if kept[0]:
            admitted[sid] = kept
    if not admitted:
        return {}
    if any(not t.schema.equals(tables[0].schema) for tables, _ in admitted.values() for t in tables[1:]):
        return _run_alone_from_parts(runtimes, admitted, time.perf_counter() - t0)  # (as in process_parts)
    names, input_tables, cols = [], [], []
    for k, (sid, (tables, owners)) in enumerate(admitted.items()):
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        names.append(inputs[sid].name)
        # As dicts at once: a slice's rows of an input are scattered over the senders' parts,
        # and a take per slice, input and chunk cost more than the warmer caches gave back.
        input_tables.append(event_dicts(table))
        n = table.num_rows
        cols.append([np.concatenate(owners)] + [np.asarray(table.column(c)) for c in (ORDER, SUB)]
                    + [np.full(n, inputs[sid].index, dtype=np.int64)]
                    + [np.asarray(table.column(c)) for c in (SLICE, SEQ)] + [np.arange(n), np.full(n, k)])
    owner, order, sub, input_idx, producer, seq, local, inp = (np.concatenate(c) for c in zip(*cols))
    perm = np.lexsort((seq, producer, input_idx, sub, order, owner))  # per slice: merge_order's order
    bounds = np.searchsorted(owner[perm], np.arange(len(runtimes) + 1))
    return _consume_events(runtimes, names, input_tables, inp[perm], local[perm], order[perm], sub[perm], bounds,
                           time.perf_counter() - t0)


def _run_each(runtimes: list[SliceRuntime], merged: pa.Table, bounds: np.ndarray, name: str,
              shared_s: float) -> dict[int, dict[int, pa.Table]]:
    """Each slice with rows runs its share of the admitted, merged rows (a zero-copy slice of
    them) alone: its own operator call, chain and numbering (``SliceRuntime.consume_merged``:
    the call, row isolation, dead letters and errors of a slice alone, in slice order). A
    vectorized operator that does not fuse slices runs so every epoch; ``shared_s``
    (admission, merge, a failed group call) is shared out equally."""
    ran = [i for i in range(len(runtimes)) if bounds[i + 1] > bounds[i]]
    results = {}
    for i in ran:
        rt = runtimes[i]
        t1 = time.perf_counter()
        results[rt.slice_id] = rt.consume_merged(name, merged.slice(int(bounds[i]), int(bounds[i + 1] - bounds[i])))
        rt.busy_s += time.perf_counter() - t1 + shared_s / len(ran)
    return {s: out for s, out in results.items() if out}


def _chained(runtimes: list[SliceRuntime], chain: tuple, table: pa.Table,
             bounds: np.ndarray) -> tuple[pa.Table, np.ndarray]:
    """A produced stream's stateless chain, run once over every slice's output (``bounds``
    per slice), with each row's owner carried through; returns the rows and new bounds.

    Transforms are row-wise, so this is each slice's chain run alone, rows in the same
    order; a failing row is that slice's error or dead letter (``SliceRuntime._chain_error``).
    """
    if not chain:
        return table, bounds
    owner = np.repeat(np.arange(len(runtimes), dtype=np.int64), np.diff(bounds))

    def owners_error(t: pa.Table, i: int, exc: BaseException) -> None:
        runtimes[int(t.column(GROUP_OWNER)[i].as_py())]._chain_error(t, i, exc)

    out = apply_chain(table.append_column(GROUP_OWNER, pa.array(owner)), chain, owners_error, carry=(GROUP_OWNER,))
    # Every step keeps its rows in their parents' order (flat_map_batches' parent order is
    # checked), so the rows are still grouped by owner: no sort.
    owner = np.asarray(out.column(GROUP_OWNER))
    return out.drop_columns([GROUP_OWNER]), np.searchsorted(owner, np.arange(len(runtimes) + 1))


def _number(runtimes: list[SliceRuntime], sid: int, table: pa.Table, out_bounds: np.ndarray,
            results: dict[int, dict[int, pa.Table]]) -> None:
    counts = np.diff(out_bounds)
    first = np.array([rt.next_seq[sid] for rt in runtimes], dtype=np.int64)
    n = table.num_rows
    seq = np.arange(n, dtype=np.int64) + np.repeat(first - out_bounds[:-1], counts)
    ids = np.repeat(np.array([rt.slice_id for rt in runtimes], dtype=np.int64), counts)
    table = table.append_column(SLICE, pa.array(ids)).append_column(SEQ, pa.array(seq))
    for rt, lo, c in zip(runtimes, out_bounds.tolist(), counts.tolist()):  # (Python ints: 64 slices an epoch)
        if c:
            results.setdefault(rt.slice_id, {})[sid] = table.slice(lo, c)
            rt.next_seq[sid] += c
            rt.events_out += c
