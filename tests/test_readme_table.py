"""The README's figures table is generated: ``benchmarks.readme_table`` from the benchmarks' JSON lines.

Covers: the table between the README's markers is exactly what ``benchmarks/results/readme.json``
gives (so it can be regenerated), the README's length limit, a result line without ``rows``
refused with a message naming the file and line, ``--write`` refusing a table that would lose
figures, the lines ``benchmarks.common.emit`` prints being accepted, and the module's doctests.
"""

from __future__ import annotations

import doctest
import json
import re
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # (the benchmarks package lives beside the layers, not in the distribution)
from benchmarks import readme_table  # noqa: E402
from benchmarks.common import emit  # noqa: E402

README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results" / "readme.json"


def test_the_readme_table_is_what_the_stored_results_give():
    """Regenerating from benchmarks/results/readme.json reproduces the README byte for byte."""
    readme = README.read_text()
    made = readme_table.table(readme_table.read_results([RESULTS]), complete=True)
    assert readme_table.current_table(readme) == made
    assert readme_table.replace_table(readme, made) == readme
    assert len(made.splitlines()) == 2 + len(readme_table.FIGURES)


def test_the_readme_stays_within_200_lines():
    assert len(README.read_text().splitlines()) <= 200


def test_write_replaces_only_the_table_between_the_markers(tmp_path):
    """``--write`` on a README whose table is stale puts the stored figures back, and nothing else
    changes."""
    readme = README.read_text()
    stale = readme.replace("| 6.27 s;", "| 9.99 s;")
    assert stale != readme
    path = tmp_path / "README.md"
    path.write_text(stale)
    assert readme_table.main([str(RESULTS), "--write", str(path)]) == 0
    assert path.read_text() == readme


def test_a_json_line_without_rows_is_refused_naming_the_file_and_line(tmp_path, capsys):
    """A JSON object without ``rows`` (say, the result's scalars copied by hand) is no benchmark
    result: the script exits 2 with one line naming the file, the line and what is expected."""
    good = RESULTS.read_text().splitlines()[0]
    bad = json.loads(good)
    del bad["rows"]
    path = tmp_path / "results.json"
    path.write_text("a line the benchmark printed before its result\n" + good + "\n" + json.dumps(bad) + "\n")
    assert readme_table.main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"readme_table: {path}:3: no 'rows' in this JSON object: not a benchmark's result (python -m "
                   "benchmarks.<name> --json prints one as its last line, its figures under 'rows')")


def test_write_refuses_a_table_that_would_lose_figures(tmp_path, capsys):
    """Results of one benchmark only: printing shows its figures; writing is refused, naming the
    figures without a line, and leaves the README as it was."""
    throughput = [line for line in RESULTS.read_text().splitlines() if '"benchmark": "throughput"' in line]
    results = tmp_path / "throughput.json"
    results.write_text("\n".join(throughput) + "\n")
    assert readme_table.main([str(results)]) == 0
    printed = capsys.readouterr().out
    # (three figures: no checkpoints, per-event, and checkpoints over none)
    assert printed.count("\n") == 5 and "M words/s over processing time" in printed
    assert re.search(r"vectorized \d\.\d\dx, per-event \d\.\d\dx", printed)
    path = tmp_path / "README.md"
    path.write_text(README.read_text())
    assert readme_table.main([str(results), "--write", str(path)]) == 2
    assert "no result line for 'deploy: " in capsys.readouterr().err
    assert path.read_text() == README.read_text()


def test_a_line_emit_prints_is_a_result_with_its_command_and_date(capsys, monkeypatch):
    """``benchmarks.common.emit`` adds the benchmark's name, its command line and the date to the
    JSON line, which the table reads as is."""
    monkeypatch.setattr(sys, "argv", ["/somewhere/benchmarks/feed.py", "--json", "--repeat", "1"])
    emit({"rows": [{"step": "feed", "rows_per_s": 1000}, {"step": "validate", "rows_per_s": 500}]}, True)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    result = readme_table.parse_result(line, "stdout:1")
    assert (result.benchmark, result.command) == ("feed", "python -m benchmarks.feed --json --repeat 1")
    assert len(result.date) == 10 and result.date[4] == "-"
    row = readme_table.table([result]).splitlines()[-1]
    assert row == (f"| Spark feed / validate, 336,776 flights | - | 1,000 / 500 rows/s | `benchmarks.feed --repeat 1` "
                   f"| {result.date} |")


def test_the_module_docstring_examples():
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    report: list[str] = []
    tests = finder.find(readme_table, "benchmarks.readme_table")
    for test in tests:
        runner.run(test, out=report.append)
    assert sum(len(t.examples) for t in tests) >= 3
    assert runner.failures == 0, "".join(report)
