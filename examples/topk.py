"""Top-K frequent words over a sliding count window per category (the ChronoStream paper's first application).

The query, as a DAG of three stages (paper section V-A):

    source (id, category, line)
      -> split into words and drop stop words       (vectorized, fused into the source stage)
      -> key_by(category): WindowWordCounts          the last ``window`` words of the category
      -> key_by(category): RankTopK                  its ``k`` most frequent words
      -> sink "topk"

**Exact definitions.** A category's word events are its lines' words (stop
words removed, ``chronostream.datasets.STOP_WORDS``) in source order, and
within a line in position order. At every word event ``e`` of category
``c``, the window is ``c``'s last ``window`` word events up to and including
``e``; the output row for ``e`` holds the ``k`` words with the most
occurrences in that window, ranked by count (descending), ties by word
(ascending), with their counts (fewer than ``k`` when the window has fewer
distinct words). Output columns: ``category``, ``id`` (the line),
``pos`` (the word's position among the line's kept words), ``word``,
``top_words`` (list of strings), ``top_counts`` (list of int64).

**How, incrementally.** ``WindowWordCounts`` keeps per category a queue of
the window's words and a word -> count map (state library: chunked, so a
delta checkpoint holds the chunks touched); per word event it emits the
count update of the word that expired (if any) and then of the arriving
word (flagged ``arrival``). ``RankTopK`` keeps per category the counts,
count -> words buckets (sorted lists) and the current top list; an update
changes one word's count by one, so the top list changes by at most one
swap: a word entering from outside, or a top word dropping below the best
word outside it, which is found in the one or two buckets between its old
and new count. No per-event sort of the vocabulary, no rescan of the window.

Data: ``chronostream.datasets.topic_text`` (seeded; Zipf words with stop
words as the most frequent, Zipf categories).

    python -m examples.topk                        # 20,000 lines, in-process runtime
    python -m examples.topk --lines 5000 --executor serial
    python -m examples.topk --executor ray --containers 2
"""

from __future__ import annotations

import argparse
import bisect
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import chronostream as cs
from chronostream.datasets import STOP_WORDS, topic_text
from examples.common import add_run_flags, run_timed

#: The output schema of the ``topk`` sink (list columns need it declared).
TOPK_SCHEMA = pa.schema([("category", pa.string()), ("id", pa.int64()), ("pos", pa.int64()), ("word", pa.string()),
                         ("top_words", pa.list_(pa.string())), ("top_counts", pa.list_(pa.int64()))])
#: The update stream between the two stages.
UPDATE_SCHEMA = pa.schema([("category", pa.string()), ("id", pa.int64()), ("pos", pa.int64()),
                           ("word", pa.string()), ("count", pa.int64()), ("arrival", pa.bool_())])


def split_category_words(t: pa.Table) -> tuple[pa.Table, pa.Array]:
    """Lines -> one row per kept word (``id``, ``category``, ``pos``, ``word``), stop words dropped, vectorized.

    >>> words, parent = split_category_words(pa.table({"id": [7], "category": ["c0"], "line": ["the cat and dog"]}))
    >>> words.to_pylist(), parent.to_pylist()
    ([{'id': 7, 'category': 'c0', 'pos': 0, 'word': 'cat'}, {'id': 7, 'category': 'c0', 'pos': 1, 'word': 'dog'}], [0, 0])
    """
    lists = pc.utf8_split_whitespace(t["line"])
    flat, parent = pc.list_flatten(lists), pc.list_parent_indices(lists)
    keep = pc.and_(pc.not_equal(flat, ""), pc.invert(pc.is_in(flat, value_set=pa.array(STOP_WORDS))))
    flat, parent = flat.filter(keep), parent.filter(keep)
    # pos = rank of the kept word within its line: index minus the index of the line's first kept word.
    n = len(parent)
    idx = pa.array(range(n), pa.int64()) if n else pa.array([], pa.int64())
    first = _first_index_per_run(parent)
    pos = pc.subtract(idx, first)
    return pa.table({"id": t["id"].take(parent), "category": t["category"].take(parent), "pos": pos,
                     "word": flat}), parent


def _first_index_per_run(parent: pa.Array) -> pa.Array:
    """For a sorted array of run labels, the index where each element's run starts."""
    p = parent.to_numpy(zero_copy_only=False)
    if len(p) == 0:
        return pa.array([], pa.int64())
    starts = np.flatnonzero(np.r_[True, p[1:] != p[:-1]])
    run = np.cumsum(np.r_[True, p[1:] != p[:-1]]) - 1
    return pa.array(starts[run].astype(np.int64))


class WindowWordCounts(cs.Operator):
    """Per key (category), the counts of words over its last ``window`` word events; emits count updates.

    Per word event: the expired word's update (``arrival=False``), if the
    window was full, then the arriving word's (``arrival=True``); ``count``
    is the word's count in the window after the event.
    """

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 word, got {window}")
        self.window = window

    def setup(self) -> None:
        self.words = self.register_queue("window")
        self.counts = self.register_map("counts")

    def consume(self, stream_id: str, event: dict) -> None:
        cat, word = event["category"], event["word"]
        self.words.append(cat, word)
        self.counts.increment(cat, word)
        expired = None
        if self.words.len(cat) > self.window:
            expired = self.words.popleft(cat)
            self.counts.increment(cat, expired, -1)
        base = {"category": cat, "id": event["id"], "pos": event["pos"]}
        if expired is not None:
            self.produce("out", {**base, "word": expired, "count": self.counts.get(cat, expired, 0),
                                 "arrival": False})
        self.produce("out", {**base, "word": word, "count": self.counts.get(cat, word, 0), "arrival": True})


def _rank(entry: list) -> tuple[int, str]:
    """Sort key of a ``[word, count]`` top entry: count descending, then word ascending."""
    return -entry[1], entry[0]


class RankTopK(cs.Operator):
    """Per key (category), the ``k`` words with the highest counts, kept exactly under +1/-1 count updates.

    At every update flagged ``arrival`` it emits the key's top list. State:
    ``counts`` (word -> count), ``buckets`` (count -> sorted words),
    ``top`` (``[[word, count], ...]``, best first, at most ``k``).
    """

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k

    def setup(self) -> None:
        self.counts = self.register_map("counts")
        self.buckets = self.register_map("buckets")
        self.top = self.register_value("top")

    def _move(self, cat: Any, word: str, old: int, new: int) -> None:
        """Move ``word`` from bucket ``old`` to bucket ``new`` (0 = no bucket)."""
        if old:
            b = self.buckets.get(cat, old)
            b.pop(bisect.bisect_left(b, word))
            if b:
                self.buckets.set(cat, old, b)
            else:
                self.buckets.delete(cat, old)
        if new:
            b = self.buckets.get(cat, new)  # updated in place and written back: no copy of a long bucket
            if b is None:
                b = []
            bisect.insort(b, word)
            self.buckets.set(cat, new, b)
            self.counts.set(cat, word, new)
        else:
            self.counts.delete(cat, word)

    def _best_outside(self, cat: Any, lo: int, hi: int, inside: set[str]) -> list | None:
        """The best-ranked word not in the top list with a count in ``[lo, hi]`` (buckets hi down to lo)."""
        for c in range(hi, max(lo, 1) - 1, -1):
            for w in self.buckets.get(cat, c, ()):
                if w not in inside:
                    return [w, c]
        return None

    def consume(self, stream_id: str, event: dict) -> None:
        cat, word, new = event["category"], event["word"], event["count"]
        old = self.counts.get(cat, word, 0)
        top = self.top.get(cat, [])
        if new != old:
            self._move(cat, word, old, new)
            top = self._retop(cat, [list(e) for e in top], word, old, new)
            self.top.set(cat, top)
        if event["arrival"]:
            self.produce("out", {"category": cat, "id": event["id"], "pos": event["pos"], "word": word,
                                 "top_words": [e[0] for e in top], "top_counts": [e[1] for e in top]})

    def _retop(self, cat: Any, top: list[list], word: str, old: int, new: int) -> list[list]:
        """The top list after ``word``'s count went from ``old`` to ``new`` (buckets already moved)."""
        where = next((i for i, e in enumerate(top) if e[0] == word), None)
        if where is None:
            # Outside, a fall changes nothing; a rise may push out the last entry.
            if new > old and (len(top) < self.k or _rank([word, new]) < _rank(top[-1])):
                top = sorted(top + [[word, new]], key=_rank)[: self.k]
            return top
        full = len(top) == self.k
        if new > old:
            top[where][1] = new
            return sorted(top, key=_rank)
        # A top word fell. Every outside word ranked below it before, and only it
        # moved, so an outside word now ranked above it has a count in [new, old]:
        # the one or two buckets between. (Not full: there is no outside word.)
        del top[where]
        inside = {e[0] for e in top}
        inside.add(word)
        best = self._best_outside(cat, new, old, inside) if full else None
        mine = [word, new] if new else None
        if best is not None and (mine is None or _rank(best) < _rank(mine)):
            mine = best
        return sorted(top + [mine], key=_rank) if mine is not None else top


def topk_query(lines: int | pa.Table, window: int = 1_000, k: int = 10, categories: int = 8, seed: int = 42,
               slices: int = 8, words_per_line: int = 10, epoch_events: int | None = None,
               log_dir: str | None = None, follow: bool = False) -> cs.Query:
    """The top-K query over ``lines`` (a count, for ``topic_text``, or a table with id/category/line).

    With ``log_dir``, the lines come from that source log's stream ``text``
    instead (``follow=True`` tails it while a writer appends).
    """
    q = cs.Query() if epoch_events is None else cs.Query(epoch_events=epoch_events)
    if log_dir is not None:
        src = q.source_log(log_dir, "text", follow=follow, slices=1)
    else:
        table = lines if isinstance(lines, pa.Table) else topic_text(lines, categories=categories,
                                                                     words_per_line=words_per_line, seed=seed)
        src = q.source("text", table)
    words = src.flat_map_batches(split_category_words).key_by("category")
    updates = words.apply(WindowWordCounts, window, slices=slices, name="counts",
                          output_schemas={"out": UPDATE_SCHEMA})
    ranked = updates.key_by("category").apply(RankTopK, k, slices=slices, name="rank",
                                              output_schemas={"out": TOPK_SCHEMA})
    ranked.sink(name="topk")
    return q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=20_000)
    ap.add_argument("--window", type=int, default=1_000, help="words per category window")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--categories", type=int, default=8)
    add_run_flags(ap)
    args = ap.parse_args()
    q = topk_query(args.lines, args.window, args.k, args.categories, args.seed, args.slices)
    job, elapsed = run_timed(q, args)
    out = job.results("topk")
    print(f"{args.lines:,} lines -> {out.num_rows:,} word events, {args.executor} executor: {elapsed:.1f} s "
          f"({out.num_rows / elapsed:,.0f} words/s)")
    last: dict[str, Any] = {}
    for row in out.select(["category", "top_words", "top_counts"]).to_pylist():
        last[row["category"]] = row
    for cat in sorted(last):
        pairs = ", ".join(f"{w} {c}" for w, c in zip(last[cat]["top_words"], last[cat]["top_counts"]))
        print(f"  {cat}: {pairs}")
    if args.executor == "ray":
        job.stop()


if __name__ == "__main__":
    main()
