"""The ``chronostream`` command line: ``demo``, ``run``, ``submit``, ``chaos``, ``validate``, and control of running jobs.

Running jobs, found by name on the cluster their record on this machine
names (or ``--address``): ``jobs``, ``status``, ``attach``, ``stop``,
``placement``, ``metrics``, ``log-floor``, ``scale-out``, ``scale-in``,
``migrate``, ``compact``, ``savepoint``, ``scale-up``, ``scale-down``; and
offline, ``autoscale-sim`` replays a recorded metrics trace through a policy.

Owns: argument parsing and the printing of summaries. Everything it does
goes through the public API (``chronostream.run`` and the Job handle).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import json
import os
import signal
import sys
import time
import webbrowser
from dataclasses import asdict
from pathlib import Path
import ray

import chronostream as cs
from chronostream.chaos import Fault, random_faults, run_with_faults
from chronostream.client import Job, keep_warm_hosts
from chronostream.cluster import connected_address, ensure_ray, probe
from chronostream.job import job_states, same_cluster
from chronostream.job_records import all_records, read_record, remove_record
from chronostream.live_view import EpochBar, top
from chronostream.demo import run_demo
from chronostream.master.migration import MigrationError
from chronostream.master.policies import BUILTIN, read_trace, simulate
from chronostream.slices.errors import ChronoStreamError, ClusterError
from chronostream.spark import spark_session, validate

#: Seconds between two progress lines of ``attach``.
ATTACH_EVERY_S = 2.0


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


def parse_options(pairs: list[str]) -> cs.JobOptions:
    """``JobOptions`` from ``NAME=VALUE`` pairs (``--option``), each value read as its field's type.

    >>> parse_options(["checkpoint_interval_s=1.5", "output_log=false", "backup_factor=1"])
    JobOptions(... output_log=False, ... checkpoint_interval_s=1.5, backup_factor=1, ...)
    >>> parse_options(["backup=1"])
    Traceback (most recent call last):
    ...
    SystemExit: --option backup=1: JobOptions has no field 'backup' (did you mean 'backup_factor'?)
    """
    defaults = cs.JobOptions()
    fields = {f.name for f in dataclasses.fields(cs.JobOptions)}
    values: dict[str, object] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in fields:
            near = difflib.get_close_matches(name, sorted(fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f" (fields: {', '.join(sorted(fields))})"
            raise SystemExit(f"--option {pair}: " + (f"JobOptions has no field {name!r}{hint}" if sep
                                                    else "expected NAME=VALUE"))
        kind = type(getattr(defaults, name)) if getattr(defaults, name) is not None else float
        try:
            if kind is bool:
                if text.strip().lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError(text)
                values[name] = text.strip().lower() in ("true", "1", "yes", "on")
            else:
                values[name] = kind(text)
        except ValueError:
            what = {bool: "true or false", int: "an integer", float: "a number"}.get(kind, kind.__name__)
            raise SystemExit(f"--option {pair}: {name} takes {what}") from None
    try:
        return cs.JobOptions(**values)
    except ValueError as exc:
        raise SystemExit(f"--option: {exc}") from None


def parse_drops(specs: list[str]) -> dict[str, list[str]] | None:
    """``--drop-state STAGE:STATE`` values as ``drop_states`` (stage -> states).

    >>> parse_drops(["sums:totals", "sums:seen"])
    {'sums': ['totals', 'seen']}
    >>> parse_drops(["sums"])
    Traceback (most recent call last):
    ...
    SystemExit: --drop-state takes STAGE:STATE, got 'sums'
    """
    out: dict[str, list[str]] = {}
    for spec in specs:
        stage, sep, state = spec.rpartition(":")
        if not sep or not stage or not state:
            raise SystemExit(f"--drop-state takes STAGE:STATE, got {spec!r}")
        out.setdefault(stage, []).append(state)
    return out or None


def cmd_run(args: argparse.Namespace) -> int:
    """Run a query defined in a Python file and print each sink's row count."""
    query = _load_query(args.file)
    t0 = time.perf_counter()
    try:
        job = cs.run(query, executor=args.executor, containers=args.containers, options=parse_options(args.option),
                     restore_from=args.restore, drop_states=parse_drops(args.drop_state))
        url = job.status().dashboard_url if isinstance(job, Job) else ""
        if url:
            print(f"{job.key}: dashboard at {url}", file=sys.stderr)
        try:
            job.wait()
            summary = {s.name: job.results(s.name).num_rows for s in job.plan.sinks}
        finally:
            job.stop()
    except (ChronoStreamError, ValueError, OSError) as exc:  # (an OSError: e.g. a sink directory in use)
        print(f"chronostream run: {exc}", file=sys.stderr)
        return 1
    summary["elapsed_s"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(summary))
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    """Go on with the job whose files are in a work directory after every process of it died:
    on a cluster (``--address``: print its name), or here to its end (print each sink's rows)."""
    t0 = time.perf_counter()
    try:
        address = args.address or os.environ.get("RAY_ADDRESS")
        job = cs.resume(args.workdir, address=address)
        if address:
            print(f"resumed {job.key} on the Ray cluster at {connected_address()}; follow it with "
                  f"`chronostream attach {job.key}`", file=sys.stderr)
            print(job.key)
            return 0
        try:
            job.wait()
            summary = {s.name: job.results(s.name).num_rows for s in job.plan.sinks}
        finally:
            job.stop()
    except (ChronoStreamError, ValueError, OSError) as exc:
        print(f"chronostream resume: {exc}", file=sys.stderr)
        return 1
    summary["elapsed_s"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(summary))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    """Submit a query defined in a Python file to a Ray cluster; print the job's name."""
    query = _load_query(args.file)
    try:
        job = cs.submit(query, address=args.address, containers=args.containers, options=parse_options(args.option),
                        restore_from=args.restore, name=args.name, workdir=args.workdir,
                        drop_states=parse_drops(args.drop_state))
    except (ChronoStreamError, ValueError, OSError) as exc:  # (an OSError: e.g. a sink directory in use)
        print(f"chronostream submit: {exc}", file=sys.stderr)
        return 1
    print(f"submitted {job.key} to the Ray cluster at {connected_address()}; follow it with `chronostream attach "
          f"{job.key}`, end it with `chronostream stop {job.key}`", file=sys.stderr)
    print(job.key)
    return 0


def _parse_kill(spec: str) -> Fault:

    stage, _, epoch = spec.partition("@")
    if not stage or not epoch.isdigit():
        raise SystemExit(f"--kill takes STAGE@EPOCH (e.g. count@10), got {spec!r}")
    return Fault("kill", int(epoch), stage)


def cmd_chaos(args: argparse.Namespace) -> int:
    """Run a query with faults, compare every sink with the serial executor, print the timeline."""

    faults = [_parse_kill(k) for k in args.kill]
    try:  # (before the query runs: a typo costs no job)
        faults += [Fault.parse(spec) for spec in args.fault]
        kinds = tuple(k for k in args.kinds.split(",") if k)
        for kind in kinds:
            Fault(kind, 0)  # (an unknown kind is refused here, naming the kinds there are)
    except ValueError as exc:
        raise SystemExit(f"chronostream chaos: {exc}") from None
    query = _load_query(args.file)
    stages = [s.name for s in cs.compile_query(query)[0].stages if s.kind == "operator"]
    if args.faults:
        epochs = cs.compile_query(query)[0].num_epochs or 10
        try:
            faults += random_faults(args.seed, args.faults, stages, max(2, epochs * 3 // 4), args.containers, kinds)
        except ValueError as exc:
            raise SystemExit(f"chronostream chaos: {exc}") from None
    faults.sort(key=lambda f: f.at_epoch)  # (stable: same-epoch faults keep the order given)
    if args.delay:
        source = next(s.name for s in cs.compile_query(query)[0].stages if s.kind == "source")
        faults.insert(0, Fault("delay", 0, source, seconds=args.delay))
    for f in faults:
        print("scheduled:", f.describe())
    report = run_with_faults(query, faults, containers=args.containers, checkpoint_every=args.checkpoint_every,
                             backup_factor=args.backup_factor, settle_pace_s=args.settle_pace)
    print(report.format_timeline())
    print(report.format_landings())
    missed = report.not_landed()
    print(f"applied {len(report.applied)} of {len(faults)} faults"
          + ("" if len(report.applied) == len(faults) else
             " (the job ended before the rest: raise --delay or --settle-pace)")
          + (f"; {len(missed)} did not land" if missed else ""))
    for name, n in report.rows.items():
        verdict = "OK" if name not in report.mismatches else f"DIFFERS: {report.mismatches[name]}"
        print(f"sink {name!r}: {n} rows, {verdict} (vs the serial executor)")
    return 0 if report.ok and not missed else 1


def cmd_validate(args: argparse.Namespace) -> int:
    """Validate a Parquet sink directory against expected rows (Parquet) with Spark."""

    spark = spark_session(args.master)
    expected = spark.read.parquet(args.expected)
    if args.drop_system:
        expected = expected.drop(*[c for c in expected.columns if c in ("_slice", "_seq", "_sub")])
    report = validate(args.output, expected, key=[k for k in args.key.split(",") if k], spark=spark,
                      round_digits=args.round, show=True)
    return 0 if report.ok else 1


def _attach(args: argparse.Namespace) -> "cs.Job":

    job = Job.attach(args.job, args.address)
    _die_at_sigterm()
    return job


def _die_at_sigterm() -> None:
    """SIGTERM ends this command at once, also inside a Ray call. ``ray.init`` installs a Python
    handler (``sys.exit``) that runs only once the call returns: a command waiting on a cluster
    that went away ignored SIGTERM. The default action needs no Python; set once connected."""
    if ray.is_initialized():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def list_jobs(address: str | None) -> list[dict]:
    """``chronostream jobs``: every job of the cluster at ``address``; without one, every job this
    machine has a record of, each asked on its own cluster (``gone`` when that cluster does not
    answer or no longer runs it), and every other job on the clusters asked. A process already
    connected to Ray (a caller's) asks only that cluster: a record of another cluster that
    answers is ``unknown`` there."""

    records = all_records()
    if address is not None or connected_address() is not None:
        clusters = [address]
    else:
        clusters = list(dict.fromkeys(r.address for r in records))
    fresh = connected_address() is None
    seen: dict[str, dict] = {}
    asked: list[str] = []
    for where in clusters:
        try:
            ensure_ray(where)
        except ClusterError:
            continue
        now = connected_address()
        _die_at_sigterm()
        asked.append(now)
        for name, state in job_states().items():
            rec = read_record(name)
            mine = rec is not None and same_cluster(rec.address, now)
            seen[f"{now}/{name}"] = {"name": name, "state": state, "address": now,
                                     "workdir": rec.workdir if mine else "", "submitted": mine and rec.submitted}
        if fresh:
            ray.shutdown()
    out = list(seen.values())
    if address is None:
        for r in records:
            if f"{r.address}/{r.name}" in seen:
                continue
            state = "gone"
            if not any(same_cluster(r.address, a) for a in asked):
                try:
                    probe(r.address)
                    state = "unknown"  # (its cluster answers; this process is connected to another)
                except ClusterError:
                    pass
            out.append({"name": r.name, "state": state, "address": r.address, "workdir": r.workdir,
                        "submitted": r.submitted})
            if state == "gone" and not r.submitted and not _alive(r.driver_pid):
                remove_record(r.name)  # (a run's job ends with its process: listed once, then forgotten)
    return out


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (0: unknown, taken as alive)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def job_status(job: "cs.Job") -> dict:
    """``chronostream status``: the job's state, progress and where it runs."""
    p = job.progress()
    s = job.status()
    return {"name": job.key, "state": str(s.state), "containers": s.containers, "done_containers": s.done_containers,
            "epochs": p["epochs"], "min_epoch": p["min_epoch"], "elapsed_s": round(s.elapsed_s, 3),
            "recoveries": p["recoveries"], "error": None if s.error is None else str(s.error),
            "address": connected_address(), "workdir": job.workdir, "dashboard_url": s.dashboard_url,
            "metrics_url": s.metrics_url}


def follow(job: "cs.Job", timeout_s: float | None) -> int:
    """``chronostream attach``: a progress line on stderr every ``ATTACH_EVERY_S`` until the job
    ends, then each sink's rows as JSON; 0 when it finished, 1 otherwise. Ctrl-C leaves the
    job running."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    bar = EpochBar(job.key)  # (a terminal: a bar; otherwise a line every ATTACH_EVERY_S)
    try:
        while True:
            st = job_status(job)
            if bar.bar.disable:
                print(f"{job.key}: {st['state']}, epoch {st['min_epoch']} of {st['epochs']}, {st['done_containers']}/"
                      f"{st['containers']} containers done, {st['recoveries']} recoveries, {st['elapsed_s']:.0f} s",
                      file=sys.stderr)
            bar.update(st)
            if cs.JobState(st["state"]).terminal:
                break
            if deadline is not None and time.monotonic() > deadline:
                print(f"chronostream attach: {job.key} still {st['state']} after {timeout_s} s; it runs on",
                      file=sys.stderr)
                return 1
            time.sleep(ATTACH_EVERY_S if bar.bar.disable else 0.2)
    finally:
        bar.close()
    if st["state"] != "finished":
        print(f"chronostream attach: {job.key} {st['state']}" + (f": {st['error']}" if st["error"] else ""),
              file=sys.stderr)
        return 1
    print(json.dumps({s.name: job.results(s.name).num_rows for s in job.plan.sinks}))
    return 0


def stop_job(args: argparse.Namespace) -> dict:
    """``chronostream stop``: a savepoint first when asked, then the stop; a job whose cluster is
    gone is forgotten (its record removed), its files left where the record says."""
    try:
        job = _attach(args)
    except ClusterError:
        record = read_record(args.job)
        if record is None or args.savepoint:
            raise
        remove_record(args.job)
        return {"name": args.job, "stopped": False, "forgotten": True, "workdir": record.workdir}
    out: dict = {"name": job.key}
    if args.savepoint:
        out["savepoint"] = job.savepoint(args.savepoint)
    job.stop(cleanup=not args.keep_files)
    out["stopped"] = True
    return out


#: Commands against a job (or the list of them), with their help: ``cmd_control``.
CONTROL_COMMANDS = [("jobs", "list the jobs started from this machine (or running on --address's cluster)"),
                    ("status", "a job's state and progress"),
                    ("attach", "follow a job to its end, then print each sink's row count"),
                    ("stop", "stop a job (after a savepoint with --savepoint) and release what it holds"),
                    ("placement", "a running job's placement"), ("metrics", "a running job's metrics"),
                    ("top", "a live table of a running job's stages and hosts"),
                    ("ui", "open a running job's live dashboard in the browser (prints its address)"),
                    ("log-floor", "the order below which a running job will not read its source log again "
                                  "(what its feeder may trim the log to)"),
                    ("scale-out", "add hosts to a stage of a running job"),
                    ("scale-in", "remove hosts from a stage of a running job"),
                    ("migrate", "move slices of a stage of a running job"),
                    ("compact", "merge a stage's containers on each host of a running job into one"),
                    ("savepoint", "write every slice's state of a running job to a new directory"),
                    ("scale-up", "give a container of a running job more threads"),
                    ("scale-down", "take threads from a container of a running job")]


def cmd_control(args: argparse.Namespace) -> int:
    """Commands against a running job: print the master's answer as JSON.

    A refused request (the job has ended, no such job, stage or slice, a
    scale-in below one host) prints one line, ``chronostream COMMAND: why``,
    on stderr and returns 1; a Python traceback is for defects, not for a
    job that finished a moment before the call.
    """


    try:
        return _control(args)
    except (ChronoStreamError, MigrationError, KeyError, ValueError) as exc:
        why = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"chronostream {args.command}: {why}", file=sys.stderr)
    except ray.exceptions.RayActorError:
        print(f"chronostream {args.command}: the job's master is gone (the job was stopped or its "
              f"driver exited); `chronostream jobs` lists the running ones", file=sys.stderr)
    return 1


def _control(args: argparse.Namespace) -> int:

    if args.command == "jobs":
        print(json.dumps(list_jobs(args.address)))
        return 0
    if args.command == "stop":
        print(json.dumps(stop_job(args), default=str))
        return 0
    job = _attach(args)
    if args.command == "attach":
        return follow(job, args.timeout)
    if args.command == "status":
        out = job_status(job)
    elif args.command == "placement":
        out = asdict(job.placement())
    elif args.command == "metrics":
        if args.summary:
            print(job.metrics_summary())
            return 0
        out = job.metrics()
    elif args.command == "top":
        state = top(job, args.interval, args.count)
        return 1 if state is cs.JobState.FAILED else 0
    elif args.command == "ui":
        url = job.status().dashboard_url
        if not url:
            raise ValueError(f"job {job.key} serves no dashboard (it runs with http_port=-1)")
        print(url)
        if not args.no_open:
            webbrowser.open(url)
        return 0
    elif args.command == "log-floor":
        out = {"floor": job.source_log_floor()}
    elif args.command == "scale-out":
        out = job.scale_out(args.stage, args.n)
    elif args.command == "scale-in":
        out = job.scale_in(args.stage, args.n)
    elif args.command == "migrate":
        out = job.migrate(args.stage, args.slices, args.to)
    elif args.command == "compact":
        out = job.compact(args.stage)
    elif args.command == "savepoint":
        out = job.savepoint(args.path)
    elif args.command == "scale-up":
        out = job.scale_up(args.container, args.threads)
    else:
        out = job.scale_down(args.container, args.threads)
    print(json.dumps(out, default=str))
    return 0


def cmd_warm_hosts(args: argparse.Namespace) -> int:
    """``warm-hosts N``: resize the cluster's pool of spare hosts; print its counts as JSON."""

    if args.n < 0:
        print(f"chronostream warm-hosts: N must be >= 0, got {args.n}", file=sys.stderr)
        return 1
    stats = keep_warm_hosts(args.n, wait_s=args.wait, address=args.address)
    print(json.dumps({k: v for k, v in asdict(stats).items() if k != "names"}))
    return 0


def cmd_autoscale_sim(args: argparse.Namespace) -> int:
    """Replay a metrics trace (``Job.autoscale_trace`` written with ``write_trace``) through a policy."""

    params = {}
    for kv in args.param:
        k, _, v = kv.partition("=")
        try:
            params[k] = json.loads(v)
        except json.JSONDecodeError:
            params[k] = v
    policy = BUILTIN[args.policy](**params)
    for d in simulate(policy, [d.snapshot for d in read_trace(args.trace)]):
        for a in d.actions:
            print(f"t={d.snapshot.t:8.2f}s  {a.describe()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``chronostream`` command."""
    parser = argparse.ArgumentParser(prog="chronostream", description="Elastic stateful stream processing on Ray")
    parser.add_argument("--version", action="version", version=f"chronostream {cs.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the demo job on the 2013 NYC flights and validate it")
    d.add_argument("--containers", type=int, default=2, help="containers per stage (default 2)")
    d.add_argument("--rows", type=int, default=0, help="use only the first N flights (0 = all)")
    d.add_argument("--out", default="out/demo", help="output directory (Parquet sink)")
    d.add_argument("--no-kill", action="store_true", help="do not kill a container mid-run")
    d.add_argument("--no-scale", action="store_true", help="do not scale the stage out and in mid-run")
    r = sub.add_parser("run", help="run a query defined in a Python file (build() or `query`)")
    r.add_argument("file")
    r.add_argument("--executor", default="ray", choices=["ray", "serial", "local"])
    r.add_argument("--containers", type=int, default=2)
    r.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="a JobOptions field, e.g. checkpoint_interval_s=1 (repeatable)")
    r.add_argument("--restore", default=None, metavar="SAVEPOINT",
                   help="start every slice from this savepoint (chronostream savepoint JOB PATH)")
    r.add_argument("--drop-state", action="append", default=[], metavar="STAGE:STATE",
                   help="with --restore: leave this state of the savepoint behind (repeatable)")
    sb = sub.add_parser("submit", help="start a query file on a Ray cluster as a job that outlives this command; "
                                       "print its name")
    sb.add_argument("file")
    sb.add_argument("--address", default=None, help="the Ray cluster's address (default: $RAY_ADDRESS)")
    sb.add_argument("--containers", type=int, default=2)
    sb.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                    help="a JobOptions field, e.g. checkpoint_interval_s=1 (repeatable)")
    sb.add_argument("--restore", default=None, metavar="SAVEPOINT", help="start every slice from this savepoint")
    sb.add_argument("--drop-state", action="append", default=[], metavar="STAGE:STATE",
                    help="with --restore: leave this state of the savepoint behind (repeatable)")
    sb.add_argument("--name", default=None, help="the job's name (default: made from its work directory)")
    sb.add_argument("--workdir", default=None, help="the job's work directory (default: a new temporary one)")
    rs = sub.add_parser("resume", help="go on with a job whose every process died, from its work directory "
                                       "(catalog, source copies, backup stores)")
    rs.add_argument("workdir")
    rs.add_argument("--address", default=None, help="a Ray cluster to resume it on as a submitted job "
                                                    "(default: $RAY_ADDRESS; none: run it here to its end)")
    v = sub.add_parser("validate", help="check a job's Parquet output with Spark: exactly-once and equality")
    v.add_argument("output", help="the job's ParquetSink directory")
    v.add_argument("--expected", required=True, help="Parquet file or directory of the expected rows")
    v.add_argument("--key", default="", help="comma-separated columns to order examples by")
    v.add_argument("--round", type=int, default=None, help="round floating columns to N digits first")
    v.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    v.add_argument("--drop-system", action="store_true",
                   help="ignore _slice/_seq/_sub in the expected file (compare user columns and _order)")
    c = sub.add_parser("chaos", help="run a query file with injected faults and check its output is exact")
    c.add_argument("file")
    c.add_argument("--kill", action="append", default=[], help="STAGE@EPOCH: kill a container (repeatable)")
    c.add_argument("--fault", action="append", default=[], metavar="KIND@EPOCH[:STAGE][,NAME=VALUE...]",
                   help="any fault of chronostream.chaos (repeatable), e.g. kill_master@10, "
                        "scale_out@20:count,n=2, kill_in_recovery@12:count,step=planned,role=producer, "
                        "delay@0:lines,seconds=0.05; NAME: index, seconds, n, step, role")
    c.add_argument("--faults", type=int, default=0, help="add N random faults (seeded by --seed; kinds: --kinds)")
    c.add_argument("--kinds", default="kill", help="comma-separated kinds --faults draws from (default kill)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--containers", type=int, default=3, help="containers per stage (default 3)")
    c.add_argument("--checkpoint-every", type=int, default=2, help="epochs between checkpoints (default 2)")
    c.add_argument("--backup-factor", type=int, default=2)
    c.add_argument("--delay", type=float, default=0.0,
                   help="slow the source by S seconds per epoch, so faults land mid-stream")
    c.add_argument("--settle-pace", type=float, default=0.0,
                   help="while a fault applies and settles, slow the sources to S seconds per epoch "
                        "(so the job does not end before the later faults)")
    for name, help_ in CONTROL_COMMANDS:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--address", default=None,
                       help="the Ray cluster's address (default: the job's record on this machine)")
        if name == "jobs":
            continue
        p.add_argument("job", help="the job's name (chronostream jobs)")
        if name == "attach":
            p.add_argument("--timeout", type=float, default=None, help="give up following after S seconds")
        if name == "metrics":
            p.add_argument("--summary", action="store_true", help="a readable summary instead of JSON")
        if name == "top":
            p.add_argument("--interval", type=float, default=1.0, help="seconds between redraws (default 1)")
            p.add_argument("-n", "--count", type=int, default=None, help="redraw N times, then exit (default: "
                                                                        "until the job ends)")
        if name == "ui":
            p.add_argument("--no-open", action="store_true", help="only print the dashboard's address")
        if name == "stop":
            p.add_argument("--savepoint", default=None, metavar="PATH",
                           help="write a savepoint to PATH (a new directory) first")
            p.add_argument("--keep-files", action="store_true",
                           help="keep the job's catalog and stores (a later run may resume it)")
        if name in ("scale-out", "scale-in", "migrate", "compact"):
            p.add_argument("stage")
        if name in ("scale-out", "scale-in"):
            p.add_argument("-n", type=int, default=1, help="hosts to add or remove (default 1)")
        if name == "migrate":
            p.add_argument("slices", type=int, nargs="+")
            p.add_argument("--to", type=int, default=None, help="a container whose host takes them (default: a new host)")
        if name == "savepoint":
            p.add_argument("path", help="a new directory (on the job's master's node)")
        if name in ("scale-up", "scale-down"):
            p.add_argument("container", type=int)
            p.add_argument("-t", "--threads", type=int, default=1, help="threads to add or remove (default 1)")
    w = sub.add_parser("warm-hosts", help="keep N warm spare hosts on the Ray cluster for later jobs (0: none)")
    w.add_argument("n", type=int)
    w.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    w.add_argument("--wait", type=float, default=0.0, help="wait up to S seconds for the spares to be ready")
    a = sub.add_parser("autoscale-sim", help="replay a recorded metrics trace through an autoscaling policy")
    a.add_argument("trace", help="a JSON-lines trace (chronostream.master.policies.write_trace)")
    a.add_argument("--policy", default="rate", choices=["rate", "utilization", "latency"])
    a.add_argument("--param", action="append", default=[], help="policy parameter NAME=VALUE (repeatable)")
    args = parser.parse_args(argv)
    if args.command in dict(CONTROL_COMMANDS):
        return cmd_control(args)
    if args.command == "submit":
        return cmd_submit(args)
    if args.command == "resume":
        return cmd_resume(args)
    if args.command == "autoscale-sim":
        return cmd_autoscale_sim(args)
    if args.command == "warm-hosts":
        return cmd_warm_hosts(args)
    if args.command == "chaos":
        return cmd_chaos(args)
    if args.command == "validate":
        return cmd_validate(args)
    if args.command == "demo":

        return run_demo(containers=args.containers, rows=args.rows, out=Path(args.out), kill=not args.no_kill,
                        scale=not args.no_scale)
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
