"""Seeded fault campaigns over the query shapes the running-sum and re-key campaigns leave out.

Method: a keyed two-input join (per-event slices run as groups, two sources
interleaved in event time) and the windows of ``test_hot_limits`` (sliding,
and tumbling closed by each slice's clock; with and without a hot limit, so
cold entries spill) run on Ray with 4 hosts for the stateful stage, a
checkpoint every 2 epochs, and a seeded schedule of faults of every kind but
``delay`` (kills, double kills, kills in a recovery, master deaths, damaged
and truncated backups, dead spares, scale-out/in, migrations, compactions).
Every sink must equal the serial executor's, row for row. One join run is
part of ``make test``; the rest are opt-in (``pytest -m campaign``).
"""

from __future__ import annotations

import pytest

import chronostream as cs
from campaigns import seeded_campaign
from chronostream.chaos import KINDS
from chronostream.datasets import payments
from queries import orders_and_customers
from test_hot_limits import WINDOWS

#: Every fault kind; ``delay`` is the campaign's own pacing of the source.
EVERY_FAULT = tuple(k for k in KINDS if k != "delay")
#: The source's pace while the faults land, and while each one settles (``run_with_faults``).
SOURCE_DELAY_S, SETTLE_PACE_S = 0.15, 0.5


def join_query() -> cs.Query:
    """6,000 orders x 500 customer updates on ``cust``, 8 slices, epochs of 101 events (about 64)."""
    orders, cust = orders_and_customers(n_orders=6000, n_customers=500)
    q = cs.Query(epoch_events=101)
    o = q.source("orders", orders, order_by="t").key_by("cust")
    c = q.source("customers", cust, order_by="t").key_by("cust")
    cs.join(o, c, slices=8, name="join").sink(name="joined")
    return q


def window_query(kind: str, hot_entries: int | None) -> cs.Query:
    """7,000 payments of 500 mostly idle cards through window ``kind`` in 8 slices (about 58 epochs)."""
    q = cs.Query(epoch_events=120)
    pay = q.source("payments", payments(7_000, cards=500, merchants=40, s=0.4, seed=13), order_by="ts")
    pay.key_by("card").window(**WINDOWS[kind], hot_entries=hot_entries, slices=8, name="w").sink(name="w")
    return q


def shape_campaign(query: cs.Query, containers: dict[str, int], stage: str, seed: int, n: int = 5) -> None:
    """``n`` seeded faults on ``stage`` (4 hosts in ``containers``) over ``query``, its first source
    paced; every sink equals the serial run and every fault landed."""
    seeded_campaign(query, containers, [stage], seed, n, 50, EVERY_FAULT, source_delay_s=SOURCE_DELAY_S,
                    settle_pace_s=SETTLE_PACE_S)


#: One host a source, 4 for the stateful stage.
JOIN_HOSTS = {"orders": 1, "customers": 1, "join": 4}
WINDOW_HOSTS = {"payments": 1, "w": 4}


def test_a_keyed_join_through_faults_and_rescaling_ends_with_exact_output(ray_session):
    """Seed 1201: a truncated backup and a kill of its slice's host (the other replica restored),
    a scale-in, a migration, a master death in a recovery and a master death, on the join's 4 hosts."""
    shape_campaign(join_query(), JOIN_HOSTS, "join", 1201)


@pytest.mark.extended
@pytest.mark.parametrize("seed", range(1200, 1210))
def test_large_seeded_campaign_over_a_keyed_join(ray_session, seed):
    """Opt-in (``pytest -m campaign``): 10 runs x 5 faults of every kind over the join."""
    shape_campaign(join_query(), JOIN_HOSTS, "join", seed)


@pytest.mark.extended
@pytest.mark.parametrize("kind", list(WINDOWS))
@pytest.mark.parametrize("hot_entries", [None, 10])
@pytest.mark.parametrize("seed", range(1300, 1303))
def test_large_seeded_campaign_over_windows(ray_session, seed, hot_entries, kind):
    """Opt-in (``pytest -m campaign``): 12 runs x 5 faults of every kind over a window stage."""
    shape_campaign(window_query(kind, hot_entries), WINDOW_HOSTS, "w", seed)
