"""Tweet-similarity search: per location, the most similar recent tweet at every tweet (the ChronoStream paper's second application).

The query, as a DAG of three stages (paper section V-A):

    source (tweet_id, location, ts, text), in event-time order
      -> tokenize: distinct words, stop words dropped   (vectorized, fused into the source stage)
      -> key_by(location): MostSimilarTweet             scores the location's window by shared words
      -> sink "similar"

**Exact definitions.** A tweet's *words* are the distinct tokens of its
text, split on whitespace and lower-cased, minus the stop words
(``chronostream.datasets.STOP_WORDS``). The *similarity* of two tweets is
the number of words they share. At every tweet ``x`` (location ``L``, time
``t``), its *window* is the earlier tweets of ``L`` (earlier in the source
order, which is ``ts`` order) that are still recent:

- time window (``window=W`` seconds, the default): those with ``ts`` in
  ``(t - W, t]``, as ``chronostream.SlidingWindow(W, time="ts")`` (a tweet
  exactly ``W`` seconds older is out; tweets at the same second are in);
- count window (``last_n=N``): the ``N`` most recent of them.

The output row for ``x`` is ``location``, ``tweet_id``, ``ts``, ``best_id``:
the window's tweet sharing the most words with ``x``, ties broken by the
most recent (largest ``tweet_id``), or null when no tweet of the window
shares a word with ``x``; and ``shared``: how many words they share (0 when
``best_id`` is null). A tweet with no words (only stop words) matches
nothing but still takes its place in the window.

**How, incrementally.** ``MostSimilarTweet`` keeps per location, in
registered state only (state-library handles, so checkpoints, migration and
recovery carry it): a queue of the window's tweets (``[tweet_id, ts,
words]``, oldest first) and an inverted index word -> ids of the window's
tweets holding it (ascending). At each tweet it expires the queue's head
while it is out of the window, removing the expired ids from the index (so
the state holds exactly the window), counts shared words over the posting
lists of the tweet's words (only tweets sharing at least one word are
touched, never the whole window), emits the best, then adds the tweet. The
cost per tweet grows with the window: the paper's "scale dependent"
application (Fig. 13).

Data: ``chronostream.datasets.tweets`` (seeded; Zipf words with the stop
words most frequent, Zipf locations, Poisson times at ``rate`` per second).

    python -m examples.similarity                          # 50,000 tweets, 10-minute window, in-process runtime
    python -m examples.similarity --rows 5000 --executor serial
    python -m examples.similarity --last-n 100 --executor ray --containers 2
"""

from __future__ import annotations

import argparse
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import chronostream as cs
from chronostream.datasets import STOP_WORDS, tweets
from examples.common import add_run_flags, run_timed

#: Default time window, in seconds (about 6,000 tweets in all windows at 10 tweets/s).
DEFAULT_WINDOW_S = 600
#: The output schema of the ``similar`` sink: ``best_id`` is null when nothing matches, so it is declared.
OUTPUT_SCHEMA = pa.schema([("location", pa.string()), ("tweet_id", pa.int64()), ("ts", pa.int64()),
                           ("best_id", pa.int64()), ("shared", pa.int64())])

_STOP_SET = pa.array(STOP_WORDS, pa.string())


def tokenize(t: pa.Table) -> pa.Table:
    """Tweets -> ``tweet_id``, ``location``, ``ts``, ``words`` (sorted distinct non-stop words), vectorized.

    For ``map_batches``: one output row per tweet, no Python per tweet.

    >>> tokenize(pa.table({"tweet_id": [1, 2], "location": ["a", "b"], "ts": [0, 5],
    ...                    "text": ["The cat and the Dog cat", "of a the"]}))["words"].to_pylist()
    [['cat', 'dog'], []]
    """
    n = t.num_rows
    text = t["text"]
    text = text.combine_chunks() if isinstance(text, pa.ChunkedArray) else text
    lists = pc.utf8_split_whitespace(pc.utf8_lower(text))
    flat, parent = pc.list_flatten(lists), pc.list_parent_indices(lists)
    keep = pc.and_(pc.not_equal(flat, ""), pc.invert(pc.is_in(flat, value_set=_STOP_SET)))
    pairs = pa.table({"p": parent.filter(keep), "w": flat.filter(keep)})
    # Sort by (tweet, word) so each tweet's duplicates are adjacent; keep the first of each run.
    pairs = pairs.take(pc.sort_indices(pairs, sort_keys=[("p", "ascending"), ("w", "ascending")]))
    p = np.asarray(pairs["p"].combine_chunks(), dtype=np.int64)
    w = pairs["w"].combine_chunks()
    first = np.ones(len(p), dtype=bool)
    if len(p) > 1:
        same_word = np.asarray(pc.equal(w.slice(1), w.slice(0, len(p) - 1)), dtype=bool)
        first[1:] = (p[1:] != p[:-1]) | ~same_word
    counts = np.bincount(p[first], minlength=n)
    offsets = pa.array(np.concatenate(([0], np.cumsum(counts))).astype(np.int32), pa.int32())
    words = pa.ListArray.from_arrays(offsets, w.filter(pa.array(first)).cast(pa.string()))
    return pa.table({"tweet_id": t["tweet_id"], "location": t["location"], "ts": t["ts"], "words": words})


class MostSimilarTweet(cs.Operator):
    """Per key (location), the window tweet sharing the most words with each new tweet (see the module doc).

    Give exactly one of ``window_s`` (time window ``(ts - window_s, ts]``)
    or ``last_n`` (the key's last ``last_n`` earlier tweets). Input events:
    ``location``, ``tweet_id``, ``ts``, ``words`` (distinct). State per
    location: queue ``similar.window`` (``[tweet_id, ts, words]``) and map
    ``similar.index`` (word -> ascending ids of the window's tweets).
    """

    output_schemas: ClassVar[dict[str, pa.Schema]] = {"out": OUTPUT_SCHEMA}

    def __init__(self, window_s: float | None = None, last_n: int | None = None) -> None:
        if (window_s is None) == (last_n is None):
            raise ValueError("give exactly one of window_s (a time window) and last_n (a count window)")
        if window_s is not None and not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if last_n is not None and last_n < 1:
            raise ValueError(f"last_n must be >= 1, got {last_n!r}")
        self.window_s = window_s
        self.last_n = last_n

    def setup(self) -> None:
        self.window = self.register_queue("similar.window")
        self.index = self.register_map("similar.index")

    def consume(self, stream_id: str, event: dict) -> None:
        loc, tid, ts = event["location"], event["tweet_id"], event["ts"]
        words = list(dict.fromkeys(event["words"] or ()))  # distinct, in a fixed order
        # Checks before any write: a late tweet raises with the state untouched (bad-input path).
        if self.window.len(loc):
            latest = self.window.peek(loc)[1]
            if ts < latest:
                raise cs.LateEventError(f"tweet {tid} at {loc!r} has ts {ts}, older than the location's latest "
                                        f"tweet ({latest}); feed the source in ts order (order_by='ts')")
        if self.window_s is not None:
            cutoff = ts - self.window_s
            while self.window.len(loc) and self.window.peekleft(loc)[1] <= cutoff:
                self._expire(loc)
        # Shared-word counts of every window tweet holding one of the words (the others share none).
        shared: dict[int, int] = {}
        for w in words:
            for other in self.index.get(loc, w, ()):
                shared[other] = shared.get(other, 0) + 1
        # Most shared words, then the largest id: a total order, so no dict-order dependence.
        best = max(shared.items(), key=lambda kv: (kv[1], kv[0])) if shared else (None, 0)
        self.produce_update("out", {"location": loc, "tweet_id": tid, "ts": ts,
                                         "best_id": best[0], "shared": best[1]})
        self.window.append(loc, [tid, ts, words])
        for w in words:
            ids = self.index.get(loc, w)
            if ids is None:
                self.index.set(loc, w, [tid])
            else:
                ids.append(tid)  # ids arrive ascending (source order): the list stays sorted
                self.index.set(loc, w, ids)
        if self.last_n is not None:
            while self.window.len(loc) > self.last_n:
                self._expire(loc)

    def _expire(self, loc: Any) -> None:
        """Drop the location's oldest window tweet from the queue and its id from the index."""
        tid, _ts, words = self.window.popleft(loc)
        for w in words:
            ids = self.index.get(loc, w)
            # The oldest tweet's id is the first of every posting list it is in.
            if ids[0] == tid:
                del ids[0]
            else:  # pragma: no cover - defensive: the index is FIFO by construction
                ids.remove(tid)
            if ids:
                self.index.set(loc, w, ids)
            else:
                self.index.delete(loc, w)  # keeps the index to the window's words


def similarity_query(rows: int, locations: int = 50, window: float | None = DEFAULT_WINDOW_S,
                     seed: int = 42, slices: int = 8, *, last_n: int | None = None, vocab: int = 20_000,
                     rate: float = 10.0, epoch_events: int = cs.DEFAULT_EPOCH_EVENTS,
                     source_slices: int = cs.DEFAULT_SOURCE_SLICES) -> cs.Query:
    """The most similar recent tweet per location at every tweet (sink ``similar``; see the module doc).

    ``rows`` seeded tweets (``chronostream.datasets.tweets`` with
    ``locations``, ``vocab``, ``rate`` and ``seed``); a time window of
    ``window`` seconds, or, with ``last_n``, a count window of the last
    ``last_n`` tweets (``window`` is then ignored). ``slices``: slices of
    the similarity stage (named ``similar``); the source stage is ``tweets``.
    """
    q = cs.Query(epoch_events=epoch_events)
    data = tweets(rows, locations=locations, vocab=vocab, rate=rate, seed=seed)
    src = q.source("tweets", data, order_by="ts", slices=source_slices)
    window_s = None if last_n is not None else window
    similar = src.map_batches(tokenize).key_by("location").apply(
        MostSimilarTweet, window_s=window_s, last_n=last_n, slices=slices, name="similar",
        output_schemas={"out": OUTPUT_SCHEMA})
    similar.sink(name="similar")
    return q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--locations", type=int, default=50)
    ap.add_argument("--window", type=float, default=DEFAULT_WINDOW_S, help="time window, seconds")
    ap.add_argument("--last-n", type=int, default=None, help="count window: the last N tweets (replaces --window)")
    ap.add_argument("--vocab", type=int, default=20_000)
    add_run_flags(ap)
    args = ap.parse_args()
    window = int(args.window) if float(args.window).is_integer() else args.window
    q = similarity_query(args.rows, args.locations, window, args.seed, args.slices, last_n=args.last_n,
                         vocab=args.vocab)
    job, elapsed = run_timed(q, args)
    out = job.results("similar")
    matched = pc.sum(pc.is_valid(out["best_id"])).as_py() or 0
    shared = np.asarray(out["shared"].combine_chunks() if isinstance(out["shared"], pa.ChunkedArray)
                        else out["shared"])
    what = f"last {args.last_n} tweets" if args.last_n is not None else f"{window} s window"
    print(f"{args.rows:,} tweets, {args.locations} locations, {what}, {args.executor} executor: "
          f"{elapsed:.1f} s ({args.rows / elapsed:,.0f} tweets/s)")
    print(f"a similar tweet found for {matched:,} of {out.num_rows:,} tweets; shared words: "
          + ", ".join(f"{k}: {int(c):,}" for k, c in enumerate(np.bincount(shared)) if c))
    best = out.take(pc.sort_indices(out, sort_keys=[("shared", "descending"), ("tweet_id", "ascending")])[:3])
    for r in best.to_pylist():
        print(f"  tweet {r['tweet_id']} at {r['location']} (ts {r['ts']}) shares {r['shared']} words "
              f"with tweet {r['best_id']}")
    if args.executor == "ray":
        job.stop()


if __name__ == "__main__":
    main()
