"""Savepoints: every slice's state at one epoch boundary, written while the job runs, read back
with pandas alone and with ``cs.read_state``.

The oracle of a savepoint at epoch E is independent of the runtime: the
running counts and sums of the input rows of orders below (E + 1) *
epoch_events, computed with pandas. The format's refusals (a path that
exists, a slice missing, a frame at another epoch, a manifest naming a file
outside the savepoint) are checked on frames made by hand, without Ray.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import chronostream as cs
from chronostream.chaos import Fault, apply_schedule
from chronostream.containers.ray_savepoints import SAVEPOINT_HOLDER
from chronostream.dag import compile_query
from chronostream.master.local import make_core
from chronostream.master.placement import initial_placement
from chronostream.slices.checkpoint import SliceCheckpoint, capture, capture_kv, decode, encode, table_part
from chronostream.slices.savepoint import read_frames, without_states, write_savepoint
from chronostream.slices.state import KeyValueState

EPOCH = 500


class RunningSum(cs.Operator):
    """Per-event running sum of ``amount`` per ``user`` in a registered key-value state."""

    def setup(self):
        self.sums = self.register_state("sums")

    def consume(self, stream_id, event):
        total = self.sums.get(event["user"], 0) + event["amount"]
        self.sums.set(event["user"], total)
        self.produce("out", {"user": event["user"], "total": total})


def _inputs(n: int = 40_000):
    rng = np.random.default_rng(7)
    words = pa.table({"word": [f"w{i}" for i in rng.zipf(1.5, n) % 400]})
    payments = pa.table({"user": rng.integers(0, 300, n), "amount": rng.integers(1, 100, n)})
    return words, payments


class RunningSumV2(RunningSum):
    """An upgrade of ``RunningSum``: the same state name, a new output column."""

    def consume(self, stream_id, event):
        total = self.sums.get(event["user"], 0) + event["amount"]
        self.sums.set(event["user"], total)
        self.produce("out", {"user": event["user"], "total": total, "version": 2})


class RenamedState(RunningSum):
    """A bad upgrade: its state is registered under another name."""

    def setup(self):
        self.sums = self.register_state("totals")


class ListedSums(RunningSum):
    """A bad upgrade: its state keeps its name and becomes a list."""

    def setup(self):
        self.sums = self.register_list("sums")


def _query(words: pa.Table, payments: pa.Table, op: type = RunningSum) -> cs.Query:
    q = cs.Query(epoch_events=EPOCH)
    q.source("words", words, slices=2).key_by("word").count(slices=4, name="counts").sink(name="c")
    q.source("payments", payments, slices=2).key_by("user").apply(op, slices=4, name="sums").sink(name="s")
    return q


def _sorted(t: pa.Table) -> list[dict]:
    return sorted(t.to_pylist(), key=lambda r: (r["_slice"], r["_seq"]))


def _started(q: cs.Query) -> cs.Job:
    """``q`` running on Ray, paced, some epochs in."""
    job = cs.run(q, containers=2, source_pace_s=0.03)
    deadline = time.monotonic() + 60
    while job.status().state == "created" and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    return job


def _savepoint_mid_run(q: cs.Query, path) -> dict:
    """Run ``q`` on Ray, take a savepoint at ``path`` while it runs, stop it; the savepoint."""
    job = _started(q)
    try:
        return job.savepoint(path)
    finally:
        job.stop()


def test_a_savepoint_mid_run_holds_every_slice_at_one_epoch_and_equals_pandas(ray_session, tmp_path):
    words, payments = _inputs(20_000)
    q = _query(words, payments)
    job = _started(q)
    try:
        # Point queries of the live state first: a few keys of each stage, each slice read between epochs.
        asked_words = ["w1", "w2", "w7", "no-such-word"]
        live_counts = job.query_state("counts", asked_words).to_pylist()
        live_sums = job.query_state("sums", [3, 77, 150, 10_000], state="sums").to_pylist()
        with pytest.raises(cs.QueryError, match="is not keyed"):
            job.query_state("words", ["w1"])
        with pytest.raises(cs.QueryError, match=r"keyed by \['user'\]: a key is one value"):
            job.query_state("sums", [(3, 4)])
        sp = job.savepoint(tmp_path / "sp")
        with pytest.raises(cs.SavepointError, match="exists"):
            job.savepoint(tmp_path / "sp")
        job.wait()
        with pytest.raises(cs.QueryError, match="the job is finished"):
            job.query_state("counts", ["w1"])
    finally:
        job.stop()
    plan, sources = compile_query(q)[:2]
    words_all, payments_all = (sources[st.stage_id].to_pandas() for st in plan.stages if st.kind == "source")
    # Each answer is the value over the rows its slice had consumed at the end of its epoch.
    assert sorted(r["word"] for r in live_counts) == ["w1", "w2", "w7"]
    for r in live_counts:
        assert r["state"] == "__op__aggregate" and r["slice"] == cs.slice_of([pa.array([r["word"]])], 4)[0]
        seen = words_all[words_all["_order"] < (r["epoch"] + 1) * EPOCH]
        assert r["count"] == (seen["word"] == r["word"]).sum(), r
    assert live_sums and {r["key"] for r in live_sums} <= {3, 77, 150}, live_sums
    # Read before the savepoint, so at most at its epoch: mid-run values, not the final ones.
    assert max(r["epoch"] for r in live_counts + live_sums) <= sp["epoch"]
    for r in live_sums:
        seen = payments_all[payments_all["_order"] < (r["epoch"] + 1) * EPOCH]
        assert r["value"] == seen.loc[seen["user"] == r["key"], "amount"].sum(), r
    last = (words.num_rows + payments.num_rows) // EPOCH - 1
    epoch = sp["epoch"]
    assert 0 <= epoch < last, f"the savepoint landed at epoch {epoch}, not mid-run (last {last})"
    manifest = json.loads((tmp_path / "sp" / "manifest.json").read_text())
    assert len(manifest["slices"]) == sum(st.num_slices for st in plan.stages) == sp["slices"]
    _, frames = read_frames(tmp_path / "sp")
    assert len(frames) == sp["slices"]
    assert {(decode(f).epoch, decode(f).kind) for f in frames.values()} == {(epoch, "full")}

    # The rows every slice had consumed at the end of the epoch: global orders below this (the
    # two sources' rows interleave by position: their orders are 0, 2, 4, ... and 1, 3, 5, ...).
    upto = (epoch + 1) * EPOCH
    words_in, payments_in = (sources[st.stage_id].to_pandas() for st in plan.stages if st.kind == "source")
    words_in, payments_in = words_in[words_in["_order"] < upto], payments_in[payments_in["_order"] < upto]
    # The built-in count: pandas alone reads the Parquet file; both equal the input's prefix.
    by_pandas = pd.read_parquet(tmp_path / "sp" / "counts" / "__op__aggregate.parquet")
    expected = words_in["word"].value_counts()
    got = by_pandas.set_index("word")["count"].sort_index()
    assert got.to_dict() == expected.sort_index().to_dict()
    state = cs.read_state(tmp_path / "sp", "counts").to_pandas()
    assert set(state["state"]) == {"__op__aggregate"}
    assert state.drop(columns="state").sort_values("word").reset_index(drop=True).equals(
        by_pandas.sort_values("word").reset_index(drop=True))

    # The per-event operator's key-value state: (slice, key, value) rows.
    sums = cs.read_state(tmp_path / "sp", "sums", state="sums").to_pandas()
    expected_sums = payments_in.groupby("user")["amount"].sum()
    assert sums.set_index("key")["value"].sort_index().to_dict() == expected_sums.sort_index().to_dict()
    # Each key is in the slice the plan's hashing gives it.
    assert (sums["slice"].to_numpy() == cs.slice_of([pa.array(sums["key"])], 4)).all()
    with pytest.raises(cs.SavepointError, match="no stage 'nope'; stages: "):
        cs.read_state(tmp_path / "sp", "nope")


def _plan():
    q = cs.Query()
    q.source("w", [{"word": "a"}], slices=1).key_by("word").count(slices=2, name="counts").sink(name="c")
    return compile_query(q)[0]


def _frames(epoch: int = 3) -> list:
    agg = table_part(pa.table({"slot": [0], "key0": ["a"], "count": [2]}))
    kv = KeyValueState("mixed")
    kv.set("x", 1)
    kv.set("y", "two")  # an int and a str: Arrow cannot type the values as one column
    ints = KeyValueState("ints")
    ints.set(5, 2.5)  # int keys: a "key" column that cannot combine with "mixed"'s strings
    return [encode(SliceCheckpoint(0, 0, epoch, "full", -1, {}, {}, {})),
            encode(SliceCheckpoint(1, 0, epoch, "full", -1, {}, {}, {"__op__aggregate": agg,
                                                                      "ints": capture_kv(ints, False)})),
            encode(SliceCheckpoint(1, 1, epoch, "full", -1, {}, {}, {"mixed": capture_kv(kv, False)}))]


def test_values_arrow_cannot_type_are_kept_as_msgpack_and_said_so(tmp_path):
    manifest = write_savepoint(tmp_path / "sp", _plan(), 3, _frames())
    state = manifest["stages"][1]["states"]
    assert state["mixed"]["value_encoding"] == "msgpack" and "value_encoding" not in state["__op__aggregate"]
    t = cs.read_state(tmp_path / "sp", "counts", state="mixed")
    assert t.schema.field("value").type == pa.binary() and sorted(t["key"].to_pylist()) == ["x", "y"]
    both = cs.read_state(tmp_path / "sp", "counts", state="__op__aggregate").to_pylist() + \
        cs.read_state(tmp_path / "sp", "counts", state="ints").to_pylist()
    assert both == [{"slice": 0, "word": "a", "count": 2, "state": "__op__aggregate"},
                    {"slice": 0, "key": 5, "value": 2.5, "state": "ints"}]
    with pytest.raises(cs.SavepointError, match="do not combine"):
        cs.read_state(tmp_path / "sp", "counts")  # "key": ints in one state, strings in another


def test_the_format_refuses_what_would_make_a_wrong_savepoint(tmp_path):
    plan = _plan()
    with pytest.raises(cs.SavepointError, match="no checkpoint of 'counts' slice 1"):
        write_savepoint(tmp_path / "a", plan, 3, _frames()[:2])
    with pytest.raises(cs.SavepointError, match="not a full one at epoch 4"):
        write_savepoint(tmp_path / "b", plan, 4, _frames())
    with pytest.raises(cs.SavepointError, match="given twice"):
        write_savepoint(tmp_path / "c", plan, 3, _frames() + _frames()[:1])
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing half-written is left
    write_savepoint(tmp_path / "d", plan, 3, _frames())
    with pytest.raises(cs.SavepointError, match="the path exists"):
        write_savepoint(tmp_path / "d", plan, 3, _frames())
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    manifest["slices"][0]["file"] = "../../etc/passwd"
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(cs.SavepointError, match="outside the savepoint"):
        read_frames(tmp_path / "d")
    with pytest.raises(cs.SavepointError, match="not a savepoint"):
        cs.read_state(tmp_path, "counts")


def test_a_job_resumed_from_a_savepoint_on_other_containers_with_an_upgraded_operator_goes_on_exactly(
        ray_session, tmp_path):
    """Savepoint mid-run, stop, resume with 3 containers a keyed stage and ``RunningSumV2``: the resumed
    job's output is the serial run's rows after the savepoint's epoch, row for row and out_seq
    for out_seq (the counts against the original query, the sums against the upgraded one)."""
    words, payments = _inputs(10_000)
    sp = _savepoint_mid_run(_query(words, payments), tmp_path / "sp")
    cut = (sp["epoch"] + 1) * EPOCH
    # No checkpoint in the resumed job's life: a host killed two epochs in is rebuilt from the savepoint.
    job = cs.run(_query(words, payments, RunningSumV2), containers={"words": 1, "payments": 1, "counts": 3, "sums": 3},
                 restore_from=tmp_path / "sp", checkpoint_interval_s=600, source_pace_s=0.01)
    try:
        applied = apply_schedule(job, [Fault("kill", sp["epoch"] + 2, "sums")])
        job.wait()
        counts, sums = job.results("c"), job.results("s")
        timeline = job.timeline()
    finally:
        job.stop()
    assert len(applied) == 1 and any(e[1] == "restored_from_savepoint" for e in timeline)
    restored = [e[2] for e in timeline if e[1] == "slices_restored"]
    assert restored and all(set(r["restored_from"]) == {SAVEPOINT_HOLDER} for r in restored), restored
    upgraded = _query(words, payments, RunningSumV2)
    for name, got, query in (("c", counts, _query(words, payments)), ("s", sums, upgraded)):
        serial = cs.run(query, executor="serial").results(name)
        after = serial.filter(pc.greater_equal(serial["_order"], cut))
        assert 0 < after.num_rows < serial.num_rows
        assert _sorted(got) == _sorted(after), name
    assert set(sums["version"].to_pylist()) == {2}
    with pytest.raises(cs.SavepointError, match="holds state 'sums', which the operator no longer registers"):
        cs.run(_query(words, payments, RenamedState), containers=1, restore_from=tmp_path / "sp")
    with pytest.raises(cs.SavepointError, match=r"stage 'sums' holds no state \['totals'\] to drop"):
        cs.run(_query(words, payments, RenamedState), restore_from=tmp_path / "sp", drop_states={"sums": ["totals"]})


def test_a_state_dropped_on_purpose_starts_empty_and_the_rest_goes_on(ray_session, tmp_path):
    """``drop_states`` on Ray: a renamed state is left behind, the new one starts empty at the cut
    (its running sums equal pandas' from the cut on); a retyped state is refused at the host."""
    words, payments = _inputs(6000)
    sp = _savepoint_mid_run(_query(words, payments), tmp_path / "sp")
    cut = (sp["epoch"] + 1) * EPOCH
    with pytest.raises(cs.SavepointError, match=r"holds state 'sums' \(a kv state there, a list state now\)"):
        cs.run(_query(words, payments, ListedSums), containers=1, restore_from=tmp_path / "sp")
    job = cs.run(_query(words, payments, RenamedState), containers=1, restore_from=tmp_path / "sp",
                 drop_states={"sums": ["sums"]})
    try:
        job.wait()
        renamed = job.results("s").to_pandas()
    finally:
        job.stop()
    plan, sources = compile_query(_query(words, payments))[:2]
    paid = sources[next(st.stage_id for st in plan.stages if st.name == "payments")].to_pandas()
    paid = paid[paid["_order"] >= cut].sort_values("_order")
    paid["total"] = paid.groupby("user")["amount"].cumsum()
    got = renamed.sort_values("_order")[["_order", "user", "total"]].reset_index(drop=True)
    assert got.equals(paid[["_order", "user", "total"]].reset_index(drop=True))


def test_a_state_registered_as_another_kind_is_refused_unless_dropped():
    """The host's check, on real cores of the old and the upgraded operator: a state that became a
    list is refused naming both kinds; a savepoint without kinds is checked by name only; a frame
    with the state dropped passes."""
    words, payments = _inputs(400)
    old_plan, sources = compile_query(_query(words, payments))[:2]
    new_plan = compile_query(_query(words, payments, ListedSums))[0]
    sums = next(st.stage_id for st in old_plan.stages if st.name == "sums")
    placement = initial_placement(old_plan, {st.stage_id: 1 for st in old_plan.stages})
    c = placement.containers[sums][0]
    old, new = make_core(old_plan, placement, c, sources), make_core(new_plan, placement, c, sources)
    assert old.state_kinds() == {"sums": "kv"} and new.state_kinds() == {"sums": "list"}
    s = placement.slices_of(c)[0]
    ck = capture(old.slices[s], False)
    with pytest.raises(cs.SavepointError, match=r"slice \d+: the savepoint holds state 'sums' \(a kv state there, "
                                                r"a list state now\).*drop_states=\{'sums': \[\.\.\.\]\}"):
        new.check_state_names(s, ck, old.state_kinds())
    new.check_state_names(s, ck, {})  # (a savepoint that recorded no kinds: names only)
    dropped = decode(without_states(bytes(encode(ck)), ["sums"]))
    assert "sums" not in dropped.state and dropped.epoch == ck.epoch and dropped.progress == ck.progress
    new.check_state_names(s, dropped, old.state_kinds())


def test_a_savepoint_that_does_not_fit_the_query_is_refused_before_the_job_starts(tmp_path):
    words, payments = _inputs(2000)
    write_savepoint(tmp_path / "sp", _plan(), 3, _frames())
    with pytest.raises(cs.SavepointError, match="its stages"):
        cs.run(_query(words, payments), restore_from=tmp_path / "sp")
    q = cs.Query()
    q.source("w", [{"word": "a"}], slices=1).key_by("word").count(slices=3, name="counts").sink(name="c")
    with pytest.raises(cs.SavepointError, match="stage 'counts' has 2 slices there and 3 in the query"):
        cs.run(q, restore_from=tmp_path / "sp")
    with pytest.raises(cs.SavepointError, match="a savepoint is restored on Ray"):
        cs.run(q, executor="serial", restore_from=tmp_path / "sp")
