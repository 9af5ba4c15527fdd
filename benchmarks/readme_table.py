"""The README's table of current figures, made from the JSON lines the benchmarks print.

    python -m benchmarks.readme_table benchmarks/results/readme.json                   # print it
    python -m benchmarks.readme_table benchmarks/results/readme.json --write README.md  # replace it

Input: files of result lines. A result line is the last stdout line of ``python -m
benchmarks.<name> --json``: one JSON object with the figures under ``rows`` and, from
``benchmarks.common.emit``, ``benchmark``, ``command`` and ``date``. Lines that do not begin
with ``{`` are skipped (the rest of what a run printed); a line without ``rows`` is refused.

Each row of the table is one ``Figure``: the result lines of its benchmark that it takes,
pooled (a median over the lines of one command run several times, a range over series), with
their commands and dates. ``benchmarks/results/readme.json`` holds the lines behind the README's
figures; to change a figure, replace its lines there with a new run's and write the table
again. ``--write`` replaces the lines between the README's ``FIGURES_START`` and
``FIGURES_END`` markers, and refuses a table that would lack a figure.

Owns: reading result lines, each figure's wording from its lines, the table and its place in the
README. Runs no benchmark.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

#: The README lines the table sits between.
FIGURES_START = "<!-- figures:start -->"
FIGURES_END = "<!-- figures:end -->"


class ResultsError(ValueError):
    """A result line or a README the table cannot use; the message names the file (and line)."""


@dataclass(frozen=True)
class Result:
    """One result line: where it was read, which run made it, and its figures."""

    where: str  # "file:line"
    benchmark: str
    command: str
    date: str
    data: dict[str, Any]

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The figures, one dict a configuration."""
        return self.data["rows"]

    def value(self, row: dict[str, Any], name: str) -> Any:
        """``row[name]``, or a ``ResultsError`` naming this line when the row lacks it."""
        if row.get(name) is None:
            raise ResultsError(f"{self.where}: a row of benchmarks.{self.benchmark} has no {name!r}: {row}")
        return row[name]


def parse_result(text: str, where: str) -> Result:
    """One result line, checked: a JSON object with ``rows`` (a list), naming its benchmark,
    command and date.

    >>> parse_result('{"benchmark": "feed", "command": "python -m benchmarks.feed --json", '
    ...              '"date": "2026-11-27", "rows": []}', "x.json:1").benchmark
    'feed'
    >>> parse_result('{"feed_rows_per_s": 90525}', "x.json:1")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    benchmarks.readme_table.ResultsError: x.json:1: no 'rows' in this JSON object: not a benchmark's result ...
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{where}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ResultsError(f"{where}: a JSON {type(data).__name__}, not an object: not a benchmark's result")
    if "rows" not in data:
        raise ResultsError(f"{where}: no 'rows' in this JSON object: not a benchmark's result (python -m "
                           "benchmarks.<name> --json prints one as its last line, its figures under 'rows')")
    if not isinstance(data["rows"], list) or not all(isinstance(r, dict) for r in data["rows"]):
        raise ResultsError(f"{where}: 'rows' must be a list of objects, one a configuration")
    for name in ("benchmark", "command", "date"):
        if not isinstance(data.get(name), str) or not data[name]:
            raise ResultsError(f"{where}: no {name!r}: the table gives each figure's benchmark, command and date "
                               "(benchmarks.common.emit adds them; add them by hand to a line printed without)")
    return Result(where, data["benchmark"], data["command"], data["date"], data)


def read_results(paths: Iterable[str | Path]) -> list[Result]:
    """Every result line of ``paths``, in order (lines not beginning with ``{`` skipped)."""
    results = []
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ResultsError(f"{path}: cannot read it ({exc.strerror or exc})") from None
        for i, line in enumerate(text.splitlines(), 1):
            if line.lstrip().startswith("{"):
                results.append(parse_result(line, f"{path}:{i}"))
    return results


# --- wording ---------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _two_digits(x: float) -> str:
    """Two significant digits: 2.9, 0.75, 25, 2.2."""
    return f"{x:.2g}"


def _size(mb: float) -> str:
    """A state size: MB below 1,000, else GB (1,000 and 1,024 are both 1 GB)."""
    return f"{mb:g} MB" if mb < 1000 else f"{round(mb / 1000):g} GB"


def _and(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _span(values: list[float], fmt: Callable[[float], str]) -> str:
    """One value, or the range ``lo-hi`` of several (each formatted)."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def _by(results: list[Result], key: str, value: str) -> dict[Any, list[float]]:
    """Each row's ``value`` over all lines, grouped by the row's ``key``, in first-seen order."""
    out: dict[Any, list[float]] = {}
    for res in results:
        for row in res.rows:
            out.setdefault(res.value(row, key), []).append(res.value(row, value))
    return out


def throughput_of(config: str, tail: str = "") -> Callable[[list[Result]], str]:
    """Words/s of one configuration of ``benchmarks.throughput``: the median over the lines."""
    def measured(results: list[Result]) -> str:
        words = _by(results, "config", "words_per_s").get(config)
        if not words:
            raise ResultsError(f"{results[0].where}: no row with config {config!r}")
        return f"{_two_digits(_median(words) / 1e6)} M words/s{tail}"
    return measured


#: ``benchmarks.checkpoint``'s targets: the largest epoch with a delta checkpoint at most this
#: many times the largest without, and the throughput at least this share of it.
CHECKPOINT_MAX_RATIO = 1.5
CHECKPOINT_THROUGHPUT_RATIO = 0.9


def checkpoint_cost(results: list[Result]) -> str:
    """Per state size, the median over the lines of each ratio; which sizes meet both targets."""
    highs = _by(results, "state_mb", "delta_max_over_no_ckpt_max")
    rates = _by(results, "state_mb", "delta_throughput_ratio")
    met, missed = [], []
    for mb in sorted(highs):
        high, rate = round(_median(highs[mb]), 3), round(_median(rates[mb]), 3)
        why = ([f"max {high:g}x"] if high > CHECKPOINT_MAX_RATIO else []) + \
              ([f"throughput {rate:g}x"] if rate < CHECKPOINT_THROUGHPUT_RATIO else [])
        (missed if why else met).append(f"{_size(mb)}" + (f" ({', '.join(why)})" if why else ""))
    return "; ".join(filter(None, [f"met at {_and(met)}" if met else "", f"not at {_and(missed)}" if missed else ""]))


def recovery(results: list[Result]) -> str:
    """The median recovery of 1 GB with 2 peers, and how much faster 2 peers are than 1 (range
    over the sizes measured with both)."""
    big = [r["recovery_s"] for res in results for r in res.rows
           if res.value(r, "target_mb") >= 1000 and res.value(r, "peers") == 2]
    if not big:
        raise ResultsError(f"{results[0].where}: no recovery row of 1 GB or more with 2 peers")
    ratios = []
    for res in results:
        by_peers = {(r["target_mb"], r["peers"]): res.value(r, "recovery_s") for r in res.rows}
        ratios += [by_peers[(mb, 1)] / by_peers[(mb, 2)] for mb, p in by_peers if p == 1 and (mb, 2) in by_peers]
    faster = f"; {_span(ratios, lambda x: f'{x:.1f}')}x faster with 2 peers than 1" if ratios else ""
    return f"{_median(big):.2f} s{faster}"


def migration(results: list[Result]) -> str:
    """The reconstruct delay by state size: sizes with one series listed together, a size with
    several series as their range."""
    delays = _by(results, "state_mb", "reconstruct_delay_ms")
    single = [mb for mb in sorted(delays) if len(delays[mb]) == 1]
    parts = []
    if single and len({_size(mb).split()[1] for mb in single}) == 1:  # one unit: "65, 98 ms at 10, 100 MB"
        sizes = [_size(mb).split()[0] for mb in single]
        parts.append(f"{', '.join(f'{delays[mb][0]:.0f}' for mb in single)} ms at "
                     f"{', '.join(sizes)} {_size(single[-1]).split()[1]}")
    else:
        parts += [f"{delays[mb][0]:.0f} ms at {_size(mb)}" for mb in single]
    parts += [f"{_span(delays[mb], lambda x: f'{x:.0f}')} ms at {_size(mb)}" for mb in sorted(delays)
              if len(delays[mb]) > 1]
    return "; ".join(parts)


#: ``benchmarks.slices``' target: 64 slices cost at most this much more than 1, in percent.
SLICES_OVERHEAD_PCT = 5.0
#: The workloads of ``benchmarks.slices`` the figure reports, by the flag each line carries.
SLICE_WORKLOADS = (("topk", "Top-K"), ("join", "join"), (None, "built-in vectorized count"))
_OTHER_SLICE_MODES = ("topk", "join", "per_event", "vectorized", "chained", "rekey", "ray")


def slice_workload(res: Result) -> str | None:
    """The workload a ``benchmarks.slices`` line measured, among ``SLICE_WORKLOADS``; None for
    the others."""
    for flag, name in SLICE_WORKLOADS:
        if flag is None and not any(res.data.get(m) for m in _OTHER_SLICE_MODES):
            return name
        if flag is not None and res.data.get(flag) and not any(res.data.get(m) for m in _OTHER_SLICE_MODES
                                                                if m != flag):
            return name
    return None


def slice_overheads(results: list[Result]) -> str:
    """64 slices against 1, per workload (a range over the lines of one): those within the target
    first."""
    pct: dict[str, list[float]] = {}
    for res in results:
        name = slice_workload(res)
        for row in res.rows:
            if name is not None and res.value(row, "slices") == 64:
                pct.setdefault(name, []).append(res.value(row, "overhead_pct"))
    met, missed = [], []
    for _, name in SLICE_WORKLOADS:
        if name in pct:
            lo, hi = min(pct[name]), max(pct[name])
            if f"{lo:.2g}" == f"{hi:.2g}":
                text = f"{lo:+.2g}%"
            else:  # "+22-25%", or "-3 to +4%" across zero
                text = f"{lo:+.2g}-{hi:.2g}%" if (lo < 0) == (hi < 0) else f"{lo:+.2g} to {hi:+.2g}%"
            (met if hi <= SLICES_OVERHEAD_PCT else missed).append(f"{name} {text}")
    return "; ".join(filter(None, [", ".join(met), ", ".join(missed)]))


#: ``benchmarks.latency``'s windows, as the figure names them.
WINDOW_NAMES = {"5m": "5 minutes", "1h": "1 hour", "7d": "7 days"}


def latency(results: list[Result]) -> str:
    """The p99.9 per window (the median over the lines), their range, and how far apart the
    windows are (largest over smallest, in whole percent, rounded up)."""
    p999 = {w: _median(v) for w, v in _by(results, "window", "p999_ms").items()}
    windows = list(p999)
    spread = math.ceil(round((max(p999.values()) / min(p999.values()) - 1) * 100, 6))
    return (f"p99.9 {_span(list(p999.values()), lambda x: f'{x:.0f}')} ms, within {spread}% from "
            f"{WINDOW_NAMES.get(windows[0], windows[0])} to {WINDOW_NAMES.get(windows[-1], windows[-1])}")


def feed_rates(results: list[Result]) -> str:
    """Rows/s of the feed and the validation (the median over the lines)."""
    rates = _by(results, "step", "rows_per_s")
    return f"{round(_median(rates['feed'])):,} / {round(_median(rates['validate'])):,} rows/s"


def ft_cost(results: list[Result]) -> str:
    """Throughput with checkpoints every second over without, per model (the median over the lines)."""
    vec = _median([res.data["ft_ratio"] for res in results])
    per_event = _median([res.data["ft_ratio_per_event"] for res in results])
    return f"vectorized {vec:.2f}x, per-event {per_event:.2f}x"


def deploy_times(results: list[Result]) -> str:
    """Seconds from ``cs.run`` to the first output: warm p50 and max, cold p50 (medians over the lines)."""
    warm = _median([res.data["warm_first_output_s_p50"] for res in results])
    high = max(res.data["warm_first_output_s_max"] for res in results)
    cold = _median([res.data["cold_first_output_s_p50"] for res in results])
    return f"warm {warm:.2f} s p50, {high:.2f} s max; cold {cold:.1f} s p50"


def state_growth(results: list[Result]) -> str:
    """Rows/s at the largest key count over the smallest, per query (the median over the lines)."""
    ratios: dict[str, list[float]] = {}
    for res in results:
        for query in dict.fromkeys(row["query"] for row in res.rows):
            rows = [row for row in res.rows if row["query"] == query]
            ratios.setdefault(query, []).append(max(rows, key=lambda row: row["keys"])["vs_smallest"])
    return ", ".join(f"{query.replace('_', ' ')} {_median(v):.2f}x" for query, v in ratios.items())


def vs_peers(results: list[Result]) -> str:
    """This runtime with checkpoints over the best peer, per query, over processing time and wall
    time (the medians over the lines)."""
    ratios: dict[str, list[tuple[float, float]]] = {}
    for res in results:
        for row in res.rows:
            if row["system"] == "chronostream" and row["config"] == "checkpoints_on" and "vs_best_peer" in row:
                ratios.setdefault(row["query"], []).append((row["vs_best_peer"], row["vs_best_peer_wall"]))
    return ", ".join(f"{query.replace('_', ' ')} {_median([p for p, _ in v]):.1f}x "
                     f"({_median([w for _, w in v]):.1f}x wall)" for query, v in ratios.items())


def sink_files(results: list[Result]) -> str:
    """Staged parts -> committed files of a 10^7-row Parquet sink, and the last commit's time
    against the job's: committed only at the end, and (the latest line's second configuration,
    when it has one) also every ``max_age_s`` while the job runs."""
    rows = results[-1].rows
    row = rows[0]
    text = (f"{row['staged_parts']:,} parts -> {row['files']} files ({row['mb']:.0f} MB); "
            f"commit {row['commit_s']:.0f} s after a {row['job_s']:.0f} s job")
    live = next((r for r in rows if r.get("max_age_s")), None)
    if live is not None:
        text += (f"; committing every {live['max_age_s']:.0f} s while it runs: {live['files']} files, "
                 f"last commit {live['commit_s']:.0f} s after a {live['job_s']:.0f} s job")
    return text


def sim_runs(results: list[Result]) -> str:
    """Schedules, landed faults and failures of the simulator's runs (summed over the lines), and
    their time."""
    total = {k: sum(res.data[k] for res in results) for k in ("schedules", "faults", "failures", "seconds")}
    return (f"{total['schedules']:,} schedules, {total['faults']:,} faults landed, {total['failures']} failed, "
            f"{total['seconds'] / 60:.0f} min")


# --- the table ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """One row of the table: what is measured, the target, and the wording of the measure from
    the result lines of ``benchmark`` that ``takes`` accepts."""

    what: str
    target: str
    benchmark: str
    measured: Callable[[list[Result]], str]
    takes: Callable[[Result], bool] = lambda res: True


FIGURES = (
    Figure("word count, vectorized, 2 containers a stage, no checkpoints", ">= 1 M words/s", "throughput",
           throughput_of("runtime_vectorized", " over processing time"),
           lambda res: not res.data.get("checkpoint_every")),
    Figure("word count, per-event Python operators", ">= 200,000 words/s", "throughput",
           throughput_of("runtime_per_event"), lambda res: not res.data.get("checkpoint_every")),
    Figure("word count with checkpoints every second, 2 backups, over without", ">= 0.9x", "throughput", ft_cost,
           lambda res: "ft_ratio" in res.data and "ft_ratio_per_event" in res.data),
    Figure("deploy: `cs.run` to first output of a 2-stage job", "warm <= 1 s; cold <= 5 s", "deploy",
           deploy_times),
    Figure("10^7 keys over 10^4, checkpoints every second", ">= 0.7x", "state_growth", state_growth),
    Figure("against the best peer (Spark Structured Streaming, Bytewax), checkpoints on", ">= 3x", "peers",
           vs_peers, lambda res: any("vs_best_peer" in row for row in res.rows)),
    Figure("Parquet sink, 10^7 rows: files, and the commit after the job", "a handful of files", "sink_files",
           sink_files, lambda res: bool(res.rows) and res.rows[0].get("rows", 0) >= 10_000_000),
    Figure("async delta checkpoint after every epoch, one slice", "max epoch <= 1.5x without; throughput >= 0.9x",
           "checkpoint", checkpoint_cost),
    Figure("recovery of 1 GB lost, 2 peers", "< 10 s", "recovery", recovery),
    Figure("live migration pause", "< 200 ms median", "migration", migration),
    Figure("64 slices against 1", "overhead <= 5%", "slices", slice_overheads,
           lambda res: slice_workload(res) is not None),
    Figure("fraud metric latency at half load", "p99.9 < 250 ms, flat over 7 days", "latency", latency),
    Figure("Spark feed / validate, 336,776 flights", "-", "feed", feed_rates),
    Figure("simulated jobs: random queries, fault schedules", "0 failed", "sim", sim_runs),
)


def _command(command: str) -> str:
    """A command as the table shows it: ``python -m`` and ``--json`` left out (every benchmark
    command has them)."""
    words = command.split()
    if words[:2] == ["python", "-m"]:
        words = [w for w in words[2:] if w != "--json"]
    return " ".join(words)


def _commands(results: list[Result]) -> str:
    counts: dict[str, int] = {}
    for res in results:
        counts[res.command] = counts.get(res.command, 0) + 1
    return "; ".join(f"`{_command(c)}`" + (f" ({n} times)" if n > 1 else "") for c, n in counts.items())


def _dates(results: list[Result]) -> str:
    dates = sorted({res.date for res in results})
    return dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"


def table(results: list[Result], complete: bool = False) -> str:
    """The markdown table of every figure with result lines (``complete``: every figure, or a
    ``ResultsError`` naming those without)."""
    lines = ["| benchmark | target | measured | command | date |", "|---|---|---|---|---|"]
    missing = []
    for fig in FIGURES:
        mine = [res for res in results if res.benchmark == fig.benchmark and fig.takes(res)]
        if not mine:
            missing.append(f"{fig.what!r} (benchmarks.{fig.benchmark})")
            continue
        try:
            measured = fig.measured(mine)
        except KeyError as exc:
            raise ResultsError(f"{mine[0].where}: benchmarks.{fig.benchmark}'s rows lack {exc} for {fig.what!r}") \
                from None
        lines.append(f"| {fig.what} | {fig.target} | {measured} | {_commands(mine)} | {_dates(mine)} |")
    if complete and missing:
        raise ResultsError(f"no result line for {', '.join(missing)}: the table would lose them (give every "
                           "benchmark's lines; benchmarks/results/readme.json holds the current ones)")
    return "\n".join(lines) + "\n"


def replace_table(readme: str, new_table: str, where: str = "README.md") -> str:
    """``readme`` with the lines between its ``FIGURES_START`` and ``FIGURES_END`` lines replaced
    by ``new_table``.

    >>> replace_table("a\\n<!-- figures:start -->\\nold\\n<!-- figures:end -->\\nb\\n", "| new |\\n")
    'a\\n<!-- figures:start -->\\n| new |\\n<!-- figures:end -->\\nb\\n'
    """
    lines = readme.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == FIGURES_START]
    ends = [i for i, line in enumerate(lines) if line.strip() == FIGURES_END]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ResultsError(f"{where}: needs one {FIGURES_START} line and, after it, one {FIGURES_END} line around "
                           f"the table (found {len(starts)} and {len(ends)})")
    return "".join(lines[:starts[0] + 1]) + new_table + "".join(lines[ends[0]:])


def current_table(readme: str) -> str:
    """The lines between a README's markers (what ``replace_table`` puts there)."""
    return readme.split(FIGURES_START + "\n", 1)[1].split(FIGURES_END, 1)[0]


def main(argv: list[str] | None = None) -> int:
    """Print the table made from the given result files, or write it into a README."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.readme_table", description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="files of result lines (python -m benchmarks.<name> --json)")
    p.add_argument("--write", metavar="README", help="replace the table between the README's figure markers")
    args = p.parse_args(argv)
    try:
        results = read_results(args.results)
        if args.write:
            path = Path(args.write)
            path.write_text(replace_table(path.read_text(), table(results, complete=True), args.write))
        else:
            sys.stdout.write(table(results))
    except (ResultsError, OSError) as exc:
        print(f"readme_table: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
