"""What the runtime writes, reads back and deletes on disk (issue 59, items 7, 8, 10, 11, 12).

Stores are driven directly (no Ray) except for the work directory of a job (``run``/``stop``),
which only the Ray executor has. Full disks are real: a small tmpfs, mounted when the test runs
as root (skipped otherwise); a store that could die of one (SIGBUS through a mapped file) is
driven in a child process, so a failure shows as a failed test, not a dead test run.
"""

from __future__ import annotations

import json
import os
import pickle
import stat
import subprocess
import sys
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pyarrow as pa
import pytest

import chronostream as cs
from chronostream.slices.sourcelog import SourceLog, SourceLogError, SourceLogWriter
from chronostream.containers.epoch_message import EpochMessage
from chronostream.containers.shm_transport import ShmPart, ShmSender
from chronostream.master.catalog import MasterCatalog
from chronostream.master.launch import JobLaunch

REPO = Path(cs.__file__).resolve().parents[1]  # the code under test (a child process imports it too)


def rows(first: int, n: int) -> pa.Table:
    return pa.table({"v": pa.array(np.arange(first, first + n), pa.int64()),
                     "_order": pa.array(np.arange(first, first + n), pa.int64()),
                     "_stream_seq": pa.array(np.arange(first, first + n), pa.int64())})


def write_log(path: Path, segments: int = 3, n: int = 100, seal: bool = True) -> SourceLogWriter:
    w = SourceLogWriter(path)
    for s in range(segments):
        w.append({"s": rows(s * n, n)}, high_water=(s + 1) * n)
    if seal:
        w.seal()
    return w


def rewrite_manifest(log_dir: Path, **changes) -> None:
    """Change manifest fields the way a writer would, its checksum recomputed when it has one
    (a damage the checksum cannot see: what is left to catch is the content)."""
    m = json.loads((log_dir / "manifest.json").read_text())
    m.update(changes)
    if "manifest_crc32" in m:
        body = {k: v for k, v in m.items() if k != "manifest_crc32"}
        m["manifest_crc32"] = zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    (log_dir / "manifest.json").write_text(json.dumps(m))


# -- item 10: the source log ------------------------------------------------------------------


def test_a_segment_entry_outside_the_log_is_refused_and_no_trim_deletes_outside_it(tmp_path):
    """Regression (issue 59, source log confinement): an index entry whose ``file`` is
    ``../victim.txt`` (index and manifest consistent: length, CRC-32s) makes the log damaged for
    a reader and for a reopening writer (``SourceLogError``), and the file outside the log
    survives; before, a writer's trim deleted it."""
    log_dir = tmp_path / "log"
    write_log(log_dir, seal=False)
    victim = tmp_path / "victim.txt"
    victim.write_text("not the log's")
    m = json.loads((log_dir / "manifest.json").read_text())
    line = (json.dumps({"file": "../victim.txt", "stream": "s", "first_order": 300, "last_order": 300,
                        "first_seq": 300, "rows": 1, "bytes": 13, "crc32": 0}, separators=(",", ":")) + "\n").encode()
    with open(log_dir / "segments.jsonl", "ab") as f:
        f.write(line)
    rewrite_manifest(log_dir, index_bytes=m["index_bytes"] + len(line),
                     index_crc32=zlib.crc32(line, m["index_crc32"]), high_water=301)
    with pytest.raises(SourceLogError, match="outside"):
        SourceLog(log_dir)
    try:
        w = SourceLogWriter(log_dir)
        w.trim(301)
    except SourceLogError as exc:
        assert "victim.txt" in str(exc)
    else:
        pytest.fail("a writer reopened a log whose index points outside it")
    assert victim.read_text() == "not the log's"


def test_a_changed_high_water_in_the_manifest_is_refused_not_read_short(tmp_path):
    """Regression (issue 59, source log manifest checksum): a manifest whose ``high_water`` was
    changed (300 -> 100) fails its checksum and the reader refuses the log with a
    ``SourceLogError``; before, a job read 100 of its 300 rows without a word."""
    write_log(tmp_path)
    assert SourceLog(tmp_path).read("s").num_rows == 300
    m = json.loads((tmp_path / "manifest.json").read_text())
    m["high_water"] = 100
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SourceLogError, match="manifest.json"):
        SourceLog(tmp_path)
    with pytest.raises(SourceLogError, match="manifest.json"):
        SourceLogWriter(tmp_path)


@pytest.mark.parametrize("garbage", [b"\x00\x01garbage{", b"[1, 2]", b'{"sealed": true}', b"\xff\xfe"])
def test_a_garbage_manifest_is_a_source_log_error(tmp_path, garbage):
    """Regression (issue 59, source log damage): a manifest that is not the JSON object a log
    writes (binary garbage, a list, missing fields, bad UTF-8) is a ``SourceLogError`` naming it,
    for a reader and a writer; before, a raw ``JSONDecodeError`` or ``KeyError``."""
    write_log(tmp_path)
    (tmp_path / "manifest.json").write_bytes(garbage)
    with pytest.raises(SourceLogError, match="manifest.json"):
        SourceLog(tmp_path)
    with pytest.raises(SourceLogError, match="manifest.json"):
        SourceLogWriter(tmp_path)


# -- item 11: what executes on load, and permissions -------------------------------------------


class _Forged:
    """A pickle that writes a file when loaded (stands for any code a forged launch would run)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "ran"))


@pytest.mark.parametrize("mac", ["crc32", "hmac"])
def test_a_forged_launch_in_the_catalog_is_refused_before_anything_unpickles_it(tmp_path, mac):
    """Regression (issue 59, unauthenticated launch pickle): a job launch written into the master
    catalog by someone without the job's key (a valid CRC-32, or an HMAC under a key of their
    own) is refused with a ``CatalogError`` by the path a restarted master takes
    (``load_launch`` then ``JobLaunch.unpack``), and its code never runs; before, a valid CRC
    was enough and the pickle ran."""
    cat = MasterCatalog(tmp_path / "master")
    cat.save_launch(JobLaunch(plan=None, containers_per_stage={0: 1}).pack())
    marker = tmp_path / "forged-code-ran"
    forged = pickle.dumps(_Forged(str(marker)))
    record = {"bytes": forged, "crc32": zlib.crc32(forged)} if mac == "crc32" else \
        {"bytes": forged, "hmac_sha256": os.urandom(32)}
    with cat.env.begin(write=True) as txn:
        txn.put(b"launch", msgpack.packb(record, use_bin_type=True))
    with pytest.raises(cs.ChronoStreamError, match="HMAC"):
        JobLaunch.unpack(cat.load_launch())
    assert not marker.exists(), "the forged launch's code ran"
    key = tmp_path / "master" / "launch.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE((tmp_path / "master").stat().st_mode) == 0o700
    cat.close()


def test_shared_memory_files_are_made_exclusively_and_private(tmp_path):
    """Regression (issue 59, shm transport files): a part's file is created with ``O_EXCL`` and
    mode 0600; a file already at the path it would take (planted by someone else) is neither
    written into nor removed, and that part goes through Ray instead; before, it was truncated
    and overwritten (and removed on failure)."""
    sender = ShmSender("job", 1, str(tmp_path), min_bytes=0, reserve_fraction=0.0)  # (the disk is not the test's)
    planted = Path(f"{sender.prefix}0")
    planted.write_text("someone else's")
    table = pa.table({"x": np.arange(1000)})
    msg, paths = sender.pack(EpochMessage({0: (table, np.zeros(1000, np.int64))}))
    assert not isinstance(msg.parts[0], ShmPart) and paths == []
    assert planted.read_text() == "someone else's"
    msg, paths = sender.pack(EpochMessage({0: (table, np.zeros(1000, np.int64))}))
    assert isinstance(msg.parts[0], ShmPart) and stat.S_IMODE(os.stat(paths[0]).st_mode) == 0o600


# -- item 12: full disks ---------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """An 8 MB tmpfs (root only: skipped elsewhere), unmounted after the test."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


_FILL_STORE = r'''
import os, sys
import numpy as np
import pyarrow as pa
kind, path = sys.argv[1], sys.argv[2]
try:
    if kind == "backup store":
        from chronostream.containers.backup_store import BackupStore
        from chronostream.slices.checkpoint import SliceCheckpoint, encode
        store = BackupStore(path)
        for i in range(16):  # 16 MB of checkpoints, flushed one by one, onto an 8 MB disk
            store.put(encode(SliceCheckpoint(1, i, 0, "full", -1, {0: [os.urandom(1 << 20)]}, {0: 1}, {})))
            store.flush()
    elif kind == "output log":
        from chronostream.containers.output_log import OutputLog
        log = OutputLog(path)
        for i in range(16):
            log.append_epoch({(0, 1): pa.table({"x": pa.array([os.urandom(1 << 20)], pa.binary()),
                                                "_seq": pa.array([i], pa.int64())})})
    else:
        from chronostream.master.catalog import MasterCatalog
        cat = MasterCatalog(path)
        for i in range(16):
            cat.add_event(i, (0.0, "blob", {"b": os.urandom(1 << 20)}))
    print("NO ERROR")
except Exception as exc:
    print(type(exc).__name__, getattr(exc, "store", None), getattr(exc, "path", None), exc)
'''


@pytest.mark.parametrize("store", ["backup store", "output log", "master catalog"])
def test_a_store_refuses_to_fill_its_disk_and_names_itself(small_tmpfs, store):
    """Regression (issue 59, full disk): 16 MB written into a store on an 8 MB tmpfs: the store
    refuses the write that would fill the disk with a ``StoreFullError`` naming the store and
    its path, and the process lives; before, the backup store (lmdb with writemap) died of
    SIGBUS and the others raised lmdb's bare "No space left on device"."""
    path = small_tmpfs / store.replace(" ", "-")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", _FILL_STORE, store, str(path)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, f"the process died (exit {r.returncode}): {r.stderr[-2000:]}"
    assert r.stdout.startswith(f"StoreFullError {store} {path} "), r.stdout + r.stderr[-2000:]


def test_the_free_disk_guard_refuses_a_write_before_it_starts(tmp_path, monkeypatch):
    """Regression (issue 59, full disk, without a tmpfs): with the disk's free space reported
    below what a write needs, ``put_all`` raises ``StoreFullError`` naming the store and path,
    and nothing of the write is stored."""
    import lmdb

    import chronostream.containers.lmdb_store as lmdb_store

    env = lmdb.open(str(tmp_path), map_size=1 << 20)
    monkeypatch.setattr(lmdb_store, "free_bytes", lambda path: 3 << 20)
    with pytest.raises(cs.StoreFullError) as err:
        lmdb_store.put_all(env, [(b"k", b"x" * 1000)], store="output log")
    assert err.value.store == "output log" and err.value.path == str(tmp_path) and str(tmp_path) in str(err.value)
    with env.begin() as txn:
        assert txn.get(b"k") is None
    env.close()


def test_a_source_log_writer_on_a_full_disk_leaves_no_temporary_file_and_a_sound_log(small_tmpfs):
    """Regression (issue 59, source log ENOSPC): an append larger than the disk's free space
    raises a ``SourceLogError`` naming the file, leaves no ``.tmp`` file and no segment of its
    own, and the log reads as before; the same writer appends again once there is room.
    Before, a raw ``OSError`` left the temporary file behind."""
    w = write_log(small_tmpfs, segments=1, n=100, seal=False)
    big = pa.table({"v": pa.array(np.frombuffer(os.urandom(12 << 20), np.int64)),
                    "_order": pa.array(np.arange(100, 100 + (12 << 20) // 8), pa.int64()),
                    "_stream_seq": pa.array(np.arange(100, 100 + (12 << 20) // 8), pa.int64())})
    with pytest.raises(SourceLogError, match=str(small_tmpfs)):
        w.append({"s": big}, high_water=100 + big.num_rows)
    assert [p.name for p in small_tmpfs.rglob("*.tmp")] == []
    assert len(list((small_tmpfs / "segments" / "s").iterdir())) == 1
    assert SourceLog(small_tmpfs).read("s")["v"].to_pylist() == list(range(100))
    w.append({"s": rows(100, 50)}, high_water=150)
    assert SourceLog(small_tmpfs).read("s")["v"].to_pylist() == list(range(150))


# -- items 7 and 8: the work directory of a job (Ray) -------------------------------------------


def _query(slices: int) -> cs.Query:
    q = cs.Query(epoch_events=20)
    q.source("w", [{"w": f"w{i % 3}"} for i in range(60)]).key_by("w").count(slices=slices).sink(name="c")
    return q


def test_a_stop_deletes_only_what_the_job_made_in_a_callers_workdir(ray_session, tmp_path, monkeypatch):
    """Regression (issue 59, workdir deletion): ``job.stop()`` in a work directory the caller
    made removes the job's catalog, source copies and host stores but keeps the caller's files
    and directories; before, the whole directory went. A start that fails writing its source
    copies (a full disk) leaves nothing either."""
    import chronostream.client as client

    mine = tmp_path / "mine"
    (mine / "data").mkdir(parents=True)
    (mine / "keep.txt").write_text("the caller's")
    (mine / "data" / "x.bin").write_bytes(b"\x00" * 10)
    real = client.save_source_tables

    def full_disk(workdir, tables):
        real(workdir, tables)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(client, "save_source_tables", full_disk)
    with pytest.raises(OSError, match="No space"):
        cs.run(_query(2), workdir=str(mine), containers=1)
    assert sorted(p.name for p in mine.iterdir()) == ["data", "keep.txt"]
    monkeypatch.setattr(client, "save_source_tables", real)
    job = cs.run(_query(2), workdir=str(mine), containers=1)
    assert job.results("c").num_rows == 60
    assert (mine / "master").is_dir()
    job.stop()
    assert (mine / "keep.txt").read_text() == "the caller's" and (mine / "data" / "x.bin").exists()
    assert sorted(p.name for p in mine.iterdir()) == ["data", "keep.txt"]


def test_a_workdir_holding_another_jobs_catalog_is_refused_unless_resumed_and_the_same(ray_session, tmp_path):
    """Regression (issue 59, foreign catalog): a second job in a work directory holding a
    catalog is refused (``WorkdirError`` naming the held job) unless ``resume=True``; resuming
    is refused for another query's catalog (naming both plan fingerprints) and accepted for the
    same query's, under the held job's key. Before, the other job was silently resumed
    ("finished" in 3 s). A directory ``run`` made is 0700, its launch key 0600, and it goes
    whole at the last stop."""
    made = tmp_path / "made"
    first = cs.run(_query(2), workdir=str(made), containers=1)
    assert first.results("c").num_rows == 60
    first.stop(cleanup=False)  # the catalog stays
    with pytest.raises(cs.ChronoStreamError, match=f"holds the catalog of job '{first.key}'.*resume=True"):
        cs.run(_query(3), workdir=str(made), containers=1)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert stat.S_IMODE((made / "master" / "launch.key").stat().st_mode) == 0o600
    with pytest.raises(cs.ChronoStreamError, match="resume=True refused.*fingerprint.*fingerprint"):
        cs.run(_query(3), workdir=str(made), containers=1, resume=True)
    again = cs.run(_query(2), workdir=str(made), containers=1, resume=True)
    assert again.key == first.key and again.status().state == "finished"
    again.stop()
    assert not made.exists(), "a directory run made for the job goes with it"


def test_a_segment_reached_through_a_symbolic_link_out_of_the_log_is_refused(tmp_path):
    """Regression (issue 59, source log confinement): a segment whose name stays inside the log
    but whose directory is a symbolic link to elsewhere is refused when read or trimmed
    (resolved paths), and the file it points at survives the trim."""
    log_dir = tmp_path / "log"
    w = write_log(log_dir, seal=False)
    outside = tmp_path / "outside"
    (log_dir / "segments" / "s").rename(outside)
    (log_dir / "segments" / "s").symlink_to(outside)
    with pytest.raises(SourceLogError, match="outside"):
        SourceLog(log_dir).read("s")
    with pytest.raises(SourceLogError, match="outside"):
        w.trim(150)
    assert len(list(outside.iterdir())) == 3


@pytest.mark.parametrize("name", ["master", "host-0"])
def test_a_callers_directory_with_the_names_a_job_uses_is_refused_before_anything_starts(tmp_path, name):
    """Regression (issue 59, workdir deletion): a work directory holding a ``master`` (that is
    no job catalog) or ``host-<id>`` entry of the caller's is refused with a ``WorkdirError``
    naming it, before Ray starts; before, the job wrote into it and its stop deleted it."""
    (tmp_path / name).mkdir()
    (tmp_path / name / "mine.txt").write_text("the caller's")
    with pytest.raises(cs.ChronoStreamError, match=f"holds \\['{name}'\\]"):
        cs.run(_query(2), workdir=str(tmp_path), containers=1)
    assert (tmp_path / name / "mine.txt").read_text() == "the caller's"
