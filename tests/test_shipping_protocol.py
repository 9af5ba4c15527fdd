"""The checkpoint shipping machine (``containers.shipping``): a round ships only after its awaits
settled and its rows reached the master, rounds end in order, refusals make the next checkpoint
full, and the invariants raise on a driver that breaks the protocol. The drivers are exercised by
the simulator (``LocalCluster``) and the Ray tier."""

from __future__ import annotations

import random

import pytest

from chronostream.containers.shipping import (ForceFull, PartsFailed, PartsStored, PeerFailed, PeerShipped,
                                              RoundEnded, RoundTaken, Settled, Ship, ShippingProtocol, StoreRows)


def test_a_round_waits_for_the_one_before_it_even_when_its_own_awaits_settle_first():
    p = ShippingProtocol(0)
    p.handle(RoundTaken(1, awaits=frozenset({"a"}), peers=(5,)))
    p.handle(RoundTaken(2, awaits=frozenset({"b"}), peers=(5,)))
    assert p.handle(Settled("b")) == []  # round 1 still waits for "a"
    assert p.handle(Settled("a")) == [Ship(0, 5)]
    assert p.handle(PeerShipped(0, 5)) == [RoundEnded(0, True), Ship(1, 5)]
    assert p.handle(PeerShipped(1, 5)) == [RoundEnded(1, True)]
    assert p.idle


def test_rows_reach_the_master_before_any_frame_ships_and_a_failed_store_ships_nothing():
    p = ShippingProtocol(0)
    assert p.handle(RoundTaken(1, rows=True, peers=(5, 6), slices=(0, 1))) == [StoreRows(0)]
    assert p.handle(RoundTaken(2, rows=True, peers=(5,), slices=(0, 1))) == []
    # The rows of round 0 did not reach the master: its frames never leave, round 1 goes on.
    assert p.handle(PartsFailed(0, "master gone")) == [RoundEnded(0, False), StoreRows(1)]
    assert p.handle(PartsStored(1)) == [Ship(1, 5)]
    assert "rows not stored" in p.timeline()


def test_a_refused_delta_or_a_failed_peer_makes_the_next_checkpoint_full_and_a_dead_peer_does_not():
    p = ShippingProtocol(0)
    p.handle(RoundTaken(1, peers=(5, 6, 7), slices=(2, 3)))
    assert p.handle(PeerShipped(0, 5, refused=(3,))) == [ForceFull((3,))]
    assert p.handle(PeerFailed(0, 6, dead=True)) == []
    assert p.handle(PeerFailed(0, 7, dead=False, error="too large")) == [ForceFull((2, 3)), RoundEnded(0, True)]


def test_a_driver_breaking_the_protocol_trips_an_invariant():
    p = ShippingProtocol(0)
    p.handle(RoundTaken(1, rows=True, peers=(5,)))
    with pytest.raises(AssertionError):
        p.handle(PeerShipped(0, 5))  # (its rows are not stored yet)
    p = ShippingProtocol(0)
    p.handle(RoundTaken(1, peers=(5,)))
    p.handle(RoundTaken(2, peers=(6,)))
    with pytest.raises(AssertionError):
        p.handle(PeerShipped(1, 6))  # (round 1 never started: round 0 is open)
    p = ShippingProtocol(0)
    p.handle(RoundTaken(1, peers=(5, 6)))
    p.handle(PeerShipped(0, 5))
    with pytest.raises(AssertionError):
        p.handle(PeerShipped(0, 5))  # (answered twice)


@pytest.mark.parametrize("seed", range(40))
def test_any_order_of_answers_keeps_the_shipping_rule(seed):
    """Random rounds, awaits settled and answers given in random order: every Ship of a round
    comes after its awaits settled, its rows were stored and every earlier round ended; rounds
    end in order, each once; everything taken ends."""
    rng = random.Random(seed)
    p = ShippingProtocol(0)
    pending: list = []  # events the "driver" may deliver next
    settled: set = set()
    stored: set[int] = set()
    ended: list[int] = []
    awaits: dict[int, set] = {}
    taken = 0
    token = 0

    def run(commands):
        for c in commands:
            if isinstance(c, StoreRows):
                assert awaits[c.round] <= settled and ended == list(range(c.round))
                pending.append(rng.choice([PartsStored(c.round), PartsStored(c.round), PartsFailed(c.round, "x")]))
            elif isinstance(c, Ship):
                assert awaits[c.round] <= settled and ended == list(range(c.round))
                assert c.round in stored or not rows[c.round]
                pending.append(rng.choice([PeerShipped(c.round, c.peer), PeerShipped(c.round, c.peer, (1,)),
                                           PeerFailed(c.round, c.peer, rng.random() < 0.5)]))
            elif isinstance(c, RoundEnded):
                ended.append(c.round)

    rows: dict[int, bool] = {}
    while taken < 12 or pending:
        if taken < 12 and rng.random() < 0.4:
            mine = {token + i for i in range(rng.randrange(3))}
            token += len(mine)
            awaits[taken], rows[taken] = mine, rng.random() < 0.5
            pending += [Settled(t) for t in mine]
            run(p.handle(RoundTaken(taken, frozenset(mine), rows[taken], tuple(rng.sample(range(4), rng.randrange(3))),
                                    (0, 1))))
            taken += 1
            continue
        if not pending:
            continue
        event = pending.pop(rng.randrange(len(pending)))
        if isinstance(event, Settled):
            settled.add(event.token)
        if isinstance(event, PartsStored):
            stored.add(event.round)
        run(p.handle(event))
    assert ended == list(range(12)) and p.idle
