"""The top-K example (examples/topk.py): exact at every word event, on every executor, and equal to Spark SQL.

Method: seeded ``topic_text`` lines. The oracle of the operators is a
brute-force recount: at every word event, Counter over the category's last
``window`` words, sorted by (count desc, word asc), first k. The serial
executor must match it at every event; the in-process runtime and Ray must
match the serial executor row for row (identity columns included), on Ray
also with a container killed and the ranking stage scaled out mid-stream
(the windows' state recovers and migrates with its slices); Spark SQL
(a self-join over window positions, ``row_number`` ranking) must compute the
same top lists.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import chronostream as cs
from chronostream.chaos import Fault, run_with_faults
from chronostream.datasets import STOP_WORDS, topic_text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.topk import RankTopK, WindowWordCounts, split_category_words, topk_query


def recount(table, window: int, k: int) -> dict[tuple, tuple[list, list]]:
    """(category, id, pos) -> (top words, top counts), by recounting the window at every word event."""
    words, _ = split_category_words(table)
    seen: dict[str, list[str]] = collections.defaultdict(list)
    out = {}
    for r in words.to_pylist():
        w = seen[r["category"]]
        w.append(r["word"])
        top = sorted(collections.Counter(w[-window:]).items(), key=lambda e: (-e[1], e[0]))[:k]
        out[(r["category"], r["id"], r["pos"])] = ([a for a, _ in top], [b for _, b in top])
    return out


def by_event(result) -> dict[tuple, tuple[list, list]]:
    return {(r["category"], r["id"], r["pos"]): (r["top_words"], r["top_counts"])
            for r in result.to_pylist()}


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), window=st.integers(1, 60), k=st.integers(1, 12),
       vocab=st.sampled_from([30, 45, 120]))
def test_top_lists_equal_a_recount_of_the_window_at_every_word_event(seed, window, k, vocab):
    """Any window length (1 included), k above or below the distinct words: the top list is exact."""
    table = topic_text(120, categories=3, words_per_line=6, vocab=vocab, seed=seed)
    got = by_event(cs.run(topk_query(table, window=window, k=k, slices=2), executor="serial").results("topk"))
    assert got == recount(table, window, k)


def test_stop_words_never_reach_the_window():
    """The split drops every stop word and keeps word positions dense per line."""
    words, parent = split_category_words(topic_text(200, vocab=60, seed=3))
    assert not set(words["word"].to_pylist()) & set(STOP_WORDS)
    per_line = collections.defaultdict(list)
    for r in words.to_pylist():
        per_line[r["id"]].append(r["pos"])
    assert all(p == list(range(len(p))) for p in per_line.values())
    assert len(parent) == words.num_rows


def test_operators_refuse_empty_windows_and_k():
    with pytest.raises(ValueError, match="window must be >= 1"):
        WindowWordCounts(0)
    with pytest.raises(ValueError, match="k must be >= 1"):
        RankTopK(0)


@pytest.mark.parametrize("containers, seed", [(1, 0), (3, 7)])
def test_top_k_on_the_in_process_runtime_equals_the_serial_oracle(containers, seed):
    """Shuffled delivery across containers: every row equal, _order/_sub/_slice/_seq included."""
    expected = cs.run(topk_query(600, window=80, k=5), executor="serial").results("topk")
    got = cs.run(topk_query(600, window=80, k=5), executor="local", containers=containers, seed=seed)
    assert got.results("topk").to_pylist() == expected.to_pylist()


def test_top_k_windows_survive_a_killed_container_and_a_scale_out_on_ray(ray_session):
    """A counting container dies and the ranking stage scales out mid-stream: still the serial output."""
    q = topk_query(1_500, window=200, k=5, slices=6, epoch_events=40)
    faults = [Fault("delay", 0, "text", seconds=0.03), Fault("kill", 8, "counts", index=0),
              Fault("scale_out", 14, "rank", n=1)]
    report = run_with_faults(q, faults, containers={"text": 1, "counts": 2, "rank": 1}, checkpoint_every=3)
    assert report.ok, report.mismatches
    assert len(report.applied) == 3, "the kill and the scale-out landed mid-stream"
    kinds = [k for _, k, _ in report.timeline]
    assert "recovery_end" in kinds and "migration_end" in kinds


SPARK_TOPK = """
WITH w AS (
  SELECT category, id, pos, word,
         ROW_NUMBER() OVER (PARTITION BY category ORDER BY id, pos) AS n
  FROM words
), counted AS (
  SELECT e.category, e.id, e.pos, x.word, COUNT(*) AS cnt
  FROM w e JOIN w x
    ON x.category = e.category AND x.n > e.n - {window} AND x.n <= e.n
  GROUP BY e.category, e.id, e.pos, x.word
), ranked AS (
  SELECT *, ROW_NUMBER() OVER (PARTITION BY category, id, pos ORDER BY cnt DESC, word ASC) AS r
  FROM counted
)
SELECT category, id, pos, r, word, cnt FROM ranked WHERE r <= {k}
"""


def test_top_k_equals_a_spark_sql_computation(spark):
    """Spark SQL ranks every word event's window by a self-join: the same top lists, row for row."""
    table = topic_text(400, categories=4, words_per_line=8, vocab=150, seed=11)
    window, k = 50, 4
    words, _ = split_category_words(table)
    spark.createDataFrame(words.to_pandas()).createOrReplaceTempView("words")
    expected: dict[tuple, tuple[list, list]] = collections.defaultdict(lambda: ([], []))
    for r in sorted(spark.sql(SPARK_TOPK.format(window=window, k=k)).collect(),
                    key=lambda r: (r["category"], r["id"], r["pos"], r["r"])):
        words_, counts = expected[(r["category"], r["id"], r["pos"])]
        words_.append(r["word"])
        counts.append(r["cnt"])
    got = by_event(cs.run(topk_query(table, window=window, k=k, slices=4), executor="local",
                          containers=2).results("topk"))
    assert len(got) == words.num_rows
    assert got == dict(expected)
