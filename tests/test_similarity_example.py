"""The tweet-similarity example (examples/similarity.py): exact against brute force, equal on every executor, bounded.

Method: the example's query on 3,000 seeded tweets over 4 locations with a
small vocabulary (so tweets share several words and ties happen), windows
holding tens of tweets. A brute-force model recomputes every output row from
the definition in examples/similarity.py: it keeps every tweet's text,
tokenizes it with plain Python, and scans the exact window (earlier tweets
of the location with ts in ``(t - W, t]``, or the last N) at every tweet.
The serial executor (the oracle) must equal it; the in-process runtime
(executor="local", 3 containers, shuffled delivery) and Ray must equal the
oracle row for row, ``_order/_sub/_slice/_seq`` included. The operator is
also driven directly (an ``OperatorContext``, no executor) to check that its
state holds only the window and survives a checkpoint round trip.
"""

from __future__ import annotations

from collections import defaultdict

import pyarrow as pa
import pytest

import chronostream as cs
from chronostream.datasets import STOP_WORDS, tweets
from chronostream.slices.operators import OperatorContext
from chronostream.slices.state import KeyValueState
from examples.similarity import MostSimilarTweet, similarity_query, tokenize
from chronostream.slices.checkpoint import SliceCheckpoint, capture_kv, decode, encode, restore_kv

ROWS, LOCATIONS, VOCAB, SEED = 3_000, 4, 300, 5
WINDOW_S = 10  # ~10 tweets/s over 4 Zipf locations: 15 to 40 tweets per window
LAST_N = 25
EPOCH = 257  # a prime: epochs never line up with anything in the data


def query(window_s: int | None = WINDOW_S, last_n: int | None = None) -> cs.Query:
    return similarity_query(ROWS, LOCATIONS, window_s, SEED, slices=5, last_n=last_n, vocab=VOCAB,
                            epoch_events=EPOCH)


def brute_force(table: pa.Table, window_s: int | None = None, last_n: int | None = None) -> list[dict]:
    """Every output row, from the definition: scan the exact window of each tweet, from scratch."""
    stop = set(STOP_WORDS)
    history: dict[str, list[tuple[int, int, frozenset]]] = defaultdict(list)  # location -> (id, ts, words)
    out = []
    for r in table.to_pylist():  # source order = ts order (the generator sorts by ts)
        words = frozenset(w for w in r["text"].lower().split() if w not in stop)
        earlier = history[r["location"]]
        window = earlier[-last_n:] if last_n is not None else [x for x in earlier if r["ts"] - window_s < x[1] <= r["ts"]]
        best_id, shared = None, 0
        for tid, _ts, other in window:
            s = len(words & other)
            if s and (s, tid) > (shared, best_id if best_id is not None else -1):
                best_id, shared = tid, s
        out.append({"location": r["location"], "tweet_id": r["tweet_id"], "ts": r["ts"], "best_id": best_id,
                    "shared": shared})
        earlier.append((r["tweet_id"], r["ts"], words))
    return out


def user_rows(table: pa.Table) -> list[dict]:
    """Output rows without the identity columns, by tweet."""
    rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in table.to_pylist()]
    return sorted(rows, key=lambda r: r["tweet_id"])


@pytest.fixture(scope="module")
def serial():
    return cs.run(query(), executor="serial")


# -- exactness ------------------------------------------------------------------------------------


def test_every_tweets_best_match_equals_brute_force_over_the_exact_time_window(serial):
    """Time window (ts - W, ts]: the serial output is the brute-force best match (most shared words, then latest id)."""
    data = tweets(ROWS, locations=LOCATIONS, vocab=VOCAB, seed=SEED)
    expected = brute_force(data, window_s=WINDOW_S)
    assert user_rows(serial.results("similar")) == expected
    shared = [r["shared"] for r in expected]
    assert 0 in shared and max(shared) >= 2, "the data has tweets matching nothing and tweets sharing several words"


def test_every_tweets_best_match_equals_brute_force_over_the_last_n_tweets():
    """Count window (the location's last N earlier tweets): the serial output is the brute-force best match."""
    data = tweets(ROWS, locations=LOCATIONS, vocab=VOCAB, seed=SEED)
    got = cs.run(query(window_s=None, last_n=LAST_N), executor="serial").results("similar")
    assert user_rows(got) == brute_force(data, last_n=LAST_N)


def test_ties_go_to_the_most_recent_tweet():
    """Two window tweets sharing as many words: the later one (larger tweet_id) is the match."""
    op, ctx = make_operator(window_s=100)
    for tid, words in [(1, ["cat", "dog"]), (2, ["cat", "dog"]), (3, ["cat"]), (4, ["cat", "dog", "eel"])]:
        consume(op, ctx, {"location": "x", "tweet_id": tid, "ts": tid, "words": words})
    assert [(e["best_id"], e["shared"]) for e in ctx.events["out"]] == [(None, 0), (1, 2), (2, 1), (2, 2)]


# -- the runtime equals the oracle --------------------------------------------------------------------


def test_local_runtime_output_equals_the_serial_oracle_row_for_row(serial):
    """executor="local" (3 containers per stage, shuffled delivery): rows == serial rows, identity columns included."""
    local = cs.run(query(), executor="local", containers=3, seed=7)
    assert local.results("similar").to_pylist() == serial.results("similar").to_pylist()
    assert serial.results("similar").num_rows == ROWS


def test_ray_runtime_output_equals_the_serial_oracle_row_for_row(ray_session, serial):
    """On Ray (1 source container, 2 similarity containers, checkpoints every 2 epochs): rows == serial rows."""
    job = cs.run(query(), containers={"tweets": 1, "similar": 2}, checkpoint_every=2)
    try:
        job.wait(timeout_s=300)
        got = job.results("similar")
    finally:
        job.stop()
    assert got.to_pylist() == serial.results("similar").to_pylist()


# -- the state: only the window, all of it registered ---------------------------------------------------


def make_operator(**kwargs) -> tuple[MostSimilarTweet, OperatorContext]:
    op = MostSimilarTweet(**kwargs)
    ctx = OperatorContext("similar", 0, ("out",))
    op.bind(ctx)
    op.setup()
    return op, ctx


def consume(op: MostSimilarTweet, ctx: OperatorContext, event: dict) -> None:
    ctx.begin_event(event["tweet_id"], 0)
    op.consume("in", event)


def state_mentions(ctx: OperatorContext) -> set:
    """Every scalar anywhere in the operator's registered state (keys and values, nested)."""
    seen: set = set()

    def walk(x) -> None:
        if isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        else:
            seen.add(x)

    for st in ctx.states.values():
        for k, v in st.items():
            walk(k)
            walk(v)
    return seen


def test_after_a_gap_longer_than_the_window_the_state_holds_only_the_new_tweet():
    """Old tweets expire from the queue and the index: the next tweet has no candidate, no old id or word remains."""
    op, ctx = make_operator(window_s=30)
    for i in range(150):  # more than two queue chunks of 64
        consume(op, ctx, {"location": "x", "tweet_id": 1000 + i, "ts": i // 10, "words": ["common", f"old{i}"]})
    consume(op, ctx, {"location": "x", "tweet_id": 5000, "ts": 100, "words": ["common", "new"]})
    assert ctx.events["out"][-1] == {"location": "x", "tweet_id": 5000, "ts": 100, "best_id": None, "shared": 0}
    assert op.window.len("x") == 1
    assert dict(op.index.items("x")) == {"common": [5000], "new": [5000]}
    mentions = state_mentions(ctx)
    assert not {1000 + i for i in range(150)} & mentions
    assert not {f"old{i}" for i in range(150)} & mentions


def test_a_count_window_keeps_exactly_the_last_n_tweets_in_its_state():
    """With last_n=5, after 200 tweets the queue holds the last 5 and the index exactly their words."""
    op, ctx = make_operator(last_n=5)
    events = [{"location": "x", "tweet_id": i, "ts": i, "words": [f"w{i % 7}", f"v{i % 11}"]} for i in range(200)]
    for e in events:
        consume(op, ctx, e)
    assert [item[0] for item in op.window.items("x")] == [195, 196, 197, 198, 199]
    expected: dict[str, list[int]] = defaultdict(list)
    for e in events[-5:]:
        for w in e["words"]:
            expected[w].append(e["tweet_id"])
    assert dict(op.index.items("x")) == dict(expected)


def test_the_state_restored_from_a_checkpoint_half_way_continues_identically():
    """Checkpoint (encode/decode) every registered state at tweet 1,500, restore into a fresh operator: same outputs."""
    t = tokenize(tweets(ROWS, locations=LOCATIONS, vocab=VOCAB, seed=SEED))
    events = t.to_pylist()

    def run(restore_at: int) -> list[dict]:
        op, ctx = make_operator(window_s=WINDOW_S)
        for i, e in enumerate(events):
            if i == restore_at:
                ckpt = SliceCheckpoint(0, 0, 0, "full", -1, {}, {},
                                       {n: capture_kv(s, False) for n, s in ctx.states.items()})
                ckpt = decode(encode(ckpt))
                op, fresh = make_operator(window_s=WINDOW_S)
                for name, part in ckpt.state.items():
                    restore_kv(fresh.states.setdefault(name, KeyValueState(name)), part)
                fresh.events = ctx.events
                ctx = fresh
            consume(op, ctx, dict(e))
        return ctx.events["out"]

    assert run(restore_at=ROWS // 2) == run(restore_at=-1)
