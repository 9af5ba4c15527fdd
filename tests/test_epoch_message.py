"""Specification of the epoch message (containers/epoch_message.py).

Unit: the control fields survive pickling (as Ray ships a push) and the
shared-memory pack/unpack round trip beside the parts; a message with only
``end`` carries no parts; ``rows``/``nbytes`` sum the parts. With real cores
in this process over a followed source log: messages carry no ``end``
while the log is open; once it is sealed after its last epoch ran, the end
notice is an ``end``-only message that tells the receiver the end and leaves
its inbox empty.
"""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import ray.cloudpickle

import chronostream as cs
from chronostream.containers.epoch_message import EpochMessage
from chronostream.containers.shm_transport import ShmPart, ShmSender, unpack
from chronostream.dag import compile_query
from chronostream.master.local import build_cores
from chronostream.master.placement import containers_per_stage, initial_placement
from chronostream.slices.sourcelog import SourceLogWriter
from test_sourcelog import rows as log_rows


def part(n: int) -> tuple[pa.Table, np.ndarray]:
    """A routed part of ``n`` rows for a 4-slice consumer (slices sorted, as ``route`` makes them)."""
    table = pa.table({"w": [f"w{i}" for i in range(n)], "_seq": np.arange(n)})
    return table, np.sort(np.arange(n) % 4).astype(np.int64)


def control_fields(m: EpochMessage) -> tuple:
    return m.end, m.coverage, m.release, m.ingest


def full_message() -> EpochMessage:
    return EpochMessage({0: part(20_000), 2: part(3)}, end=9, coverage=frozenset({(1, 0), (1, 3)}),
                        release=(2, 5), ingest=1_700_000_000.25)


def test_control_fields_and_parts_survive_pickling_as_ray_ships_them():
    message = full_message()
    for dumps, loads in ((lambda m: pickle.dumps(m, protocol=5), pickle.loads),
                         (ray.cloudpickle.dumps, ray.cloudpickle.loads)):
        back = loads(dumps(message))
        assert type(back) is EpochMessage
        assert control_fields(back) == (9, frozenset({(1, 0), (1, 3)}), (2, 5), 1_700_000_000.25)
        assert sorted(back.parts) == [0, 2]
        for sid, (table, dst) in message.parts.items():
            assert back.parts[sid][0].equals(table) and np.array_equal(back.parts[sid][1], dst)


def test_control_fields_survive_the_shared_memory_round_trip(tmp_path):
    """The wire form swaps the large part for a file and keeps every control field; the read-back
    message has the same fields and the same parts (the small part travels inline)."""
    message = full_message()
    wire, paths = ShmSender("job", 1, str(tmp_path), min_bytes=1024, reserve_fraction=0.0).pack(message)
    assert len(paths) == 1 and isinstance(wire.parts[0], ShmPart) and wire.parts[2] is message.parts[2]
    assert control_fields(wire) == control_fields(message)
    assert not isinstance(message.parts[0], ShmPart), "packing leaves the sender's message as it was"
    back = unpack(pickle.loads(pickle.dumps(wire, protocol=5)))
    assert control_fields(back) == control_fields(message)
    assert back.parts[0][0].equals(message.parts[0][0]) and np.array_equal(back.parts[0][1], message.parts[0][1])
    assert back.rows() == message.rows() == 20_003


def test_a_message_with_only_end_carries_no_parts():
    notice = EpochMessage(end=4)
    assert notice.parts == {} and notice.rows() == 0 and notice.nbytes() == 0
    assert (notice.coverage, notice.release, notice.ingest) == (None, None, None)
    assert EpochMessage().parts is not notice.parts, "each message has its own parts"
    assert pickle.loads(pickle.dumps(notice)).parts == {}


def test_rows_and_nbytes_sum_the_parts_tables():
    a, b = part(10), part(7)
    m = EpochMessage({0: a, 1: b})
    assert m.rows() == 17
    assert m.nbytes() == a[0].nbytes + b[0].nbytes


def test_a_sealed_followed_log_ends_downstream_through_an_end_only_message(tmp_path):
    """Two full epochs run while the log is open: their messages carry parts and an ingest time,
    no end. The log is sealed after them: the source is done without another epoch, and its
    end notice (epoch 1, ``end`` = 2, no parts) makes the receiver learn the end; the receiver
    drops the message itself and its inbox keeps only the two epochs it has yet to run."""
    writer = SourceLogWriter(tmp_path)
    writer.append({"s": log_rows(0, 0, 128)}, high_water=128)  # two full epochs of 64
    q = cs.Query(epoch_events=64)
    q.source_log(str(tmp_path), "s", follow=True).key_by("k").sum("v", slices=3).sink(name="out")
    plan, sources = compile_query(q)
    assert plan.num_epochs is None
    placement = initial_placement(plan, containers_per_stage(plan, 1))
    cores = build_cores(plan, placement, sources)
    source_id, sum_id = placement.containers[0][0], placement.containers[1][0]
    source, total = cores[source_id], cores[sum_id]
    for epoch in range(2):
        source.poll_source()
        assert source.ready()
        message = source.step()[sum_id]
        assert message.end is None and message.ingest is not None and message.rows() == 64
        assert total.deliver(epoch, source_id, message)
    assert source.take_end_notice() is None, "the log is open: no end to tell"
    writer.seal()
    source.poll_source()
    assert not source.ready() and source.done and source.num_epochs == 2
    last_epoch, notices = source.take_end_notice()
    assert last_epoch == 1 and list(notices) == [sum_id]
    notice = notices[sum_id]
    assert notice.parts == {} and notice.end == 2
    assert source.take_end_notice() is None, "the notice goes out once"
    assert total.num_epochs is None
    assert total.deliver(last_epoch, source_id, notice) is False  # (an epoch it already has)
    assert total.num_epochs == 2 and sorted(total.inbox) == [0, 1]
    while total.ready():
        total.step()
    assert total.done and total.next_epoch == 2
