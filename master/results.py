"""Reading a memory sink back: which sink a name means, and one table of its parts.

Owns: resolving a sink name (a query's sink or the job's dead-letter sink)
to the id its writers use, and assembling the (slice, epoch) parts that
the master holds (handed over at checkpoints) and the live containers hold
into the table ``job.results`` returns. Both drivers (``master.local`` in
process, ``master.actor`` on Ray) gather the parts their own way and call
these. Knows no Ray and does not read Parquet sinks (``chronostream.slices.sinks``).

>>> parts = {(1, 0): pa.table({"_slice": [1], "_seq": [0]}), (0, 0): pa.table({"_slice": [0], "_seq": [0]})}
>>> sink_table({0: parts}, []).column("_slice").to_pylist()
[0, 1]
>>> sink_table({0: {}}, []).num_rows
0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from chronostream.slices.plan import JobPlan
from chronostream.slices.sinks import dead_letter_table, sort_output
from chronostream.containers.core import SinkParts, dead_letter_sink_id, is_dead_letter_sink_id
from chronostream.containers.sink_parts import PackedSinkParts, add_sink_parts


@dataclass(frozen=True)
class SinkPartRefs:
    """Where a memory sink's parts are (``JobMaster.sink_part_refs``): the ids they travel under
    (``memory_sink_ids``), object references of ``PackedSinkParts`` in the order a part held
    twice keeps its later copy, and the source rows that broke the declared schema (the dead
    letters' first rows)."""

    ids: list[int]
    refs: list[Any]
    source_dead_letters: list[dict]


def packed_sink_table(ids: list[int], packs: list[PackedSinkParts], source_dead_letters: list[dict]) -> pa.Table:
    """``sink_table`` of packed parts (a part in two packs: the later one's): one contiguous
    table. Its buffers are a copy of the packs' (which may live in Ray's object store), except
    for a sink of one part, whose rows need neither joining nor sorting and are kept as they are.

    >>> from chronostream.containers.sink_parts import pack_sink_parts
    >>> a = pack_sink_parts({0: {(1, 0): pa.table({"_slice": [1], "_seq": [0]})}})
    >>> b = pack_sink_parts({0: {(0, 0): pa.table({"_slice": [0], "_seq": [0]})}})
    >>> t = packed_sink_table([0], [a, b], [])
    >>> t.column("_slice").to_pylist(), t.column("_slice").num_chunks
    ([0, 1], 1)
    """
    parts: dict[int, SinkParts] = {i: {} for i in ids}
    for pack in packs:
        add_sink_parts(parts, pack.unpack())
    return sink_table(parts, source_dead_letters)


def memory_sink_ids(plan: JobPlan, sink_name: str) -> list[int]:
    """The ids a sink's parts travel under: a query sink's id, or for the dead-letter sink one
    per stage (``dead_letter_sink_id``). A name that is neither raises ``KeyError`` listing the
    sinks there are."""
    dead = plan.dead_letter_sink
    if dead is not None and dead.name == sink_name:
        return [dead_letter_sink_id(st.stage_id) for st in plan.stages]
    sink = next((s for s in plan.sinks if s.name == sink_name), None)
    if sink is None:
        names = [s.name for s in plan.sinks] + ([dead.name] if dead is not None else [])
        raise KeyError(f"no sink named {sink_name!r}; sinks: {names}")
    return [sink.sink_id]


def sink_table(parts: dict[int, SinkParts], source_dead_letters: list[dict]) -> pa.Table:
    """One table of a sink's parts (by the ids ``memory_sink_ids`` gave): rows sorted by
    identity (producer slice, out_seq), or, for the dead letters, ``dead_letter_table``'s order
    (the source's first). A part held twice (a migrated slice's, by its source and its
    destination) is the same rows: ``parts`` keys it once. One contiguous table (one chunk, not
    one per part: a 64-slice job's sink has thousands of parts); a single part already in order
    is returned without a copy."""
    tables = [t for sink_id in sorted(parts) for _, t in sorted(parts[sink_id].items()) if t.num_rows]
    if any(is_dead_letter_sink_id(i) for i in parts):
        table = dead_letter_table(tables, source_dead_letters)
    elif not tables:
        return pa.table({})
    else:
        table = sort_output(pa.concat_tables(tables, promote_options="permissive"))
    return table.combine_chunks() if table.num_columns else table
