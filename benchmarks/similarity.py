"""Tweet-similarity search (paper Fig. 13): time to process 50,000 tweets as the window state grows.

The query is ``examples.similarity`` (per location, the most similar tweet
of a sliding time window at every tweet, by shared distinct non-stop words),
on Ray: one source container (tokenization fused into it) and two for the
similarity stage (8 slices). Tweets: ``chronostream.datasets.tweets``
(seeded; 50 Zipf locations, 10 tweets/s of event time, so a window of W
seconds holds about 10 W tweets in all).

For each window length W the job gets ``prefill + events`` tweets, where the
``prefill`` (about 10 W tweets, rounded up to whole epochs) fills the
windows first, so the ``events`` measured tweets all run against a full
window. Per window:

- ``seconds``: from the moment the last prefill epoch's output reached the
  sink to the moment the last epoch's did (``job.sink_write_times``): the
  time the ``events`` tweets took with the state at its full size;
  ``events_per_s`` = ``events / seconds``;
- ``run_s``: the whole job's processing time (deploy excluded), prefill
  included, over ``total_events``;
- ``state_mb`` / ``state_keys``: the similarity stage's state at the end
  (full windows), summed over its slices from the job's metrics snapshot
  (``job.metrics()["snapshot"]["stages"]["similar"]["per_slice"]``: the
  runtime's estimate, the msgpack size of a strided sample of 32 entries of
  each state times its entry count; an exact count of every entry, driving
  the operator in one process on the same data, gave 3.5 MB for the 1 h
  window where the estimate says 3.2 MB, and 26.7 MB for 10 h where it says
  25.1 MB; ``window_tweets``: the tweets the windows hold at the
  end (from the data);
- ``p50_ms`` / ``p99_ms``: the runtime's end-to-end latency (source ingest to
  sink write, ``job.metrics()["latency_total"]``) over the whole run. The
  source is read as fast as the job goes, so this is latency under
  saturation (epochs queue behind backpressure), not at a paced rate
  (see ``benchmarks.latency`` for that).

    python -m benchmarks.similarity --json                 # windows 1 min, 1 h, 10 h; 50,000 tweets each
    python -m benchmarks.similarity --json --quick         # 5,000 tweets; windows 30 s, 5 min, 50 min
"""

from __future__ import annotations

import math

import numpy as np

import chronostream as cs
from benchmarks.common import emit, median, parser
from chronostream.datasets import tweets
from examples.similarity import similarity_query

CONTAINERS = {"tweets": 1, "similar": 2}
RATE = 10.0  # tweets per second of event time (the generator's default)
LOCATIONS = 50
SLICES = 8


def window_label(seconds: int) -> str:
    """``60`` -> ``1m``, ``36000`` -> ``10h``, ``45`` -> ``45s``."""
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def one_run(window_s: int, events: int, epoch: int, seed: int) -> dict:
    """Run the query once with ``window_s``: the prefill, then ``events`` timed tweets (see the module doc)."""
    prefill = max(1, math.ceil(RATE * window_s / epoch)) * epoch
    total = prefill + events
    q = similarity_query(total, LOCATIONS, window_s, seed, SLICES, epoch_events=epoch, source_slices=1)
    job = cs.run(q, containers=CONTAINERS, checkpoint_interval_s=0)
    try:
        st = job.wait(timeout_s=3600)
        metrics = job.metrics()
        written = job.sink_write_times("similar")
        out_rows = job.results("similar").num_rows
    finally:
        job.stop()
    assert out_rows == total, f"{out_rows} output rows for {total} tweets"
    prefill_epochs = prefill // epoch
    t_prefilled = max(t for (_slice, e), t in written.items() if e < prefill_epochs)
    t_end = max(written.values())
    per_slice = metrics["snapshot"]["stages"]["similar"]["per_slice"]
    ts = np.asarray(tweets(total, locations=LOCATIONS, rate=RATE, seed=seed)["ts"])
    seconds = t_end - t_prefilled
    return {"seconds": seconds, "run_s": st.elapsed_s, "prefill": prefill, "total_events": total,
            "state_mb": sum(x["state_bytes"] for x in per_slice) / 1e6,
            "state_keys": sum(x["state_keys"] for x in per_slice),
            "window_tweets": int(np.count_nonzero(ts > ts[-1] - window_s)),
            "p50_ms": metrics["latency_total"]["p50_ms"], "p99_ms": metrics["latency_total"]["p99_ms"]}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.set_defaults(repeat=1)
    p.add_argument("--events", type=int, default=50_000, help="timed tweets per window (default 50,000)")
    p.add_argument("--windows", default="60,3600,36000", help="window lengths, seconds (default 1 min, 1 h, 10 h)")
    p.add_argument("--epoch", type=int, default=1000, help="events per epoch (default 1,000)")
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args()
    events = 5_000 if args.quick else args.events
    windows = [30, 300, 3000] if args.quick else [int(w) for w in args.windows.split(",")]
    cs.ensure_ray(num_cpus=2)
    rows = []
    for w in windows:
        runs = [one_run(w, events, args.epoch, args.seed) for _ in range(args.repeat)]
        secs = median([r["seconds"] for r in runs])
        mid = min(runs, key=lambda r: abs(r["seconds"] - secs))  # the median run's other figures
        rows.append({"window": window_label(w), "window_s": w, "events": events, "seconds": round(secs, 2),
                     "events_per_s": round(events / secs), "state_mb": round(mid["state_mb"], 2),
                     "state_keys": mid["state_keys"], "window_tweets": mid["window_tweets"],
                     "p50_ms": mid["p50_ms"], "p99_ms": mid["p99_ms"], "prefill": mid["prefill"],
                     "total_events": mid["total_events"], "run_s": round(mid["run_s"], 2),
                     "runs_s": [round(r["seconds"], 2) for r in runs]})
    emit({"benchmark": "similarity", "locations": LOCATIONS, "rate_per_s": RATE, "slices": SLICES,
          "epoch_events": args.epoch, "containers": CONTAINERS, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
