"""The ``Job`` handle of a job running on Ray, and finding a job by name.

Owns: a job's handle (status, results, control calls, stop), joining the
cluster a named job runs on (its record on this machine, an address given,
or the cluster this process is connected to), and listing the jobs of a
cluster. Must not touch: starting jobs (``client``), the records' files
(``job_records``).
"""

from __future__ import annotations

import os
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import ray

from chronostream.cluster import RAY_NAMESPACE, connected_address, ensure_ray
from chronostream.containers.shm_transport import remove_job_files, shm_job_tag
from chronostream.job_records import JobRecord, read_record, records_dir, remove_record
from chronostream.live_view import EpochBar, metrics_summary
from chronostream.master.job_state import JobState
from chronostream.master.policies import Decision
from chronostream.master.results import packed_sink_table
from chronostream.master.rpc_results import MasterStatus, PlacementView
from chronostream.slices.errors import ClusterError, JobFailed, JobNotFound, QueryError
from chronostream.slices.hashing import slice_of_scalar
from chronostream.slices.plan import JobPlan
from chronostream.slices.savepoint import key_names
from chronostream.slices.sinks import ParquetSink, dead_letter_table, read_parquet_sink
from chronostream.slices.state_query import answer_rows
from chronostream.source_ref_keeper import holder_name, ray_keeper

#: Seconds ``job_states`` waits for a master's answer before it calls the job unreachable.
STATUS_TIMEOUT_S = 10.0


def master_name(key: str) -> str:
    """Ray actor name of a job's master."""
    return f"chronostream-{key}-master"


def jobs(address: str | None = None) -> list[str]:
    """Names of the jobs whose master runs on a Ray cluster (``Job.attach`` takes one): the
    cluster at ``address``, else the one this process is connected to, else ``$RAY_ADDRESS``'s
    (``ClusterError`` when none is given: ``chronostream jobs`` lists this machine's records)."""

    if address is None and connected_address() is None and not os.environ.get("RAY_ADDRESS"):
        raise ClusterError("jobs(): which Ray cluster? pass address= (or set RAY_ADDRESS); "
                           "`chronostream jobs` lists the jobs started from this machine on every cluster")
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
    metrics_url: str = ""  # the job's Prometheus endpoint (``JobOptions.http_port``; "" without one)
    dashboard_url: str = ""  # the job's live dashboard, on loopback (``chronostream ui NAME`` opens it)


def _job_status(s: MasterStatus) -> JobStatus:
    """The user's view of the master's status."""
    return JobStatus(s.state, s.containers, s.done, s.elapsed_s, s.error, s.metrics_url, s.dashboard_url)


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
        self._window = uuid.uuid4().hex  # this handle's own rate window of ``metrics()``
        self.progress_bar: bool | None = None  # ``wait``'s bar: None draws it on a terminal only (``run(progress=)``)

    @staticmethod
    def attach(key: str, address: str | None = None) -> "Job":
        """The handle of a job started by this or another process (``run``, ``submit``), found by
        its name on the cluster ``join_cluster_of`` joins; ``JobNotFound`` when its master does
        not run there, ``ClusterError`` when that cluster does not answer."""

        record = join_cluster_of(key, address)
        try:
            master = ray.get_actor(master_name(key), namespace=RAY_NAMESPACE)
        except ValueError:
            where = connected_address()
            raise JobNotFound(f"no job {key!r} runs on the Ray cluster at {where}; running there: "
                              f"{jobs(where)}" + _gone_hint(record)) from None
        plan = ray.get(master.plan_of.remote())
        return Job(plan, master, ray.get(master.placement_view.remote()).stages,
                   record.workdir if record else "", key=key)

    def status(self) -> JobStatus:
        """Current status (one call to the master)."""
        return _job_status(self._master_status())

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

    def wait(self, timeout_s: float | None = None, poll_s: float = 0.05, progress: bool | None = None) -> JobStatus:
        """Block until the job finishes (and its Parquet sinks' files are committed); raise
        ``JobFailed`` (with the cause) if it failed. ``progress``: a bar of the job's epochs on
        stderr (default: ``run(progress=)``'s choice, else on a terminal only)."""
        bar = EpochBar(self.key, self.progress_bar if progress is None else progress)
        try:
            return self._wait(timeout_s, poll_s, bar)
        finally:
            bar.close()

    def _wait(self, timeout_s: float | None, poll_s: float, bar: EpochBar) -> JobStatus:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            s = self._master_status()
            st = _job_status(s)
            bar.update({"state": s.state, "epochs": s.epochs, "min_epoch": s.min_epoch, "recoveries": s.recoveries})
            if st.state is JobState.FAILED:
                err = st.error
                raise JobFailed(f"job failed: {err}", err) from err
            if st.state.terminal:
                if st.state is JobState.FINISHED and any(isinstance(s.sink, ParquetSink) for s in self.plan.sinks):
                    ray.get(self.master.commit_sinks.remote())  # (the Parquet files in place: ParquetSink)
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

    def query_state(self, stage: str, keys: Any, state: str | None = None) -> pa.Table:
        """The values ``keys`` have in ``stage``'s state now, read from the live slices without
        stopping them: each slice that owns one of the keys is read on its host between two of
        its epochs (a slice moving meanwhile waits for the move to end). ``keys``: key values
        of the stage's key (one column: the values; several: tuples of them).

        Returns the rows ``cs.read_state`` gives for a savepoint, for these keys only, with a
        ``state`` column: a registered key-value state's ``slice, key, value`` (a key it holds
        no value for has no row) and a built-in aggregate's ``slice``, key columns and running
        values. ``state`` names one state. ``QueryError`` when the job is not running or the
        stage is not keyed.
        """
        self._check_stage(stage)
        st = next(s for s in self.plan.stages if s.name == stage)
        names = key_names(self.plan, st.stage_id)
        if not names:
            raise QueryError(f"query_state: stage {stage!r} is not keyed (its input has no key_by): its state has "
                             "no keys to ask for")
        wanted: dict[int, list[tuple]] = {}
        for key in (keys if isinstance(keys, (list, tuple, set)) else [keys]):
            values = tuple(key) if isinstance(key, tuple) else (key,)
            if len(values) != len(names):
                raise QueryError(f"query_state: stage {stage!r} is keyed by {names}: a key is "
                                 f"{'a tuple of ' + str(len(names)) + ' values' if len(names) > 1 else 'one value'}, "
                                 f"got {key!r}")
            wanted.setdefault(slice_of_scalar(list(values), st.num_slices), []).append(values)
        answers = self._control(self.master.query_state.remote(st.stage_id, wanted))
        return answer_rows(answers, names, state)

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
        threads, per-slice figures; latency percentiles and rates since this handle's previous
        call, the first call's rates 0.0; throughput; per-host CPU and RSS), ``latency_total``
        (p50/p99/p99.9/max over the whole run). Each handle has its own interval: another
        caller's reads (the autoscaler's, another process's) do not shorten it."""

        return ray.get(self.master.metrics.remote(self._window))

    def metrics_summary(self) -> str:
        """``metrics()`` as text a person reads: throughput and latency, a table of stages (events/s,
        busy and backpressured shares, backlog, threads) and one of hosts (CPU, memory)."""
        return metrics_summary(self.metrics())

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
            _kill_named(holder_name(self.key))  # (a submitted job's source tables)
            record = read_record(self.key) if self.key else None
            if record is not None and same_cluster(record.address, connected_address()):
                remove_record(self.key)
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


def same_cluster(a: str | None, b: str | None) -> bool:
    """Whether two GCS addresses name the same cluster (``localhost`` being ``127.0.0.1``).

    >>> same_cluster("localhost:6379", "127.0.0.1:6379"), same_cluster("127.0.0.1:6379", None)
    (True, False)
    """
    norm = lambda s: s.replace("localhost:", "127.0.0.1:") if s else None  # noqa: E731
    return a is not None and norm(a) == norm(b)


def join_cluster_of(key: str, address: str | None = None) -> JobRecord | None:
    """Connect this process to the cluster job ``key`` runs on and return its record (None when
    this machine has none): ``address`` when given, else the address its record holds, else
    the cluster this process is connected to, else ``$RAY_ADDRESS``'s. Never Ray's ``auto``
    guess (the newest cluster started on this machine, often another program's).
    ``JobNotFound`` when nothing says where the job is; ``ClusterError`` when its cluster does
    not answer, or this process is connected to another one."""

    record = read_record(key)
    now = connected_address()
    where = address or (record.address if record else None) or now or os.environ.get("RAY_ADDRESS")
    if where is None:
        raise JobNotFound(f"no job {key!r} was started from this machine (no record of it in {records_dir()}): "
                          "pass the address of its Ray cluster (--address, or address=)")
    if now is not None:
        if where != "auto" and not same_cluster(now, where):
            raise ClusterError(f"this process is connected to the Ray cluster at {now}; job {key!r} runs on "
                               f"the one at {where}")
        return record
    try:
        ensure_ray(where)
    except ClusterError as exc:
        raise ClusterError(f"job {key!r}: {exc}" + _gone_hint(record)) from None
    return record


def _gone_hint(record: JobRecord | None) -> str:
    if record is None:
        return ""
    return (f" (this machine's record of the job, started {time.strftime('%Y-%m-%d %H:%M', time.localtime(record.started_at))}"
            f", says its files are in {record.workdir}; `chronostream stop {record.name}` forgets it)")


def job_states(timeout_s: float = STATUS_TIMEOUT_S) -> dict[str, str]:
    """Name -> state (``JobState``'s value, or ``unreachable`` when its master does not answer
    within ``timeout_s``) of every job whose master runs on the cluster this process is
    connected to."""

    names = jobs(connected_address())
    asks = {}
    for name in names:
        try:
            asks[name] = ray.get_actor(master_name(name), namespace=RAY_NAMESPACE).status.remote()
        except ValueError:
            continue  # (stopped between the two calls)
    states = {}
    for name, ref in asks.items():
        try:
            states[name] = str(ray.get(ref, timeout=timeout_s).state)
        except Exception:  # a master restarting, or killed a moment ago
            states[name] = "unreachable"
    return states


def _kill_named(name: str) -> None:
    """Kill the actor called ``name`` in the jobs' namespace, when there is one."""
    try:
        ray.kill(ray.get_actor(name, namespace=RAY_NAMESPACE))
    except ValueError:
        pass

