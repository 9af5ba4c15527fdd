"""The source log: complete segments only, checksummed, readable from any sequence number.

No Spark here: the writer is driven directly, as the feeder drives it.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import numpy as np
import pyarrow as pa
import pytest

import chronostream as cs
from chronostream.sourcelog import SourceLog, SourceLogError, SourceLogWriter


def rows(stream_seq0: int, order0: int, n: int, step: int = 1) -> pa.Table:
    """n rows with dense stream sequence numbers and increasing global orders."""
    return pa.table({"k": pa.array([f"k{(stream_seq0 + i) % 5}" for i in range(n)]),
                     "v": pa.array(np.arange(stream_seq0, stream_seq0 + n), pa.int64()),
                     "_order": pa.array(np.arange(order0, order0 + n * step, step), pa.int64()),
                     "_stream_seq": pa.array(np.arange(stream_seq0, stream_seq0 + n), pa.int64())})


def write_log(path, segments: int = 4, n: int = 100) -> None:
    w = SourceLogWriter(path)
    for s in range(segments):
        w.append({"s": rows(s * n, s * n, n)}, high_water=(s + 1) * n)
    w.seal()


def test_log_reads_back_every_row_in_order(tmp_path):
    """Rows appended in several segments read back as one ordered table."""
    write_log(tmp_path)
    t = SourceLog(tmp_path).read("s")
    assert t["_order"].to_pylist() == list(range(400))


def test_log_is_readable_from_any_order_and_any_stream_seq(tmp_path):
    """Replay: a read from order k, or from stream sequence k, starts exactly at k."""
    write_log(tmp_path)
    log = SourceLog(tmp_path)
    for k in (0, 1, 99, 100, 257, 399, 400):
        assert log.read("s", from_order=k)["_order"].to_pylist() == list(range(k, 400))
        assert log.read_from_seq("s", k)["_stream_seq"].to_pylist() == list(range(k, 400))


def test_truncated_last_segment_is_detected_not_read(tmp_path):
    """A truncated segment raises SourceLogError naming it; its rows are never returned."""
    write_log(tmp_path)
    log = SourceLog(tmp_path)
    last = tmp_path / log.segments[-1].file
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])
    with pytest.raises(SourceLogError, match="torn") as err:
        log.read("s")
    assert log.segments[-1].file in str(err.value)
    assert log.read("s", 0, 300)["_order"].to_pylist() == list(range(300))  # the sound part stays readable
    assert len(log.verify()) == 1


def test_corrupted_segment_fails_its_checksum(tmp_path):
    """A segment with flipped bytes (same size) is refused by its CRC-32."""
    write_log(tmp_path)
    log = SourceLog(tmp_path)
    seg = tmp_path / log.segments[1].file
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg.write_bytes(bytes(data))
    with pytest.raises(SourceLogError, match="CRC"):
        log.read("s", from_order=100, to_order=200)


def test_segment_not_in_the_manifest_does_not_exist_for_readers(tmp_path):
    """A half-written segment file (crash before the manifest update) is ignored."""
    write_log(tmp_path, segments=2)
    (tmp_path / "segments" / "s" / "000000000200-deadbeef.arrow").write_bytes(b"partial")
    assert SourceLog(tmp_path).read("s").num_rows == 200


def test_writer_refuses_gaps_and_reordering(tmp_path):
    """Appends must continue the stream sequence densely and keep the global order increasing."""
    w = SourceLogWriter(tmp_path)
    w.append({"s": rows(0, 0, 10)}, high_water=10)
    with pytest.raises(SourceLogError, match="dense"):
        w.append({"s": rows(11, 10, 5)})
    with pytest.raises(SourceLogError, match="above"):
        w.append({"s": rows(10, 5, 5)})


def test_sealed_log_takes_no_more_rows(tmp_path):
    """Opening a sealed log for writing fails clearly."""
    write_log(tmp_path, segments=1)
    with pytest.raises(SourceLogError, match="sealed"):
        SourceLogWriter(tmp_path)


def test_manifest_never_lists_a_segment_before_it_is_complete(tmp_path):
    """Every segment the manifest lists exists with its recorded size (checked after each append)."""
    w = SourceLogWriter(tmp_path)
    for s in range(5):
        w.append({"s": rows(s * 50, s * 50, 50)}, high_water=(s + 1) * 50)
        listed = SourceLog(tmp_path).segments
        assert len(listed) == s + 1
        for seg in listed:
            assert (tmp_path / seg.file).stat().st_size == seg.bytes


def test_an_index_tail_the_manifest_does_not_cover_does_not_exist(tmp_path):
    """A writer that died after appending an index line but before publishing the manifest left a
    segment no reader sees; the next writer cuts that tail off and goes on."""
    write_log_open = SourceLogWriter(tmp_path)
    write_log_open.append({"s": rows(0, 0, 50)}, high_water=50)
    published = json.loads((tmp_path / "manifest.json").read_text())
    write_log_open.append({"s": rows(50, 50, 50)}, high_water=100)
    (tmp_path / "manifest.json").write_text(json.dumps(published))  # the publish never happened
    log = SourceLog(tmp_path)
    assert len(log.segments) == 1 and log.high_water == 50
    w = SourceLogWriter(tmp_path)
    w.append({"s": rows(50, 50, 50)}, high_water=100)
    w.seal()
    assert SourceLog(tmp_path).read("s")["v"].to_pylist() == list(range(100))


def test_a_corrupted_segment_index_is_refused(tmp_path):
    write_log(tmp_path, segments=3)
    index = tmp_path / "segments.jsonl"
    data = bytearray(index.read_bytes())
    data[10] ^= 0x01
    index.write_bytes(bytes(data))
    with pytest.raises(SourceLogError, match="segments.jsonl is torn or corrupt"):
        SourceLog(tmp_path)


def test_a_tailing_reader_parses_only_the_new_index_lines(tmp_path):
    """Refresh cost stays O(new segments): the index is read from where the last refresh stopped."""
    w = SourceLogWriter(tmp_path)
    w.append({"s": rows(0, 0, 10)}, high_water=10)
    log = SourceLog(tmp_path)
    first = log._index_bytes
    for s in range(1, 4):
        w.append({"s": rows(s * 10, s * 10, 10)}, high_water=(s + 1) * 10)
        log.refresh()
    assert len(log.segments) == 4 and log._index_bytes > first
    assert [seg.first_order for seg in log.segments_of("s", 25, 35)] == [20, 30]
    assert log.read("s", 15)["v"].to_pylist() == list(range(15, 40))


def test_a_version_1_log_is_read_and_moved_to_the_index_by_a_writer(tmp_path):
    """Logs written before the segment index (every segment in the manifest) still work."""
    write_log(tmp_path, segments=2, n=20)
    segs = [dataclasses.asdict(s) for s in SourceLog(tmp_path).segments]
    m = json.loads((tmp_path / "manifest.json").read_text())
    for k in ("index_bytes", "index_crc32"):
        del m[k]
    m.update(version=1, segments=segs, sealed=False)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    (tmp_path / "segments.jsonl").unlink()
    assert SourceLog(tmp_path).read("s")["v"].to_pylist() == list(range(40))
    w = SourceLogWriter(tmp_path)
    w.append({"s": rows(40, 40, 20)}, high_water=60)
    w.seal()
    assert "segments" not in json.loads((tmp_path / "manifest.json").read_text())
    assert SourceLog(tmp_path).read("s")["v"].to_pylist() == list(range(60))


def count_query(log_dir, follow: bool) -> cs.Query:
    q = cs.Query(epoch_events=64)
    q.source_log(str(log_dir), "s", follow=follow).key_by("k").sum("v", slices=3, name="sum").sink(name="sums")
    return q


def test_an_unchanged_manifest_is_not_parsed_again(tmp_path, monkeypatch):
    """A tailing source refreshes every few ms: without news that costs an fstat, not a parse."""
    import chronostream.sourcelog as sl

    w = SourceLogWriter(tmp_path)
    w.append({"s": rows(0, 0, 10)}, high_water=10)
    log = SourceLog(tmp_path)
    parses = []
    real = sl.json.loads
    monkeypatch.setattr(sl.json, "loads", lambda text: parses.append(1) or real(text))
    log.refresh()
    log.refresh()
    assert parses == [] and log.high_water == 10
    w.append({"s": rows(10, 10, 10)}, high_water=20)
    log.refresh()
    assert parses and log.high_water == 20  # the manifest and the one new index line


def test_job_tailing_a_growing_log_equals_a_bounded_run_over_the_final_log(tmp_path):
    """A job following the log while a writer appends gives the bounded run's output (local runtime)."""
    w = SourceLogWriter(tmp_path)
    w.append({"s": rows(0, 0, 50)}, high_water=50)

    def writer():
        for s in range(1, 12):
            time.sleep(0.02)
            w.append({"s": rows(s * 50, s * 50, 50)}, high_water=(s + 1) * 50)
        w.seal()

    t = threading.Thread(target=writer)
    t.start()
    live = cs.run(count_query(tmp_path, follow=True), executor="local", containers=2).results("sums")
    t.join()
    bounded = cs.run(count_query(tmp_path, follow=False), executor="local", containers=2).results("sums")
    assert live.num_rows == bounded.num_rows == 600
    assert live.to_pylist() == bounded.to_pylist()
    assert bounded.to_pylist() == cs.run(count_query(tmp_path, follow=False), executor="serial").results("sums").to_pylist()


def test_job_on_ray_tailing_a_growing_log_equals_a_bounded_run(ray_session, tmp_path):
    """The same on Ray: the live job ends when the log is sealed, with the bounded run's output."""
    w = SourceLogWriter(tmp_path)
    w.append({"s": rows(0, 0, 30)}, high_water=30)
    job = cs.run(count_query(tmp_path, follow=True), containers=2)
    try:
        for s in range(1, 10):
            time.sleep(0.05)
            w.append({"s": rows(s * 30, s * 30, 30)}, high_water=(s + 1) * 30)
        assert job.status().state == "running"  # it waits for more input
        w.seal()
        live = job.results("sums")
    finally:
        job.stop()
    bounded = cs.run(count_query(tmp_path, follow=False), executor="serial").results("sums")
    assert live.num_rows == 300
    assert live.to_pylist() == bounded.to_pylist()


def test_job_on_ray_with_paced_full_collections_equals_a_bounded_run(ray_session, tmp_path):
    """Hosts that run their own full garbage collections (here every 0.2 s, while the job tails a
    log) still give the bounded run's output, and report the collections they ran."""
    w = SourceLogWriter(tmp_path)
    w.append({"s": rows(0, 0, 30)}, high_water=30)
    job = cs.run(count_query(tmp_path, follow=True), containers=2, full_gc_interval_s=0.2)
    try:
        for s in range(1, 10):
            time.sleep(0.15)
            w.append({"s": rows(s * 30, s * 30, 30)}, high_water=(s + 1) * 30)
        stats = job.statistics()
        w.seal()
        live = job.results("sums")
    finally:
        job.stop()
    bounded = cs.run(count_query(tmp_path, follow=False), executor="serial").results("sums")
    assert live.to_pylist() == bounded.to_pylist()
    assert all(s.gc_full_collections >= 1 for s in stats.values())


@pytest.mark.parametrize("executor", ["local", "ray"])
def test_a_log_sealed_after_its_last_full_epoch_was_processed_still_ends_the_job(tmp_path, request, executor):
    """The input ends exactly on an epoch boundary and the seal comes after that epoch ran: no
    epoch message can carry the end any more, so the end is sent on its own, and every stage ends."""
    if executor == "ray":
        request.getfixturevalue("ray_session")
    w = SourceLogWriter(tmp_path)
    w.append({"s": rows(0, 0, 100)}, high_water=100)
    q = count_query(tmp_path, follow=True)
    epoch = q.epoch_events
    w.append({"s": rows(100, 100, 2 * epoch - 100)}, high_water=2 * epoch)  # two full epochs, no more
    sealer = threading.Timer(1.5, w.seal)
    sealer.start()
    try:
        job = cs.run(q, executor=executor, containers=2)
        job.wait(timeout_s=60)
        live = job.results("sums")
        if executor == "ray":
            job.stop()
    finally:
        sealer.join()
    assert live.num_rows == 2 * epoch
    assert live.to_pylist() == cs.run(count_query(tmp_path, follow=False), executor="serial").results("sums").to_pylist()
