"""A Parquet sink's commit: staged (slice, epoch) parts become a few files a reader sees whole,
each row once, typed as one; a commit that stopped half-way finishes and writes nothing twice."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import chronostream as cs
from chronostream.slices import sinks
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
    real = os.replace
    calls = []

    def stop_at_the_first_rename(src, dst):
        calls.append(dst)
        if str(dst).endswith(".parquet") and len(calls) > 1:  # (the mark's rename goes through)
            raise OSError("the process died here")
        return real(src, dst)

    monkeypatch.setattr(sinks.os, "replace", stop_at_the_first_rename)
    with pytest.raises(OSError, match="died"):
        commit_parquet_sink(tmp_path, target_file_bytes=5_000)
    monkeypatch.setattr(sinks.os, "replace", real)
    assert (tmp_path / COMMITTED).exists() and (tmp_path / STAGING).exists()
    names = commit_parquet_sink(tmp_path, target_file_bytes=1)  # (finishes the recorded commit)
    assert len(names) > 1 and not (tmp_path / STAGING).exists()
    assert read_parquet_sink(tmp_path).num_rows == 3 * 10 * 20
    assert commit_parquet_sink(tmp_path) == names and read_parquet_sink(tmp_path).num_rows == 600


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
