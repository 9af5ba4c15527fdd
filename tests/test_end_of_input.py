"""The end-of-input hook (``Operator.on_end``): what a slice emits when the input ends.

Specified against the serial executor (the oracle), then on the in-process
driver (real cores, lmdb logs and backups): the hook's rows follow every other
row of their slice, carry the end order as lineage, reach downstream stages,
which consume them before running their own hook, and come out exactly once
through recovery and migration. Ray runs are in tests/test_end_of_input_ray.py.
"""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

import chronostream as cs
from chronostream.dag import compile_query
from chronostream.slices.errors import EventError
from chronostream.slices.types import END_OF_INPUT
from chronostream.master.local import LocalCluster
from chronostream.master.placement import containers_per_stage, initial_placement

EPOCH = 7
WORDS = [f"w{i:02d}" for i in range(23)]


class TotalsAtEnd(cs.Operator):
    """A running count per word, and at the end one final row per word with its total."""

    def setup(self):
        self.totals = self.register_state("totals")

    def consume(self, stream_id, event):
        n = self.totals.get(event["word"], 0) + 1
        self.totals.set(event["word"], n)
        self.produce("out", {"word": event["word"], "n": n, "final": False})

    def on_end(self):
        for word, n in sorted(self.totals.items()):
            self.produce("out", {"word": word, "n": n, "final": True})


class FinalsSeen(cs.Operator):
    """Downstream: passes rows on, counts the final rows reaching its slice, and at the end
    emits that count (so it must run after the upstream hooks' rows arrived)."""

    def setup(self):
        self.seen = self.register_state("seen")

    def consume(self, stream_id, event):
        if event["final"]:
            self.seen.set("finals", self.seen.get("finals", 0) + 1)
        self.produce_update("out", {"word": event["word"], "n": event["n"], "final": event["final"]})

    def on_end(self):
        self.produce("out", {"word": "", "n": self.seen.get("finals", 0), "final": True})


class RaisingAtEnd(TotalsAtEnd):
    def on_end(self):
        raise ValueError("no end for you")


class BatchTotalsAtEnd(cs.Operator):
    """``TotalsAtEnd`` written vectorized: its end rows go out as two batches without lineage
    columns (the hook gives them theirs)."""

    def setup(self):
        self.totals = self.register_state("totals")

    def consume_batch(self, stream_id, batch):
        ns = []
        for word in batch.column("word").to_pylist():
            ns.append(self.totals.get(word, 0) + 1)
            self.totals.set(word, ns[-1])
        self.produce_batch("out", batch.select(["word", "_order", "_sub"]).append_column("n", pa.array(ns))
                           .append_column("final", pa.array([False] * len(ns))))

    def on_end(self):
        items = sorted(self.totals.items())
        half = len(items) // 2
        for part in (items[:half], items[half:]):
            self.produce_batch("out", pa.table({"word": [w for w, _ in part], "n": [n for _, n in part],
                                                "final": [True] * len(part)}))


class LineageLess(BatchTotalsAtEnd):
    def consume_batch(self, stream_id, batch):
        self.produce_batch("out", batch.select(["word"]))


def words(n: int = 400, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    return [{"word": rng.choice(WORDS)} for _ in range(n)]


def totals_query(slices: int = 4, downstream: bool = True, n: int = 400, op=TotalsAtEnd,
                 dead_letters: bool = False) -> cs.Query:
    q = cs.Query(epoch_events=EPOCH)
    if dead_letters:
        q.dead_letters()
    counted = q.source("words", words(n)).key_by("word").apply(op, slices=slices, name="totals")
    if downstream:
        counted = counted.key_by("word").apply(FinalsSeen, slices=3, name="finals")
    counted.sink(name="out")
    return q


def cluster(query: cs.Query, containers: int = 2, **kw) -> LocalCluster:
    plan, sources = compile_query(query)
    kw.setdefault("checkpoint_every", 2)
    return LocalCluster(plan, initial_placement(plan, containers_per_stage(plan, containers)), sources, **kw)


def serial_rows(query: cs.Query) -> list[dict]:
    return cs.run_serial(query).results("out").to_pylist()


def test_the_hook_emits_after_every_other_row_of_its_slice_with_the_end_order_as_lineage():
    rows = serial_rows(totals_query(downstream=False))
    end_order = (400 // EPOCH + 1) * EPOCH - 1  # the last order of the last epoch
    assert end_order // EPOCH == 400 // EPOCH, "inside the last epoch, after every word's order"
    for s in range(4):
        mine = [r for r in rows if r["_slice"] == s]
        finals = [r for r in mine if r["final"]]
        assert finals and mine[-len(finals):] == finals, f"slice {s}: the end rows come last"
        assert [(r["_order"], r["_sub"]) for r in finals] == [(end_order, k) for k in range(len(finals))]
        running = {r["word"]: r["n"] for r in mine if not r["final"]}
        assert {r["word"]: r["n"] for r in finals} == running, "each word's total is its last count"
    assert sum(r["n"] for r in rows if r["final"]) == 400


def test_a_downstream_stage_consumes_the_upstream_end_rows_before_its_own_hook():
    rows = serial_rows(totals_query())
    counts = [r["n"] for r in rows if r["final"] and r["word"] == ""]
    assert len(counts) == 3, "one end row per downstream slice"
    assert sum(counts) == len(WORDS), "every upstream final row was seen before the hook ran"


def test_an_operator_without_the_hook_is_never_asked_and_the_plan_says_so():
    plan, _ = compile_query(totals_query(downstream=False))
    assert plan.has_end_hooks and [st.ends for st in plan.stages] == [False, True]
    q = cs.Query(epoch_events=EPOCH)
    q.source("words", words(20)).key_by("word").count(slices=2).sink(name="out")
    assert not compile_query(q)[0].has_end_hooks


def test_a_raising_hook_fails_the_job_naming_the_stage_slice_and_end_order():
    with pytest.raises(EventError) as err:
        cs.run_serial(totals_query(downstream=False, op=RaisingAtEnd))
    assert err.value.stage == "totals" and err.value.order == (400 // EPOCH + 1) * EPOCH - 1
    assert "no end for you" in str(err.value)


def test_a_raising_hook_becomes_one_dead_letter_per_slice_with_dead_letters_on():
    q = totals_query(downstream=False, op=RaisingAtEnd, dead_letters=True)
    dead = cs.run_serial(q).dead_letters()
    assert sorted(d["slice"] for d in dead) == [0, 1, 2, 3]
    assert {d["event"] for d in dead} == {repr(END_OF_INPUT)}


@pytest.mark.parametrize("containers", [1, 2, 3])
def test_the_runtime_matches_the_serial_run_whatever_the_containers(containers):
    q = totals_query()
    cl = cluster(q, containers=containers)
    cl.run()
    assert cl.results("out").to_pylist() == serial_rows(q)


def test_a_slice_without_input_in_the_last_epoch_still_runs_its_hook():
    # 401 words: the last epoch holds one word, so most slices get nothing in it.
    q = totals_query(n=401)
    cl = cluster(q)
    cl.run()
    got = cl.results("out").to_pylist()
    assert got == serial_rows(q)
    assert sum(1 for r in got if r["final"] and r["word"]) == len(WORDS)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_host_killed_at_a_seeded_round_leaves_the_end_rows_exact(seed):
    q = totals_query()
    cl = cluster(q, containers=3)
    victims = sorted({cl.hosts[c] for st in cl.plan.stages if st.kind == "operator"
                      for c in cl.placement.containers[st.stage_id]})
    rng = random.Random(seed)
    rounds = -(-400 // EPOCH)
    cl.run(kills={rng.randrange(rounds - 4, rounds + 2): [rng.choice(victims)]})
    assert any(kind == "recovery_end" for _, kind, _ in cl.timeline)
    assert cl.results("out").to_pylist() == serial_rows(q)


@pytest.mark.parametrize("back", [4, 2, 1, 0])
def test_a_downstream_slice_moved_as_the_job_ends_replays_the_upstream_end_rows(back):
    """The moved slice catches up from the upstream output logs, the last epoch's included, so
    the hooks' rows must sit in that epoch's order range (replays cut epochs by order)."""
    q = totals_query()
    cl = cluster(q)
    rounds = 400 // EPOCH + 1
    cl.run(faults={rounds - back: lambda cl: cl.scale_out(cl.stage_id("finals"), 1)})
    assert cl.migrated
    assert cl.results("out").to_pylist() == serial_rows(q)


def test_a_scale_out_near_the_end_leaves_the_end_rows_exact():
    q = totals_query()
    cl = cluster(q)
    stage = cl.stage_id("totals")
    rounds = -(-400 // EPOCH)
    cl.run(faults={rounds - 6: lambda cl: cl.scale_out(stage, 1)})
    assert cl.migrated
    assert cl.results("out").to_pylist() == serial_rows(q)


def closing_windows_query(zone: str | None, n: int = 600, clock: str = "key") -> cs.Query:
    """Hourly tumbling windows emitted on close over seeded payments, the time column in ``zone``,
    closed by ``clock`` (the key's or the slice's event time)."""
    import datetime as dt

    import pyarrow.compute as pc

    from chronostream.datasets import payments

    table = payments(n, cards=40, span_s=6 * 3600, seed=3)
    ts = pc.multiply(table.column("ts"), 1_000_000).cast(pa.timestamp("us", tz=zone))
    table = table.set_column(table.schema.get_field_index("ts"), "ts", ts)
    q = cs.Query(epoch_events=EPOCH * 3)
    (q.source("payments", table, order_by="ts").key_by("card")
     .window(cs.TumblingWindow(dt.timedelta(hours=1), time="ts", emit="close", clock=clock), count=True, sum="amount",
             slices=4, name="hourly")
     .sink(name="out"))
    return q


@pytest.mark.parametrize("zone, clock", [(None, "key"), ("UTC", "key"), ("Europe/Paris", "key"), ("+05:30", "key"),
                                         (None, "slice"), ("Europe/Paris", "slice")])
def test_windows_emitted_on_close_also_emit_those_open_at_the_end_in_the_columns_type(zone, clock):
    q = closing_windows_query(zone, clock=clock)
    expected = serial_rows(q)
    end_order = max(r["_order"] for r in expected)
    end_rows = [r for r in expected if r["_order"] == end_order]
    assert 0 < len(end_rows) <= 40, "one open window per card at most"
    cl = cluster(q, containers=2)
    cl.run(kills={5: [cl.hosts[cl.placement.containers[cl.stage_id("hourly")][0]]]})
    got = cl.results("out")
    assert got.schema.field("window_start").type == pa.timestamp("us", tz=zone)
    assert got.to_pylist() == expected


def tailing_totals_query(log_dir, follow: bool) -> cs.Query:
    q = cs.Query(epoch_events=64)
    (q.source_log(str(log_dir), "s", follow=follow).key_by("k").apply(TotalsOfV, slices=3, name="totals")
     .sink(name="out"))
    return q


class TotalsOfV(cs.Operator):
    """The sum of ``v`` per key, emitted only at the end of the input."""

    def setup(self):
        self.sums = self.register_state("sums")

    def consume(self, stream_id, event):
        self.sums.set(event["k"], self.sums.get(event["k"], 0) + event["v"])

    def on_end(self):
        for k, v in sorted(self.sums.items()):
            self.produce("out", {"k": k, "total": v})


@pytest.mark.parametrize("executor", ["local", "ray"])
def test_a_tailed_log_sealed_after_its_last_full_epoch_runs_the_hooks_in_one_more_epoch(
        tmp_path, request, executor):
    """The log holds exactly two full epochs and is sealed later, after they ran: with an end
    hook in the job such an input has a third, empty, epoch, where the hooks run; their rows
    equal a bounded run's and the serial run's."""
    import threading

    from chronostream.slices.sourcelog import SourceLogWriter
    from test_sourcelog import rows

    if executor == "ray":
        request.getfixturevalue("ray_session")
    w = SourceLogWriter(tmp_path)
    w.append({"s": rows(0, 0, 128)}, high_water=128)  # two full epochs of 64, no more
    sealer = threading.Timer(1.5, w.seal)
    sealer.start()
    try:
        job = cs.run(tailing_totals_query(tmp_path, follow=True), executor=executor, containers=2)
        job.wait(timeout_s=60)
        live = job.results("out").to_pylist()
        if executor == "ray":
            job.stop()
    finally:
        sealer.join()
    expected = cs.run(tailing_totals_query(tmp_path, follow=False), executor="serial").results("out").to_pylist()
    assert len(live) == 5 and sum(r["total"] for r in live) == sum(range(128))
    assert {r["_order"] for r in live} == {3 * 64 - 1}, "the last order of a third epoch"
    assert live == expected


def test_slices_restored_past_the_last_epoch_do_not_run_their_hook_again():
    """A host dies after the end: its slices come back from checkpoints of the last epoch, but
    one whose every copy is gone is rebuilt from the start (``recompute_lost``). The new
    container runs every epoch again for that one; at the last epoch only it runs its hook (the
    others' end rows are already out, and numbered)."""
    q = totals_query(downstream=False, n=396)  # the last epoch holds 4 words
    cl = cluster(q, containers=2, checkpoint_every=1, recompute_lost=True)
    cl.run()
    stage = cl.stage_id("totals")
    victim = cl.placement.containers[stage][0]
    rebuilt, *restored = cl.placement.slices_of(victim)
    assert restored, "the victim holds more than one slice"
    for store in cl.stores.values():
        store.drop(stage, rebuilt)
    cl.kill([cl.hosts[victim]])
    cl.run()
    (new,) = [c for c in cl.placement.containers[stage] if c != victim and rebuilt in cl.placement.slices_of(c)]
    assert {s: cl.cores[new].slices[s].last_epoch for s in restored} == \
        {s: cl.plan.epochs_until(395) - 1 for s in restored}, "restored past the last epoch"
    assert cl.results("out").to_pylist() == serial_rows(q)


def test_a_vectorized_hook_may_produce_batches_without_lineage_and_they_get_the_end_order():
    q = totals_query(downstream=False, op=BatchTotalsAtEnd)
    rows = serial_rows(q)
    assert rows == serial_rows(totals_query(downstream=False)), "the same rows as produce() makes them"
    end_order = (400 // EPOCH + 1) * EPOCH - 1
    for s in range(4):
        finals = [r for r in rows if r["_slice"] == s and r["final"]]
        assert [(r["_order"], r["_sub"]) for r in finals] == [(end_order, k) for k in range(len(finals))], \
            "sub-orders count on across the hook's batches"


def test_the_runtime_matches_the_serial_run_for_a_vectorized_hook_through_a_kill():
    q = totals_query(op=BatchTotalsAtEnd)
    cl = cluster(q, containers=3)
    victim = cl.hosts[cl.placement.containers[cl.stage_id("totals")][0]]
    cl.run(kills={-(-400 // EPOCH) - 2: [victim]})
    assert any(kind == "recovery_end" for _, kind, _ in cl.timeline)
    assert cl.results("out").to_pylist() == serial_rows(q)


def test_a_batch_without_lineage_outside_the_hook_is_refused_naming_the_stage():
    with pytest.raises(EventError, match=r"stage 'totals'.*needs the '_order' and '_sub' columns"):
        serial_rows(totals_query(downstream=False, op=LineageLess))
