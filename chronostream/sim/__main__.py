"""``python -m chronostream.sim``: run seeded simulations, report, and replay one seed's story.

    python -m chronostream.sim --seeds 1-1000 --json   # last line: one JSON object
    python -m chronostream.sim --seeds 1-10000 --jobs 2 # on two processes
    python -m chronostream.sim --seed 42 --story       # one seed's timeline
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

from chronostream.sim.faults import FAULT_KINDS
from chronostream.sim.runner import fault_counts, run_seeds


def parse_seeds(text: str) -> list[int]:
    """``"1-5,9"`` -> ``[1, 2, 3, 4, 5, 9]``.

    >>> parse_seeds("1-3,7")
    [1, 2, 3, 7]
    """
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        out += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the simulator; 0 when every seed passed, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m chronostream.sim",
                                     description="Seeded whole-job simulations with faults, checked against "
                                                 "the serial executor")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--seeds", help="seeds to run, e.g. 1-1000 or 1-10,42")
    which.add_argument("--seed", type=int, help="one seed")
    parser.add_argument("--story", action="store_true", help="print each seed's timeline")
    parser.add_argument("--kinds", default=",".join(FAULT_KINDS),
                        help=f"fault kinds to draw from (default all: {','.join(FAULT_KINDS)})")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of totals")
    parser.add_argument("--jobs", type=int, default=1,
                        help=f"processes to run seeds on (this machine has {os.cpu_count()} CPUs; default 1)")
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(FAULT_KINDS))
    if unknown:
        parser.error(f"unknown fault kinds {unknown}; kinds: {', '.join(FAULT_KINDS)}")
    seeds = parse_seeds(args.seeds) if args.seeds else [args.seed]
    t0 = time.perf_counter()
    results = []
    failed = []
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    for r in run_seeds(seeds, kinds, args.jobs):
        seed = r.seed
        results.append(r)
        if args.story:
            print(r.format_story())
        if not r.ok:
            failed.append(seed)
            if not args.story:
                print(f"seed {seed} FAILED: {r.failures[0].splitlines()[0]}\n  {r.shape}\n"
                      f"  replay: {r.replay_command()}", file=sys.stderr)
    by_kind = fault_counts(results)
    inapplicable = sum(x.effect.startswith("inapplicable") for r in results for x in r.faults)
    # (``benchmark``, ``command``, ``date`` and ``rows``: a result line as the benchmarks print
    # them, so the README's table of figures takes it: ``benchmarks.readme_table``)
    command = "python -m chronostream.sim " + " ".join(argv if argv is not None else sys.argv[1:])
    totals = {"benchmark": "sim", "command": command, "date": datetime.date.today().isoformat(),
              "schedules": len(results), "faults": sum(by_kind.values()), "faults_by_kind": by_kind,
              "inapplicable": inapplicable, "failures": len(failed), "failed_seeds": failed[:100],
              "rounds": sum(r.rounds for r in results),
              "rows": [{"kind": k, "landed": n} for k, n in by_kind.items()],
              "seconds": round(time.perf_counter() - t0, 2)}
    if args.json:
        print(json.dumps(totals))
    elif not args.story:
        print(f"{totals['schedules']} schedules, {totals['faults']} faults landed "
              f"({', '.join(f'{k} {v}' for k, v in by_kind.items())}), {totals['failures']} failed, "
              f"{totals['seconds']} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
