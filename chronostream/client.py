"""The client face: ``run(query)``, ``submit(query)`` and ``resume(workdir)``.

Owns: starting a job: choosing its executor, its work directory and name,
shipping the compiled plan and source data to a new JobMaster on Ray (owned
by the caller for ``run``, by the cluster for ``submit``), and writing the
job's record on this machine. Must not touch: a running job (``job.Job``),
the connection to Ray (``cluster``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any

import pyarrow as pa
import ray

from chronostream import cluster
from chronostream.cluster import RAY_NAMESPACE, RAY_SYSTEM_CONFIG, connected_address, ensure_ray, token_auth_on
from chronostream.containers.options import JobOptions
from chronostream.dag import JobPlan, Query, compile_query
from chronostream.job import Job, JobStatus, _parquet_dead_letters, jobs, master_name
from chronostream.job_records import JobRecord, check_name, write_record
from chronostream.master.actor import JobMaster
from chronostream.master.catalog import catalog_identity, saved_launch
from chronostream.master.host_pool import PoolStats, keep_warm_hosts as resize_pool
from chronostream.master.job_state import JobState
from chronostream.master.launch import JobLaunch, plan_fingerprint
from chronostream.master.local import collect, run_local
from chronostream.master.placement import containers_per_stage, initial_placement
from chronostream.serial import SerialResult, _SerialRun
from chronostream.slices.errors import ClusterError, SavepointError, WorkdirError
from chronostream.slices.savepoint import check_restorable
from chronostream.slices.sinks import ParquetSink, commit_file_sinks, read_parquet_sink
from chronostream.master.source_copies import SOURCES_DIR, load_source_tables, save_source_tables
from chronostream.source_ref_keeper import SourceHolder, holder_name

#: Names this module re-exports (their homes: ``cluster``, ``job``).
__all__ = ["CompletedJob", "Job", "JobStatus", "RAY_NAMESPACE", "RAY_SYSTEM_CONFIG", "ensure_ray", "jobs",
           "keep_warm_hosts", "master_name", "resume", "run", "submit"]

_OWN_PACKAGES = ("chronostream", "slices", "containers", "master", "ray", "pyarrow", "numpy")


def keep_warm_hosts(size: int, *, wait_s: float = 0.0, address: str | None = None) -> PoolStats:
    """Keep ``size`` warm spare hosts on the cluster for later jobs' deploys, scale-outs and recoveries.

    A host is a process; starting one costs a second or two of CPU (Ray, Arrow and the
    runtime imported) before it runs a slice. Spares pay that ahead, one at a time, and a
    master adopts one instead of starting a process when one is ready (on the node it
    wants); with none ready it starts one as before. ``size=0`` stops the spares. The pool
    outlives jobs (a detached actor); ``wait_s`` waits up to that long for it to be full.
    Returns the pool's counts (``PoolStats``)::

        cs.ensure_ray(num_cpus=2)
        cs.keep_warm_hosts(4, wait_s=30)   # PoolStats(size=4, ready=4, ...)
    """


    if size < 0:
        raise ValueError(f"keep_warm_hosts: size must be >= 0, got {size}")
    ensure_ray(address)
    pool = resize_pool(size, RAY_NAMESPACE)
    if wait_s > 0:
        ray.get(pool.wait_full.remote(wait_s))
    return ray.get(pool.stats.remote())


def _pickle_user_code_by_value(plan: JobPlan) -> None:
    # Operators and functions defined in a script or a test module are not
    # importable on Ray workers: ship their modules by value.
    from ray import cloudpickle

    fns: list[Any] = []
    for st in plan.stages:
        if st.factory is not None:
            fns.append(st.factory[0])
    for sp in plan.streams:
        fns.extend(getattr(step, "fn", None) for step in sp.chain)
    for fn in fns:
        mod_name = getattr(fn, "__module__", None)
        if not mod_name or mod_name == "__main__" or mod_name.split(".")[0] in _OWN_PACKAGES:
            continue
        mod = sys.modules.get(mod_name)
        if mod is None:
            continue
        path = getattr(mod, "__file__", "") or ""
        if "site-packages" in path:
            continue
        try:
            cloudpickle.register_pickle_by_value(mod)
        except ValueError:
            pass


class CompletedJob:
    """A job run by the serial or local executor: already finished."""

    def __init__(self, plan: JobPlan, results: Any, dead: Any = None, dead_from_sink: bool = True) -> None:
        self.plan = plan
        self._results = results
        self._dead = dead
        # The serial executor keeps its dead letters in memory whatever the sink; the runtime
        # writes them to the dead-letter sink, a ParquetSink's directory included.
        self._dead_from_sink = dead_from_sink

    def wait(self, timeout_s: float | None = None) -> JobStatus:
        """Return at once: the job is finished."""
        return JobStatus(JobState.FINISHED, 0, 0, 0.0)

    def status(self) -> JobStatus:
        """Always finished."""
        return self.wait()

    def results(self, sink_name: str) -> pa.Table:
        """Rows of a sink, sorted by (producer slice, out_seq)."""
        spec = next((s.sink for s in self.plan.sinks if s.name == sink_name), None)
        if isinstance(spec, ParquetSink):
            return read_parquet_sink(spec.path)
        return self._results(sink_name)

    def dead_letters(self) -> pa.Table:
        """Poison events routed to the dead-letter sink."""
        if isinstance(self.plan.dead_letter_sink, ParquetSink) and self._dead_from_sink:
            return _parquet_dead_letters(self.plan)
        return self._dead()

    def savepoint(self, path: str | os.PathLike) -> dict[str, Any]:
        """Refused: a savepoint is taken of a job running on Ray (its slices live in hosts)."""
        raise SavepointError(f"savepoint {path}: the serial and local executors run a job to its end "
                             "in the caller; savepoints are taken of jobs running on Ray")

    def stop(self) -> None:
        """Nothing to release."""


def run(query: Query, *, executor: str = "ray", containers: int | dict[str, int] = 2,
        options: JobOptions | None = None, address: str | None = None, workdir: str | None = None,
        autoscale: Any = None, resume: bool = False, seed: int = 0, restore_from: str | os.PathLike | None = None,
        drop_states: dict[str, list[str]] | None = None, progress: bool | None = None,
        **knobs: Any) -> Job | CompletedJob:
    """Run ``query`` and return its job handle.

    ``executor``: ``"ray"`` (the runtime; Ray starts in this process, listening on
    loopback only, unless ``address=`` or ``$RAY_ADDRESS`` points at a cluster),
    ``"serial"`` (one process, one event at a time: the oracle and debug mode) or
    ``"local"`` (the runtime's containers in one process, no Ray).
    ``containers``: hosts per stage, one number or ``{stage name: number}``.

    ``options``: the job's ``JobOptions`` (checkpoints and backups, backpressure,
    timeouts, state spilling, transports; each field documents itself). A field
    may also be given as a keyword here, ``run(q, checkpoint_every=4)`` being
    ``run(q, options=JobOptions(checkpoint_every=4))``; a keyword overrides the
    field of ``options``.

    ``autoscale``: a policy (``cs.UtilizationPolicy``, ``cs.Policies`` ...) the
    master asks every ``autoscale_interval_s`` with ``job.metrics()``.
    ``seed``: the local executor's interleaving of containers (any seed gives the
    same output). ``progress``: the handle's ``wait()`` draws a bar of the job's epochs
    on stderr (default None: on a terminal only; False: never). The job's live dashboard
    is at ``job.status().dashboard_url``.

    ``restore_from``: a savepoint (``Job.savepoint``) every slice starts from: the
    job goes on from the epoch after the savepoint's, with any number of containers,
    and with operators whose code changed (an upgrade) as long as the stages, their
    slices and the epoch size are the same (``SavepointError`` otherwise). A key-value state
    the savepoint holds must be registered by the new code under its name and as its kind
    (``register_state``, ``register_list`` ...), or be dropped: ``drop_states={stage name:
    [state names]}`` leaves those states behind (the new code starts them empty). A Parquet
    sink keeps the parts the stopped job staged: they are per slice and epoch, so the
    parts this run makes again replace the same rows, and all are committed when it
    finishes (a sink directory holding a finished run's committed files is refused).

    Files (Ray executor): the job's catalog and its hosts' stores live under
    ``workdir`` (default: a new directory in the system's temporary directory, mode
    0700). A ``workdir`` that holds a job's catalog is refused (``WorkdirError``)
    unless ``resume=True``, which resumes that job if it is this query's (same plan
    fingerprint) and refuses it otherwise. ``job.stop()`` deletes the directory
    when ``run`` made it, else only what the job put in it (docs/guide.md,
    "Security and safety").

    >>> import chronostream as cs
    >>> q = cs.Query()
    >>> _ = q.source("w", [{"w": "a"}, {"w": "a"}]).key_by("w").count(slices=2).sink(name="c")
    >>> cs.run(q, executor="serial").results("c")["count"].to_pylist()
    [1, 2]
    >>> cs.run(q, executor="local", checkpoint_evry=4)
    Traceback (most recent call last):
    ...
    TypeError: run() got an unexpected keyword argument 'checkpoint_evry' (did you mean 'checkpoint_every'? ...)
    """
    plan, sources = compile_query(query)
    options = job_options(options, knobs)
    if executor not in ("serial", "local", "ray"):
        raise ValueError(f"unknown executor {executor!r}; choose 'ray', 'serial' or 'local'")
    # Checked for every executor, the serial one too (it runs no containers), before Ray starts.
    per_stage = containers_per_stage(plan, containers)
    if restore_from is not None and executor != "ray":
        raise SavepointError(f"restore_from: the {executor} executor runs a job from its start; "
                             "a savepoint is restored on Ray")
    restore_from = _restore_path(restore_from, plan, drop_states)
    for spec in [s.sink for s in plan.sinks] + [plan.dead_letter_sink]:
        if isinstance(spec, ParquetSink) and restore_from is None:
            spec.prepare()  # an earlier run's files would be read back with this one's
    if executor == "serial":
        res: SerialResult = _SerialRun(plan, sources).run()
        commit_file_sinks(plan.sinks)
        dl = lambda: pa.Table.from_pylist(res.dead_letters())  # noqa: E731
        return CompletedJob(plan, res.results, dl, dead_from_sink=False)
    if executor == "local":

        cores = run_local(plan, initial_placement(plan, per_stage), sources, seed=seed,
                          spill_state=options.spill_state)
        commit_file_sinks(plan.sinks)
        return CompletedJob(plan, lambda name: collect(plan, cores, name),
                            lambda: collect(plan, cores, plan.dead_letter_sink.name))


    job = _start_on_ray(plan, sources, per_stage, options, autoscale, restore_from, address, workdir, resume,
                        drop_states=drop_states)
    job.progress_bar = progress
    return job


def submit(query: Query, *, address: str | None = None, containers: int | dict[str, int] = 2,
           options: JobOptions | None = None, workdir: str | None = None, autoscale: Any = None,
           name: str | None = None, restore_from: str | os.PathLike | None = None,
           drop_states: dict[str, list[str]] | None = None, **knobs: Any) -> Job:
    """Start ``query`` on a Ray cluster as a job that does not depend on this process: it runs
    on when the caller exits, and is found by its name (``job.key``, also ``name``) from any
    process on this machine (``Job.attach(name)``, ``chronostream status NAME``) until
    ``stop``. Its master and its hosts are the cluster's (detached actors); so are its
    in-memory source tables (a ``SourceHolder`` actor owns them).

    The cluster must outlive the caller: ``address`` (or ``$RAY_ADDRESS``) of one started with
    ``ray start --head`` (docs/guide.md, "Operating a job"); a Ray this process started is
    refused (``ClusterError``). ``name``: the job's name on the cluster (default: made from
    its work directory); a name a running job has is refused. The other arguments are
    ``run``'s. A finished submitted job keeps its master (and its results) until ``stop``.
    """
    if name is not None:
        check_name(name)
    plan, sources = compile_query(query)
    options = job_options(options, knobs)
    per_stage = containers_per_stage(plan, containers)
    restore_from = _restore_path(restore_from, plan, drop_states)
    address = address or os.environ.get("RAY_ADDRESS")
    if cluster.started_here() or (address is None and connected_address() is None):
        raise ClusterError("submit: a submitted job needs a Ray cluster that outlives this process; start one "
                           "with `ray start --head` (docs/guide.md, \"Operating a job\") and pass its address "
                           "(address=, --address or RAY_ADDRESS)")
    for spec in [s.sink for s in plan.sinks] + [plan.dead_letter_sink]:
        if isinstance(spec, ParquetSink) and restore_from is None:
            spec.prepare()
    job = _start_on_ray(plan, sources, per_stage, options, autoscale, restore_from, address, workdir, False,
                        submitted=True, name=name, drop_states=drop_states)
    assert isinstance(job, Job)
    return job


def resume(workdir: str | os.PathLike, *, address: str | None = None) -> Job:
    """Go on with the Ray job whose files are in ``workdir`` after every process of it died
    (``kill -9`` of the driver, the master, the hosts, Ray itself): its code, options and
    containers come from its catalog (``workdir/master``, authenticated), its in-memory source
    tables from the copies it wrote when it started (``workdir/sources``), and every slice from
    the newest copy its dead hosts' backup stores hold on disk (``workdir/host-<id>``). The
    output goes on exactly once: what the sinks received before is not received twice.

    ``address`` (or ``$RAY_ADDRESS``): a cluster that outlives this process; the job is then a
    submitted one (found by its name, ended by ``chronostream stop``). Without one, Ray starts
    here and the job belongs to this process, as with ``run``. A job whose master still runs is
    refused (attach to it); so is a directory without a catalog (``WorkdirError``).

    The files must be where the job wrote them: a job that ran on several machines resumes
    where its work directory is one shared filesystem (docs/guide.md, "Operating a job").
    """
    workdir = os.path.abspath(workdir)
    identity = catalog_identity(os.path.join(workdir, "master"))
    if not identity:
        raise WorkdirError(f"resume: {workdir} holds no job catalog (its master/ directory) to resume")
    launch = JobLaunch.unpack(saved_launch(os.path.join(workdir, "master")))
    sources: dict[int, Any] = dict(launch.source_readers)
    sources.update(load_source_tables(workdir, [s for s in launch.source_stages if s not in sources]))
    per_stage = {launch.plan.stages[s].name: n for s, n in launch.containers_per_stage.items()}
    address = address or os.environ.get("RAY_ADDRESS")
    submitted = address is not None and not cluster.started_here()
    return _start_on_ray(launch.plan, sources, per_stage, launch.options or JobOptions(), launch.policy,
                         launch.restore_from, address, workdir, True, submitted=submitted,
                         name=identity.get("job_key"), drop_states=launch.drop_states)


def _start_on_ray(plan: JobPlan, sources: dict[int, pa.Table], per_stage: dict[str, int], options: JobOptions,
                  autoscale: Any, restore_from: str | None, address: str | None, workdir: str | None,
                  resume: bool, *, submitted: bool = False, name: str | None = None,
                  drop_states: dict[str, list[str]] | None = None) -> Job:
    """Start the job's master on Ray, deploy the job, write its record; its handle."""
    workdir, made = _job_workdir(workdir)
    key = name or (os.path.basename(workdir.rstrip("/")).removeprefix("chronostream-") + "-" + uuid.uuid4().hex[:8])
    identity = catalog_identity(os.path.join(workdir, "master"))
    if identity is not None:
        key = _resumable_key(workdir, identity, plan_fingerprint(plan), resume)
    elif resume:
        raise WorkdirError(f"resume=True, but the work directory {workdir} holds no job catalog to resume")
    else:
        # The names the job's own files take (and a stop deletes): none may be the caller's.
        taken = sorted(n for n in os.listdir(workdir) if n in ("master", SOURCES_DIR) or re.fullmatch(r"host-\d+", n))
        if taken:
            raise WorkdirError(f"the work directory {workdir} holds {taken}, which are not a job's: the job "
                               "would write into them and delete them at its stop; choose another workdir")
    try:
        ensure_ray(address)
    except ClusterError:
        if made:
            os.rmdir(workdir)  # (made empty here a moment ago)
        raise
    try:
        ray.get_actor(master_name(key), namespace=RAY_NAMESPACE)
    except ValueError:
        pass  # (a resumed job's master is gone: this one resumes it from the catalog)
    else:
        if identity is not None:
            raise WorkdirError(f"the job {key!r} of the work directory {workdir} still runs; "
                               f"attach to it with Job.attach({key!r})")
        raise ClusterError(f"a job named {key!r} already runs on the Ray cluster at {connected_address()}; "
                           "choose another name")
    _pickle_user_code_by_value(plan)
    if identity is None:  # (so that a job whose every process died can go on: ``resume``)
        try:
            save_source_tables(workdir, {s: t for s, t in sources.items() if isinstance(t, pa.Table)})
        except BaseException:  # (a full disk: nothing of the job is left behind)
            shutil.rmtree(workdir if made else os.path.join(workdir, SOURCES_DIR), ignore_errors=True)
            raise
    holder = None
    if submitted:  # the tables must outlive this process: an actor of the cluster owns them
        holder = SourceHolder.options(name=holder_name(key), namespace=RAY_NAMESPACE, lifetime="detached").remote()
        refs = ray.get(holder.hold.remote(sources))
    else:
        refs = {sid: [ray.put(t)] for sid, t in sources.items()}
    # The job goes to deploy, not the constructor: Ray restarts the master with its constructor's
    # arguments, which must hold nothing from the object store (master.launch).
    launch = JobLaunch(plan, per_stage, options, autoscale, sorted(refs), restore_from, drop_states,
                       {s: src for s, src in sources.items() if not isinstance(src, pa.Table)}).pack()
    master = JobMaster.options(max_concurrency=1000, name=master_name(key), namespace=RAY_NAMESPACE,
                               lifetime="detached" if submitted else None).remote(workdir, key)
    try:
        placement = ray.get(master.deploy.remote(launch, refs, made))
    except ray.exceptions.RayTaskError as exc:  # (e.g. a savepoint the operators do not fit)
        try:  # the hosts made so far, the master and what they wrote go; the deploy's error stays
            ray.get(master.stop.remote(True))
        finally:
            ray.kill(master)
            if holder is not None:
                ray.kill(holder)
        cause: BaseException = exc
        while isinstance(cause, ray.exceptions.RayTaskError) and isinstance(cause.cause, Exception):
            cause = cause.cause  # (a host's error, through the master's deploy)
        raise cause from None
    if holder is not None:
        ray.get(holder.keep_for.remote(master))
    write_record(JobRecord(key, connected_address() or "", workdir, submitted, token_auth_on(), os.getpid(),
                           time.time()))
    return Job(plan, master, placement, workdir, key, source_refs=None if submitted else refs)


def _restore_path(restore_from: str | os.PathLike | None, plan: JobPlan,
                  drop_states: dict[str, list[str]] | None) -> str | None:
    """The savepoint's absolute path once it fits ``plan`` (``check_restorable``, the states to
    drop included) and the Parquet sinks can take a resumed job's rows; ``SavepointError``
    otherwise (``drop_states`` without a savepoint too). A job resumed from a savepoint adds to
    its Parquet sinks' staged parts (a part made again replaces its rows); a sink whose
    directory holds a finished run's committed files cannot take them."""
    if restore_from is None:
        if drop_states:
            raise SavepointError("drop_states: states are dropped from a savepoint the job restores (restore_from=)")
        return None
    path = os.path.abspath(os.fspath(restore_from))
    check_restorable(path, plan, drop_states)
    for sp in plan.sinks:
        if isinstance(sp.sink, ParquetSink) and sp.sink.committed():
            raise SavepointError(f"ParquetSink {sp.sink.name!r}: {sp.sink.path} holds the committed files of a "
                                 "finished run; a resumed job's rows cannot be added to them: give the sink "
                                 "another directory")
    return path


def job_options(options: JobOptions | None, knobs: dict[str, Any]) -> JobOptions:
    """``options`` (default ``JobOptions()``) with the ``JobOptions`` fields given as keywords to
    ``run`` replacing its own; any other keyword is refused with the names it may have meant.

    >>> job_options(JobOptions(checkpoint_every=4), {"backup_factor": 1})
    JobOptions(... checkpoint_every=4, ... backup_factor=1, ...)
    """
    fields = {f.name for f in dataclasses.fields(JobOptions)}
    unknown = sorted(set(knobs) - fields)
    if unknown:
        near = difflib.get_close_matches(unknown[0], sorted(fields), n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise TypeError(f"run() got an unexpected keyword argument {unknown[0]!r} ({hint}run takes the query, "
                        "executor, containers, options, address, workdir, autoscale, resume, seed, restore_from, drop_states "
                        f"and the fields of JobOptions: {', '.join(sorted(fields))})")
    base = options if options is not None else JobOptions()
    if not isinstance(base, JobOptions):
        raise TypeError(f"options must be a chronostream.JobOptions, got {type(base).__name__}")
    return dataclasses.replace(base, **knobs) if knobs else base


def _job_workdir(workdir: str | None) -> tuple[str, bool]:
    """The job's work directory and whether it was made here for the job (then mode 0700, and a
    stop with cleanup removes it whole). ``None``: a new directory in the temporary directory
    (``mkdtemp``: made atomically, 0700, a name no one else has)."""
    if workdir is None:
        return tempfile.mkdtemp(prefix="chronostream-job-"), True
    workdir = os.path.abspath(workdir)
    try:
        os.makedirs(workdir, mode=0o700)
    except FileExistsError:
        if not os.path.isdir(workdir):
            raise WorkdirError(f"the work directory {workdir} exists and is not a directory") from None
        return workdir, False
    os.chmod(workdir, 0o700)  # (makedirs' mode is masked by the umask)
    return workdir, True


def _resumable_key(workdir: str, identity: dict[str, Any], fingerprint: str, resume: bool) -> str:
    """The key of the job whose catalog ``workdir`` holds, when the caller asked to resume it and
    it is this query's job (same plan fingerprint); ``WorkdirError`` otherwise."""
    held = identity.get("job_key")
    if not resume:
        raise WorkdirError(
            f"the work directory {workdir} holds the catalog of job {held!r}: pass resume=True to resume "
            "that job, choose another workdir, or remove its master/ directory to start afresh")
    if held is None or identity.get("fingerprint") != fingerprint:
        raise WorkdirError(
            f"resume=True refused: the work directory {workdir} holds the catalog of job {held!r} (plan "
            f"fingerprint {identity.get('fingerprint')}), not of this query (plan fingerprint {fingerprint})")
    return held
