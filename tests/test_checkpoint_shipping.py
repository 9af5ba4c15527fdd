"""A container's checkpoint shipments on Ray go out in order, after their pushes and their rows, and
one that fails does not stop the next.

Unit test of ``CheckpointShipping`` (containers/ray_shipping.py), the Ray driver of the shipping
machine (``containers.shipping``), with stand-ins for its host, peers, pushes and core.
"""

from __future__ import annotations

import asyncio
import types

import pyarrow as pa

from chronostream.containers.core import ContainerCore
from chronostream.containers.ray_shipping import CheckpointShipping
from chronostream.slices.sinks import MemorySink


class Checkpointer:
    def __init__(self) -> None:
        self.unshipped = 0
        self.forced: list[int] = []

    def force_full(self, slices) -> None:
        self.forced += list(slices)


def host(fail_peer_once: int | None = None, acks: dict | None = None, master=None):
    """A stand-in host whose shipments' ``send_backups`` raises once for ``fail_peer_once``; a push
    ``ref`` is acknowledged when ``acks[ref]`` (an asyncio.Event) is set."""
    sent: list[tuple[int, list[bytes]]] = []
    failed: set[int] = set()
    core = types.SimpleNamespace(checkpointer=Checkpointer(), slices={0: None, 1: None})

    async def send_backups(actor, blobs):
        if actor == fail_peer_once and actor not in failed:
            failed.add(actor)
            raise ValueError(f"piece of a frame refused by host {actor}")
        sent.append((actor, list(blobs)))
        return []

    async def acknowledged(dst, ref):
        await acks[ref].wait()

    h = types.SimpleNamespace(host_id=1, cores={0: core}, hosts={2: 2, 3: 3}, sent=sent, master=master,
                              pushes=types.SimpleNamespace(acknowledged=acknowledged))
    h.shipping = CheckpointShipping(h)
    h.shipping.send_backups = send_backups
    return h, core


def test_a_failed_shipment_does_not_stop_the_containers_later_ones():
    h, core = host(fail_peer_once=2)

    async def go():
        for i in (1, 2, 3):
            h.shipping.take_round(0, i, [], {}, {2: [b"d%d" % i]})
        assert core.checkpointer.unshipped == 3
        await h.shipping.drained(0)
    asyncio.run(go())
    assert h.sent == [(2, [b"d2"]), (2, [b"d3"])]  # in order, after the one that failed
    assert core.checkpointer.unshipped == 0
    assert core.checkpointer.forced == [0, 1]  # (the peer missed a delta: the next one is full)


def test_one_peers_failure_does_not_stop_the_same_rounds_other_peers():
    h, core = host(fail_peer_once=2)

    async def go():
        h.shipping.take_round(0, 1, [], {}, {2: [b"a"], 3: [b"a"]})
        await h.shipping.drained(0)
    asyncio.run(go())
    assert h.sent == [(3, [b"a"])]


def test_a_round_waits_for_the_pushes_of_its_epochs():
    acks = {"e1": asyncio.Event(), "e2": asyncio.Event()}
    h, core = host(acks=acks)

    async def go():
        h.shipping.take_round(0, 2, [(7, "e1"), (7, "e2")], {}, {2: [b"c2"]})
        await asyncio.sleep(0.01)
        assert h.sent == []  # (no push acknowledged yet)
        acks["e2"].set()
        await asyncio.sleep(0.01)
        assert h.sent == []  # (e1 still out)
        acks["e1"].set()
        await h.shipping.drained(0)
    asyncio.run(go())
    assert h.sent == [(2, [b"c2"])]


def host_with_sink(master_stores: bool):
    """A stand-in host holding one container with a memory sink (id 7) whose parts up to epoch 1
    were taken for the master, with a checkpoint frame for peer 2; the master stand-in stores them
    or dies while storing them."""
    writer = MemorySink("s").writer("c0")
    for epoch in (1, 2):
        writer.write(epoch, 0, pa.table({"x": [epoch]}))

    async def store(packed):
        if not master_stores:
            raise ConnectionError("the master died while storing the parts")

    master = types.SimpleNamespace(store_sink_parts=types.SimpleNamespace(remote=store))
    h, _ = host(master=master)
    core = types.SimpleNamespace(checkpointer=None, slices={0: None}, _all_writers=lambda: {7: writer})
    core.drop_handed_sink_parts = types.MethodType(ContainerCore.drop_handed_sink_parts, core)
    h.cores = {0: core}

    async def go():
        h.shipping.take_round(0, 1, [], {7: writer.take_parts(1)}, {2: [b"c1"]})
        await h.shipping.drained(0)
    asyncio.run(go())
    return writer, h


def test_sink_parts_the_master_stored_are_let_go_by_their_host_and_then_the_checkpoint_ships():
    writer, h = host_with_sink(master_stores=True)
    assert sorted(writer.parts) == [(0, 2)]  # epoch 2 was not handed over yet
    assert h.sent == [(2, [b"c1"])]


def test_sink_parts_the_master_failed_to_store_stay_with_their_host_and_the_checkpoint_stays_too():
    writer, h = host_with_sink(master_stores=False)
    assert sorted(writer.parts) == [(0, 1), (0, 2)]
    assert h.sent == []  # (a checkpoint must not leave before the rows it covers reached the master)
