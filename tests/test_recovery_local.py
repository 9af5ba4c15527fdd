"""Recovery, specified on the in-process driver (master.local): real cores, lmdb output logs and backup stores.

A host dies between rounds (its in-flight messages partly lost, its output
log and the backups it held gone); the same recovery plan the Ray master
runs re-hosts its slices from chained backups and replays upstream output
logs. The sink output must equal the serial executor's, row for row and
out_seq for out_seq, with no duplicates: for every acceptance query, for
faults at random rounds (a seeded campaign), for two hosts at once, for a
corrupt replica, and for the cases recovery must refuse.
"""

from __future__ import annotations

import random

import pytest

import chronostream as cs
from chronostream.containers.shipping import PeerFailed
from chronostream.dag import compile_query
from chronostream.slices.errors import RecoveryError
from chronostream.master.local import LocalCluster
from chronostream.master.placement import containers_per_stage, initial_placement
from chronostream.master.recovery import BackupsLost
from test_local_executor import BUILDERS, SLICES, serial_sinks


EPOCH = 7  # many small epochs: faults land mid-stream, with checkpoints before and after


def cluster(name: str, containers=3, slices: int = SLICES, **kw) -> LocalCluster:
    query = BUILDERS[name][0](slices)
    query.epoch_events = EPOCH
    plan, sources = compile_query(query)
    placement = initial_placement(plan, containers_per_stage(plan, containers))
    kw.setdefault("checkpoint_every", 2)
    return LocalCluster(plan, placement, sources, **kw)


def assert_equals_serial(name: str, cl: LocalCluster) -> None:
    expected = serial_sinks(name)  # (the epoch size does not change the output)
    for sink in BUILDERS[name][1]:
        got = cl.results(sink).to_pylist()
        assert got == expected[sink], f"{name}/{sink}: {len(got)} rows vs {len(expected[sink])} from the serial run"


def operator_hosts(cl: LocalCluster) -> list[int]:
    """Hosts running a stateful (operator) stage's container."""
    return sorted({cl.hosts[c] for st in cl.plan.stages if st.kind == "operator"
                   for c in cl.placement.containers[st.stage_id]})


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_killing_a_stateful_container_mid_stream_gives_the_serial_output(name):
    cl = cluster(name)
    victim = operator_hosts(cl)[0]
    cl.run(kills={3: [victim]})
    assert any(kind == "recovery_end" for _, kind, _ in cl.timeline)
    assert_equals_serial(name, cl)


@pytest.mark.parametrize("name", ["rekey", "join"])
def test_killing_a_source_container_mid_stream_gives_the_serial_output(name):
    cl = cluster(name)
    source_hosts = sorted({cl.hosts[c] for st in cl.plan.stages if st.kind == "source"
                           for c in cl.placement.containers[st.stage_id]})
    cl.run(kills={2: [source_hosts[0]]})
    assert_equals_serial(name, cl)


def test_a_dead_containers_slices_are_rebuilt_in_parallel_by_its_backup_peers():
    cl = cluster("word_count", containers=4, slices=12)
    stage = next(st.stage_id for st in cl.plan.stages if st.kind == "operator")
    victim = cl.placement.containers[stage][0]
    cl.run(kills={4: [victim]})
    starts = [info for _, kind, info in cl.timeline if kind == "recovery_start"]
    assert len({s["host"] for s in starts}) == 3, "each of the 3 peers rebuilds a share"
    assert sorted(s for info in starts for s in info["slices"]) == [0, 4, 8]
    expected = cs.run_serial(BUILDERS["word_count"][0](12)).results("counts").to_pylist()
    assert cl.results("counts").to_pylist() == expected


def test_two_containers_of_one_stage_killed_at_once_recover_with_backup_factor_two():
    cl = cluster("running_sum", containers=4, backup_factor=2)
    stage = next(st.stage_id for st in cl.plan.stages if st.kind == "operator")
    a, b = cl.placement.containers[stage][:2]
    cl.run(kills={5: [a, b]})
    assert_equals_serial("running_sum", cl)


@pytest.mark.parametrize("round_", [3, 6, 9])
def test_containers_of_adjacent_stages_killed_at_once_give_the_serial_output(round_):
    """A producer and its consumer die together (as when a node dies). The consumer's
    replacement needs the producer's output since the consumer's checkpoint; when the
    producer's checkpoint is newer, the producer's slices are rebuilt from the start."""
    cl = cluster("rekey", containers=2, checkpoint_every=1)
    victims = [cl.placement.containers[st.stage_id][0] for st in cl.plan.stages]  # one per stage
    cl.run(kills={round_: victims})
    assert_equals_serial("rekey", cl)


def test_a_corrupt_backup_replica_is_refused_and_the_other_one_used():
    cl = cluster("running_sum", containers=3, backup_factor=2)
    stage = next(st.stage_id for st in cl.plan.stages if st.kind == "operator")
    victim = cl.placement.containers[stage][0]
    victim_slices = set(cl.placement.slices_of(victim))

    def corrupt_then_kill(cl):
        damaged = [(h, key) for h, store in cl.stores.items() for key in store.holds()
                   if key[0] == stage and key[1] in victim_slices]
        assert damaged, "the victim's slices have backups by now"
        for h, key in damaged[:1]:
            cl.stores[h].corrupt(*key)
        cl.kill([victim])

    cl.run(faults={6: corrupt_then_kill})
    rejected = [info for _, kind, info in cl.timeline if kind == "backup_rejected"]
    assert len(rejected) == 1 and "checksum" in rejected[0]["error"]
    assert_equals_serial("running_sum", cl)


def test_a_backup_damaged_at_rest_is_healed_by_a_full_checkpoint_while_the_job_runs():
    """Bit rot in a held backup is found when its chain is merged; the holder refuses further
    deltas, the owner sends a full checkpoint instead, and a later kill restores from it."""
    cl = cluster("running_sum", containers=3, backup_factor=2, merge_every=2)
    stage = next(st.stage_id for st in cl.plan.stages if st.kind == "operator")
    victim = cl.placement.containers[stage][0]
    key = (stage, cl.placement.slices_of(victim)[0])
    holder: list[int] = []

    def corrupt(cl):
        holder.append(next(h for h, store in cl.stores.items() if key in store.holds()))
        cl.stores[holder[0]].corrupt(*key)

    cl.run(faults={3: corrupt, 17: lambda cl: cl.kill([victim])})
    store = cl.stores[holder[0]]
    assert store.refused >= 1, "the damaged chain refused a delta"
    assert key not in store.damaged, "a full checkpoint replaced the damaged chain"
    assert any(k == "recovery_end" for _, k, _ in cl.timeline), "the kill landed mid-stream"
    assert not [i for _, k, i in cl.timeline if k == "backup_rejected"], "the kill found sound backups"
    assert_equals_serial("running_sum", cl)


def test_when_every_replica_is_corrupt_recovery_fails_naming_slice_and_checkpoint():
    cl = cluster("running_sum", containers=3, backup_factor=2)
    stage = next(st.stage_id for st in cl.plan.stages if st.kind == "operator")
    victim = cl.placement.containers[stage][0]
    slice_ = cl.placement.slices_of(victim)[0]

    def truncate_all_then_kill(cl):
        for store in cl.stores.values():
            if (stage, slice_) in store.holds():
                store.corrupt(stage, slice_, truncate=True)
        cl.kill([victim])

    with pytest.raises(RecoveryError, match=rf"slice {slice_}.*truncated"):
        cl.run(faults={6: truncate_all_then_kill})


def test_losing_every_backup_of_a_slice_fails_naming_the_slice():
    cl = cluster("word_count", containers=2, backup_factor=1)
    stage = next(st.stage_id for st in cl.plan.stages if st.kind == "operator")
    with pytest.raises(BackupsLost, match=r"stage 'count' slice \d+"):
        cl.run(kills={6: list(cl.placement.containers[stage])})


def test_losing_every_backup_can_be_recomputed_from_the_start_when_allowed():
    cl = cluster("word_count", containers=2, backup_factor=1, recompute_lost=True)
    stage = next(st.stage_id for st in cl.plan.stages if st.kind == "operator")
    cl.run(kills={6: list(cl.placement.containers[stage])})
    assert_equals_serial("word_count", cl)


def test_a_single_container_stage_without_backup_peers_is_rebuilt_from_the_start():
    cl = cluster("running_sum", containers={"payments": 1, "running_sum": 1, "stats": 1})
    stage = next(st.stage_id for st in cl.plan.stages if st.name == "running_sum")
    cl.run(kills={3: list(cl.placement.containers[stage])})
    assert_equals_serial("running_sum", cl)


def stage_hosts(cl: LocalCluster) -> dict[int, set[int]]:
    return {st: {cl.hosts[c] for c in ids if cl.hosts[c] in cl.alive} for st, ids in cl.placement.containers.items()}


@pytest.mark.parametrize("seed", range(9))
def test_seeded_random_fault_campaign_ends_with_exact_output(seed):
    """Each run kills 2-3 random hosts at random rounds, one at a time, never leaving a
    stage fewer than 2 live hosts (with L=2 a copy of every slice then survives).
    9 runs, 22 faults."""
    rng = random.Random(seed)
    name = sorted(BUILDERS)[seed % len(BUILDERS)]
    cl = cluster(name, containers=4, checkpoint_every=rng.choice([1, 2, 3]), seed=seed)
    rounds = sorted(rng.sample(range(1, 12), rng.randint(2, 3)))
    chosen = []

    def kill_a_random_host(cl):
        by_stage = stage_hosts(cl)
        allowed = [h for h in sorted(cl.alive)
                   if all(len(hs - {h}) >= 2 for hs in by_stage.values() if h in hs)]
        h = rng.choice(allowed)
        chosen.append(h)
        cl.kill([h])

    try:
        cl.run(faults={r: kill_a_random_host for r in rounds})
    except RecoveryError as exc:  # a producer rebuilt earlier no longer reaches back: refused, never wrong
        assert "lost with the container" in str(exc)
        return
    assert len(chosen) == len(rounds)
    assert_equals_serial(name, cl)


@pytest.mark.parametrize("seed", range(3))
def test_seeded_node_failures_kill_one_container_of_every_stage_and_the_output_is_exact(seed):
    """A node dies: with containers spread round-robin, one container of every stage dies at once."""
    rng = random.Random(seed)
    name = ["rekey", "join", "running_sum"][seed]
    cl = cluster(name, containers=3, checkpoint_every=rng.choice([1, 2]), seed=seed)
    victims = [rng.choice(cl.placement.containers[st.stage_id]) for st in cl.plan.stages]
    cl.run(kills={rng.randint(2, 10): victims})
    assert_equals_serial(name, cl)


def test_gc_keeps_output_logs_and_backups_bounded_over_many_checkpoint_cycles():
    """200 epochs, a checkpoint every 2 (100 cycles): output logs and carried outputs are trimmed
    below every consumer's checkpoint, so they stay a few epochs long; a kill late in the run
    still recovers exactly from what GC kept."""
    import queries

    query = queries.rekey_pipeline(5, n_lines=600)
    query.epoch_events = 3
    plan, sources = compile_query(query)
    cl = LocalCluster(plan, initial_placement(plan, containers_per_stage(plan, 3)), sources, checkpoint_every=2)
    assert plan.num_epochs == 200
    samples = []
    collect = cl.collect_garbage

    def sampled():
        dropped = collect()
        samples.append((max(c.output_log.entries() for c in cl.cores.values()),
                        max(sum(len(segs) for segs in s.outputs.values()) for s in cl.stores.values()),
                        max(s.total_bytes() for s in cl.stores.values())))
        return dropped

    cl.collect_garbage = sampled
    cl.run(kills={150: [cl.placement.containers[plan.stage("count").stage_id][0]]})
    entries, segments, held = zip(*samples)
    assert max(entries) <= 12, "an output log keeps a few epochs, not 200"
    # (12 since GC keeps what a copy up to the recovery slack behind the newest needs: 4 epochs here)
    assert max(segments) <= 14, "backup holders keep a few carried-output segments"
    half = len(held) // 2
    assert max(held[half:]) <= 2 * max(held[:half]), "backup memory does not grow with the run"
    expected = cs.run_serial(queries.rekey_pipeline(5, n_lines=600)).results("buckets").to_pylist()
    assert cl.results("buckets").to_pylist() == expected


def test_a_checkpoint_that_reached_only_one_of_its_peers_when_its_container_died_is_safe():
    """Fault during a checkpoint: the victim's newest checkpoint reached one backup peer, not
    the other. Whichever copy recovery uses, the output is exact."""
    cl = cluster("running_sum", containers=3, backup_factor=2, checkpoint_every=1)
    stage = next(st.stage_id for st in cl.plan.stages if st.kind == "operator")
    victim = cl.placement.containers[stage][0]
    ship = cl.shipping._ship
    half: dict[str, bool] = {}

    def ship_half(cid, cmd):
        # From round 5 on, the victim's next checkpoint reaches only its first peer; then it dies.
        if half.get("armed") and cid == victim and not half.get("done"):
            if cmd.peer != min(cl.shipping.payload[(cid, cmd.round)][1]):
                half["done"] = True
                return PeerFailed(cmd.round, cmd.peer, dead=False, error="its container died mid-shipment")
        return ship(cid, cmd)

    def on_round(cl):
        half["armed"] = half.get("armed") or cl.round >= 5
        if half.get("done") and victim in cl.cores:
            cl.kill([victim])

    cl.shipping._ship = ship_half
    cl.run(on_round=on_round)
    assert half.get("done"), "no checkpoint of the victim was cut short"
    assert cl.cores.get(victim) is None and any(k == "recovery_end" for _, k, _ in cl.timeline)
    assert_equals_serial("running_sum", cl)


def test_both_hosts_of_a_two_host_stage_dying_together_are_restored_from_copies_on_other_stages_hosts():
    """With the default backup factor 2, a stage on two hosts keeps a second copy of each slice on
    another stage's host (``host_backup_peers``): both its hosts dying at once is a restore from
    those copies and a replay, not a loss nor a rebuild from epoch 0."""
    cl = cluster("running_sum", containers={"payments": 1, "running_sum": 2, "stats": 2})
    stage = cl.stage_id("running_sum")
    victims = sorted(cl.hosts[c] for c in cl.placement.containers[stage])
    cl.run(kills={12: victims})
    starts = [info for _, k, info in cl.timeline if k == "recovery_start"]
    ends = [info for _, k, info in cl.timeline if k == "recovery_end"]
    assert {info["host"] for info in starts} <= cl.alive - set(victims)
    assert sorted(s for info in starts for s in info["slices"]) == list(range(cl.plan.stages[stage].num_slices))
    assert all(info["resume_epoch"] > 2 for info in ends), "resumed after a checkpoint, not from epoch 0"
    assert_equals_serial("running_sum", cl)


@pytest.mark.parametrize("kind", ["operator", "source"])
def test_a_stage_on_one_host_is_restored_from_a_backup_on_another_stages_host(kind):
    """A stage with one container has no peer of its own: its slices are backed up to the job's
    other hosts (``host_backup_peers``), so its host's death is a restore where a copy is and a
    replay from the checkpoint, not a rebuild from epoch 0 (a source re-reading its input)."""
    cl = cluster("running_sum", containers={"payments": 1, "running_sum": 1, "stats": 2})
    stage = next(st for st in cl.plan.stages if st.kind == kind)
    (victim,) = cl.placement.containers[stage.stage_id]
    cl.run(kills={12: [cl.hosts[victim]]})
    starts = [info for _, k, info in cl.timeline if k == "recovery_start"]
    ends = [info for _, k, info in cl.timeline if k == "recovery_end"]
    adopters = {info["host"] for info in starts}
    assert adopters <= cl.alive and len(adopters) > 1, "live holders on other hosts rebuild a share each"
    assert sorted(s for info in starts for s in info["slices"]) == list(range(stage.num_slices))
    assert all(info["resume_epoch"] > 2 for info in ends), "resumed after a checkpoint, not from epoch 0"
    assert_equals_serial("running_sum", cl)
