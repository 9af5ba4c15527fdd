"""This machine's records of jobs: written whole or not at all, read as data only (a file that is
not a record, or names another job, is not one), names that cannot leave the records directory;
a process connected to one cluster does not look for a job of another there."""

from __future__ import annotations

import json

import pytest

import chronostream as cs
from chronostream.job_records import (HOME_ENV, JobRecord, all_records, check_name, read_record, records_dir,
                                      remove_record, write_record)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv(HOME_ENV, str(tmp_path))
    return tmp_path / "jobs"


def test_records_are_written_whole_and_read_back_as_data_only(home):
    write_record(JobRecord("a", "127.0.0.1:1", "/w/a", submitted=True, started_at=2.0))
    write_record(JobRecord("b", "127.0.0.1:2", "/w/b", started_at=1.0))
    assert records_dir() == home and oct(home.stat().st_mode & 0o777) == "0o700"
    assert sorted(p.name for p in home.iterdir()) == ["a.json", "b.json"]  # (no temporary file left)
    assert [r.name for r in all_records()] == ["b", "a"]  # oldest first
    (home / "c.json").write_text("{not json")
    (home / "d.json").write_text(json.dumps({"name": "d", "address": 5, "workdir": "/w"}))  # a number
    (home / "e.json").write_text(json.dumps({"name": "other", "address": "x:1", "workdir": "/w"}))
    (home / "f.json").write_text(json.dumps(["a", "list"]))
    assert [r.name for r in all_records()] == ["b", "a"] and read_record("c") is None and read_record("e") is None
    remove_record("a")
    remove_record("a")  # (gone already: nothing to do)
    assert read_record("a") is None and read_record("b").workdir == "/w/b"


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "-x", "a" * 101, "a b"])
def test_a_name_that_could_leave_the_records_directory_is_refused(home, name):
    with pytest.raises(ValueError, match="use letters, digits"):
        check_name(name)
    with pytest.raises(ValueError):
        write_record(JobRecord(name, "127.0.0.1:1", "/w"))
    assert read_record(name) is None


def test_a_job_of_another_cluster_is_not_looked_for_on_this_one(ray_session, home):
    write_record(JobRecord("elsewhere", "127.0.0.1:9", "/w"))
    here = ray_session.get_runtime_context().gcs_address
    with pytest.raises(cs.ClusterError, match=f"connected to the Ray cluster at {here}; job 'elsewhere' runs on "
                                              "the one at 127.0.0.1:9"):
        cs.Job.attach("elsewhere")
    with pytest.raises(cs.JobNotFound, match=f"no job 'nowhere' runs on the Ray cluster at {here}"):
        cs.Job.attach("nowhere")
