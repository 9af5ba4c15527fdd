"""A Parquet sink's commit: staged (slice, epoch) parts become a few files a reader sees whole,
each row once, typed as one; commits while the job runs take the epochs up to a bound and drop
parts made again below it unread; a commit that stopped half-way finishes and writes nothing
twice."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import chronostream as cs
from chronostream.slices import parquet_commit
from chronostream.slices.sinks import COMMITTED, STAGING, commit_parquet_sink, read_parquet_sink


def _stage(root, parts: dict[tuple[int, int], pa.Table]) -> None:
    w = cs.ParquetSink(str(root)).writer("c0")
    for (s, e), t in parts.items():
        w.write(e, s, t)


def _part(s: int, e: int, n: int, kind: str = "int") -> pa.Table:
    values = {"int": pa.array(range(n), pa.int64()), "float": pa.array([x / 2 for x in range(n)]),
              "null": pa.nulls(n)}[kind]
    return pa.table({"_slice": pa.array([s] * n, pa.int64()), "_seq": pa.array(range(e * n, (e + 1) * n), pa.int64()),
                     "v": values})


def _commit_dying_at_its_first_files_rename(monkeypatch, root, **commit_args) -> None:
    """A commit whose process dies at the first rename of a committed file (its record, a
    ``.json`` rename, goes through)."""
    real = os.replace

    def stop_at_a_files_rename(src, dst):
        if str(dst).endswith(".parquet"):
            raise OSError("the process died here")
        return real(src, dst)

    monkeypatch.setattr(parquet_commit.os, "replace", stop_at_a_files_rename)
    with pytest.raises(OSError, match="died"):
        commit_parquet_sink(root, **commit_args)
    monkeypatch.setattr(parquet_commit.os, "replace", real)


def test_staged_parts_become_a_few_files_read_whole_in_identity_order(tmp_path):
    parts = {(s, e): _part(s, e, 50, ["int", "float", "null"][(s + e) % 3]) for s in range(4) for e in range(30)}
    _stage(tmp_path, parts)
    assert not list(tmp_path.glob("part-*")) and pq.read_table(tmp_path).num_rows == 0  # staged: unseen
    names = commit_parquet_sink(tmp_path, target_file_bytes=40_000)
    assert 1 < len(names) < 10 and sorted(p.name for p in tmp_path.iterdir()) == sorted(names + [COMMITTED])
    whole = pq.read_table(tmp_path)  # what any Parquet reader of the directory sees
    assert whole.schema.field("v").type == pa.float64() and whole.num_rows == 4 * 30 * 50
    ids = list(zip(whole["_slice"].to_pylist(), whole["_seq"].to_pylist()))
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    want = pa.concat_tables([parts[k] for k in sorted(parts)], promote_options="permissive")
    assert read_parquet_sink(tmp_path)["v"].to_pylist() == want["v"].cast(pa.float64()).to_pylist()


def test_a_commit_stopped_half_way_finishes_and_writes_nothing_twice(tmp_path, monkeypatch):
    _stage(tmp_path, {(s, e): _part(s, e, 20) for s in range(3) for e in range(10)})
    _commit_dying_at_its_first_files_rename(monkeypatch, tmp_path, target_file_bytes=5_000)
    assert (tmp_path / COMMITTED).exists() and (tmp_path / STAGING).exists()
    names = commit_parquet_sink(tmp_path, target_file_bytes=1)  # (finishes the recorded commit)
    assert len(names) > 1 and not (tmp_path / STAGING).exists()
    assert read_parquet_sink(tmp_path).num_rows == 3 * 10 * 20
    assert commit_parquet_sink(tmp_path) == names and read_parquet_sink(tmp_path).num_rows == 600


def test_commits_while_the_job_runs_take_each_epoch_once_and_drop_parts_made_again(tmp_path):
    """Three commits up to epochs 3, 3 (nothing new) and 7, with parts of epochs at or below a
    committed bound made again between them (a recovery from an older copy), then the final
    commit: every row once, in each commit's files; a reader between commits sees whole commits."""
    parts = {(s, e): _part(s, e, 10) for s in range(3) for e in range(12)}
    _stage(tmp_path, {k: t for k, t in parts.items() if k[1] <= 5})
    first = commit_parquet_sink(tmp_path, through=3)
    seen = read_parquet_sink(tmp_path)
    assert first == ["part-00000.parquet"] and seen.num_rows == 3 * 4 * 10
    assert set(seen["_seq"].to_pylist()) == set(range(40))
    assert commit_parquet_sink(tmp_path, through=3) == first  # (nothing new up to 3)
    _stage(tmp_path, {k: t for k, t in parts.items() if 2 <= k[1] <= 9})  # epochs 2-3 made again
    second = commit_parquet_sink(tmp_path, through=7)
    assert second[:1] == first and len(second) == 2
    assert not any(int(p.stem.split("-")[1]) <= 7 for p in (tmp_path / STAGING).rglob("epoch-*.arrow"))
    assert parquet_commit.read_record(tmp_path)["through"] == 7
    _stage(tmp_path, {k: t for k, t in parts.items() if k[1] >= 6})  # a resume from epoch 5
    final = commit_parquet_sink(tmp_path)
    assert len(final) == 3 and not (tmp_path / STAGING).exists()
    assert parquet_commit.read_record(tmp_path)["final"] is True
    got = read_parquet_sink(tmp_path)
    want = pa.concat_tables([parts[k] for k in sorted(parts)])
    assert got.num_rows == want.num_rows and got.sort_by([("_slice", "ascending"), ("_seq", "ascending")]).equals(
        want.sort_by([("_slice", "ascending"), ("_seq", "ascending")]))
    assert cs.ParquetSink(str(tmp_path)).committed()


def test_a_commit_while_running_stopped_after_its_record_is_finished_by_the_next_one(tmp_path, monkeypatch):
    """A commit up to epoch 4 stops at its first file's rename (its record written); the next
    commit, up to epoch 9, first finishes it, then takes epochs 5-9: every row once."""
    _stage(tmp_path, {(s, e): _part(s, e, 10) for s in range(2) for e in range(10)})
    _commit_dying_at_its_first_files_rename(monkeypatch, tmp_path, through=4)
    assert parquet_commit.read_record(tmp_path)["pending"]["through"] == 4
    assert read_parquet_sink(tmp_path).num_rows == 0  # (a reader sees nothing of it yet)
    names = commit_parquet_sink(tmp_path, through=9)
    assert names == ["part-00000.parquet", "part-00001.parquet"]
    got = read_parquet_sink(tmp_path)
    assert got.num_rows == 2 * 10 * 10 and len(set(zip(got["_slice"].to_pylist(), got["_seq"].to_pylist()))) == 200


def test_committed_files_share_one_schema_a_directory_reader_can_take_for_all(tmp_path):
    """A reader of the directory takes one file's schema for all: a commit while running waits
    while a column is all null so far, and while its parts do not fit the committed files (ints
    that become floats); the last commit writes the earlier files again in the wider type."""
    _stage(tmp_path, {(s, e): _part(s, e, 10, "null") for s in range(2) for e in range(3)})
    assert commit_parquet_sink(tmp_path, through=2) == []  # (no type yet: waits)
    _stage(tmp_path, {(s, e): _part(s, e, 10) for s in range(2) for e in range(3, 6)})
    assert commit_parquet_sink(tmp_path, through=5) == ["part-00000.parquet"]
    assert pq.read_schema(tmp_path / "part-00000.parquet").field("v").type == pa.int64()
    _stage(tmp_path, {(s, e): _part(s, e, 10, "float") for s in range(2) for e in range(6, 9)})
    assert commit_parquet_sink(tmp_path, through=8) == ["part-00000.parquet"]  # (floats: wait)
    assert pq.read_table(tmp_path).num_rows == 2 * 6 * 10  # (a reader sees the first commit whole)
    final = commit_parquet_sink(tmp_path)
    assert final == ["part-00001.parquet"] and not (tmp_path / "part-00000.parquet").exists()
    whole = pq.read_table(tmp_path)  # one schema: the directory reads whole
    assert whole.schema.field("v").type == pa.float64() and whole.num_rows == 2 * 9 * 10
    assert len(set(zip(whole["_slice"].to_pylist(), whole["_seq"].to_pylist()))) == 180


def test_a_run_commits_its_parquet_sink_and_the_next_run_is_refused(tmp_path):
    q = cs.Query(epoch_events=7)
    q.source("w", [{"w": f"w{i % 5}"} for i in range(100)]).key_by("w").count(slices=4) \
        .sink(cs.ParquetSink(str(tmp_path), name="c"))
    for executor in ("serial", "local"):
        if executor == "local":
            q.sinks[0] = (q.sinks[0][0], cs.ParquetSink(str(tmp_path), name="c", overwrite=True))
        got = cs.run(q, executor=executor).results("c")
        assert got.num_rows == 100 and sorted(p.name for p in tmp_path.iterdir()) == [COMMITTED, "part-00000.parquet"]
        with pytest.raises(FileExistsError, match="holds an earlier run's output"):
            cs.ParquetSink(str(tmp_path), name="c").prepare()
    with pytest.raises(ValueError, match="target_file_bytes must be a positive int"):
        cs.ParquetSink(str(tmp_path), target_file_bytes=0)
