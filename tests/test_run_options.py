"""``cs.run(query, options=cs.JobOptions(...))``: the job's options as one typed value.

The common arguments stay keywords of ``run`` (executor, containers, address,
workdir, autoscale, resume, seed); every other knob is a field of
``JobOptions``, given through ``options=`` or as a keyword of the same name.
"""

from __future__ import annotations

import inspect

import pytest

import chronostream as cs
from chronostream.cli import main, parse_options
from chronostream.client import job_options
from chronostream.containers.options import DEFAULT_CHECKPOINT_INTERVAL_S


def counts() -> cs.Query:
    q = cs.Query()
    q.source("w", [{"w": w} for w in "abacab"]).key_by("w").count(slices=2).sink(name="c")
    return q


def test_run_takes_few_keywords_and_the_rest_as_job_options():
    params = inspect.signature(cs.run).parameters
    named = [p for p in params if params[p].kind is not inspect.Parameter.VAR_KEYWORD]
    assert named == ["query", "executor", "containers", "options", "address", "workdir", "autoscale",
                     "resume", "seed", "restore_from", "drop_states", "progress"]


def test_a_keyword_overrides_the_field_of_options():
    base = cs.JobOptions(checkpoint_every=4, backup_factor=1)
    merged = job_options(base, {"backup_factor": 2, "gc_interval_s": 5.0})
    assert (merged.checkpoint_every, merged.backup_factor, merged.gc_interval_s) == (4, 2, 5.0)
    assert base.backup_factor == 1  # options are frozen: the caller's value is not changed
    assert job_options(None, {}) == cs.JobOptions()
    assert job_options(base, {}) is base


def test_checkpoints_by_time_by_epochs_or_both_and_off_when_neither_is_given():
    default = cs.JobOptions()
    assert default.checkpoint_period_s == DEFAULT_CHECKPOINT_INTERVAL_S
    assert default.checkpointing == (DEFAULT_CHECKPOINT_INTERVAL_S > 0)
    # Epochs given alone: by epochs only; both given: both triggers.
    assert cs.JobOptions(checkpoint_every=4).checkpoint_period_s == 0.0
    assert cs.JobOptions(checkpoint_every=4, checkpoint_interval_s=2.5).checkpoint_period_s == 2.5
    on = job_options(None, {"checkpoint_interval_s": 1})
    assert on.checkpointing and on.checkpoint_period_s == 1.0
    off = job_options(None, {"checkpoint_interval_s": 0})
    assert not off.checkpointing and off.checkpoint_period_s == 0.0
    assert not job_options(cs.JobOptions(checkpoint_every=4), {"checkpoint_every": 0, "checkpoint_interval_s": 0.0}
                           ).checkpointing
    with pytest.raises(ValueError, match="checkpoint_interval_s must be >= 0, got -1"):
        cs.JobOptions(checkpoint_interval_s=-1)
    assert parse_options(["checkpoint_interval_s=0"]).checkpoint_period_s == 0.0  # (a float, from the CLI)
    with pytest.raises(SystemExit, match="checkpoint_interval_s takes a number"):
        parse_options(["checkpoint_interval_s=often"])


def test_an_unknown_keyword_names_the_field_it_may_mean():
    with pytest.raises(TypeError, match=r"'checkpoint_evry' \(did you mean 'checkpoint_every'\?"):
        cs.run(counts(), executor="local", checkpoint_evry=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        cs.run(counts(), executor="serial", colour="red")


def test_options_must_be_job_options():
    with pytest.raises(TypeError, match="options must be a chronostream.JobOptions, got dict"):
        cs.run(counts(), executor="local", options={"checkpoint_every": 4})


def test_a_bad_value_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="backup_factor must be >= 0, got -1"):
        cs.run(counts(), executor="local", backup_factor=-1)
    with pytest.raises(ValueError, match="max_inflight_epochs must be >= 1"):
        cs.run(counts(), executor="serial", options=cs.JobOptions(max_inflight_epochs=0))


@pytest.mark.parametrize("how", ["options", "keywords"])
def test_the_local_executor_runs_with_options_either_way(how):
    kw = {"options": cs.JobOptions(spill_state=False)} if how == "options" else {"spill_state": False}
    got = cs.run(counts(), executor="local", **kw).results("c")
    want = cs.run(counts(), executor="serial").results("c")
    assert sorted(zip(got["w"].to_pylist(), got["count"].to_pylist())) == \
        sorted(zip(want["w"].to_pylist(), want["count"].to_pylist()))


def test_the_cli_run_command_takes_job_options(tmp_path, capsys):
    path = tmp_path / "q.py"
    path.write_text("import chronostream as cs\nquery = cs.Query()\n"
                    "query.source('w', [{'w': 'a'}, {'w': 'b'}]).key_by('w').count(slices=2).sink(name='c')\n")
    assert main(["run", str(path), "--executor", "local", "--option", "spill_state=off",
                 "--option", "checkpoint-every=2"]) == 0
    assert '"c": 2' in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--option spill=off: JobOptions has no field 'spill'"):
        main(["run", str(path), "--executor", "local", "--option", "spill=off"])
    with pytest.raises(SystemExit, match="--option backup_factor=two: backup_factor takes an integer"):
        main(["run", str(path), "--executor", "local", "--option", "backup_factor=two"])
    with pytest.raises(SystemExit, match="--option: backup_factor must be >= 0, got -1"):
        main(["run", str(path), "--executor", "local", "--option", "backup_factor=-1"])


def test_the_cli_run_command_says_in_one_line_why_a_run_cannot_start(tmp_path, capsys):
    """A sink directory holding an earlier run's files, a state dropped with no savepoint: one line
    ``chronostream run: why`` on stderr and exit 1, not a traceback."""
    out = tmp_path / "out"
    path = tmp_path / "q.py"
    path.write_text(f"import chronostream as cs\nquery = cs.Query()\nquery.source('w', [{{'w': 'a'}}])"
                    f".key_by('w').count(slices=2).sink(cs.ParquetSink({str(out)!r}, name='c'))\n")
    assert main(["run", str(path), "--executor", "serial"]) == 0
    capsys.readouterr()
    assert main(["run", str(path), "--executor", "serial"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("chronostream run: ParquetSink 'c': ") and "earlier run's output" in err, err
    assert main(["run", str(path), "--executor", "serial", "--drop-state", "c:x"]) == 1
    assert capsys.readouterr().err == ("chronostream run: drop_states: states are dropped from a savepoint the job "
                                       "restores (restore_from=)\n")
