"""What the examples' command lines share: the executor flags and a timed run.

Owns nothing but argument parsing and timing for ``python -m examples.<name>``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import chronostream as cs


def add_run_flags(ap: argparse.ArgumentParser, slices: int = 8) -> None:
    """``--seed``, ``--slices``, ``--executor`` (local, serial, ray) and ``--containers``."""
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--slices", type=int, default=slices)
    ap.add_argument("--executor", choices=["local", "serial", "ray"], default="local")
    ap.add_argument("--containers", type=int, default=2)


def run_timed(q: cs.Query, args: argparse.Namespace) -> tuple[Any, float]:
    """Run ``q`` on ``args.executor`` to the end; (job, seconds). Stop a Ray job with ``job.stop()``."""
    start = time.perf_counter()
    kwargs = {} if args.executor == "serial" else {"containers": args.containers}
    job = cs.run(q, executor=args.executor, **kwargs)
    if args.executor == "ray":
        job.wait()
    return job, time.perf_counter() - start
