"""Liveness and bounds: a failed job stays failed, hosts leave when their master dies, a long
job's records stay bounded, and a local Spark driver listens on loopback only.

The job-state tests drive ``JobMaster`` (master/actor.py) on the plain class behind the Ray
actor, with stand-in hosts, so the race between a container's failure and the end of the
deploy is taken in a fixed order.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
import types

import pytest

import chronostream as cs
import chronostream.master.actor as master_actor
from chronostream.dag import compile_query
from chronostream.master.actor import JobMaster
from chronostream.master.job_state import JobState
from chronostream.master.launch import JobLaunch
from chronostream.master.placement import containers_per_stage
from chronostream.master.protocols.job import ContainerDone, ContainerFailed, Deployed, JobLifecycle, Settled, StopAsked

PlainMaster = JobMaster.__ray_metadata__.modified_class


def _launch(containers: int = 1) -> bytes:
    q = cs.Query()
    q.source("s", [{"k": i, "v": float(i)} for i in range(4)]).map(lambda e: e).sink(name="out")
    plan, sources = compile_query(q)
    return JobLaunch(plan, containers_per_stage(plan, containers), None, None, sorted(sources)).pack()


class _Remote:
    def __init__(self, fn) -> None:
        self._fn = fn

    def remote(self, *args):
        return self._fn(*args)


def _master(tmp_path, monkeypatch, on_start) -> PlainMaster:
    """A master whose hosts are stand-ins: a host's ``start`` runs ``on_start(master, host)``."""
    monkeypatch.setattr(master_actor.ray, "nodes", lambda: [{"NodeID": "n0", "Alive": True}])
    m = PlainMaster(str(tmp_path / "job"), "t")
    stopped: list[int] = []

    def host(h: int):
        async def start():
            await on_start(m, h)

        def stop(*_):
            stopped.append(h)
        return types.SimpleNamespace(start=_Remote(start), stop=_Remote(stop))

    async def new_host(h, node=None):
        m.handles[h] = host(h)
        m.alive.add(h)
        return m.handles[h]

    async def configure(h):
        m.nodes[h] = "n0"

    async def add_container(*_args, **_kw):
        return None

    m.hosts.new_or_found, m.deployer.configure, m.deployer.add_container = new_host, configure, add_container
    m._ensure_watching = lambda: None  # (no watch loop: no Ray here)
    m.stopped_hosts = stopped  # (what ``_fail`` stopped)
    return m


def test_a_container_failure_during_deploy_leaves_the_job_failed(tmp_path, monkeypatch):
    """Regression (issue 59, failure during deploy): a container that fails while the master still
    awaits its hosts' ``start`` sets the job failed; the end of the deploy must not set it back to
    running (the job's ``wait`` would never return). Checks the state, the saved progress, and that
    the timeline has no ``job_running`` after ``job_failed``."""
    async def fail_on_start(m, h):
        await m.container_failed(h, ValueError("column 'v' already exists"))

    m = _master(tmp_path, monkeypatch, fail_on_start)
    asyncio.run(m.deploy(_launch(), {}))
    assert m.state is JobState.FAILED
    assert m.catalog.load_progress()["state"] is JobState.FAILED
    kinds = [k for _, k, _ in m.timeline]
    assert "job_failed" in kinds and "job_running" not in kinds, kinds
    assert asyncio.run(m.status()).state is JobState.FAILED
    assert m.stopped_hosts == [0]
    m.catalog.close()


def test_terminal_states_are_final(tmp_path, monkeypatch):
    """Regression (issue 59, failure during deploy): failed, finished and stopped are final; a later
    report changes nothing, and one that would have changed the state is kept in the timeline as
    ``state_kept`` (``master.protocols.job``)."""
    ends = {JobState.FAILED: ContainerFailed("", "boom"), JobState.FINISHED: ContainerDone(0, frozenset({0})),
            JobState.STOPPED: StopAsked()}
    for terminal, end in ends.items():
        m = _master(tmp_path / terminal, monkeypatch, lambda m, h: asyncio.sleep(0))
        m._job(Deployed(frozenset({0, 1}) if terminal is not JobState.FINISHED else frozenset({0})))
        m._job(end)
        assert m.state is terminal and m.catalog.load_progress()["state"] is terminal
        for other in (Deployed(frozenset({0})), ContainerFailed("", "late"), ContainerDone(1, frozenset({0, 1})),
                      Settled(frozenset({0})), StopAsked()):
            m._job(other)
            assert m.state is terminal
        kept = [i for _, k, i in m.timeline if k == "state_kept"]
        assert {i["refused"] for i in kept} == {"running", "failed"} - {terminal}
        assert [k for _, k, _ in m.timeline].count(f"job_{terminal}") == 1
        m.catalog.close()


def test_containers_that_finish_during_deploy_finish_the_job(tmp_path, monkeypatch):
    """Regression (issue 59, failure during deploy): containers that report done while the master
    still awaits the hosts' start finish the job once it runs (a report before ``running`` was
    dropped: the job would run forever)."""
    async def done_on_start(m, h):
        await m.container_done(h, None)

    m = _master(tmp_path, monkeypatch, done_on_start)
    asyncio.run(m.deploy(_launch(), {}))
    assert m.state is JobState.FINISHED
    kinds = [k for _, k, _ in m.timeline]
    assert kinds.index("job_running") < kinds.index("job_finished"), kinds
    m.catalog.close()


def test_hosts_leave_when_their_master_dies(ray_session, tmp_path):
    """Regression (issue 59, orphan hosts): hosts are detached actors; when their master dies for
    good (here ``ray.kill(no_restart=True)``, as when the driver that owned it is killed), every
    host exits within ``master_lost_s`` (plus a ping period and slack), not never, and leaves its
    backup store on disk. (Its work directory is the test's: no stop removes it.)"""
    import ray
    from ray.exceptions import RayActorError

    q = cs.Query()
    q.source("s", [{"k": i % 3, "v": i} for i in range(30)]).key_by("k").count(slices=4).sink(name="c")
    job = cs.run(q, containers=1, master_lost_s=2.0, workdir=str(tmp_path / "job"))
    job.wait(timeout_s=60)
    hosts = list(ray.get(job.master.host_handles.remote()).values())
    assert len(hosts) >= 2
    ray.kill(job.master, no_restart=True)
    t0 = time.monotonic()
    alive = list(hosts)
    while alive and time.monotonic() - t0 < 20:
        time.sleep(0.5)
        still = []
        for h in alive:
            try:
                ray.get(h.ping.remote(), timeout=2)
                still.append(h)
            except (RayActorError, ray.exceptions.GetTimeoutError):
                pass
        alive = still
    assert not alive, (f"{len(alive)} of {len(hosts)} hosts still answer {time.monotonic() - t0:.0f} s "
                       f"after their master died")
    # Their stores stay: with the catalog, what ``chronostream resume`` goes on from.
    stores = sorted(p.parent.parent.name for p in (tmp_path / "job").glob("host-*/backups/data.mdb"))
    assert len(stores) == len(hosts), stores


def _listening_off_loopback(pids: set[int]) -> list[tuple[int, str, str]]:
    """(pid, process name, address) of the TCP sockets the processes ``pids`` listen on that are
    not on a loopback address (``::ffff:127.0.0.1``, IPv4 mapped into IPv6, counts as loopback)."""
    import ipaddress

    import psutil

    out = []
    for c in psutil.net_connections(kind="tcp"):
        if c.status != psutil.CONN_LISTEN or c.pid not in pids:
            continue
        ip = ipaddress.ip_address(c.laddr.ip.split("%")[0])
        mapped = getattr(ip, "ipv4_mapped", None)
        if not (ip.is_loopback or (mapped is not None and mapped.is_loopback)):
            out.append((c.pid, psutil.Process(c.pid).name(), f"{c.laddr.ip}:{c.laddr.port}"))
    return out


def test_a_local_spark_session_listens_on_loopback_only(spark):
    """Regression (issue 59, exposure): the Spark driver ``spark_session`` starts for a ``local``
    master (its JVM, a child of this process, and the Python workers under it) listens on
    loopback only, not on the machine's external address."""
    import psutil

    spark.createDataFrame([(1,)], ["a"]).collect()  # (the block manager and Python workers are up)
    def cmdline(p: psutil.Process) -> str:
        try:
            return " ".join(p.cmdline())
        except psutil.Error:  # (a process that ended meanwhile)
            return ""

    jvms = [p for p in psutil.Process().children(recursive=True) if "org.apache.spark" in cmdline(p)]
    assert jvms, "no Spark JVM under this process"
    pids = {p.pid for j in jvms for p in [j, *j.children(recursive=True)]}
    listening = [c for c in psutil.net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert listening, "the Spark driver listens on nothing?"
    assert _listening_off_loopback(pids) == []


def test_a_ray_the_project_starts_listens_on_loopback_only(ray_session):
    """Regression (issue 59, exposure): the Ray ``cs.ensure_ray`` starts (the test session's: GCS,
    raylet, workers and the warm hosts, all descendants of this process) listens on loopback
    only; Ray's default on Linux is every interface."""
    import psutil

    @ray_session.remote
    def one() -> int:
        return 1

    assert ray_session.get(one.remote()) == 1  # (a worker is up)
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ  # (restored after the start)
    pids = {p.pid for p in psutil.Process().children(recursive=True)}
    listening = [c for c in psutil.net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert len(listening) >= 3, "the GCS, the raylet and the workers listen on nothing?"
    assert _listening_off_loopback(pids) == []


def test_the_timeline_and_its_catalog_copy_stay_bounded(tmp_path, monkeypatch):
    """Regression (issue 59, unbounded growth): the master's timeline keeps the latest
    ``per_kind`` events of each kind, in memory and in its catalog copy, however many come; a
    rare kind (the job's state changes) is never pushed out, and counts cover every event. A
    restarted master reads back the bounded copy."""
    from chronostream.master.timeline import Timeline

    m = _master(tmp_path, monkeypatch, lambda m, h: asyncio.sleep(0))
    m.timeline = Timeline(per_kind=10)
    m._job(Deployed(frozenset({0})))
    for i in range(200):
        m._event("autoscale_decision", action=f"tick {i}")
        if i % 50 == 0:
            m._event("recovery_end", i=i)
    kinds = [k for _, k, _ in m.timeline]
    assert kinds.count("autoscale_decision") == 10 and kinds.count("recovery_end") == 4
    assert kinds[0] == "job_running"
    assert [i["action"] for _, k, i in m.timeline if k == "autoscale_decision"][-1] == "tick 199"
    saved = m.catalog.load_numbered_events()
    assert [e for _, e in saved] == list(m.timeline)
    assert m.timeline.count("autoscale_decision") == 200
    again = Timeline(per_kind=10)
    assert again.extend(saved) == [] and list(again) == list(m.timeline)
    m.catalog.close()


def test_the_autoscaler_keeps_its_latest_decisions(tmp_path, monkeypatch):
    """Regression (issue 59, unbounded growth): the master keeps the latest ``DECISIONS_KEPT``
    autoscaler ticks (each a full per-slice snapshot), not every tick of the job."""
    from chronostream.containers.options import JobOptions

    m = _master(tmp_path, monkeypatch, lambda m, h: asyncio.sleep(0))
    assert m.decisions.maxlen == master_actor.DECISIONS_KEPT <= 10_000
    # (a smaller bound for the test, set on the master: once a Ray job ran in this process, the
    # class Ray keeps is a copy whose globals a patch of the module does not reach)
    m.decisions = collections.deque(maxlen=5)
    m.opts = JobOptions(autoscale_interval_s=1e-4)
    m.policy = types.SimpleNamespace(decide=lambda snap: [])
    ticks = []

    async def snapshot():
        ticks.append(len(ticks))
        if len(ticks) > 30:
            m.job.handle(StopAsked())
        return types.SimpleNamespace(n=len(ticks), to_plain=lambda: {})

    m.reads.metrics_snapshot = snapshot
    m.job = JobLifecycle(JobState.RUNNING)
    asyncio.run(m.scaling.autoscale())
    assert m.decisions_made == 30
    assert [d.snapshot.n for d in m.decisions] == [27, 28, 29, 30, 31]  # (the first: the base of the rates)
    assert len(asyncio.run(m.autoscale_trace())) == 5
    m.catalog.close()


def test_a_source_log_reader_and_index_hold_only_live_segments(tmp_path, monkeypatch):
    """Regression (issue 59, unbounded growth): a tailing reader forgets trimmed segments, and
    ``trim`` compacts the segment index on disk, so both stay proportional to the live
    segments however many were written; reads, a new reader and a reopened writer still see
    every live row."""
    import pyarrow as pa

    from chronostream.slices import sourcelog
    from chronostream.slices.sourcelog import SourceLog, SourceLogWriter

    monkeypatch.setattr(sourcelog, "COMPACT_MIN_LINES", 8)
    w = SourceLogWriter(tmp_path)
    reader = None
    for i in range(120):
        w.append({"s": pa.table({"x": [i], "_order": [i], "_stream_seq": [i]})}, high_water=i + 1)
        reader = reader or SourceLog(tmp_path)
        if i >= 5:
            w.trim(i - 5)  # five live segments at most, plus the newest
        reader.refresh()
        assert len(reader.segments) <= 6, (i, len(reader.segments))
    index = [p for p in tmp_path.iterdir() if p.name.startswith("segments") and p.suffix == ".jsonl"]
    assert len(index) == 1
    assert len(index[0].read_bytes().splitlines()) <= 2 * 8 + 6
    assert reader.read("s", 114)["x"].to_pylist() == list(range(114, 120))
    assert SourceLog(tmp_path).read("s", 114)["x"].to_pylist() == list(range(114, 120))
    assert len(SourceLog(tmp_path, keep_trimmed=True).segments) <= 2 * 8 + 6
    w2 = SourceLogWriter(tmp_path)
    w2.append({"s": pa.table({"x": [120], "_order": [120], "_stream_seq": [120]})}, high_water=121)
    reader.refresh()
    assert reader.read_from_seq("s", 117)["x"].to_pylist() == [117, 118, 119, 120]
