"""``python -m benchmarks.figures``: the paper's figures as PNGs from the benchmarks' JSON lines.

In ``make test``: the slice benchmark runs live on its quick settings (two seconds, no Ray) and
the figures are drawn from its line beside the committed quick-run lines of the others (``tests/data/quick_results.json``: the last stdout line of each
``python -m benchmarks.<name> --quick --json``, its command in it); every figure is a non-empty
PNG. Extended: every benchmark runs live on its quick settings first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import last_json_line
from benchmarks.figures import FIGURES, draw, main, newest, read_results

ROOT = Path(__file__).parent.parent
QUICK = Path(__file__).parent / "data" / "quick_results.json"
PNG = b"\x89PNG\r\n\x1a\n"


def _quick_run(name: str) -> dict:
    out = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--quick", "--json"], capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return last_json_line(out.stdout)


def _assert_drawn(results: list[dict], out: Path) -> None:
    drawn, skipped = draw(results, out)
    assert skipped == [] and [d["figure"] for d in drawn] == list(FIGURES)
    for d in drawn:
        data = (out / f"{d['figure']}.png").read_bytes()
        assert data[:8] == PNG and len(data) > 10_000 and d["bytes"] == len(data), d


def test_the_figures_are_drawn_from_quick_runs(tmp_path, capsys):
    live = _quick_run("slices")
    committed = read_results([QUICK])
    assert all("--quick" in r["command"] for r in committed)
    results = tmp_path / "results.json"
    results.write_text("".join(json.dumps(r) + "\n" for r in committed + [live]))
    main(["--results", str(results), "--out", str(tmp_path / "figures"), "--json"])
    out = last_json_line(capsys.readouterr().out)
    assert out["skipped"] == [] and [r["figure"] for r in out["rows"]] == list(FIGURES)
    # The live line comes last: the slice overhead is drawn from it.
    assert next(r for r in out["rows"] if r["figure"] == "slices")["from"].startswith(live["command"])
    for r in out["rows"]:
        data = (tmp_path / "figures" / f"{r['figure']}.png").read_bytes()
        assert data[:8] == PNG and len(data) > 10_000 and r["bytes"] == len(data), r


def test_a_figure_without_its_data_is_skipped_and_named(tmp_path):
    """A migration line without the stop-copy baseline (``--no-stop-copy``: nulls) and no other
    benchmark: nothing to draw, each figure named; a recovery sweep over peers is preferred to a
    newer line of one peer count."""
    lines = [{"benchmark": "migration", "rows": [{"state_mb": 10, "reconstruct_delay_ms": 50, "stop_copy_delay_ms": None},
                                                 {"state_mb": 100, "reconstruct_delay_ms": 60, "stop_copy_delay_ms": None}]}]
    path = tmp_path / "r.json"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    drawn, skipped = draw(read_results([path]), tmp_path / "out")
    assert drawn == [] and skipped == list(FIGURES)
    sweep = {"benchmark": "recovery", "rows": [{"target_mb": 10, "peers": p, "recovery_s": 1.0 / p} for p in (1, 2)]}
    one = {"benchmark": "recovery", "rows": [{"target_mb": 10, "peers": 2, "recovery_s": 0.4}]}
    assert newest([sweep, one], "recovery", "target_mb", "peers", "recovery_s", sweep="peers") is sweep
    assert newest([one], "recovery", "target_mb", "peers", "recovery_s", sweep="peers") is one


@pytest.mark.extended
def test_the_figures_are_drawn_from_every_benchmark_run_live_on_its_quick_settings(tmp_path):
    _assert_drawn([_quick_run(name) for name in FIGURES], tmp_path)
