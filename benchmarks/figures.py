"""The paper's figures as pictures: PNGs (matplotlib) drawn from the benchmarks' JSON lines.

Reads JSON-lines files of benchmark results (each line one benchmark's last stdout line, as
``python -m benchmarks.<name> --json`` prints it; default ``benchmarks/results/readme.json``, the
lines the README's table is made from) and draws, from the newest line of each benchmark that has
what a figure needs (a sweep preferred):

- ``migration.png``: a migrated slice's output delay against its state size, live migration
  (``reconstruct``) beside stop-copy-restart and no migration (the paper's Fig. 14);
- ``checkpoint.png``: delta checkpoints' interference: throughput and the slowest epoch, each over
  the run without checkpoints, against state size (Fig. 18);
- ``recovery.png``: recovery time against the peers rebuilding the lost slices, per lost state
  size (Fig. 19);
- ``slices.png``: throughput overhead against slices per container (Fig. 21);
- ``latency.png``: end-to-end latency percentiles against window length;
- ``peers.png``: throughput against Spark Structured Streaming and Bytewax, per query.

A figure whose data is missing is skipped and named. The last stdout line is one JSON object,
``rows`` one per figure drawn (its file, bytes and the result line it came from).

    python -m benchmarks.figures --json                       # into docs/figures/
    python -m benchmarks.figures --results my.json --out /tmp/figs --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # (files only: no display)
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.common import emit  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DEFAULT_RESULTS = (RESULTS / "readme.json",)
DEFAULT_OUT = Path(__file__).parent.parent / "docs" / "figures"

Result = dict[str, Any]


def read_results(paths: list[Path]) -> list[Result]:
    """Every result line of ``paths`` (missing files: none), in file order."""
    out = []
    for path in paths:
        if path.exists():
            out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def newest(results: list[Result], benchmark: str, *fields: str, sweep: str = "") -> Result | None:
    """The last line of ``benchmark`` whose every row has ``fields`` (not null), preferring one whose
    rows take two values of ``sweep`` at least (a curve; a quick run may have one point)."""
    def has(r: Result) -> bool:
        return bool(r.get("rows")) and all(row.get(f) is not None for row in r["rows"] for f in fields)

    found = [r for r in results if r.get("benchmark") == benchmark and has(r)]
    curves = [r for r in found if not sweep or len({row[sweep] for row in r["rows"]}) > 1]
    return (curves or found or [None])[-1]


def _axes(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _curves(ax: Any, rows: list[dict[str, Any]], x: str, curves: list[tuple[str, str, str]]) -> None:
    """One line per (field, style, label) of ``rows`` over ``x``, on a log x axis, with a legend."""
    for field, style, label in curves:
        ax.plot([r[x] for r in rows], [r[field] for r in rows], style, label=label)
    ax.set_xscale("log")
    ax.legend()


def _source(fig: Any, result: Result) -> None:
    fig.text(0.01, 0.005, f"{result.get('command', '')} ({result.get('date', '')})", fontsize=6, color="#777")


def migration_figure(results: list[Result]) -> tuple[Any, Result] | None:
    r = newest(results, "migration", "state_mb", "reconstruct_delay_ms", "stop_copy_delay_ms", sweep="state_mb")
    if r is None:
        return None
    rows = sorted(r["rows"], key=lambda x: x["state_mb"])
    fig, ax = _axes("Migration: output delay of the moved slice", "state of the moved slice (MB)",
                    "output delay during migration (ms)")
    curves = [("reconstruct_delay_ms", "o-", "live migration (ChronoStream)"),
              ("stop_copy_delay_ms", "s--", "stop, copy, restart")]
    if all(x.get("no_migration_delay_ms") is not None for x in rows):
        curves.append(("no_migration_delay_ms", ":", "no migration"))
    _curves(ax, rows, "state_mb", curves)
    return fig, r


def checkpoint_figure(results: list[Result]) -> tuple[Any, Result] | None:
    r = newest(results, "checkpoint", "state_mb", "delta_throughput_ratio", "delta_max_over_no_ckpt_max",
               sweep="state_mb")
    if r is None:
        return None
    rows = sorted(r["rows"], key=lambda x: x["state_mb"])
    fig, ax = _axes("Checkpoint interference (delta checkpoints every epoch)", "state (MB)",
                    "with checkpoints / without")
    ax.axhline(1.0, color="#777", lw=0.8)
    _curves(ax, rows, "state_mb", [("delta_throughput_ratio", "o-", "throughput"),
                                   ("delta_max_over_no_ckpt_max", "s--", "slowest epoch")])
    return fig, r


def recovery_figure(results: list[Result]) -> tuple[Any, Result] | None:
    r = newest(results, "recovery", "target_mb", "peers", "recovery_s", sweep="peers")
    if r is None:
        return None
    fig, ax = _axes("Recovery time against peers", "peers rebuilding the lost slices", "recovery (s)")
    for mb in sorted({x["target_mb"] for x in r["rows"]}):
        rows = sorted((x for x in r["rows"] if x["target_mb"] == mb), key=lambda x: x["peers"])
        ax.plot([x["peers"] for x in rows], [x["recovery_s"] for x in rows], "o-", label=f"{mb} MB lost")
    ax.set_xticks(sorted({x["peers"] for x in r["rows"]}))
    ax.set_ylim(bottom=0)
    ax.legend()
    return fig, r


def slices_figure(results: list[Result]) -> tuple[Any, Result] | None:
    r = newest(results, "slices", "slices", "overhead_pct", sweep="slices")
    if r is None:
        return None
    rows = sorted(r["rows"], key=lambda x: x["slices"])
    fig, ax = _axes("Slice overhead: one container, more slices", "slices", "throughput lost (%)")
    ax.plot([x["slices"] for x in rows], [x["overhead_pct"] for x in rows], "o-", label="keyed count")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.legend()
    return fig, r


def latency_figure(results: list[Result]) -> tuple[Any, Result] | None:
    r = newest(results, "latency", "window", "p50_ms", "p99_ms", "p999_ms", sweep="window")
    if r is None:
        return None
    fig, ax = _axes("End-to-end latency against window length", "window", "latency (ms)")
    windows = [x["window"] for x in r["rows"]]
    for q, style in (("p50", "o-"), ("p99", "s-"), ("p999", "^-")):
        ax.plot(windows, [x[f"{q}_ms"] for x in r["rows"]], style, label=q.replace("p999", "p99.9"))
    ax.set_ylim(bottom=0)
    ax.legend()
    return fig, r


def peers_figure(results: list[Result]) -> tuple[Any, Result] | None:
    r = newest(results, "peers", "query", "system", "config", "words_per_s")
    if r is None:
        return None
    fig, ax = _axes("Throughput against the peers (2 cores)", "words/s (millions)", "")
    rows = r["rows"]
    fig.set_size_inches(7.0, 1.6 + 0.32 * len(rows))
    colours = {"chronostream": "#d62728", "spark": "#1f77b4", "bytewax": "#2ca02c"}
    ax.barh(range(len(rows)), [x["words_per_s"] / 1e6 for x in rows],
            color=[colours.get(x["system"], "#777") for x in rows])
    ax.set_yticks(range(len(rows)), [f"{x['query']} · {x['system']} · {x['config'].replace('_', ' ')}" for x in rows],
                  fontsize=8)
    ax.invert_yaxis()
    return fig, r


FIGURES: dict[str, Callable[[list[Result]], tuple[Any, Result] | None]] = {
    "migration": migration_figure, "checkpoint": checkpoint_figure, "recovery": recovery_figure,
    "slices": slices_figure, "latency": latency_figure, "peers": peers_figure}


def draw(results: list[Result], out: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Write every figure the results allow into ``out``; returns (drawn rows, figures skipped)."""
    out.mkdir(parents=True, exist_ok=True)
    drawn, skipped = [], []
    for name, make in FIGURES.items():
        made = make(results)
        if made is None:
            skipped.append(name)
            continue
        fig, source = made
        _source(fig, source)
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        path = out / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        drawn.append({"figure": name, "path": os.path.relpath(path), "bytes": path.stat().st_size,
                      "from": f"{source.get('command', '')} ({source.get('date', '')})"})
    return drawn, skipped


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", action="append", type=Path, default=None,
                   help="a JSON-lines file of results (repeatable; default: benchmarks/results/readme.json)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory of the PNGs (default docs/figures)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line (last line)")
    args = p.parse_args(argv)
    drawn, skipped = draw(read_results(args.results or list(DEFAULT_RESULTS)), args.out)
    if skipped:
        print(f"no data for: {', '.join(skipped)}", file=sys.stderr)
    emit({"out": str(args.out), "skipped": skipped, "rows": drawn}, args.json)


if __name__ == "__main__":
    main()
