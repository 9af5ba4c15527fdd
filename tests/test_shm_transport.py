"""Specification of the shared-memory transport of epoch messages (containers/shm_transport.py).

Unit: a large routed part goes out as a file and comes back equal (schema,
field metadata, dictionary codes, consumer slices); small parts and control
fields stay in the message; the receiver unlinks the file and its tables
outlive it; cleanup touches only one job's files; a part that would eat into
the directory's reserve stays in the message. On Ray: a job on one node
sends its parts through the files and its output equals the serial run's,
with the transport on and off, and leaves no file behind; a stopped host
refuses messages and unlinks their files; a host's stop leaves its files to
their receivers, the job's stop removes them.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest
import ray

import chronostream as cs
from chronostream.chaos import compare_with_serial
from chronostream.slices.types import KEY_HASHES_META
from chronostream.containers.epoch_message import EpochMessage
from chronostream.containers.shm_transport import (ShmPart, ShmSender, job_prefix, remove_job_files, shm_job_tag,
                                                    unpack)
from queries import word_count


def routed_part(n: int = 20_000) -> tuple[pa.Table, np.ndarray]:
    """A part as routing makes it: words, system columns, the key's dictionary codes with their
    hashes in the field's metadata, and the consumer slice of every row (sorted)."""
    words = pa.array([f"w{i % 300}" for i in range(n)])
    codes = words.dictionary_encode()
    field = pa.field("_codes_word", codes.type, metadata={KEY_HASHES_META: b"\x01" * 16})
    table = pa.table({"word": words, "_order": np.arange(n), "_sub": np.zeros(n, np.int64),
                      "_slice": np.zeros(n, np.int64), "_seq": np.arange(n)}).append_column(field, codes)
    return table, np.sort(np.arange(n) % 64).astype(np.int64)


def sender(job: str, host: int, directory, **kw) -> ShmSender:
    """A sender writing under a test's own directory, with no reserve: ``tmp_path`` is on the
    machine's disk, whose free share is not the test's to judge (the reserve has its own test)."""
    return ShmSender(job, host, str(directory), reserve_fraction=0.0, **kw)


def test_a_large_part_travels_as_a_file_and_comes_back_equal_with_its_consumer_slices(tmp_path):
    table, dst = routed_part()
    wire, paths = sender("job", 1, tmp_path).pack(EpochMessage({3: (table, dst)}))
    assert isinstance(wire.parts[3], ShmPart) and paths == [wire.parts[3].path] and os.path.exists(paths[0])
    back, back_dst = unpack(wire).parts[3]
    assert back.equals(table) and back.schema.equals(table.schema, check_metadata=True)
    assert back.schema.field("_codes_word").metadata == {KEY_HASHES_META: b"\x01" * 16}
    assert back_dst.dtype == np.int64 and np.array_equal(back_dst, dst)


def test_small_parts_empty_parts_and_control_fields_stay_in_the_message(tmp_path):
    small = pa.table({"word": ["a", "b"], "_seq": [0, 1]})
    empty = small.slice(0, 0)
    message = EpochMessage({0: (small, np.zeros(2, np.int64)), 1: (empty, np.zeros(0, np.int64))}, end=7,
                           release=(2,), ingest=1.5)
    wire, paths = sender("job", 1, tmp_path, min_bytes=1024).pack(message)
    assert paths == [] and wire is message, "a message without files is not copied"
    assert unpack(wire) is wire, "a message without files is not copied"


def test_the_receiver_unlinks_the_file_and_its_tables_outlive_it(tmp_path):
    table, dst = routed_part()
    wire, paths = sender("job", 1, tmp_path).pack(EpochMessage({0: (table, dst)}))
    back = unpack(wire).parts[0][0]
    assert not os.path.exists(paths[0]) and os.listdir(tmp_path) == []
    _ = [np.ones(1 << 20) for _ in range(20)]  # other allocations in between
    assert back.column("word").to_pylist()[:3] == ["w0", "w1", "w2"] and back.equals(table)


def test_a_part_that_cannot_be_written_travels_in_the_message(tmp_path):
    table, dst = routed_part()
    wire, paths = ShmSender("job", 1, str(tmp_path / "missing")).pack(EpochMessage({0: (table, dst)}))
    assert paths == [] and wire.parts[0][0] is table


def test_cleanup_removes_one_jobs_files_and_no_other_jobs(tmp_path):
    table, dst = routed_part()
    sender("a", 1, tmp_path).pack(EpochMessage({0: (table, dst)}))
    sender("a", 2, tmp_path).pack(EpochMessage({0: (table, dst)}))
    _, kept = sender("b", 1, tmp_path).pack(EpochMessage({0: (table, dst)}))
    assert remove_job_files("a", str(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(kept[0])]


def test_a_part_that_would_eat_into_the_reserve_travels_in_the_message(tmp_path):
    table, dst = routed_part()
    full = ShmSender("job", 1, str(tmp_path), reserve_fraction=1.0)  # (no room is ever left)
    wire, paths = full.pack(EpochMessage({0: (table, dst)}))
    assert paths == [] and wire.parts[0][0] is table and full.refused_for_room == 1
    roomy = ShmSender("job", 2, str(tmp_path), reserve_fraction=0.0)
    _, paths = roomy.pack(EpochMessage({0: (table, dst)}))
    assert len(paths) == 1 and roomy.refused_for_room == 0


def _job_files(job) -> list[str]:
    prefix = job_prefix(shm_job_tag(job.master))
    return [p for p in (os.path.join("/dev/shm", f) for f in os.listdir("/dev/shm")) if p.startswith(prefix)]


@pytest.mark.parametrize("shm", [True, False])
def test_a_job_on_one_node_sends_its_parts_through_shared_memory_and_matches_the_serial_run(ray_session, shm):
    """The suite sets ``$CHRONOSTREAM_SHM_MIN_BYTES`` to 0 (conftest): every part goes through a
    file when the transport is on, from the first one (a host learns its peers' nodes when they
    are made known), none when it is off; the sinks equal the serial run either way."""
    job = cs.run(word_count(slices=4, n_lines=3000), containers=2, shm_transport=shm)
    try:
        job.wait(timeout_s=300)
        stats = job.statistics().values()
        sent = sum(s.shm_parts for s in stats)
        assert (sent > 0) == shm, sent
        assert sum(s.parts_node_unknown for s in stats) == 0, "no part waited for its receiver's node"
        assert all(s.send_s > 0 for s in stats if s.stage == "lines"), "a producer times its sends"
        mismatches, rows = compare_with_serial(job, word_count(slices=4, n_lines=3000))
        assert mismatches == {} and rows["counts"] > 0
    finally:
        job.stop()
    assert _job_files(job) == [], "every file was unlinked by its receiver or at the stop"


def test_a_stopped_host_takes_no_message_and_unlinks_its_files_unread(ray_session):
    job = cs.run(word_count(slices=2, n_lines=300), containers=1)
    try:
        job.wait(timeout_s=300)
        host = ray.get(job.master.host_handles.remote())[0]
        ray.get(host.stop.remote(False))
        table, dst = routed_part()
        wire, paths = ShmSender(shm_job_tag(job.master), 99).pack(EpochMessage({0: (table, dst)}))
        assert ray.get(host.push.remote(0, 10**6, 0, wire)) is False
        assert not os.path.exists(paths[0])
    finally:
        job.stop()


def test_a_hosts_stop_leaves_its_files_to_their_receivers_and_the_jobs_stop_removes_them(ray_session):
    """The master stops hosts one by one: a file a stopped host sent may still be queued at a
    live receiver, which would fail on it gone. What is left goes with the job's stop."""
    job = cs.run(word_count(slices=2, n_lines=300), containers=1)
    job.wait(timeout_s=300)
    hosts = ray.get(job.master.host_handles.remote())
    host_id = min(hosts)
    # A file as the host's own sender names them (``ShmSender(job tag, host id)``), in flight.
    _, paths = ShmSender(shm_job_tag(job.master), host_id).pack(EpochMessage({0: routed_part()}))
    ray.get(hosts[host_id].stop.remote(True))
    assert os.path.exists(paths[0]), "a host's stop unlinks none of its files"
    job.stop()
    assert not os.path.exists(paths[0]) and _job_files(job) == []
