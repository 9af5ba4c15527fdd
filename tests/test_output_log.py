"""Specification of containers.output_log.OutputLog: the per-container replay log on lmdb.

Each (stream, producer slice) channel is a dense out_seq sequence written in
epoch batches; ``read(stream, slice, after_seq)`` must return exactly the rows
after ``after_seq``, in order, from any starting point, and survive reopening.
Uses a real lmdb store in a temporary directory.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from chronostream.containers.output_log import OutputLog

CHANNELS = [(s, p) for s in (0, 1, 7) for p in (0, 1, 2, 300)]


def rows(stream: int, slc: int, first: int, n: int) -> pa.Table:
    seqs = np.arange(first, first + n, dtype=np.int64)
    return pa.table({
        "x": pa.array([f"{stream}/{slc}/{q}" for q in seqs.tolist()]),
        "v": pa.array(seqs * 10 + stream, pa.int64()),
        "_seq": pa.array(seqs, pa.int64()),
    })


@st.composite
def epochs(draw):
    """A list of epochs: each maps some channels to a batch continuing that channel's out_seq."""
    nxt = {c: 0 for c in CHANNELS}
    out = []
    for _ in range(draw(st.integers(1, 8))):
        epoch = {}
        for c in draw(st.sets(st.sampled_from(CHANNELS), max_size=5)):
            n = draw(st.integers(0, 5))
            epoch[c] = rows(c[0], c[1], nxt[c], n)
            nxt[c] += n
        out.append(epoch)
    return out, nxt


def seqs(table: pa.Table) -> list[int]:
    return table.column("_seq").to_pylist() if table.num_rows else []


def check_reads(log: OutputLog, nxt: dict) -> None:
    for (stream, slc), n in nxt.items():
        for after in range(-1, n + 3):
            got = log.read(stream, slc, after_seq=after)
            assert seqs(got) == list(range(after + 1, n)), (stream, slc, after)
            if got.num_rows:
                assert got.column("x").to_pylist() == [f"{stream}/{slc}/{q}" for q in range(after + 1, n)]


@settings(max_examples=40, deadline=None)
@given(epochs())
def test_read_returns_exactly_the_rows_after_any_seq_in_order(data):
    """For every channel and every after_seq in [-1, max+2], read() gives the rows with seq > after_seq."""
    eps, nxt = data
    with tempfile.TemporaryDirectory() as d:
        log = OutputLog(d)
        try:
            for e in eps:
                log.append_epoch(e)
            check_reads(log, nxt)
        finally:
            log.close()


@settings(max_examples=25, deadline=None)
@given(epochs())
def test_reopened_log_reads_the_same_rows(data):
    """A new OutputLog on the same directory reads back everything the first one wrote."""
    eps, nxt = data
    with tempfile.TemporaryDirectory() as d:
        log = OutputLog(d)
        for e in eps:
            log.append_epoch(e)
        before = {c: log.read(*c) for c in CHANNELS}
        log.close()
        log = OutputLog(d)
        try:
            for c in CHANNELS:
                assert log.read(*c).equals(before[c])
            check_reads(log, nxt)
        finally:
            log.close()


def test_channels_do_not_leak_into_each_other(tmp_path):
    """Neighbouring keys (same stream, next slice; next stream, same slice) are never read."""
    log = OutputLog(tmp_path)
    try:
        log.append_epoch({(1, 1): rows(1, 1, 0, 3), (1, 2): rows(1, 2, 0, 2), (2, 1): rows(2, 1, 0, 4),
                          (0, 1): rows(0, 1, 0, 1)})
        log.append_epoch({(1, 1): rows(1, 1, 3, 1), (1, 0): rows(1, 0, 0, 2)})
        for (s, p), n in {(1, 1): 4, (1, 2): 2, (2, 1): 4, (0, 1): 1, (1, 0): 2}.items():
            t = log.read(s, p)
            assert seqs(t) == list(range(n))
            assert all(x.startswith(f"{s}/{p}/") for x in t.column("x").to_pylist())
        assert log.read(1, 3).num_rows == 0
        assert log.read(3, 1).num_rows == 0
        assert log.read(1, 1, after_seq=3).num_rows == 0
    finally:
        log.close()


def test_read_past_the_end_of_the_last_channel_is_empty(tmp_path):
    """Reading after the last logged seq of the highest-keyed channel returns no rows."""
    log = OutputLog(tmp_path)
    try:
        log.append_epoch({(5, 5): rows(5, 5, 0, 3)})
        assert log.read(5, 5, after_seq=2).num_rows == 0
        assert log.read(5, 5, after_seq=10).num_rows == 0
        assert seqs(log.read(5, 5, after_seq=1)) == [2]
    finally:
        log.close()


def test_empty_log_reads_empty(tmp_path):
    """A fresh log has nothing for any channel."""
    log = OutputLog(tmp_path)
    try:
        assert log.read(0, 0).num_rows == 0
        assert list(log.scan(0, 0)) == []
    finally:
        log.close()


def test_empty_tables_are_not_logged(tmp_path):
    """append_epoch skips empty outputs (no row counted, nothing to read)."""
    log = OutputLog(tmp_path)
    try:
        log.append_epoch({(0, 0): rows(0, 0, 0, 0)})
        assert log.rows_written == 0
        assert log.read(0, 0).num_rows == 0
    finally:
        log.close()


def test_reappending_an_epoch_overwrites_instead_of_duplicating(tmp_path):
    """Logging the same epoch twice (a replay) leaves each row once: keys are (stream, slice, first seq)."""
    log = OutputLog(tmp_path)
    try:
        e0, e1 = {(0, 0): rows(0, 0, 0, 3)}, {(0, 0): rows(0, 0, 3, 2)}
        log.append_epoch(e0)
        log.append_epoch(e1)
        log.append_epoch(e0)
        assert seqs(log.read(0, 0)) == [0, 1, 2, 3, 4]
    finally:
        log.close()


def test_scan_yields_one_table_per_logged_batch_trimmed_at_the_start(tmp_path):
    """scan() starts inside the batch holding after_seq + 1 and yields later batches whole."""
    log = OutputLog(tmp_path)
    try:
        for first, n in ((0, 4), (4, 3), (7, 2)):
            log.append_epoch({(0, 0): rows(0, 0, first, n)})
        assert [seqs(t) for t in log.scan(0, 0, after_seq=5)] == [[6], [7, 8]]
        assert [seqs(t) for t in log.scan(0, 0, after_seq=3)] == [[4, 5, 6], [7, 8]]
    finally:
        log.close()


def test_log_grows_past_a_tiny_map_size(tmp_path):
    """With map_size=64 KiB, writing megabytes grows the map and loses nothing."""
    log = OutputLog(tmp_path, map_size=64 * 1024)
    try:
        payload = "p" * 2000
        n_epochs, per = 40, 20
        for e in range(n_epochs):
            t = rows(0, 0, e * per, per).append_column("pad", pa.array([payload] * per))
            log.append_epoch({(0, 0): t})
        assert log.env.info()["map_size"] > 64 * 1024
        assert log.rows_written == n_epochs * per
        assert seqs(log.read(0, 0)) == list(range(n_epochs * per))
        assert seqs(log.read(0, 0, after_seq=555)) == list(range(556, n_epochs * per))
    finally:
        log.close()


def test_single_epoch_larger_than_the_map_is_written(tmp_path):
    """One transaction bigger than the whole initial map still commits (the map doubles until it fits)."""
    log = OutputLog(tmp_path, map_size=64 * 1024)
    try:
        t = rows(0, 0, 0, 100).append_column("pad", pa.array(["q" * 5000] * 100))
        log.append_epoch({(0, 0): t})
        assert log.read(0, 0).equals(t)
    finally:
        log.close()
    reopened = OutputLog(tmp_path, map_size=64 * 1024)
    try:
        assert seqs(reopened.read(0, 0)) == list(range(100))
    finally:
        reopened.close()


def test_log_directory_is_created(tmp_path):
    """The log creates its directory (and parents) when missing."""
    path = Path(tmp_path) / "a" / "b"
    log = OutputLog(path)
    try:
        assert path.is_dir()
    finally:
        log.close()


def test_a_slice_moved_to_another_log_reads_the_same_there_and_nothing_here(tmp_path):
    """Compaction hands a slice's logged outputs to the new container's log as stored."""
    a, b = OutputLog(tmp_path / "a"), OutputLog(tmp_path / "b")
    a.append_epoch({(0, 3): rows(0, 3, 0, 2), (0, 4): rows(0, 4, 0, 1)})
    a.append_epoch({(0, 3): rows(0, 3, 2, 1)})
    before = a.read(0, 3).to_pylist()
    assert a.move_to(b, 0, 3) == 2
    assert b.read(0, 3).to_pylist() == before and a.read(0, 3).num_rows == 0
    assert a.read(0, 4).num_rows == 1 and b.read(0, 4).num_rows == 0
    a.close()
    b.close()
