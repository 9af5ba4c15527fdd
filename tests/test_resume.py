"""Whole-cluster loss: a job whose every process died goes on from its work directory.

The driver, the master, every host and (in the acceptance test) Ray itself
are killed mid-run, after the GC trimmed output logs (so a rebuild from the
start would lose rows: every slice must come back from a copy on disk). Then
``cs.resume(workdir)`` / ``chronostream resume WORKDIR`` rebuilds the job from
its catalog, its in-memory source tables' copies and its dead hosts' backup
stores, and finishes it: the output equals the serial executor's row for row
and ``_seq`` for ``_seq`` (the Parquet parts the dead run staged are replaced,
never counted twice), and every slice was restored from a store on disk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import msgpack
import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import chronostream as cs
from chronostream.master.ray_disk_copies import DISK_HOLDER
from chronostream.slices.parquet_commit import read_record
from test_savepoints import RunningSum

EPOCH = 250


def _query(out: Path, n: int = 12_000, parquet_sums: bool = False, max_age_s: float = 60.0) -> cs.Query:
    rng = np.random.default_rng(11)
    words = pa.table({"word": [f"w{i}" for i in rng.zipf(1.5, n) % 300]})
    payments = pa.table({"user": rng.integers(0, 200, n), "amount": rng.integers(1, 100, n)})
    q = cs.Query(epoch_events=EPOCH)
    q.source("words", words, slices=2).key_by("word").count(slices=4, name="counts") \
        .sink(cs.ParquetSink(str(out / "counts"), max_age_s=max_age_s), name="c")
    q.source("payments", payments, slices=2).key_by("user").apply(RunningSum, slices=4, name="sums") \
        .sink(cs.ParquetSink(str(out / "sums")) if parquet_sums else None, name="s")
    return q


def _gc_marks(workdir: Path) -> dict[int, int]:
    """The GC marks the job's catalog holds now (read-only: the master keeps writing it)."""
    path = workdir / "master"
    if not (path / "data.mdb").exists():
        return {}
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=0)
    try:
        with env.begin() as txn:
            v = txn.get(b"gc_marks")
    finally:
        env.close()
    return {} if v is None else {int(k): int(m) for k, m in msgpack.unpackb(v, raw=False).items()}


def _wait_for_trimmed_logs(workdir: Path, deadline_s: float = 60) -> dict[int, int]:
    """Until both source stages' output logs were trimmed (a GC mark of at least 1 each)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        marks = _gc_marks(workdir)
        if marks.get(0, -1) >= 1 and marks.get(2, -1) >= 1:
            return marks
        time.sleep(0.2)
    raise AssertionError(f"no output log trimmed within {deadline_s} s: {_gc_marks(workdir)}")


def _sorted(t: pa.Table, columns: list[str]) -> list[dict]:
    return sorted(t.select(columns).to_pylist(), key=lambda r: (r["_slice"], r["_seq"]))


def _restored_from_disk(timeline) -> list[dict]:
    restored = [info for _, kind, info in timeline if kind == "slices_restored"]
    assert restored
    holders = {h for info in restored for h in info["restored_from"]}
    assert holders == {DISK_HOLDER}, restored
    return restored


def test_a_job_whose_master_and_hosts_all_died_goes_on_from_its_stores_on_disk(ray_session, tmp_path):
    """On the shared Ray: the master and every host killed for good after the GC trimmed the
    logs; ``cs.resume`` restores every slice (all 12) from the dead hosts' stores and the
    output of both sinks, a Parquet one (committing every 0.5 s) and a memory one, equals the
    serial run's."""
    import ray

    workdir = tmp_path / "job"
    q = _query(tmp_path, max_age_s=0.5)
    job = cs.run(q, containers=2, workdir=str(workdir), source_pace_s=0.15, checkpoint_interval_s=0.3,
                 gc_interval_s=1.0)
    _wait_for_trimmed_logs(workdir)
    hosts = list(ray.get(job.master.host_handles.remote()).values())
    assert job.status().state == "running"
    ray.kill(job.master, no_restart=True)
    for h in hosts:
        ray.kill(h, no_restart=True)
    if job._ref_keeper is not None:  # (the handle of the dead job: its keeper asks a dead master)
        job._ref_keeper.stop()
    staged = list((tmp_path / "counts" / "_staging").rglob("epoch-*.arrow"))
    assert staged, "the dead run staged no Parquet part: nothing to be counted twice"

    again = cs.resume(str(workdir))
    try:
        again.wait(timeout_s=180)
        assert again.status().state == "finished"
        timeline = again.timeline()
        restored = _restored_from_disk(timeline)
        assert sorted((info["stage"], s) for info in restored for s in info["slices"]) == \
            sorted([(st, s) for st in (0, 2) for s in range(2)] + [(st, s) for st in (1, 3) for s in range(4)])
        serial = cs.run(_query(tmp_path / "serial"), executor="serial")
        got_c = cs.read_parquet_sink(str(tmp_path / "counts"))
        exp_c = serial.results("c")
        assert got_c.num_rows == exp_c.num_rows
        assert _sorted(got_c, exp_c.column_names) == _sorted(exp_c, exp_c.column_names)
        exp_s = serial.results("s")
        assert _sorted(again.results("s"), exp_s.column_names) == _sorted(exp_s, exp_s.column_names)
    finally:
        again.stop()
    assert not workdir.exists()  # (made for the job: its stop removes it whole)


DRIVER = '''
import sys, time
import numpy as np, pyarrow as pa, ray
import chronostream as cs
sys.path.insert(0, sys.argv[3])
from test_resume import _query
from pathlib import Path
job = cs.run(_query(Path(sys.argv[2]), 10_000, parquet_sums=True, max_age_s=0.5), containers=1, workdir=sys.argv[1],
             source_pace_s=0.15, checkpoint_interval_s=0.3, gc_interval_s=1.0)
print(ray._private.worker._global_node.get_session_dir_path(), flush=True)
time.sleep(600)
'''


def _kill_tree(pid: int) -> list[psutil.Process]:
    """SIGKILL a process and every process under it, all at once; the processes killed."""
    root = psutil.Process(pid)
    procs = [root] + root.children(recursive=True)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=20)
    return procs


def test_kill_9_of_every_process_of_the_cluster_then_chronostream_resume_gives_the_uninterrupted_output(tmp_path):
    """The acceptance test: a driver process runs a job on the Ray it started; once the GC has
    trimmed output logs, the driver and every process under it (Ray's own processes, the
    master, the hosts) are killed with SIGKILL at once. ``chronostream resume WORKDIR``, a new
    process with no address, starts a Ray of its own, finds the job's code in its catalog, its
    input in its source copies and every slice in the dead hosts' stores, and finishes it: both
    Parquet sinks equal the serial run's, row for row and ``_seq`` for ``_seq``."""
    workdir, out = tmp_path / "job", tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(workdir), str(out), str(Path(__file__).parent)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    serial = cs.run(_query(tmp_path / "serial", 10_000, parquet_sums=True), executor="serial")
    try:
        session = driver.stdout.readline().strip()
        assert session, "the driver did not start its job"
        _wait_for_trimmed_logs(workdir)
        # A reader of the sink's directory while the job runs: committed files only, each row once.
        deadline = time.monotonic() + 60
        while not list((out / "counts").glob("part-*.parquet")) and time.monotonic() < deadline:
            time.sleep(0.2)
        seen = pq.read_table(out / "counts")
    finally:
        killed = _kill_tree(driver.pid)
    ids = list(zip(seen["_slice"].to_pylist(), seen["_seq"].to_pylist()))
    assert 0 < len(ids) == len(set(ids)) < serial.results("c").num_rows
    assert set(ids) <= set(zip(serial.results("c")["_slice"].to_pylist(), serial.results("c")["_seq"].to_pylist()))
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if session in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes of the killed Ray still run: {left}"
    assert len(killed) >= 5  # (the driver, Ray's own processes, the master and hosts)
    assert list((out / "counts" / "_staging").rglob("epoch-*.arrow")), "the dead run staged no part"
    assert not read_record(out / "counts")["final"]  # (the job did not finish)

    done = subprocess.run([sys.executable, "-m", "chronostream", "resume", str(workdir)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    for sink, path in (("c", "counts"), ("s", "sums")):
        got, expected = cs.read_parquet_sink(str(out / path)), serial.results(sink)
        assert summary[sink] == got.num_rows == expected.num_rows > 0
        assert _sorted(got, expected.column_names) == _sorted(expected, expected.column_names), sink
    assert not workdir.exists()  # (the resumed job's stop removed what run made for it)


def test_the_newest_sound_copy_on_disk_is_handed_over_and_a_damaged_one_gives_way(tmp_path):
    """Two dead hosts' stores hold a slice at epochs 4 and 6; the newer is damaged: the catalog
    offers epoch 4 and names the damage, and a read hands over the epoch-4 copy."""
    from chronostream.containers.backup_store import BackupStore
    from chronostream.master.ray_disk_copies import DiskStores
    from chronostream.slices.checkpoint import SliceCheckpoint, decode, encode

    for host, epoch in ((0, 4), (1, 6)):
        store = BackupStore(tmp_path / f"h{host}")
        store.put(encode(SliceCheckpoint(1, 0, epoch, "full", -1, {}, {0: 10 * epoch})))
        if host == 1:
            store.corrupt(1, 0)
        store.close()
    stores = DiskStores({0: str(tmp_path / "h0"), 1: str(tmp_path / "h1")})
    try:
        good, bad = stores.catalog()
        assert good == [(1, 0, 4)]
        assert len(bad) == 1 and bad[0][:2] == (1, 0) and "host 1's store on disk" in bad[0][2]
        assert decode(stores.backup_bytes(1, 0)).epoch == 4
        with pytest.raises(KeyError, match="no sound copy of stage 1 slice 3"):
            stores.backup_bytes(1, 3)
    finally:
        stores.close()


def test_a_host_reports_for_the_gc_only_what_its_store_on_disk_holds(tmp_path):
    """The epochs a host reports to the GC (which trims output logs by them) are on disk when
    reported: a store reopened from its files after the report, with no other flush, holds them."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from chronostream.containers.backup_store import BackupStore
    from chronostream.containers.ray_backup_host import HostBackups
    from chronostream.slices.checkpoint import SliceCheckpoint, encode

    store = BackupStore(tmp_path / "backups")
    for s, epoch in ((0, 3), (1, 5)):
        store.put(encode(SliceCheckpoint(2, s, epoch, "full", -1, {}, {0: epoch})))
    host = SimpleNamespace(backup_store=store, _store_thread=ThreadPoolExecutor(1))
    reported = asyncio.run(HostBackups(host).persisted_epochs())
    store.close(flush=False)  # (what a kill -9 leaves: the files as they are)
    host._store_thread.shutdown()
    assert reported == {(2, 0): 3, (2, 1): 5}
    again = BackupStore(tmp_path / "backups")
    try:
        assert again.epochs() == reported
    finally:
        again.close(flush=False)


def test_a_job_tailing_a_source_log_goes_on_from_the_log_after_its_every_process_died(ray_session, tmp_path):
    """A job following a source log (not a table: the launch keeps where to read it) loses its
    master and hosts after the GC trimmed its logs; more input arrives and the log is sealed;
    ``cs.resume`` reads on from the log and the sums equal the bounded serial run's."""
    import ray
    from chronostream.slices.sourcelog import SourceLogWriter

    from test_sourcelog import count_query, rows

    log, workdir = tmp_path / "log", tmp_path / "job"
    w = SourceLogWriter(log)
    w.append({"s": rows(0, 0, 640)}, high_water=640)
    job = cs.run(count_query(log, follow=True), containers=2, workdir=str(workdir), checkpoint_interval_s=0.2,
                 gc_interval_s=0.5)
    n, deadline = 640, time.monotonic() + 60
    while _gc_marks(workdir).get(0, -1) < 1 and time.monotonic() < deadline:
        w.append({"s": rows(n, n, 64)}, high_water=n + 64)  # (an epoch at a time, as a feeder would)
        n += 64
        time.sleep(0.2)
    assert _gc_marks(workdir).get(0, -1) >= 1, "no output log trimmed"
    hosts = list(ray.get(job.master.host_handles.remote()).values())
    ray.kill(job.master, no_restart=True)
    for h in hosts:
        ray.kill(h, no_restart=True)
    assert not list(workdir.glob("sources/*"))  # (a log is read again, not copied)
    w.append({"s": rows(n, n, 320)}, high_water=n + 320)
    w.seal()
    again = cs.resume(str(workdir))
    try:
        again.wait(timeout_s=120)
        _restored_from_disk(again.timeline())
        got = again.results("sums")
    finally:
        again.stop()
    assert got.to_pylist() == cs.run(count_query(log, follow=False), executor="serial").results("sums").to_pylist()
