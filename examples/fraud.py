"""Railgun-style fraud profiles: per card, sum and count of amounts over the last 5 minutes and 7 days, at every payment.

Railgun's queries (CIDR '21, Example 1), evaluated exactly at every event
with real sliding windows (``(t - size, t]``), the two windows sharing one
event queue per card:

    SELECT SUM(amount), COUNT(*) FROM payments GROUP BY card [RANGE 5 MINUTES]
    SELECT SUM(amount), COUNT(*) FROM payments GROUP BY card [RANGE 7 DAYS]

and the rule "more than 4 payments of a card in 5 minutes", evaluated two
ways: on the exact sliding window, and on 5-minute windows hopping by
1 minute (the approximation Railgun argues against). The payments are
``chronostream.datasets.payments``: seeded, Zipf-skewed cards (exponent
0.8 over 100,000 cards here), log-normal amounts, Poisson event times over
7 days, plus card-testing bursts (one per 200 payments).

    python -m examples.fraud                      # 200,000 payments, in-process runtime
    python -m examples.fraud --rows 20000 --executor serial
    python -m examples.fraud --executor ray --containers 2
"""

from __future__ import annotations

import argparse

import pyarrow.compute as pc

import chronostream as cs
from chronostream.datasets import payments
from examples.common import add_run_flags, run_timed

FIVE_MINUTES_S = 300
SEVEN_DAYS_S = 7 * 86_400
MAX_PAYMENTS_IN_5_MIN = 4


def fraud_query(rows: int, cards: int = 100_000, seed: int = 42, slices: int = 8, skew: float = 0.8) -> cs.Query:
    """Profiles per card at every payment (sink ``profiles``), and the 5-minute rule's alerts two ways.

    Sinks: ``profiles`` (card, ts, count_5m, sum_amount_5m, count_7d,
    sum_amount_7d), ``alerts`` (the profiles breaking the rule) and
    ``hopping_alerts`` (the rule on 1-minute-hop windows: card, ts,
    window_start, window_end, count).
    """
    q = cs.Query()
    pay = q.source("payments", payments(rows, cards=cards, s=skew, seed=seed), order_by="ts").key_by("card")
    profiles = pay.window([cs.SlidingWindow(FIVE_MINUTES_S, time="ts", name="5m"),
                           cs.SlidingWindow(SEVEN_DAYS_S, time="ts", name="7d")],
                          count=True, sum="amount", slices=slices, name="profiles")
    profiles.sink(name="profiles")
    profiles.filter_batches(lambda t: pc.greater(t["count_5m"], MAX_PAYMENTS_IN_5_MIN)).sink(name="alerts")
    pay.window(cs.HoppingWindow(FIVE_MINUTES_S, 60, time="ts"), count=True, slices=slices, name="hopping") \
        .filter_batches(lambda t: pc.greater(t["count"], MAX_PAYMENTS_IN_5_MIN)).sink(name="hopping_alerts")
    return q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--cards", type=int, default=100_000)
    ap.add_argument("--skew", type=float, default=0.8, help="Zipf exponent of card frequencies")
    add_run_flags(ap)
    args = ap.parse_args()
    q = fraud_query(args.rows, args.cards, args.seed, args.slices, args.skew)
    job, elapsed = run_timed(q, args)
    profiles, alerts, hopping = (job.results(s) for s in ("profiles", "alerts", "hopping_alerts"))
    exact_cards = set(alerts["card"].to_pylist())
    hop_cards = set(hopping["card"].to_pylist())
    print(f"{args.rows:,} payments, {args.executor} executor: {elapsed:.1f} s "
          f"({args.rows / elapsed:,.0f} payments/s, two sliding windows + one hopping window per payment)")
    print(f"profiles: {profiles.num_rows:,} rows (one per payment); largest 7-day sum "
          f"{pc.max(profiles['sum_amount_7d']).as_py():,.2f}")
    print(f"rule '> {MAX_PAYMENTS_IN_5_MIN} payments in 5 min': exact sliding window alerts on "
          f"{alerts.num_rows:,} payments of {len(exact_cards)} cards; 1-minute hopping windows on "
          f"{len(hop_cards)} cards; missed by hopping: {len(exact_cards - hop_cards)} cards")
    if args.executor == "ray":
        job.stop()


if __name__ == "__main__":
    main()
