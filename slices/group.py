"""Owns running one epoch of many slices of one stage in one vectorized pass (a slice group).

A container with 64 slices of a stage would otherwise pay every per-slice
step 64 times an epoch: the merge sort, the operator call, the numbering,
each a handful of Arrow and numpy calls whatever the slice's share of the
rows (paper Fig. 21; ``benchmarks.slices``). When the stage's operator can
take many slices' batches in one call (``Operator.fuses_slices``), the group
does those steps once for the container:

1. admit, per slice (each slice's progress vector drops what it consumed);
2. merge, once: the admitted rows of every slice sorted by (slice, merge
   key) -- per slice exactly the order ``SliceRuntime`` gives it alone;
3. one ``consume_slices`` call, each slice's operator owning its rows;
4. number, once: ``_slice``/``out_seq`` per row from each slice's counter;
   each slice's output is a zero-copy slice of the one table.

Results equal running each slice alone, row for row: slices stay the units
of state, checkpoints and migration. A group epoch that raises (a poison
row) is rerun slice by slice from the admitted rows, where the row-by-row
isolation and dead letters live. Knows no Ray and no container.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pyarrow as pa

from chronostream.dag import JobPlan, StagePlan
from chronostream.types import ORDER, SEQ, SLICE, SUB
from slices.slice import SliceRuntime

log = logging.getLogger("chronostream.slices")


def fuses(stage: StagePlan, plan: JobPlan) -> bool:
    """Whether a stage's slices can run as one group: a fusing operator with one input,
    and produced streams without stateless chains (those run per slice)."""
    if stage.kind != "operator" or len(stage.inputs) != 1:
        return False
    cls = stage.factory[0]  # type: ignore[index]
    if not cls.fuses_slices():
        return False
    return all(not plan.streams[sid].chain for sid in stage.produced)


def reads_key_codes(stage: StagePlan) -> bool:
    """Whether a stage's operator groups its one input by the stream key and reuses routing's
    dictionary codes of it (``Operator.reads_key_codes``; see ``containers.routing.route``)."""
    if stage.kind != "operator" or len(stage.inputs) != 1:
        return False
    return bool(stage.factory[0].reads_key_codes())  # type: ignore[index]


def grouped_merge_order(owner: np.ndarray, order: np.ndarray, sub: np.ndarray,
                        producer: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Permutation sorting rows by owning slice, then each slice's merge order (one input).

    >>> grouped_merge_order(np.array([1, 0, 0]), np.array([0, 5, 2]), np.zeros(3, int),
    ...                     np.zeros(3, int), np.arange(3)).tolist()
    [2, 1, 0]
    """
    # Same fast path as merge_order: stable sorts keep arrival order among equal
    # (slice, order), which is the full order unless a run mixes producers or
    # goes back in sub-order. Rows usually arrive grouped by slice, each slice's
    # in source order (one producer): then there is nothing to sort.
    if len(owner) > 1 and bool(np.all((owner[1:] > owner[:-1])
                                      | ((owner[1:] == owner[:-1]) & (order[1:] >= order[:-1])))):
        perm = np.arange(len(owner))
    else:
        perm = np.lexsort((order, owner))
    if len(perm) > 1:
        w, o, p, s = owner[perm], order[perm], producer[perm], sub[perm]
        same = (w[1:] == w[:-1]) & (o[1:] == o[:-1])
        if not np.any(same & ((p[1:] != p[:-1]) | (s[1:] < s[:-1]))):
            return perm
    return np.lexsort((seq, producer, sub, order, owner))


def process_group(runtimes: list[SliceRuntime], epoch: int,
                  inputs: dict[int, dict[int, list[pa.Table]]]) -> dict[int, dict[int, pa.Table]]:
    """One epoch of the slices in ``inputs``, in one pass over the group ``runtimes``.

    ``runtimes``: every local slice of the stage, in slice order (the same list
    epoch after epoch, so an operator can keep group-wide lookups between calls);
    ``inputs`` maps the slices to run to their input tables by stream id (as for
    ``SliceRuntime.process``); the others sit the epoch out. Returns numbered
    outputs by slice, then stream id.
    """
    t0 = time.perf_counter()
    admitted: dict[int, dict[int, list[pa.Table]]] = {}
    for rt in runtimes:
        if rt.slice_id in inputs:
            rt._begin(epoch)
            admitted[rt.slice_id] = rt._admit(inputs[rt.slice_id])
    tables: list[pa.Table] = []
    owners: list[int] = []
    rows_of: list[int] = []
    for i, rt in enumerate(runtimes):
        for ts in admitted.get(rt.slice_id, {}).values():  # one input stream
            for t in ts:
                tables.append(t)
                owners.append(i)
                rows_of.append(t.num_rows)
    if not tables:
        return {}
    combined = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    owner = np.repeat(np.asarray(owners, dtype=np.int64), rows_of)
    cols = {k: np.asarray(combined.column(k)) for k in (ORDER, SUB, SLICE, SEQ)}
    perm = grouped_merge_order(owner, cols[ORDER], cols[SUB], cols[SLICE], cols[SEQ])
    identity = bool(np.all(perm == np.arange(len(perm))))
    batch = (combined if identity else combined.take(pa.array(perm))).drop_columns([SLICE, SEQ])
    bounds = np.searchsorted(owner[perm], np.arange(len(runtimes) + 1))
    stage = runtimes[0].stage
    name = stage.inputs[0].name
    runtimes_by_id = {rt.slice_id: rt for rt in runtimes}
    try:
        outputs = type(runtimes[0].op).consume_slices([rt.op for rt in runtimes], name, batch, bounds)
    except Exception as exc:  # noqa: BLE001 - rerun per slice: row-by-row isolation, dead letters
        log.info("stage %s epoch %s: group call failed (%s: %s); slices %s run one by one",
                 stage.name, epoch, type(exc).__name__, exc, sorted(admitted))
        failed_s = time.perf_counter() - t0  # the failed call's time, shared among the slices
        rerun = {}
        for s, adm in admitted.items():
            t1 = time.perf_counter()
            rerun[s] = runtimes_by_id[s]._emit(runtimes_by_id[s]._run(adm))
            runtimes_by_id[s].busy_s += time.perf_counter() - t1 + failed_s / len(admitted)
        return {s: out for s, out in rerun.items() if out}
    results: dict[int, dict[int, pa.Table]] = {}
    for sid in stage.produced:
        produced = outputs.get(runtimes[0].plan.streams[sid].output)
        if produced is None or produced[0].num_rows == 0:
            continue
        _number(runtimes, sid, produced[0], np.asarray(produced[1]), results)
    # Busy time and counts per slice: its share of the group's rows.
    elapsed = time.perf_counter() - t0
    total = max(int(bounds[-1]), 1)
    for i, rt in enumerate(runtimes):
        n_in = int(bounds[i + 1] - bounds[i])
        if n_in:
            rt.events_in += n_in
            rt.busy_s += elapsed * n_in / total
    return results


def _number(runtimes: list[SliceRuntime], sid: int, table: pa.Table, out_bounds: np.ndarray,
            results: dict[int, dict[int, pa.Table]]) -> None:
    counts = np.diff(out_bounds)
    first = np.array([rt.next_seq[sid] for rt in runtimes], dtype=np.int64)
    n = table.num_rows
    seq = np.arange(n, dtype=np.int64) + np.repeat(first - out_bounds[:-1], counts)
    ids = np.repeat(np.array([rt.slice_id for rt in runtimes], dtype=np.int64), counts)
    table = table.append_column(SLICE, pa.array(ids)).append_column(SEQ, pa.array(seq))
    for i, rt in enumerate(runtimes):
        c = int(counts[i])
        if c:
            results.setdefault(rt.slice_id, {})[sid] = table.slice(int(out_bounds[i]), c)
            rt.next_seq[sid] += c
            rt.events_out += c
