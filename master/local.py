"""An in-process driver for the container cores: same placement, routing and merge, no Ray.

Owns: running every ``ContainerCore`` of a job in this process, delivering
messages in a seeded random order (to show that the output does not depend
on delivery order). Used by unit and property tests and as a debug mode
(``cs.run(query, executor="local")``). The real runtime is ``master.actor``.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

from chronostream.dag import JobPlan
from containers.core import ContainerCore
from containers.output_log import OutputLog
from master.placement import Placement


def build_cores(plan: JobPlan, placement: Placement, sources: dict, workdir: str | None = None,
                with_log: bool = False) -> dict[int, ContainerCore]:
    """Create one core per container of ``placement``."""
    root = Path(workdir or tempfile.mkdtemp(prefix="chronostream-local-")) if with_log else Path(".")
    cores: dict[int, ContainerCore] = {}
    for stage_id, ids in placement.containers.items():
        for c in ids:
            writers = {s.sink_id: s.sink.writer(f"c{c}") for s in plan.sinks if plan.streams[s.stream_id].stage_id == stage_id}
            dl = plan.dead_letter_sink.writer(f"c{c}") if plan.dead_letter_sink is not None else None
            cores[c] = ContainerCore(plan, stage_id, c, placement.slices_of(c), placement.routes_for(plan, stage_id),
                                     placement.senders_for(plan, stage_id), source_table=sources.get(stage_id),
                                     output_log=OutputLog(root / f"container-{c}") if with_log else None,
                                     sink_writers=writers, dead_letter_writer=dl)
    return cores


def run_local(plan: JobPlan, placement: Placement, sources: dict, seed: int = 0,
              duplicate_every: int = 0, poll_s: float = 0.02, timeout_s: float = 600.0) -> dict[int, ContainerCore]:
    """Run the job to completion in this process; return the cores (their sinks hold the output).

    Messages are delivered in a seeded shuffled order; with ``duplicate_every``
    = k every k-th message is delivered twice (dedup must absorb it).
    """
    rng = random.Random(seed)
    cores = build_cores(plan, placement, sources)
    in_flight: list[tuple[int, int, int, dict]] = []  # (dst, epoch, sender, message)
    sent = 0
    deadline = time.monotonic() + timeout_s
    while not all(c.done for c in cores.values()):
        progressed = False
        for cid in sorted(cores):
            core = cores[cid]
            if core.ready():
                epoch = core.next_epoch
                for dst, msg in core.step().items():
                    in_flight.append((dst, epoch, cid, msg))
                progressed = True
        rng.shuffle(in_flight)
        while in_flight:
            dst, epoch, sender, msg = in_flight.pop()
            cores[dst].deliver(epoch, sender, msg)
            sent += 1
            if duplicate_every and sent % duplicate_every == 0:
                cores[dst].deliver(epoch, sender, msg)
            progressed = True
        if not progressed:
            sources = [c for c in cores.values() if c.reader is not None and not c.done]
            if not sources or time.monotonic() > deadline:
                raise RuntimeError("local run stalled: no container ready and nothing in flight")
            time.sleep(poll_s)  # a followed source log: wait for the writer
            for c in sources:
                c.poll_source()
    return cores


def collect(plan: JobPlan, cores: dict[int, ContainerCore], sink_name: str):
    """Concatenate a memory sink's rows over all cores, sorted by identity."""
    import pyarrow as pa

    from chronostream.sinks import sort_output

    sink = next((s for s in plan.sinks if s.name == sink_name), None)
    if sink is None:
        if plan.dead_letter_sink is not None and plan.dead_letter_sink.name == sink_name:
            tables = [c.dead_letter_writer.collect() for c in cores.values() if c.dead_letter_writer]
            tables = [t for t in tables if t is not None]
            if plan.source_dead_letters:
                tables.insert(0, pa.Table.from_pylist(plan.source_dead_letters))
            return pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({})
        raise KeyError(f"no sink named {sink_name!r}")
    tables = [c.sink_writers[sink.sink_id].collect() for c in cores.values() if sink.sink_id in c.sink_writers]
    tables = [t for t in tables if t is not None]
    if not tables:
        return pa.table({})
    return sort_output(pa.concat_tables(tables, promote_options="permissive"))
