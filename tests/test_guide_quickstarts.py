"""The quickstarts of docs/guide.md run as they stand.

Method: every python code block the guide marks with ``<!-- test: NAME -->`` on the line before
it is run, the blocks of one name in order in one namespace (``__main__``), with tracebacks
pointing at the guide's lines; then the names the recipe leaves are checked against the same
figures computed another way. The recipes' temporary directories go under the test's
``tmp_path``. The Spark recipe runs on the suite's one Spark session (``spark``), the Ray ones on
its Ray (``ray_session``: a process connected to Ray runs ``cs.run(address=...)`` there).
"""

from __future__ import annotations

import re
import tempfile
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"
MARKED = re.compile(r"^<!-- test: ([\w-]+) -->\n```python\n(.*?)^```$", re.M | re.S)
RECIPES = {"quickstart-parquet", "quickstart-spark", "quickstart-ray"}


def guide_blocks() -> dict[str, list[tuple[int, str]]]:
    """Name -> the marked blocks of that name: (line of the block's first code line, code)."""
    text = GUIDE.read_text()
    blocks: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for m in MARKED.finditer(text):
        blocks[m.group(1)].append((text.count("\n", 0, m.start(2)) + 1, m.group(2)))
    return blocks


def run_recipe(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Run the blocks called ``name`` in one namespace; return it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (the recipes' mkdtemp)
    ns: dict = {"__name__": "__main__"}
    for line, code in guide_blocks()[name]:
        exec(compile("\n" * (line - 1) + code, str(GUIDE), "exec"), ns)  # noqa: S102 - the guide's code
    return ns


def last_per_key(updates: pa.Table, key: str, columns: list[str]) -> dict[str, tuple]:
    """Each key's last running update (greatest ``_order``): key -> the columns' values."""
    rows = updates.sort_by([("_order", "ascending"), ("_sub", "ascending")]).to_pylist()
    return {r[key]: tuple(r[c] for c in columns) for r in rows}


def test_every_python_block_of_the_quickstarts_is_marked_for_testing():
    """The Quickstarts section has no python block the tests skip, and the three recipes are there."""
    text = GUIDE.read_text()
    section = text[text.index("\n## Quickstarts\n"):text.index("\n## Operators\n")]
    assert section.count("```python") == section.count("<!-- test: ")
    assert set(guide_blocks()) >= RECIPES


def test_the_parquet_quickstart_reads_files_into_a_source_and_a_source_log(tmp_path, monkeypatch):
    """From Parquet files: per card, the count and sum of payments of 5 or more (in-memory
    source), and the sum of all payments (source log); the last update per card equals the
    figures computed from the files with pyarrow."""
    ns = run_recipe("quickstart-parquet", tmp_path, monkeypatch)
    pay = ns["pay"]
    big = pay.filter(pc.greater_equal(pay["amount"], 5.0))
    expected = {r["card"]: (r["amount_count"], r["amount_sum"])
                for r in big.group_by("card").aggregate([("amount", "count"), ("amount", "sum")]).to_pylist()}
    assert ns["updates"].num_rows == big.num_rows
    got = last_per_key(ns["updates"], "card", ["count", "sum_amount"])
    assert got.keys() == expected.keys()
    assert all(got[k][0] == expected[k][0] and got[k][1] == pytest.approx(expected[k][1]) for k in expected)
    assert {r["card"]: (r["count_last"], pytest.approx(r["sum_amount_last"])) for r in ns["latest"].to_pylist()} \
        == got
    totals = last_per_key(ns["totals"], "card", ["sum_amount"])
    all_sums = {r["card"]: r["amount_sum"] for r in pay.group_by("card").aggregate([("amount", "sum")]).to_pylist()}
    assert ns["totals"].num_rows == pay.num_rows and totals.keys() == all_sums.keys()
    assert all(totals[k][0] == pytest.approx(all_sums[k]) for k in all_sums)


def test_the_spark_quickstart_feeds_runs_on_ray_and_validates(ray_session, spark, tmp_path, monkeypatch):
    """A DataFrame fed to a source log, a running sum per card on Ray, validated by Spark."""
    ns = run_recipe("quickstart-spark", tmp_path, monkeypatch)
    assert ns["spark"] is spark
    assert ns["report"].ok and ns["report"].output_rows == 2_000 == ns["report"].expected_rows


def test_the_ray_quickstart_runs_on_the_cluster_it_is_connected_to(ray_session, tmp_path, monkeypatch):
    """``address="auto"`` in a process connected to Ray: the job runs on that Ray, the stages on the
    containers asked, and every payment gives one update."""
    ns = run_recipe("quickstart-ray", tmp_path, monkeypatch)
    per_card = ns["per_card"]
    assert per_card.num_rows == 20_000
    assert sum(count for (count,) in last_per_key(per_card, "card", ["count"]).values()) == 20_000
    assert [len(ns["where"][stage]) for stage in ("payments", "per_card")] == [1, 4]
    assert sorted(s for slices in ns["where"]["per_card"].values() for s in slices) == list(range(16))
