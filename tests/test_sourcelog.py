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
from chronostream.slices.sourcelog import SourceLog, SourceLogError, SourceLogWriter


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


def test_trimming_deletes_the_segments_wholly_below_the_order_and_keeps_the_rest_readable(tmp_path):
    w = SourceLogWriter(tmp_path)
    for s in range(4):  # 4 segments of 100 rows
        w.append({"s": rows(s * 100, s * 100, 100)}, high_water=(s + 1) * 100)
    assert w.trim(250) == 2, "segments [0, 100) and [100, 200); [200, 300) holds rows at or above 250"
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "segments" / "s").iterdir()) == \
        ["000000000200", "000000000300"]
    log = SourceLog(tmp_path)
    assert log.low_water == 250 and log.verify() == []
    assert log.read("s", from_order=250)["_order"].to_pylist() == list(range(250, 400))
    assert log.read_from_seq("s", 200)["_stream_seq"].to_pylist() == list(range(200, 400))


@pytest.mark.parametrize("read", [lambda log: log.read("s", from_order=249), lambda log: log.read("s"),
                                  lambda log: log.read_from_seq("s", 199)])
def test_reading_below_the_trimmed_order_names_both_orders_instead_of_returning_fewer_rows(tmp_path, read):
    w = SourceLogWriter(tmp_path)
    for s in range(4):
        w.append({"s": rows(s * 100, s * 100, 100)}, high_water=(s + 1) * 100)
    w.trim(250)
    with pytest.raises(SourceLogError, match=r"trimmed below order 250"):
        read(SourceLog(tmp_path))


def test_a_trim_cut_short_after_publishing_its_mark_is_finished_by_the_next_writer(tmp_path, monkeypatch):
    import pathlib

    w = SourceLogWriter(tmp_path)
    for s in range(4):
        w.append({"s": rows(s * 100, s * 100, 100)}, high_water=(s + 1) * 100)
    real, calls = pathlib.Path.unlink, []

    def crash_on_second(self, missing_ok=False):
        calls.append(self)
        if len(calls) == 2:
            raise OSError("the feeder died")
        real(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", crash_on_second)
    with pytest.raises(OSError):
        w.trim(300)
    monkeypatch.setattr(pathlib.Path, "unlink", real)
    assert SourceLog(tmp_path).low_water == 300, "the mark was published first"
    assert SourceLogWriter(tmp_path).trim(300) == 2, "the restarted feeder deletes what is left below it"
    assert len(list((tmp_path / "segments" / "s").iterdir())) == 1


def test_an_append_differing_only_in_nullability_takes_the_logs_schema_unless_it_holds_nulls(tmp_path):
    w = SourceLogWriter(tmp_path)
    first = rows(0, 0, 10)
    w.append({"s": first.cast(pa.schema([f.with_nullable(f.name != "v") for f in first.schema]))}, high_water=10)
    w.append({"s": rows(10, 10, 10)}, high_water=20)  # all nullable: cast to the log's
    log = SourceLog(tmp_path)
    assert log.read("s")["v"].to_pylist() == list(range(20)) and not log.schema("s").field("v").nullable
    with_null = rows(20, 20, 2).set_column(1, "v", pa.array([None, 1], pa.int64()))
    with pytest.raises(SourceLogError, match="column 'v' holds nulls; the log's is non-null"):
        w.append({"s": with_null}, high_water=22)
    with pytest.raises(SourceLogError, match="schema changed"):
        w.append({"s": rows(20, 20, 2).set_column(1, "v", pa.array([1.0, 2.0]))}, high_water=22)


def test_trimming_never_lowers_the_mark_nor_passes_the_high_water_and_survives_a_new_writer(tmp_path):
    w = SourceLogWriter(tmp_path)
    w.append({"s": rows(0, 0, 100)}, high_water=100)
    tail = SourceLog(tmp_path)
    w.trim(60)
    assert w.trim(10) == 0 and SourceLog(tmp_path).low_water == 60
    with pytest.raises(SourceLogError, match="above its high water mark 100"):
        w.trim(101)
    tail.refresh()
    assert tail.low_water == 60, "a tailing reader sees the mark"
    w2 = SourceLogWriter(tmp_path)  # the feeder restarted
    w2.append({"s": rows(100, 100, 100)}, high_water=200)
    assert w2.trim(150) == 1 and SourceLog(tmp_path).low_water == 150
    assert SourceLog(tmp_path).read("s", 150)["v"].to_pylist() == list(range(150, 200))


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


def feed_twice(live: SourceLogWriter, full: SourceLogWriter, i: int, n: int = 64) -> None:
    """Batch ``i`` of ``n`` rows into both logs (``full`` is never trimmed: the serial run's input)."""
    for w in (live, full):
        w.append({"s": rows(i * n, i * n, n)}, high_water=(i + 1) * n)


def test_a_feeder_trimming_its_log_to_the_jobs_floor_loses_nothing_through_kills(tmp_path):
    """The feeder appends an epoch every other round and trims the log to the job's floor; the
    source's host and a counting host die on the way (their slices re-read the log from their
    checkpoints). The output equals the serial run over an untrimmed copy, and most of the log
    was deleted on the way."""
    from chronostream.dag import compile_query
    from chronostream.master.local import LocalCluster
    from chronostream.master.placement import containers_per_stage, initial_placement

    live, full = SourceLogWriter(tmp_path / "live"), SourceLogWriter(tmp_path / "full")
    feed_twice(live, full, 0)
    plan, sources = compile_query(count_query(tmp_path / "live", follow=True))
    cl = LocalCluster(plan, initial_placement(plan, containers_per_stage(plan, 2)), sources, checkpoint_every=1)
    deleted, floors = [], []

    def feed(i: int):
        def step(cl: LocalCluster) -> None:
            if i < 20:
                feed_twice(live, full, i)
            else:
                live.seal(), full.seal()
            floors.append(cl.source_log_floors()["s"])
            deleted.append(live.trim(floors[-1]))
        return step

    def trim_then_kill(stage: int):
        def step(cl: LocalCluster) -> None:  # trimmed to the floor just now: the restore reads from it
            floors.append(cl.source_log_floors()["s"])
            deleted.append(live.trim(floors[-1]))
            cl.kill([cl.hosts[cl.placement.containers[stage][0]]])
        return step

    faults = {2 * i: feed(i) for i in range(1, 21)}
    faults[13] = trim_then_kill(0)  # the source's host
    faults[27] = trim_then_kill(cl.stage_id("sum"))
    cl.run(faults=faults)
    assert sum(1 for _, kind, _ in cl.timeline if kind == "recovery_end") == 2
    assert floors == sorted(floors) and floors[-1] >= 10 * 64, floors
    assert sum(deleted) >= 10, "most segments went while the job ran"
    expected = cs.run(count_query(tmp_path / "full", follow=False), executor="serial").results("sums").to_pylist()
    assert cl.results("sums").to_pylist() == expected


def test_a_feeder_on_ray_trims_to_the_jobs_floor_and_a_killed_source_host_rereads_above_it(ray_session, tmp_path):
    """The same on Ray through ``Job.source_log_floor``: the feeder trims after every batch, the
    source's host dies half-way and its slices re-read the log from their checkpoints."""
    from chronostream.chaos import Fault, apply_schedule
    from test_migration_ray import run_cli

    live, full = SourceLogWriter(tmp_path / "live"), SourceLogWriter(tmp_path / "full")
    feed_twice(live, full, 0)
    job = cs.run(count_query(tmp_path / "live", follow=True), containers=2, checkpoint_every=1, gc_interval_s=0.2)
    floors, deleted, applied = [], [], []
    try:
        for i in range(1, 40):
            time.sleep(0.08)
            feed_twice(live, full, i)
            floors.append(job.source_log_floor())
            deleted.append(live.trim(floors[-1]))
            if i == 20:
                applied = apply_schedule(job, [Fault("kill", at_epoch=0, stage="s")])
            if i == 30:  # an operator's shell asks too
                cli = run_cli("log-floor", job.key)
                assert cli.returncode == 0, cli.stderr[-2000:]
                assert floors[-1] <= json.loads(cli.stdout.strip().splitlines()[-1])["floor"] <= job.source_log_floor()
        live.seal(), full.seal()
        got = job.results("sums").to_pylist()
        timeline = job.timeline()
    finally:
        job.stop()
    assert applied and "recovery_end" in [kind for _, kind, _ in timeline]
    assert floors == sorted(floors) and floors[-1] > 0 and sum(deleted) > 0, (floors, deleted)
    assert got == cs.run(count_query(tmp_path / "full", follow=False), executor="serial").results("sums").to_pylist()


def test_a_job_reading_tables_has_no_source_log_floor():
    with pytest.raises(ValueError, match="reads no source log"):
        cs.Job(compile_query_plan(), master=None, placement={}).source_log_floor()


def compile_query_plan():
    from chronostream.dag import compile_query

    q = cs.Query()
    q.source("w", [{"w": "a"}]).key_by("w").count(slices=2).sink(name="c")
    return compile_query(q)[0]


def test_an_unchanged_manifest_is_not_parsed_again(tmp_path, monkeypatch):
    """A tailing source refreshes every few ms: without news that costs an fstat, not a parse."""
    import chronostream.slices.sourcelog as sl

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
