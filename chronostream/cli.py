"""The ``chronostream`` command line: ``demo`` and ``run``.

Owns: argument parsing and the printing of summaries. Everything it does
goes through the public API (``chronostream.run`` and the Job handle).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import chronostream as cs


def _load_query(path: str) -> cs.Query:
    spec = importlib.util.spec_from_file_location("chronostream_user_query", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    if hasattr(mod, "build"):
        return mod.build()
    if isinstance(getattr(mod, "query", None), cs.Query):
        return mod.query
    raise SystemExit(f"{path} must define build() -> chronostream.Query or a `query` variable")


def cmd_run(args: argparse.Namespace) -> int:
    """Run a query defined in a Python file and print each sink's row count."""
    query = _load_query(args.file)
    t0 = time.perf_counter()
    job = cs.run(query, executor=args.executor, containers=args.containers)
    try:
        job.wait()
        summary = {s.name: job.results(s.name).num_rows for s in job.plan.sinks}
    finally:
        job.stop()
    summary["elapsed_s"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``chronostream`` command."""
    parser = argparse.ArgumentParser(prog="chronostream", description="Elastic stateful stream processing on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the demo job on the 2013 NYC flights and validate it")
    d.add_argument("--containers", type=int, default=2, help="containers per stage (default 2)")
    d.add_argument("--rows", type=int, default=0, help="use only the first N flights (0 = all)")
    d.add_argument("--out", default="out/demo", help="output directory (Parquet sink)")
    r = sub.add_parser("run", help="run a query defined in a Python file (build() or `query`)")
    r.add_argument("file")
    r.add_argument("--executor", default="ray", choices=["ray", "serial", "local"])
    r.add_argument("--containers", type=int, default=2)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from chronostream.demo import run_demo

        return run_demo(containers=args.containers, rows=args.rows, out=Path(args.out))
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
