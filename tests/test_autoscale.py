"""Autoscaling: policies over metrics snapshots, their simulator, and the live loop on Ray.

Unit specifications feed hand-made snapshots to each built-in policy. The
integration test writes a followed source log at a rate that steps up and
then down; the rate-based policy must scale the stage out on the step up
and in on the step down, the output must equal the serial executor's, and
replaying the recorded snapshots through a fresh policy (the simulator)
must give the decisions the live loop took.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow as pa

import chronostream as cs
from chronostream.master.policies import (CompactionRule, Decision, HotSliceRule, LatencyPolicy, Policies, RatePolicy,
                                    ScalingAction, ScheduledPolicy, UtilizationPolicy, read_trace, simulate,
                                    write_trace)
from chronostream.containers.metrics import MetricsSnapshot, SliceMetrics, StageMetrics
from chronostream.slices.sourcelog import SourceLogWriter


def stage(util=0.5, rate=1000.0, proc=1000.0, backlog=0, hosts=1, per=()):
    return StageMetrics("s", hosts, tuple(range(hosts)), 8, input_rate=rate, processing_rate=proc, utilization=util,
                        backlog_events=backlog, backlog_epochs=0, threads=hosts, per_slice=tuple(per))


def snap(t, latency=None, **kw):
    return MetricsSnapshot(t, {"s": stage(**kw)}, latency or {})


def kinds(actions):
    return [(a.kind, a.n) for a in actions]


def test_utilization_policy_scales_out_only_after_a_sustained_high_and_then_cools_down():
    p = UtilizationPolicy(high=0.8, low=0.3, sustain=2, cooldown_s=10)
    assert p.decide(snap(1, util=0.9)) == []
    assert kinds(p.decide(snap(2, util=0.95))) == [("scale_out", 1)]
    assert p.decide(snap(3, util=0.95)) == [] and p.decide(snap(4, util=0.95)) == [], "cooldown"
    assert p.decide(snap(13, util=0.5, hosts=2)) == [], "inside the band: nothing"
    p.decide(snap(14, util=0.1, hosts=2))
    assert kinds(p.decide(snap(15, util=0.1, hosts=2))) == [("scale_in", 1)]
    assert p.decide(snap(30, util=0.1, hosts=1)) == [] and p.decide(snap(31, util=0.1, hosts=1)) == [], "min_hosts"


def test_rate_policy_sizes_the_stage_from_input_rate_backlog_and_per_host_capacity():
    p = RatePolicy(catch_up_s=10, headroom=1.0, lazy_in=2, max_step=8)
    (a,) = p.decide(snap(1, rate=2500, proc=1000, backlog=5000))
    assert (a.kind, a.n) == ("scale_out", 2), "ceil((2500 + 5000/10) / 1000) = 3 hosts"
    assert "target 3000 ev/s" in a.reason
    assert p.decide(snap(2, rate=2500, proc=1000, hosts=3)) == []
    assert p.decide(snap(3, rate=100, proc=1000, hosts=3)) == [], "scale-in is lazy"
    assert kinds(p.decide(snap(4, rate=100, proc=1000, hosts=3))) == [("scale_in", 1)]
    assert p.decide(snap(5, rate=100, proc=0, hosts=2)) == [], "no capacity measured: no decision"


def test_latency_policy_adds_a_host_to_the_busiest_stage_when_p99_is_too_high():
    p = LatencyPolicy(high_ms=200, low_ms=20, sustain=1, cooldown_s=0)
    (a,) = p.decide(snap(1, {"count": 10, "p99_ms": 900.0}, util=0.9))
    assert a.kind == "scale_out" and "p99 900 ms" in a.reason
    (b,) = p.decide(snap(2, {"count": 10, "p99_ms": 5.0}, util=0.1, hosts=2))
    assert b.kind == "scale_in"


def test_scheduled_policy_takes_each_action_once_when_its_time_comes():
    out = ScalingAction("scale_out", "s", 2, "nightly batch")
    p = ScheduledPolicy([(10.0, out)])
    assert p.decide(snap(5)) == [] and p.decide(snap(10)) == [out] and p.decide(snap(11)) == []


def test_hot_slice_rule_moves_the_hot_slice_to_the_least_loaded_container():
    rates = {0: 300.0, 1: 300.0, 2: 1000.0, 3: 300.0}  # container 0 runs 0..3 (1900 ev/s), container 1 4..7
    per = [SliceMetrics(s, 0 if s < 4 else 1, 0, 0.0, 0, 0, 0, input_rate=rates.get(s, 10.0)) for s in range(8)]
    (a,) = HotSliceRule(ratio=3).decide(snap(1, hosts=2, per=per))
    assert (a.kind, a.slice, a.to_container) == ("migrate", 2, 1)
    alone = [SliceMetrics(s, 0 if s < 4 else 1, 0, 0.0, 0, 0, 0, input_rate=1000.0 if s == 2 else 10.0) for s in range(8)]
    assert HotSliceRule(ratio=3).decide(snap(1, hosts=2, per=alone)) == [], "moving it alone would not help"


def test_compaction_rule_compacts_a_stage_with_extra_containers_once_its_host_count_is_quiet():
    def with_containers(t, hosts, containers):
        return MetricsSnapshot(t, {"s": StageMetrics("s", hosts, tuple(range(containers)), 8, 0.0, 0.0, 0.0, 0, 0, 1)})

    r = CompactionRule(extra=2, quiet_s=5, cooldown_s=30)
    assert r.decide(with_containers(0, 2, 3)) == [], "one extra container: below extra=2"
    assert r.decide(with_containers(1, 3, 6)) == [], "the host count just changed (a scale-out)"
    assert r.decide(with_containers(5, 2, 5)) == [], "and again (a scale-in): quiet for 5 s first"
    (a,) = r.decide(with_containers(10, 2, 5))
    assert (a.kind, a.stage) == ("compact", "s") and "5 containers on 2 hosts" in a.reason
    assert r.decide(with_containers(20, 2, 5)) == [], "cooldown"
    assert kinds(r.decide(with_containers(40, 2, 4))) == [("compact", 0)]


def test_compaction_rule_leaves_a_stage_above_its_state_limit_alone_and_has_none_by_default():
    big = [SliceMetrics(s, s % 4, 0, 0.0, 0, 1000, 100 << 20) for s in range(8)]  # 8 x 100 MB
    st = StageMetrics("s", 2, (0, 1, 2, 3), 8, 0.0, 0.0, 0.0, 0, 0, 1, per_slice=tuple(big))
    assert CompactionRule(quiet_s=0, max_state_mb=256).decide(MetricsSnapshot(1.0, {"s": st})) == []
    assert kinds(CompactionRule(quiet_s=0, max_state_mb=1000).decide(MetricsSnapshot(1.0, {"s": st}))) \
        == [("compact", 0)]
    assert kinds(CompactionRule(quiet_s=0).decide(MetricsSnapshot(1.0, {"s": st}))) == [("compact", 0)]


def test_the_simulator_replays_a_trace_to_the_same_decisions(tmp_path):
    snaps = [snap(t, rate=r, proc=1000, hosts=h) for t, r, h in
             [(1, 300, 1), (2, 2400, 1), (3, 2400, 3), (4, 200, 3), (5, 200, 3), (6, 200, 2), (7, 200, 2)]]
    live = simulate(Policies(RatePolicy(catch_up_s=5, lazy_in=2), UtilizationPolicy()), snaps)
    write_trace(live, str(tmp_path / "trace.jsonl"))
    again = simulate(Policies(RatePolicy(catch_up_s=5, lazy_in=2), UtilizationPolicy()),
                     [d.snapshot for d in read_trace(str(tmp_path / "trace.jsonl"))])
    assert [d.actions for d in again] == [d.actions for d in live]
    assert [k for d in live for k in kinds(d.actions)] == [("scale_out", 2), ("scale_in", 1), ("scale_in", 1)]
    assert Decision.from_plain(live[1].to_plain()) == live[1]


# -- live, on Ray ----------------------------------------------------------------------------


class CostlySum(cs.Operator):
    """A running sum per key that spends ``cost_s`` per event (sleeping: the GIL is free meanwhile)."""

    def __init__(self, cost_s: float = 0.0) -> None:
        self.cost_s = cost_s

    def setup(self) -> None:
        self.sums = self.register_state("sums")

    def consume(self, stream_id, event):
        if self.cost_s:
            time.sleep(self.cost_s)
        total = self.sums.get(event["k"], 0) + event["v"]
        self.sums.set(event["k"], total)
        self.produce("out", {"k": event["k"], "total": total})


def build(log_dir: str, cost_s: float, follow: bool) -> cs.Query:
    q = cs.Query(epoch_events=100)
    q.source_log(log_dir, "events", follow=follow, slices=1).key_by("k") \
        .apply(CostlySum, cost_s, slices=6, name="sum").sink(name="sums")
    return q


def append(w: SourceLogWriter, n: int, k: int) -> int:
    idx = np.arange(n, n + k)
    w.append({"events": pa.table({"k": idx % 40, "v": idx % 7, "_order": idx, "_stream_seq": idx})}, high_water=n + k)
    return n + k


def write_at_rates(w: SourceLogWriter, n: int, phases: list[tuple[float, float]], stop: threading.Event) -> None:
    """Append rows at ``rate`` events/s for ``seconds``, phase after phase, then seal."""
    for rate, seconds in phases:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not stop.is_set():
            n = append(w, n, max(1, int(rate / 10)))
            time.sleep(0.1)
    w.seal()


def test_an_input_rate_step_makes_the_rate_policy_scale_out_then_in_and_the_output_is_exact(ray_session, tmp_path):
    log_dir = str(tmp_path / "log")
    w = SourceLogWriter(log_dir)
    n = append(w, 0, 10)  # the stream exists before the query is built
    stop = threading.Event()
    writer = threading.Thread(target=write_at_rates, args=(w, n, [(300, 4), (2500, 6), (100, 14)], stop))
    policy = RatePolicy(catch_up_s=5, headroom=1.2, lazy_in=2, max_hosts=3, stages=["sum"])
    job = cs.run(build(log_dir, 0.001, True), containers={"events": 1, "sum": 1}, autoscale=policy,
                 autoscale_interval_s=1.0)
    try:
        writer.start()
        job.wait(timeout_s=240)
        trace = job.autoscale_trace()
        got = job.results("sums").to_pylist()
        timeline = job.timeline()
    finally:
        stop.set()
        writer.join()
        job.stop()
    taken = [a for d in trace for a in d.actions]
    print("\n".join(f"t={d.snapshot.t}: " + "; ".join(a.describe() for a in d.actions) for d in trace if d.actions))
    outs = [a for a in taken if a.kind == "scale_out"]
    ins = [a for a in taken if a.kind == "scale_in"]
    assert outs and ins, [a.describe() for a in taken]
    assert taken.index(outs[0]) < taken.index(ins[0]), "out on the step up, then in on the step down"
    assert any(k == "migration_end" for _, k, _ in timeline)
    expected = cs.run(build(log_dir, 0.0, False), executor="serial").results("sums").to_pylist()
    assert got == expected
    replay = simulate(RatePolicy(catch_up_s=5, headroom=1.2, lazy_in=2, max_hosts=3, stages=["sum"]),
                      [d.snapshot for d in trace])
    assert [d.actions for d in replay] == [d.actions for d in trace], "the simulator decides as the live loop did"


def test_the_autoscale_sim_command_prints_the_decisions_of_a_trace(tmp_path, capsys):
    from chronostream.cli import main

    snaps = [snap(t, rate=r, proc=1000, hosts=h) for t, r, h in [(1, 300, 1), (2, 2400, 1), (3, 2400, 3)]]
    write_trace(simulate(RatePolicy(), snaps), str(tmp_path / "t.jsonl"))
    assert main(["autoscale-sim", str(tmp_path / "t.jsonl"), "--policy", "rate", "--param", "catch_up_s=5"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "scale_out s by 2" in out[0] and out[0].startswith("t=    2.00s")
