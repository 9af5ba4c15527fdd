"""The client face: ``run(query)`` and the ``Job`` handle.

Owns: starting (or joining) Ray, shipping the compiled plan and source data
to a new JobMaster, and the ``Job`` handle users wait on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import ipaddress
import os
import re
import sys
import tempfile
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa
import ray

from chronostream.dag import JobPlan, Query, compile_query
from chronostream.slices.errors import JobFailed, QueryError, SavepointError, WorkdirError
from chronostream.containers.options import JobOptions
from chronostream.serial import SerialResult, _SerialRun
from chronostream.slices.savepoint import check_restorable
from chronostream.slices.sinks import ParquetSink, dead_letter_table, read_parquet_sink
from chronostream.source_ref_keeper import ray_keeper
from chronostream.containers.shm_transport import remove_job_files, shm_job_tag
from chronostream.master.actor import JobMaster
from chronostream.master.catalog import catalog_identity
from chronostream.master.host_pool import PoolStats, keep_warm_hosts as resize_pool
from chronostream.master.job_state import JobState
from chronostream.master.launch import JobLaunch, plan_fingerprint
from chronostream.master.local import collect, run_local
from chronostream.master.placement import containers_per_stage, initial_placement
from chronostream.master.policies import Decision
from chronostream.master.results import packed_sink_table
from chronostream.master.rpc_results import MasterStatus, PlacementView

_OWN_PACKAGES = ("chronostream", "slices", "containers", "master", "ray", "pyarrow", "numpy")


#: Ray namespace of the jobs' actors (hosts are detached named actors, found again by a restarted master).
RAY_NAMESPACE = "chronostream"


#: Ray settings a cluster that runs jobs should have (``ensure_ray`` starts Ray with them; set
#: them as ``RAY_<name>`` environment variables of ``ray start`` for a cluster of your own).
#: ``oom_grace_period_s`` = 0: when the object store is full and spilling cannot free room (the
#: objects are mapped by readers: a source's input table is, for the job's life), Ray waits this
#: long before it allocates the object from the filesystem instead. Its default, 2 s, stalled
#: every container of a job: a 100 MB migration seed or checkpoint put waited 2.0-2.3 s, and
#: every push between containers waited behind it (``benchmarks.migration`` 100 MB rows, 2 runs
#: of 3; docs/design.md section 5).
RAY_SYSTEM_CONFIG = {"oom_grace_period_s": 0}


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Start Ray in this process (default) or connect to ``address`` / ``$RAY_ADDRESS``.

    Ray started here gets ``RAY_SYSTEM_CONFIG`` and an object store of
    ``$CHRONOSTREAM_OBJECT_STORE_BYTES`` (default 1 GiB); a cluster you connect to keeps its own.
    Without an address this always starts a Ray of its own: Ray's own default would join the
    latest cluster started on the machine (``/tmp/ray/ray_current_cluster``), another
    program's, or fail with a ``ValueError`` when that file names one that died. A Ray started
    here is a single-machine node on 127.0.0.1: nothing of it listens beyond loopback.
    """

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        # A node on loopback (one this project started) is joined on loopback: Ray would
        # otherwise look for it at the machine's address, where nothing of it listens.
        with _ray_on_loopback() if _on_loopback(address) else contextlib.nullcontext():
            ray.init(address=address, logging_level="WARNING", log_to_driver=True, namespace=RAY_NAMESPACE)
        return
    with _ray_on_loopback():
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 2, include_dashboard=False,
                 logging_level="WARNING", namespace=RAY_NAMESPACE,
                 object_store_memory=int(os.environ.get("CHRONOSTREAM_OBJECT_STORE_BYTES", 1 << 30)),
                 log_to_driver=True, _system_config=dict(RAY_SYSTEM_CONFIG))


#: Ray's switch between a node reachable from other machines (its default on Linux: servers on
#: every interface, the node's address the machine's) and a single-machine node on 127.0.0.1.
_RAY_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _on_loopback(address: str) -> bool:
    """Whether the Ray cluster at ``address`` (``host:port``, or ``auto``: the latest started on
    this machine) is on a loopback address. A Ray client address (``ray://``) is not."""
    from ray._private.services import get_ray_address_from_environment

    if address == "auto":
        try:
            address = get_ray_address_from_environment("auto", None) or ""
        except (ConnectionError, ValueError):  # (no cluster to find: ray.init says so itself)
            return False
    if "://" in address:
        return False
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def _ray_on_loopback() -> Iterator[None]:
    """While Ray starts in this process: its node takes 127.0.0.1 as its address, so the GCS,
    the raylet and the workers listen on loopback only. ``ray.init(_node_ip_address=
    "127.0.0.1")`` cannot ask for this: Ray replaces a loopback address by the machine's
    unless its cluster switch is off, which it reads once at import (the driver) and from the
    environment (the processes it starts). Both are restored afterwards, so a cluster this
    process joins later, or a subprocess it starts, is as Ray makes it."""
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(_RAY_CLUSTER_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_RAY_CLUSTER_SWITCH] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_RAY_CLUSTER_SWITCH, None)
        else:
            os.environ[_RAY_CLUSTER_SWITCH] = saved_env


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


def master_name(key: str) -> str:
    """Ray actor name of a job's master."""
    return f"chronostream-{key}-master"


def jobs(address: str | None = "auto") -> list[str]:
    """Keys of the jobs whose master runs on the Ray cluster (``Job.attach`` takes one)."""

    ensure_ray(address)
    names = [a["name"] if isinstance(a, dict) else a for a in ray.util.list_named_actors(all_namespaces=True)]
    return sorted(n[len("chronostream-"):-len("-master")] for n in names
                  if n.startswith("chronostream-") and n.endswith("-master"))


@dataclass(frozen=True)
class JobStatus:
    """A job's state (``JobState``: created, running, finished, failed or stopped), its
    containers, how many of them are done, the time it has run, and what failed it."""

    state: JobState
    containers: int
    done_containers: int
    elapsed_s: float
    error: BaseException | None = None


class Job:
    """Handle of a running job.

    ``wait()`` blocks until it finishes (raising ``JobFailed`` on failure),
    ``results(name)`` returns a memory sink's rows, ``sink_path(name)`` a
    Parquet sink's directory, ``stop()`` releases its actors.
    """

    def __init__(self, plan: JobPlan, master: Any, placement: dict[str, dict[int, list[int]]], workdir: str = "",
                 key: str = "", source_refs: Any = None) -> None:
        self.plan = plan
        # The input tables in Ray's object store, owned by this process: held for the job's life,
        # because the hosts and a restarted master borrow them (master.launch; a source's host
        # recovered after a master restart once failed: the owner had let them go).
        self._source_refs = source_refs
        # A restarted master whose hosts all died asks for them: answered while this process
        # does anything else (``status``, ``wait`` and ``progress`` answer too).
        self._ref_keeper = ray_keeper(master, source_refs) if source_refs else None
        if self._ref_keeper is not None:
            weakref.finalize(self, self._ref_keeper.stop)
        self.workdir = workdir  # the hosts' local stores and the master's catalog live under it
        self.master = master
        self.key = key  # the job's name on the Ray cluster (``Job.attach(key)``, ``chronostream jobs``)
        self._placement = placement
        self._result_cache: dict[str, pa.Table] = {}

    @staticmethod
    def attach(key: str, address: str | None = "auto") -> "Job":
        """The handle of a job another process started on the same Ray cluster (see ``jobs()``)."""

        ensure_ray(address)
        try:
            master = ray.get_actor(master_name(key), namespace=RAY_NAMESPACE)
        except ValueError:
            raise KeyError(f"no running job {key!r}; running: {jobs(address)}") from None
        plan = ray.get(master.plan_of.remote())
        return Job(plan, master, ray.get(master.placement_view.remote()).stages, key=key)

    def status(self) -> JobStatus:
        """Current status (one call to the master)."""
        s = self._master_status()
        return JobStatus(s.state, s.containers, s.done, s.elapsed_s, s.error)

    def progress(self) -> dict[str, Any]:
        """State (a ``JobState``), epochs of the input, the lowest epoch every container has
        passed, containers and those done, time run, recoveries so far."""
        s = self._master_status()
        return {"state": s.state, "epochs": s.epochs, "min_epoch": s.min_epoch, "done": s.done,
                "containers": s.containers, "elapsed_s": s.elapsed_s, "recoveries": s.recoveries}

    def _master_status(self) -> MasterStatus:
        """The master's ``status``. A restarted master that found a source table's reference on
        no live host (every host died with it) asks for them there: this handle owns the
        tables, and hands the references back."""

        s = ray.get(self.master.status.remote())
        if s.wants_source_refs and self._source_refs:
            ray.get(self.master.give_source_refs.remote(self._source_refs))
        return s

    def wait(self, timeout_s: float | None = None, poll_s: float = 0.05) -> JobStatus:
        """Block until the job finishes; raise ``JobFailed`` (with the cause) if it failed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            st = self.status()
            if st.state is JobState.FAILED:
                err = st.error
                raise JobFailed(f"job failed: {err}", err) from err
            if st.state.terminal:
                return st
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job still {st.state} after {timeout_s}s ({st.done_containers}/{st.containers} containers done)")
            time.sleep(poll_s)

    def results(self, sink_name: str) -> pa.Table:
        """Rows of a sink, sorted by (producer slice, out_seq) (waits for the job)."""
        self.wait()
        spec = next((s.sink for s in self.plan.sinks if s.name == sink_name), None)
        if isinstance(spec, ParquetSink):
            return read_parquet_sink(spec.path)
        if sink_name not in self._result_cache:
            self._result_cache[sink_name] = self._read_memory_sink(sink_name)
        return self._result_cache[sink_name]

    def _read_memory_sink(self, sink_name: str, attempts: int = 3) -> pa.Table:
        """A memory sink's rows, read straight from the object references the master points at
        (``JobMaster.sink_part_refs``: its own parts and each live host's). A host that died
        after pointing at its parts took them with it (Ray: the owner died): ask again, and the
        master settles that host (it raises when rows died with it)."""
        from ray.exceptions import ObjectLostError, OwnerDiedError


        def read() -> pa.Table:
            where = ray.get(self.master.sink_part_refs.remote(sink_name))
            return packed_sink_table(where.ids, ray.get(list(where.refs)), where.source_dead_letters)

        for _ in range(attempts - 1):
            try:
                return read()
            except (OwnerDiedError, ObjectLostError):
                continue  # the master settles the dead host when asked again
        return read()

    def dead_letters(self) -> pa.Table:
        """Poison events routed to the dead-letter sink (waits for the job): the source rows that
        broke the declared schema, then the runtime's sorted by (order, sub, stage, slice)."""
        if self.plan.dead_letter_sink is None:
            raise ValueError("this query has no dead-letter sink (see Query.dead_letters)")
        if isinstance(self.plan.dead_letter_sink, ParquetSink):
            self.wait()
            return _parquet_dead_letters(self.plan)
        return self.results(self.plan.dead_letter_sink.name)

    def sink_path(self, sink_name: str) -> str:
        """Directory of a Parquet sink."""
        spec = next((s.sink for s in self.plan.sinks if s.name == sink_name), None)
        if not isinstance(spec, ParquetSink):
            raise ValueError(f"sink {sink_name!r} is not a ParquetSink")
        return spec.path

    def timeline(self) -> list[tuple[float, str, dict[str, Any]]]:
        """The job's recovery timeline: (time, event, details) for faults, detection,
        per-slice restore, recovery end and each recovered slice's first output. The master
        keeps the latest 1,000 events of each kind (``master.timeline``)."""

        return ray.get(self.master.recovery_timeline.remote())

    def placement(self) -> PlacementView:
        """Where the job runs now: stage name -> container id -> slices (``stages``), container ->
        host (``hosts``), host -> node id (``nodes``), the master's node id (``master_node``) and,
        for a job that takes checkpoints, stage name -> the fewest backup copies a slice of it has
        now (``backup_copies``: fewer than ``backup_factor`` when the job has too few hosts).
        ``dataclasses.asdict`` gives it as a dict (``chronostream placement KEY`` prints that)."""

        return ray.get(self.master.placement_view.remote())

    def scale_out(self, stage: str, n: int = 1) -> dict[str, Any]:
        """Add ``n`` containers (hosts) to ``stage`` while it runs; slices move to them live.

        Only the moving slices notice: each is rebuilt on its new host from
        a backup, runs in dual mode until it caught up, then the old copy is
        released (docs/design.md section 7f). Returns what moved, with each
        slice's release epoch and the pause its output saw (``pause_ms``).
        """
        self._check_stage(stage)
        return self._control(self.master.scale_out.remote(stage, n, "requested", uuid.uuid4().hex))

    def scale_in(self, stage: str, n: int = 1) -> dict[str, Any]:
        """Drain ``n`` of ``stage``'s hosts (those running the fewest slices) by migrating their
        slices to the others, then release them."""
        self._check_stage(stage)
        return self._control(self.master.scale_in.remote(stage, n, "requested", uuid.uuid4().hex))

    def savepoint(self, path: str | os.PathLike) -> dict[str, Any]:
        """Write the state of every slice at one epoch boundary to ``path`` (a new directory)
        while the job keeps running: a manifest, each stage's states as Parquet (readable with
        pandas or ``cs.read_state``), each slice's checkpoint (``slices.savepoint``). The job's
        master writes it, so ``path`` is on the master's node. Returns ``path``, ``epoch``,
        ``slices`` and ``bytes``; ``SavepointError`` when it cannot be taken (the job ended
        and released its hosts, a host died on the way, the path exists)."""
        return self._control(self.master.savepoint.remote(os.path.abspath(os.fspath(path))))

    def compact(self, stage: str) -> dict[str, Any]:
        """Merge ``stage``'s containers on each host into one, while the job runs.

        Recoveries and scale-ins leave several containers of a stage on a
        host (each its own epoch loop, messages and slice group). This moves
        every slice of such a host into one new container there, by the
        migration protocol (dual mode, then release): the slices are rebuilt
        from snapshots their containers take in-process, a copy of their
        state. Returns what moved, as ``scale_out`` does; no transfers when
        every host runs one container of the stage.
        """
        self._check_stage(stage)
        return self._control(self.master.compact.remote(stage, "requested", uuid.uuid4().hex))

    def migrate(self, stage: str, slices: int | list[int], to_container: int | None = None,
                baseline: str | None = None) -> dict[str, Any]:
        """Move ``slices`` of ``stage`` to the host of container ``to_container`` (None: a new host).

        (``baseline="stop_copy"`` is the stop-copy-restart comparison of ``benchmarks.migration``.)
        """
        self._check_stage(stage)
        return self._control(self.master.migrate.remote(stage, [slices] if isinstance(slices, int) else slices,
                                                        to_container, "requested", baseline, uuid.uuid4().hex))

    def scale_up(self, container: int, threads: int = 1) -> dict[str, Any]:
        """Give ``container`` ``threads`` more threads (from its next epoch; no state moves).

        Threads help only where operator work releases the GIL (Arrow
        kernels, large numpy operations, I/O): see ``containers.threads``.
        """
        now = self._control(self.master.threads_of.remote(container))
        return self._control(self.master.set_threads.remote(container, now + threads))

    def scale_down(self, container: int, threads: int = 1) -> dict[str, Any]:
        """Take ``threads`` threads from ``container`` (at least one stays)."""
        now = self._control(self.master.threads_of.remote(container))
        return self._control(self.master.set_threads.remote(container, max(1, now - threads)))

    def _check_stage(self, stage: str | int) -> None:
        """Refuse a stage this job does not have before asking the master (``QueryError``)."""
        names = [s.name for s in self.plan.stages]
        if isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage < len(names):
            return
        if stage not in names:
            raise QueryError(f"this job has no stage {stage!r}; its stages are {names}")

    def _control(self, ref: Any) -> Any:

        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:  # surface the master's own error type
            cause = exc.cause if isinstance(exc.cause, Exception) else exc
            raise cause from None

    def source_log_floor(self) -> int:
        """The global order below which no recovery or migration of this job will read its source
        log again: what the log's feeder may trim it to (``SourceLogWriter.trim``) while the job
        runs. It only grows; 0 while no checkpoint covers every source slice, and always 0
        without checkpoints or with ``recompute_lost`` (lost slices are rebuilt from the start).
        A feeder calls ``writer.trim(job.source_log_floor())`` every few seconds.
        """

        logs = [st.name for st in self.plan.stages if st.log_dir is not None]
        if not logs:
            raise ValueError("the job reads no source log (its sources are in-memory tables)")
        floors = ray.get(self.master.source_log_floors.remote())
        return min(floors[name] for name in logs)

    def metrics(self) -> dict[str, Any]:
        """Live metrics: ``snapshot`` (per stage input/processing rate, utilization, backlog,
        threads, per-slice figures; latency percentiles since the previous call; throughput;
        per-host CPU and RSS), ``latency_total`` (p50/p99/p99.9/max over the whole run)."""

        return ray.get(self.master.metrics.remote())

    def autoscale_trace(self) -> list[Any]:
        """The autoscaler's latest ticks (at most ``master.actor.DECISIONS_KEPT``), as
        ``chronostream.master.policies.Decision`` (snapshot + actions)."""


        return [Decision.from_plain(d) for d in ray.get(self.master.autoscale_trace.remote())]

    def sink_write_times(self, sink_name: str) -> dict[tuple[int, int], float]:
        """(producer slice, epoch) -> wall time a memory sink first received that part (diagnostics:
        shows which slices produced output when, e.g. during a migration)."""

        return ray.get(self.master.sink_write_times.remote(sink_name))

    def statistics(self) -> dict[int, Any]:
        """Per-container statistics (``ContainerStatistics``)."""

        return ray.get(self.master.statistics.remote())

    def stop(self, cleanup: bool = True) -> None:
        """Stop the job and release its containers and master.

        ``cleanup`` deletes what the job made under its work directory: the directory itself
        when ``run`` made it, else only the catalog (``master/``) and the hosts' stores
        (``host-<id>/``), never other files there. Without it the catalog stays, and a later
        ``run`` in that directory is refused unless it resumes this job (``resume=True``).
        Memory sink results already fetched stay available.
        """


        if self._ref_keeper is not None:
            self._ref_keeper.stop()
        try:
            ray.get(self.master.stop.remote(cleanup))
        finally:
            ray.kill(self.master)
            # The master's stop removes them; a master that died first cannot (this node's only).
            remove_job_files(shm_job_tag(self.master))

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _parquet_dead_letters(plan: JobPlan) -> pa.Table:
    """The dead letters a job wrote to its ParquetSink dead-letter sink, with the source's."""
    spec = plan.dead_letter_sink
    assert isinstance(spec, ParquetSink)
    return dead_letter_table([read_parquet_sink(spec.path, "stage=*/slice=*/epoch-*.parquet")],
                             plan.source_dead_letters)


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
    same output).

    ``restore_from``: a savepoint (``Job.savepoint``) every slice starts from: the
    job goes on from the epoch after the savepoint's, with any number of containers,
    and with operators whose code changed (an upgrade) as long as the stages, their
    slices and the epoch size are the same (``SavepointError`` otherwise). A Parquet
    sink keeps the files already there: its parts are per slice and epoch, so the
    parts this run makes again replace the same rows.

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
    if restore_from is not None:
        if executor != "ray":
            raise SavepointError(f"restore_from: the {executor} executor runs a job from its start; "
                                 "a savepoint is restored on Ray")
        restore_from = os.path.abspath(os.fspath(restore_from))
        check_restorable(restore_from, plan)
    for spec in [s.sink for s in plan.sinks] + [plan.dead_letter_sink]:
        if isinstance(spec, ParquetSink) and restore_from is None:
            spec.prepare()  # an earlier run's files would be read back with this one's
    if executor == "serial":
        res: SerialResult = _SerialRun(plan, sources).run()
        dl = lambda: pa.Table.from_pylist(res.dead_letters())  # noqa: E731
        return CompletedJob(plan, res.results, dl, dead_from_sink=False)
    if executor == "local":

        cores = run_local(plan, initial_placement(plan, per_stage), sources, seed=seed,
                          spill_state=options.spill_state)
        return CompletedJob(plan, lambda name: collect(plan, cores, name),
                            lambda: collect(plan, cores, plan.dead_letter_sink.name))


    workdir, made = _job_workdir(workdir)
    key = os.path.basename(workdir.rstrip("/")).removeprefix("chronostream-") + "-" + uuid.uuid4().hex[:8]
    identity = catalog_identity(os.path.join(workdir, "master"))
    if identity is not None:
        key = _resumable_key(workdir, identity, plan_fingerprint(plan), resume)
    elif resume:
        raise WorkdirError(f"resume=True, but the work directory {workdir} holds no job catalog to resume")
    else:
        # The names the job's own files take (and a stop deletes): none may be the caller's.
        taken = sorted(n for n in os.listdir(workdir) if n == "master" or re.fullmatch(r"host-\d+", n))
        if taken:
            raise WorkdirError(f"the work directory {workdir} holds {taken}, which are not a job's: the job "
                               "would write into them and delete them at its stop; choose another workdir")
    ensure_ray(address)
    if identity is not None:
        try:
            ray.get_actor(master_name(key), namespace=RAY_NAMESPACE)
        except ValueError:
            pass  # its master is gone: this one resumes the job from the catalog
        else:
            raise WorkdirError(f"the job {key!r} of the work directory {workdir} still runs; "
                               f"attach to it with Job.attach({key!r})")
    _pickle_user_code_by_value(plan)
    refs = {sid: [ray.put(t)] for sid, t in sources.items()}
    # The job goes to deploy, not the constructor: Ray restarts the master with its constructor's
    # arguments, which must hold nothing from the object store (master.launch).
    launch = JobLaunch(plan, per_stage, options, autoscale, sorted(refs), restore_from).pack()
    master = JobMaster.options(max_concurrency=1000, name=master_name(key), namespace=RAY_NAMESPACE).remote(
        workdir, key)
    try:
        placement = ray.get(master.deploy.remote(launch, refs, made))
    except ray.exceptions.RayTaskError as exc:  # (e.g. a savepoint the operators do not fit)
        try:  # the hosts made so far, the master and what they wrote go; the deploy's error stays
            ray.get(master.stop.remote(True))
        finally:
            ray.kill(master)
        cause: BaseException = exc
        while isinstance(cause, ray.exceptions.RayTaskError) and isinstance(cause.cause, Exception):
            cause = cause.cause  # (a host's error, through the master's deploy)
        raise cause from None
    return Job(plan, master, placement, workdir, key, source_refs=refs)


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
                        "executor, containers, options, address, workdir, autoscale, resume, seed, restore_from "
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
