"""Helpers shared by the benchmarks: argument parsing, medians, JSON output."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line (last line)")
    p.add_argument("--repeat", type=int, default=3, help="runs per configuration (the median is reported)")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    return p


def median(xs: list[float]) -> float:
    """Median of a non-empty list."""
    return float(statistics.median(xs))


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Print a human summary, then (with --json) the JSON object as the last line."""
    for k, v in result.items():
        if k != "rows":
            print(f"{k}: {v}", file=sys.stderr if as_json else sys.stdout)
    for row in result.get("rows", []):
        print("  " + ", ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr if as_json else sys.stdout)
    if as_json:
        print(json.dumps(result))
