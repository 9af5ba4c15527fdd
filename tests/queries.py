"""The queries of the acceptance tests, with seeded data generators.

Each builder takes the slice count of its stateful stages and returns a
fresh ``Query`` whose sinks are memory sinks. Data is small and seeded so the
suite stays fast and every run sees the same input.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import chronostream as cs

EPOCH = 257  # a prime, so epochs never line up with anything in the data


def zipf_lines(n_lines: int, seed: int = 7, vocab: int = 300) -> list[dict]:
    """Lines of 0-9 words drawn from a Zipf(1.3) vocabulary (seeded)."""
    rng = np.random.default_rng(seed)
    words = np.array([f"w{i}" for i in range(vocab)])
    out = []
    for _ in range(n_lines):
        k = int(rng.integers(0, 10))
        idx = np.minimum(rng.zipf(1.3, k) - 1, vocab - 1)
        out.append({"line": " ".join(words[idx])})
    return out


def payments(n: int, seed: int = 11, cards: int = 40) -> pa.Table:
    """Payments (card, amount, cents) with skewed card frequencies (seeded)."""
    rng = np.random.default_rng(seed)
    card = np.minimum(rng.zipf(1.5, n) - 1, cards - 1)
    amount = np.round(rng.exponential(30.0, n), 2)
    return pa.table({"card": pa.array([f"c{c:03d}" for c in card]), "amount": amount,
                     "cents": (amount * 100).astype(np.int64)})


def split_words(t: pa.Table):
    """Vectorized whitespace split: (words table, parent row index)."""
    words = pc.utf8_split_whitespace(t["line"])
    flat = pc.list_flatten(words)
    return pa.table({"word": flat}), pc.list_parent_indices(words)


def word_count(slices: int, n_lines: int = 1500) -> cs.Query:
    """(a) word count: split (vectorized) -> key by word -> running count."""
    q = cs.Query(epoch_events=EPOCH)
    q.source("lines", zipf_lines(n_lines)).flat_map_batches(split_words) \
        .filter_batches(lambda t: pc.not_equal(t["word"], "")) \
        .key_by("word").count(slices=slices, name="count").sink(name="counts")
    return q


class RunningSum(cs.Operator):
    """Per-event keyed running sum, written with the ChronoStream operator model."""

    def setup(self) -> None:
        self.totals = self.register_state("totals")

    def consume(self, stream_id: str, event: dict) -> None:
        total = self.totals.get(event["card"], 0) + event["cents"]
        self.totals.set(event["card"], total)
        self.produce("out", {"card": event["card"], "total": total})


def running_sum(slices: int, n: int = 2500) -> cs.Query:
    """(b) keyed running sum, twice: per-event operator and built-in vectorized aggregate."""
    q = cs.Query(epoch_events=EPOCH)
    pay = q.source("payments", payments(n)).key_by("card")
    pay.apply(RunningSum, slices=slices, name="running_sum").sink(name="sums")
    pay.aggregate(count=True, sum=["amount"], min=["amount"], max=["amount"], mean=["amount"],
                  slices=slices, name="stats").sink(name="stats")
    return q


class BucketTotals(cs.Operator):
    """Second stage of the re-key pipeline: per bucket, how many updates and their sum."""

    def setup(self) -> None:
        self.acc = self.register_state("acc")

    def consume(self, stream_id: str, event: dict) -> None:
        n, s = self.acc.get(event["bucket"], (0, 0))
        n, s = n + 1, s + event["count"]
        self.acc.set(event["bucket"], (n, s))
        self.produce("out", {"bucket": event["bucket"], "word": event["word"], "updates": n, "sum": s})


def rekey_pipeline(slices: int, n_lines: int = 1200) -> cs.Query:
    """(c) two stateful stages with a re-key in between (word -> bucket of its count)."""
    q = cs.Query(epoch_events=EPOCH)
    counts = q.source("lines", zipf_lines(n_lines, seed=3)) \
        .flat_map(lambda e: [{"word": w} for w in e["line"].split()]) \
        .key_by("word").count(slices=slices, name="count")
    counts.map(lambda e: {**e, "bucket": e["count"] % 5}).key_by("bucket") \
        .apply(BucketTotals, slices=slices, name="buckets").sink(name="buckets")
    return q


def orders_and_customers(n_orders: int = 900, n_customers: int = 60, seed: int = 5):
    """Two streams with event times that interleave: customer updates and orders."""
    rng = np.random.default_rng(seed)
    cust = pa.table({"cust": rng.integers(0, 25, n_customers), "tier": rng.choice(["a", "b", "c"], n_customers),
                     "t": np.sort(rng.integers(0, 10_000, n_customers))})
    orders = pa.table({"cust": rng.integers(0, 25, n_orders), "qty": rng.integers(1, 9, n_orders),
                       "t": np.sort(rng.integers(0, 10_000, n_orders))})
    return orders, cust


def keyed_join(slices: int) -> cs.Query:
    """(d) two-input keyed equi-join (orders x customer updates on ``cust``), in event-time order."""
    orders, cust = orders_and_customers()
    q = cs.Query(epoch_events=EPOCH)
    o = q.source("orders", orders, order_by="t").key_by("cust")
    c = q.source("customers", cust, order_by="t").key_by("cust")
    cs.join(o, c, slices=slices, name="join").sink(name="joined")
    return q


QUERIES = {
    "word_count": (word_count, ["counts"], ["word"]),
    "running_sum": (running_sum, ["sums", "stats"], ["card"]),
    "rekey": (rekey_pipeline, ["buckets"], ["bucket"]),
    "join": (keyed_join, ["joined"], ["cust"]),
}


def per_key_sequences(table: pa.Table, key: list[str]) -> dict:
    """Each key's output rows (user columns) in lineage order: independent of slice count."""
    rows = table.to_pylist()
    rows.sort(key=lambda r: (r["_order"], r["_sub"]))
    out: dict = {}
    for r in rows:
        k = tuple(r[c] for c in key)
        out.setdefault(k, []).append({c: v for c, v in r.items() if not c.startswith("_")})
    return out
