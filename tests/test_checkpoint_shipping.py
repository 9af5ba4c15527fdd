"""A container's checkpoint shipments go out in order, and one that fails does not stop the next.

Unit test of ``ResourceContainer._ship_checkpoint`` / ``_ship_in_order`` (containers/actor.py)
on the plain class behind the Ray actor, with stand-ins for its peers and its core.
"""

from __future__ import annotations

import asyncio
import types

from chronostream.containers.actor import ResourceContainer

Plain = ResourceContainer.__ray_metadata__.modified_class


class Checkpointer:
    def __init__(self) -> None:
        self.unshipped = 0
        self.forced: list[int] = []

    def force_full(self, slices) -> None:
        self.forced += list(slices)


def host(fail_peer_once: int | None):
    """A stand-in host whose ``_send_backups`` raises once for ``fail_peer_once``."""
    sent: list[tuple[int, list[bytes]]] = []
    failed: set[int] = set()
    core = types.SimpleNamespace(checkpointer=Checkpointer())

    async def send_backups(actor, blobs):
        if actor == fail_peer_once and actor not in failed:
            failed.add(actor)
            raise ValueError(f"piece of a frame refused by host {actor}")
        sent.append((actor, list(blobs)))
        return []

    h = types.SimpleNamespace(host_id=1, cores={0: core}, hosts={2: 2, 3: 3}, sent=sent,
                              _send_backups=send_backups)
    h._ship_in_order = types.MethodType(Plain._ship_in_order, h)
    h._ship_checkpoint = types.MethodType(Plain._ship_checkpoint, h)
    return h, core


def ship_rounds(h, core, rounds: list[dict[int, list[bytes]]]) -> None:
    async def go():
        previous = None
        for backups in rounds:
            core.checkpointer.unshipped += 1
            previous = asyncio.get_running_loop().create_task(h._ship_checkpoint(0, previous, [], {}, backups))
        await previous
    asyncio.run(go())


def test_a_failed_shipment_does_not_stop_the_containers_later_ones():
    h, core = host(fail_peer_once=2)
    ship_rounds(h, core, [{2: [b"d1"]}, {2: [b"d2"]}, {2: [b"d3"]}])
    assert h.sent == [(2, [b"d2"]), (2, [b"d3"])]  # in order, after the one that failed
    assert core.checkpointer.unshipped == 0


def test_one_peers_failure_does_not_stop_the_same_rounds_other_peers():
    h, core = host(fail_peer_once=2)
    ship_rounds(h, core, [{2: [b"a"], 3: [b"a"]}])
    assert h.sent == [(3, [b"a"])]


def host_with_sink(master_stores: bool):
    """A stand-in host holding one container with a memory sink (id 7) whose parts up to epoch 1
    were taken for the master; the master stand-in stores them or dies while storing them."""
    import pyarrow as pa

    from chronostream.slices.sinks import MemorySink
    from chronostream.containers.core import ContainerCore

    writer = MemorySink("s").writer("c0")
    for epoch in (1, 2):
        writer.write(epoch, 0, pa.table({"x": [epoch]}))
    core = types.SimpleNamespace(checkpointer=None, _all_writers=lambda: {7: writer})
    core.drop_handed_sink_parts = types.MethodType(ContainerCore.drop_handed_sink_parts, core)

    async def store(packed):
        if not master_stores:
            raise ConnectionError("the master died while storing the parts")

    master = types.SimpleNamespace(store_sink_parts=types.SimpleNamespace(remote=store))
    h = types.SimpleNamespace(host_id=1, cores={0: core}, hosts={}, master=master)
    for name in ("_ship_in_order", "_ship_checkpoint", "_drop_handed_sink_parts"):
        setattr(h, name, types.MethodType(getattr(Plain, name), h))
    asyncio.run(h._ship_checkpoint(0, None, [], {7: writer.take_parts(1)}, {}))
    return writer


def test_sink_parts_the_master_stored_are_let_go_by_their_host():
    writer = host_with_sink(master_stores=True)
    assert sorted(writer.parts) == [(0, 2)]  # epoch 2 was not handed over yet


def test_sink_parts_the_master_failed_to_store_stay_with_their_host():
    writer = host_with_sink(master_stores=False)
    assert sorted(writer.parts) == [(0, 1), (0, 2)]
