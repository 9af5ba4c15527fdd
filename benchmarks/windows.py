"""Windows emitted on close: what the slice's clock costs, and how much sooner it closes them.

Hourly tumbling windows (``emit="close"``) with a count and a sum, per card,
over seeded payments (``chronostream.datasets.payments``: Zipf-distributed
cards, a week of event times, bursts), in one process (``executor="local"``,
one container per stage), closed by each key's own next event
(``clock="key"``, the default) or by the slice's event time
(``clock="slice"``: an idle card's window closes once any card of its slice
passes its end). Reported per clock: events/s (median of ``--repeat`` runs,
the two interleaved run by run), the windows emitted, how many only at the
end of the input, and the *close lag* of the others: the event time of the
event that closed a window minus the window's end (p50/p99, seconds of
event time), i.e. how long after its end a window's row comes out.

    python -m benchmarks.windows --json
    python -m benchmarks.windows --json --payments 400000 --cards 50000 --slices 32
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow.compute as pc

import chronostream as cs
from benchmarks.common import emit, median, parser
from chronostream.datasets import payments

CLOCKS = ("key", "slice")


def windows_query(table, clock: str, slices: int, epoch: int) -> cs.Query:
    """The benchmark's query: hourly tumbling windows on close, per card, closed by ``clock``."""
    q = cs.Query(epoch_events=epoch)
    (q.source("payments", table, order_by="ts").key_by("card")
     .window(cs.TumblingWindow(3600, time="ts", emit="close", clock=clock), count=True, sum="amount",
             slices=slices, name="hourly")
     .sink(name="hourly"))
    return q


def close_lags(rows, sorted_ts: np.ndarray) -> tuple[np.ndarray, int]:
    """Per window row closed by an event: that event's time minus the window's end; and how many
    rows came out at the end of the input (their order is past every event's)."""
    order = np.asarray(rows.column("_order"))
    during = order < len(sorted_ts)
    ends = np.asarray(rows.column("window_end"))
    return sorted_ts[order[during]] - ends[during], int((~during).sum())


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--payments", type=int, default=200_000, help="payments (default 200,000)")
    p.add_argument("--cards", type=int, default=10_000, help="distinct cards (default 10,000)")
    p.add_argument("--slices", type=int, default=8, help="slices of the window stage (default 8)")
    p.add_argument("--epoch", type=int, default=8192, help="events per epoch (default 8192)")
    args = p.parse_args()
    n = 20_000 if args.quick else args.payments
    table = payments(n, cards=args.cards, seed=7)
    sorted_ts = np.sort(np.asarray(table.column("ts")), kind="stable")
    times: dict[str, list[float]] = {c: [] for c in CLOCKS}
    out = {}
    for r in range(1 if args.quick else args.repeat):
        for clock in (CLOCKS if r % 2 == 0 else CLOCKS[::-1]):
            t0 = time.perf_counter()
            job = cs.run(windows_query(table, clock, args.slices, args.epoch), executor="local", containers=1,
                         checkpoint_interval_s=0)
            times[clock].append(time.perf_counter() - t0)
            out[clock] = job.results("hourly")
    assert out["key"].num_rows == out["slice"].num_rows, "on time-ordered input both clocks emit the same windows"
    assert pc.sum(out["key"]["count"]).as_py() == n
    rows = []
    for clock in CLOCKS:
        lags, at_end = close_lags(out[clock], sorted_ts)
        rows.append({"clock": clock, "events_per_s": round(n / median(times[clock])),
                     "runs_s": [round(t, 3) for t in times[clock]], "windows": out[clock].num_rows,
                     "closed_at_end": at_end,
                     "close_lag_p50_s": float(np.percentile(lags, 50)) if len(lags) else None,
                     "close_lag_p99_s": float(np.percentile(lags, 99)) if len(lags) else None})
    cost = round((median(times["slice"]) / median(times["key"]) - 1) * 100, 1)
    emit({"payments": n, "cards": args.cards, "slices": args.slices, "epoch_events": args.epoch,
          "slice_clock_cost_pct": cost, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
