"""Live slice migration, specified on the in-process driver (master.local): real cores, real lmdb.

Method: a job runs with many small epochs and message delivery in a seeded
shuffled order; between two rounds a migration starts (scale-out, scale-in,
one slice), and the driver advances it one protocol phase per round while
every container keeps processing. Each sink must equal the serial
executor's, row for row and out_seq for out_seq, and the migration's story
must show the phases in order. Faults during a migration (source or
destination host dies) must still give the serial output.
"""

from __future__ import annotations

import pytest

from chronostream.dag import compile_query
from chronostream.master.local import LocalCluster
from chronostream.master.migration import MigrationError, MigrationPhase
from chronostream.master.placement import containers_per_stage, initial_placement
from queries import QUERIES
from test_local_executor import BUILDERS as SHORT
from test_recovery_local import EPOCH

import chronostream as cs

PHASES = ["warming", "rebuilding", "dual", "releasing", "done"]
BUILDERS = {**SHORT, "long_sum": (lambda s: QUERIES["running_sum"][0](s, n=700), *QUERIES["running_sum"][1:]),
            "long_words": (lambda s: QUERIES["word_count"][0](s, n_lines=400), *QUERIES["word_count"][1:]),
            "long_rekey": (lambda s: QUERIES["rekey"][0](s, n_lines=1200), *QUERIES["rekey"][1:])}


_serial: dict = {}


def assert_equals_serial(name: str, cl: LocalCluster) -> None:
    """Every sink equals the serial executor's run of the same query (same slice counts)."""
    slices = next(st.num_slices for st in cl.plan.stages if st.kind == "operator")
    if (name, slices) not in _serial:
        res = cs.run_serial(BUILDERS[name][0](slices))
        _serial[(name, slices)] = {s: res.results(s).to_pylist() for s in BUILDERS[name][1]}
    for sink, rows in _serial[(name, slices)].items():
        got = cl.results(sink).to_pylist()
        assert got == rows, f"{name}/{sink}: {len(got)} rows vs {len(rows)} from the serial run"


def cluster(name: str, containers=1, slices: int = 6, seed: int = 0, **kw) -> LocalCluster:
    query = BUILDERS[name][0](slices)
    query.epoch_events = EPOCH
    plan, sources = compile_query(query)
    placement = initial_placement(plan, containers_per_stage(plan, containers))
    kw.setdefault("output_logs", True)
    return LocalCluster(plan, placement, sources, seed=seed, **kw)


def operator_stage(cl: LocalCluster) -> str:
    return next(st.name for st in cl.plan.stages if st.kind == "operator")


def hosts_of(cl: LocalCluster, stage: str) -> dict[int, list[int]]:
    from chronostream.master.migration import stage_hosts

    return stage_hosts(cl.placement, cl.hosts, cl.stage_id(stage))


def phases(t) -> list[str]:
    return [phase for _, phase, _, _ in t.story]


@pytest.mark.parametrize("name", sorted(SHORT))
def test_scale_out_one_to_two_mid_stream_gives_the_serial_output(name):
    cl = cluster(name)
    stage = operator_stage(cl)
    cl.run(faults={3: lambda cl: cl.scale_out(stage, 1)})
    assert [len(v) for v in hosts_of(cl, stage).values()] == [3, 3]
    (t,) = cl.migrated
    assert phases(t) == PHASES
    assert_equals_serial(name, cl)


def script(*steps, start: int = 2):
    """Faults for ``LocalCluster.run``: each step runs at the first round from ``start`` on
    when no migration is in progress (the next one waits for the previous one)."""
    pending = list(steps)

    def tick(cl):
        if pending and not cl.migrations:
            pending.pop(0)(cl)
    return {r: tick for r in range(start, 10_000)}, pending


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scale_out_one_to_two_to_four_then_in_to_one_gives_the_serial_output(seed):
    cl = cluster("long_sum", slices=8, seed=seed)
    stage = operator_stage(cl)
    seen = []

    def note(cl):
        seen.append(sorted(len(v) for v in hosts_of(cl, stage).values()))

    faults, pending = script(lambda cl: cl.scale_out(stage, 1), note, lambda cl: cl.scale_out(stage, 2), note,
                             lambda cl: cl.scale_in(stage, 3), note)
    cl.run(faults=faults)
    assert not pending, "every step ran mid-stream"
    assert seen == [[4, 4], [2, 2, 2, 2], [8]]
    assert all(t.phase is MigrationPhase.DONE for t in cl.migrated)
    assert_equals_serial("long_sum", cl)


def test_scaling_in_a_grouped_aggregate_empties_a_container_and_gives_the_serial_output():
    """Scale-in moves every slice of one container of the built-in count (a stage whose slices
    run as one group) away: that container releases them before its last epoch, which it then
    processes with no slice at all (this failed the job: an empty group). The sink equals the
    serial run."""
    cl = cluster("long_words", slices=6)
    faults, pending = script(lambda cl: cl.scale_out("count", 1), lambda cl: cl.scale_in("count", 1))
    cl.run(faults=faults)
    assert not pending, "both steps ran mid-stream"
    assert [len(v) for v in hosts_of(cl, "count").values()] == [6]
    assert [phases(t) for t in cl.migrated] == [PHASES, PHASES]
    assert_equals_serial("long_words", cl)


def test_slices_of_several_containers_moving_to_one_host_land_in_one_new_container():
    """Scale-in from three hosts to one: the two drained containers' slices go to one new
    container (not one per source container), whose sources release at one epoch (the consumers
    take the new container's messages once no source covers its slices). The sink equals the
    serial run."""
    cl = cluster("long_sum", containers=3, slices=6)
    stage = operator_stage(cl)
    faults, pending = script(lambda cl: cl.scale_in(stage, 2))
    cl.run(faults=faults)
    assert not pending
    sid = cl.stage_id(stage)
    assert len(cl.migrated) == 2 and len({t.source for t in cl.migrated}) == 2
    assert len({t.new_id for t in cl.migrated}) == 1, "one new container on the one destination host"
    assert len(cl.placement.containers[sid]) == 2, "the staying container and the new one"
    assert len({e for t in cl.migrated for e in t.released_at.values()}) == 1, "both sources released at one epoch"
    assert_equals_serial("long_sum", cl)


def test_repeated_scale_out_and_in_keeps_at_most_two_containers_a_host():
    """Each scale-out gives the new host one container; each scale-in one per staying host: five
    rounds of out and in leave no host with more than two containers of the stage (one per
    source container and destination host made 3 on each new host here)."""
    cl = cluster("long_sum", containers=3, slices=12)
    stage = operator_stage(cl)
    sid = cl.stage_id(stage)
    most = []

    def note(cl):
        per_host: dict[int, int] = {}
        for c in cl.placement.containers[sid]:
            per_host[cl.hosts[c]] = per_host.get(cl.hosts[c], 0) + 1
        most.append(max(per_host.values()))

    steps = []
    for _ in range(5):
        steps += [lambda cl: cl.scale_out(stage, 1), note, lambda cl: cl.scale_in(stage, 1), note]
    faults, pending = script(*steps)
    cl.run(faults=faults)
    assert not pending
    assert len(most) == 10 and max(most) <= 2, most
    assert_equals_serial("long_sum", cl)


def test_a_scale_out_empties_a_hosts_smallest_container_first_so_that_it_retires():
    """A host that runs a big container and a one-slice container (a migration put slice 1
    there) gives the scale-out that slice first: that container retires, the big one stays
    whole; without the preference the highest slice ids (of the big one) went and both stayed."""
    cl = cluster("long_sum", containers=2, slices=8)
    stage = operator_stage(cl)
    sid = cl.stage_id(stage)
    first = {}

    def move_slice_1(cl):
        host_of_0 = cl.hosts[cl.placement.slice_to_container[sid][0]]
        (t,) = cl.migrate(stage, [1], to_host=host_of_0)
        first["small"] = t.new_id

    faults, pending = script(move_slice_1, lambda cl: cl.scale_out(stage, 1))
    cl.run(faults=faults)
    assert not pending
    moved_out = sorted(s for t in cl.migrated[1:] for s in t.slices)  # (cl.migrated[0]: the move of slice 1)
    assert 1 in moved_out, moved_out
    assert first["small"] not in cl.placement.containers[sid], "the one-slice container retired"
    assert len(cl.placement.containers[sid]) == 3
    assert_equals_serial("long_sum", cl)


def containers_per_host(cl: LocalCluster, stage: str) -> list[int]:
    sid = cl.stage_id(stage)
    per_host: dict[int, int] = {}
    for c in cl.placement.containers[sid]:
        per_host[cl.hosts[c]] = per_host.get(cl.hosts[c], 0) + 1
    return [per_host[h] for h in sorted(per_host)]


def test_compaction_merges_each_hosts_containers_into_one_and_gives_the_serial_output():
    """A scale-out and a scale-in leave two containers of the stage on each staying host;
    ``compact`` moves each host's slices into one new container there, its sources handing
    them over at one epoch. The sink equals the serial run."""
    cl = cluster("long_sum", containers=3, slices=12)
    stage = operator_stage(cl)
    seen, merged = [], []
    faults, pending = script(lambda cl: cl.scale_out(stage, 1), lambda cl: cl.scale_in(stage, 1),
                             lambda cl: seen.append(containers_per_host(cl, stage)),
                             lambda cl: merged.extend(cl.compact(stage)),
                             lambda cl: seen.append(containers_per_host(cl, stage)))
    cl.run(faults=faults)
    assert not pending, "every step ran mid-stream"
    assert seen == [[2, 2, 2], [1, 1, 1]]
    assert len(merged) == 6 and all(t.phase is MigrationPhase.DONE for t in merged)
    assert all(t.host == cl.hosts[t.source] for t in merged), "each host's slices stay on it"
    by_new: dict[int, set[int]] = {}
    for t in merged:
        by_new.setdefault(t.new_id, set()).update(t.released_at.values())
    assert len(by_new) == 3 and all(len(e) == 1 for e in by_new.values()), "each host's sources released at one epoch"
    assert_equals_serial("long_sum", cl)


def two_containers_on_one_host(name: str, **kw):
    """A cluster of two hosts where, once the first step ran, the second host runs two containers
    of the operator stage (the first host's first slice migrated to it), and that host."""
    cl = cluster(name, containers=2, **kw)
    stage = operator_stage(cl)
    state: dict = {}

    def first_slice_to_the_other_host(cl):
        (_a, slices), (b, _) = sorted(hosts_of(cl, stage).items())
        cl.migrate(stage, slices[:1], to_host=b)
        state["host"] = b
    return cl, stage, first_slice_to_the_other_host, state


def test_compaction_hands_the_slices_over_in_process_without_a_copy():
    """The merged containers give their slices to the new container as they are: the same
    runtime objects (state, progress, out_seq counters), no snapshot, at one epoch; and their
    backup chains go on: the new container's checkpoints of them are deltas on the chains the
    old containers shipped (no seed, no full checkpoint). The sink equals the serial run."""
    cl, stage, migrate_one, state = two_containers_on_one_host("long_sum", checkpoint_every=2)
    sid = cl.stage_id(stage)
    before: dict = {}

    def compact(cl):
        for c in cl.placement.containers[sid]:
            if cl.hosts[c] == state["host"]:
                before.update(cl.cores[c].slices)
        state["merged"] = cl.compact(stage)
    faults, pending = script(migrate_one, compact)
    cl.run(faults=faults)
    assert not pending, "both steps ran mid-stream"
    merged = state["merged"]
    (new_id,) = {t.new_id for t in merged}
    assert len(merged) == 2 and all(t.phase is MigrationPhase.DONE and t.snapshot == [] for t in merged)
    assert sorted(before) == sorted(s for t in merged for s in t.slices)
    assert all(cl.cores[new_id].slices[s] is rt for s, rt in before.items()), "the same runtimes, not copies"
    assert {e for t in merged for e in t.released_at.values()} == {merged[0].hand_over_epoch}
    ckpt = cl.cores[new_id].checkpointer
    assert ckpt.taken > 0 and ckpt.full_taken == 0 and ckpt.seeded == 0, "the chains went on with deltas"
    assert_equals_serial("long_sum", cl)


def test_compaction_keeps_the_slice_groups_of_the_containers_it_merges():
    """A stage run as slice groups (the built-in count): after the handover the new container
    runs each old container's slices as the group they were (one cohort each), with the same
    key-index group, instead of one new group whose first epoch sorts every key. The sink equals
    the serial run."""
    cl, stage, migrate_one, state = two_containers_on_one_host("long_words", slices=6)
    sid = cl.stage_id(stage)
    groups_before: dict = {}

    def compact(cl):
        for c in cl.placement.containers[sid]:
            core = cl.cores[c]
            if cl.hosts[c] == state["host"] and len(core.slices) > 1:  # (one slice: no group)
                first = core.slices[min(core.slices)].op
                groups_before[c] = (sorted(core.slices), first._key_group)
        state["merged"] = cl.compact(stage)

    def look(cl):
        new = cl.cores[state["merged"][0].new_id]
        state["cohorts"] = new.threads.table.cohorts(list(new.slices))
        state["groups"] = {min(c): new.slices[min(c)].op._key_group for c in state["cohorts"]}
    faults, pending = script(migrate_one, compact, look)
    cl.run(faults=faults)
    assert not pending, "every step ran mid-stream"
    assert groups_before, "the host ran a container of several slices"
    assert len(state["cohorts"]) == 2
    for slices, group in groups_before.values():
        assert slices in state["cohorts"] and group is not None and state["groups"][slices[0]] is group
    assert_equals_serial("long_words", cl)


def test_a_compaction_asked_as_the_input_ends_is_undone_and_the_output_is_exact():
    """Asked once every producer is past the last epoch, the handover epoch lies beyond the
    input: the sources finish first, the compaction is aborted, the new container removed,
    and nothing is lost or duplicated."""
    cl, stage, migrate_one, state = two_containers_on_one_host("long_sum")
    sid = cl.stage_id(stage)

    def compact_at_the_end(cl):
        producers = [core for _, core in cl.producers(sid)]
        if "merged" not in state and "host" in state and not cl.migrations and all(p.done for p in producers) \
                and not all(cl.cores[c].done for c in cl.placement.containers[sid]):
            state["merged"] = cl.compact(stage)
    faults, pending = script(migrate_one)
    cl.run(faults={r: (lambda cl, f=faults.get(r): (f(cl) if f else None, compact_at_the_end(cl)))
                   for r in range(2, 10_000)})
    assert "merged" in state, "the compaction was asked before the stage finished"
    assert {t.phase for t in state["merged"]} == {MigrationPhase.ABORTED}
    assert state["merged"][0].new_id not in cl.cores
    assert_equals_serial("long_sum", cl)


def test_compaction_with_one_container_a_host_moves_nothing():
    cl = cluster("long_sum", containers=2, slices=6)
    assert cl.compact(operator_stage(cl)) == []
    source = next(st.name for st in cl.plan.stages if st.kind == "source")
    assert cl.compact(source) == []


def test_a_source_stage_left_with_two_containers_on_a_host_is_compacted_too():
    """A source stage's migration leaves the destination host two containers (it makes one
    per source container: no producer marks one release epoch for several). A compaction
    merges them: the host fixes one handover epoch for both, and one new container reads on
    from there. The sinks equal the serial run."""
    cl = cluster("long_rekey", containers={"lines": 2}, checkpoint_every=2)
    source = next(st.name for st in cl.plan.stages if st.kind == "source")
    merged = []

    def first_slice_to_the_other_host(cl):
        (_a, slices), (b, _) = sorted(hosts_of(cl, source).items())
        cl.migrate(source, slices[:1], to_host=b)
    faults, pending = script(first_slice_to_the_other_host, lambda cl: merged.extend(cl.compact(source)))
    cl.run(faults=faults)
    assert not pending, "both steps ran mid-stream"
    assert len({t.new_id for t in merged}) == 1 and len(merged) == 2
    assert all(t.phase is MigrationPhase.DONE for t in merged), [t.story for t in merged]
    assert {e for t in merged for e in t.released_at.values()} == {merged[0].hand_over_epoch}
    assert containers_per_host(cl, source) == [1, 1]
    assert_equals_serial("long_rekey", cl)


def test_a_source_stage_scales_out_and_in_too():
    cl = cluster("rekey", containers=1)
    source = next(st.name for st in cl.plan.stages if st.kind == "source")
    faults, pending = script(lambda cl: cl.scale_out(source, 1), lambda cl: cl.scale_in(source, 1))
    cl.run(faults=faults)
    assert not pending
    assert len(cl.migrated) == 2 and all(t.phase is MigrationPhase.DONE for t in cl.migrated)
    assert_equals_serial("rekey", cl)


def test_migrating_one_slice_moves_only_that_slice():
    cl = cluster("word_count", containers=2)
    stage = operator_stage(cl)
    before = hosts_of(cl, stage)
    src_host, slices = next(iter(before.items()))
    dst_host = next(h for h in before if h != src_host)
    cl.run(faults={4: lambda cl: cl.migrate(stage, [slices[0]], to_host=dst_host)})
    after = hosts_of(cl, stage)
    assert after[src_host] == slices[1:]
    assert after[dst_host] == sorted(before[dst_host] + [slices[0]])
    assert_equals_serial("word_count", cl)


def test_a_migration_with_checkpoints_rebuilds_from_the_destinations_own_backup():
    """With chained backups, a destination that holds the newest backup needs no snapshot;
    a checkpoint is taken every epoch, so every phase of the migration overlaps one."""
    cl = cluster("running_sum", containers=2, checkpoint_every=1, backup_factor=1)
    stage = operator_stage(cl)
    before = hosts_of(cl, stage)
    (h0, s0), (h1, _) = before.items()

    def move(cl):
        local = [s for s in s0 if (cl.stage_id(stage), s) in cl.stores[h1].holds()]
        assert local, "host 1 backs up host 0's slices (backup factor 1, two hosts)"
        cl.migrate(stage, local[:1], to_host=h1)

    cl.run(faults={6: move})
    (t,) = cl.migrated
    rebuild = next(info for _, phase, _, info in t.story if phase == "rebuilding")
    assert rebuild["local"] == t.slices and rebuild["snapshot"] == []
    assert_equals_serial("running_sum", cl)


def test_a_moved_slices_new_backup_chain_starts_from_its_restore_point_and_recovers_it_exactly():
    """After the move the destination ships the chain it restored from, then deltas (no full
    checkpoint of the moved slice); its new backup peer is the old source's host. Killing the
    destination then forces a recovery from that seeded chain alone (two hosts: it is the only
    live copy), and the output is still the serial one."""
    cl = cluster("running_sum", containers=2, checkpoint_every=1, backup_factor=1)
    stage = operator_stage(cl)
    (h0, s0), (h1, _) = hosts_of(cl, stage).items()
    sid = cl.stage_id(stage)
    moved, seen = [], []

    def move(cl):
        local = [s for s in s0 if (sid, s) in cl.stores[h1].holds()]
        moved.append(local[0])
        cl.migrate(stage, local[:1], to_host=h1)

    def kill_destination_once_seeded(cl):
        if seen or not cl.migrated:
            return
        (t,) = cl.migrated
        ck = cl.cores[t.new_id].checkpointer
        if ck.seeded and cl.stores[h0].epochs().get((sid, moved[0]), -1) > t.resume[moved[0]]:
            seen.append((ck.seeded, ck.seed_bytes, cl.stores[h0].latest(sid, moved[0]).epoch))
            cl.kill([h1])

    cl.run(faults={6: move, **{r: kill_destination_once_seeded for r in range(7, 10_000)}})
    assert seen, "the destination shipped a seeded checkpoint to the old source's host before the end"
    seeded, seed_bytes, _ = seen[0]
    assert seeded >= 1 and seed_bytes > 0
    assert any(k == "recovery_end" for _, k, _ in cl.timeline)
    assert_equals_serial("running_sum", cl)


def test_the_source_keeps_running_the_slices_until_the_destination_caught_up():
    """Dual mode: the source container processes the moving slices through DUAL; it releases
    them at a later epoch than the destination's restore point."""
    cl = cluster("running_sum", containers=1, checkpoint_every=3)
    stage = operator_stage(cl)
    cl.run(faults={8: lambda cl: cl.scale_out(stage, 1)})
    (t,) = cl.migrated
    assert t.released_at and all(t.released_at[s] >= t.resume[s] for s in t.slices)
    assert set(t.pause_ms) == set(t.slices)
    assert_equals_serial("running_sum", cl)


@pytest.mark.parametrize("when", [1, 2, 3, 4])
def test_the_destination_host_dying_during_a_migration_gives_the_serial_output(when):
    """Killed after `when` phases: before release the migration aborts (the source keeps the
    slices); during release it completes and recovery rebuilds the slices from backups."""
    cl = cluster("running_sum", containers=2, checkpoint_every=2)
    stage = operator_stage(cl)
    start = 5

    phase = []

    def kill_destination(cl):
        phase.append(cl.migrations[0].phase)
        cl.kill([cl.migrations[0].host])  # (both containers' transfers go to the new host)

    cl.run(faults={start: lambda cl: cl.scale_out(stage, 1), start + when: kill_destination})
    assert len(cl.migrated) == 2
    expect = MigrationPhase.DONE if phase[0] is MigrationPhase.RELEASING else MigrationPhase.ABORTED
    assert {t.phase for t in cl.migrated} == {expect}, phase
    assert_equals_serial("running_sum", cl)


@pytest.mark.parametrize("rounds_after", [1, 2, 3])
def test_the_destination_dying_right_after_a_migration_loses_no_slice(rounds_after):
    """Two hosts: the moved slice was rebuilt from its destination's own backup, the only one,
    and the source drops its copy at the release. The sources release only once the new
    container's first checkpoints reached a peer, so the destination dying in the epochs
    right after the move is recovered (it raised ``BackupsLost`` before) and exact."""
    cl = cluster("running_sum", containers=2, checkpoint_every=2)
    stage = operator_stage(cl)
    state = {"host": None, "rounds": 0}

    def move_one(cl):
        (_a, slices), (b, _) = sorted(hosts_of(cl, stage).items())
        cl.migrate(stage, slices[:1], to_host=b)
        state["host"] = b

    steps, pending = script(move_one)
    scripted = steps[2]

    def step(cl):
        if state["host"] is None:
            scripted(cl)
        elif not cl.migrations and state["rounds"] < rounds_after:
            state["rounds"] += 1
            if state["rounds"] == rounds_after:
                cl.kill([state["host"]])

    cl.run(faults={r: step for r in range(2, 10_000)})
    assert not pending and state["rounds"] == rounds_after
    assert [t.phase for t in cl.migrated] == [MigrationPhase.DONE]
    assert any(k == "recovery_end" for _, k, _ in cl.timeline)
    assert_equals_serial("running_sum", cl)


@pytest.mark.parametrize("when", [1, 2, 3, 4])
def test_the_host_dying_during_a_compaction_gives_the_serial_output(when):
    """A compaction's sources and destination share a host: killed after ``when`` phases, before
    release the compaction aborts with them and recovery rebuilds the sources' slices from their
    backups on the other host; during release it completes and recovery rebuilds the merged one."""
    cl = cluster("running_sum", containers=2, checkpoint_every=2)
    stage = operator_stage(cl)
    sid = cl.stage_id(stage)
    state = {"compacting": None, "rounds": 0, "phase": None, "host": None}

    def first_slice_to_the_other_host(cl):
        by_host = hosts_of(cl, stage)
        (a, slices), (b, _) = sorted(by_host.items())
        cl.migrate(stage, slices[:1], to_host=b)
        state["host"] = b

    def compact(cl):
        state["compacting"] = cl.compact(stage)

    steps, pending = script(first_slice_to_the_other_host, compact)
    scripted = steps[2]  # (one function: the next step, once no migration runs)

    def step(cl):
        if state["compacting"] is None:
            scripted(cl)
        elif state["phase"] is None:
            state["rounds"] += 1
            if state["rounds"] == when:
                state["phase"] = state["compacting"][0].phase
                cl.kill([state["host"]])

    faults = {r: step for r in range(2, 10_000)}
    cl.run(faults=faults)
    assert not pending and state["phase"] is not None, "the kill landed during the compaction"
    merged = state["compacting"]
    assert len(merged) == 2 and all(t.host == state["host"] for t in merged)
    expect = MigrationPhase.DONE if state["phase"] is MigrationPhase.RELEASING else MigrationPhase.ABORTED
    assert {t.phase for t in merged} == {expect}, state["phase"]
    assert any(k == "recovery_end" for _, k, _ in cl.timeline)
    assert len(hosts_of(cl, stage)) == 1, "the other host runs every slice"
    assert all(c in cl.placement.containers[sid] for c in cl.placement.slice_to_container[sid].tolist())
    assert_equals_serial("running_sum", cl)


@pytest.mark.parametrize("when", [1, 2, 3, 4])
def test_the_source_host_dying_during_a_migration_gives_the_serial_output(when):
    cl = cluster("running_sum", containers=2, checkpoint_every=2)
    stage = operator_stage(cl)
    start = 5
    victim, victim_phase = [], []

    def kill_source(cl):
        (t,) = cl.migrations
        victim.append(cl.hosts[t.source])
        victim_phase.append(t.phase)
        cl.kill(victim)

    cl.run(faults={start: lambda cl: cl.migrate(stage, next(iter(hosts_of(cl, stage).values()))[:1]),
                   start + when: kill_source})
    assert any(k == "recovery_end" for _, k, _ in cl.timeline)
    assert victim_phase[0] is [MigrationPhase.WARMING, MigrationPhase.REBUILDING, MigrationPhase.DUAL,
                               MigrationPhase.DUAL][when - 1] or when == 4
    assert_equals_serial("running_sum", cl)


def test_migration_needs_output_logs_and_real_slices():
    cl = cluster("running_sum", output_logs=False)
    with pytest.raises(MigrationError, match="output logs"):
        cl.scale_out(operator_stage(cl), 1)
    cl = cluster("running_sum")
    with pytest.raises(MigrationError, match="no slices \\[99\\]"):
        cl.migrate(operator_stage(cl), [99])
    with pytest.raises(MigrationError, match="cannot remove 1"):
        cl.scale_in(operator_stage(cl), 1)
    with pytest.raises(MigrationError, match="no stage named"):
        cl.scale_out("nope", 1)


def _replay_by_filtering_each_epoch(core, stage_id, slices, target, upto):
    """The replay as first written: one filter of the whole log per epoch (the reference)."""
    import numpy as np
    import pyarrow as pa

    from chronostream.slices.types import ORDER
    from chronostream.containers.routing import OutputRoute, route

    moved = np.array(sorted(slices), dtype=np.int64)
    table = core.routes[stage_id].slice_to_container.copy()
    table[moved] = target
    keep = OutputRoute(stage_id, table, {})
    out: dict = {}
    for sid, t in core._replay_rows(stage_id, slices, moved, {}).items():
        epochs = np.asarray(t.column(ORDER)) // core.plan.epoch_events
        for e in np.unique(epochs).tolist():
            if e < upto:
                part = route(t.filter(pa.array(epochs == e)), core.plan.streams[sid].key, keep)
                if target in part:
                    out.setdefault(e, {})[sid] = part[target]
    return out


def test_a_replay_read_in_rounds_equals_one_replay_and_the_per_epoch_reference():
    """Catch-up rounds (ResourceContainer.reroute) read the output log from a cursor: the
    messages of rounds [0, k) + [k, n) equal one replay of [0, n), epoch for epoch, and both
    equal cutting the log by filtering it once per epoch. Four producer slices interleave
    their epochs in the read, so the cut must sort by epoch."""
    import numpy as np

    cl = cluster("running_sum", containers=1)
    cl.run()
    (source,) = [c for c in cl.cores.values() if c.reader is not None]
    stage_id = cl.stage_id(operator_stage(cl))
    moved, target, upto = [0, 2], 99, source.next_epoch
    assert len(source.slices) > 1 and upto > 10
    resume = {s: 0 for s in moved}
    whole = source.replay_epochs(stage_id, moved, target, {}, resume, upto)
    cursor: dict = {}
    rounds = {**source.replay_epochs(stage_id, moved, target, {}, resume, upto // 3, 0, cursor),
              **source.replay_epochs(stage_id, moved, target, {}, resume, upto, upto // 3, cursor)}
    reference = _replay_by_filtering_each_epoch(source, stage_id, moved, target, upto)
    assert sorted(whole) == sorted(rounds) == list(range(upto))
    assert sum(1 for m in whole.values() if m.parts) == len(reference) > 10
    for e in range(upto):
        assert set(whole[e].parts) == set(rounds[e].parts) == set(reference.get(e, {}))
        for sid, (table, dst) in whole[e].parts.items():
            for other in (rounds[e].parts[sid], reference[e][sid]):
                assert table.equals(other[0]) and np.array_equal(dst, other[1])


def _off_chain_copies(cl: LocalCluster) -> list[tuple[int, tuple[int, int]]]:
    """(host, slice key) of every live copy whose host is not in its slice's chain now."""
    chains = cl.slice_chains()
    return [(h, k) for h, store in cl.stores.items() if h in cl.alive for k in store.holds()
            if h not in chains.get(k, [])]


def test_copies_a_scale_out_left_off_the_chain_are_dropped_once_the_chain_holds_newer_ones():
    """A scale-out lays the stage's backup chain over its new hosts: the copies the old chain
    left behind are dropped by GC once the new chain holds a checkpoint more than the recovery
    slack newer (until then a recovery could still need them). The output is the serial one."""
    cl = cluster("long_sum", containers=2, checkpoint_every=1, backup_factor=1)
    stage = operator_stage(cl)
    seen: list[int] = []
    cl.run(faults={6: lambda cl: cl.scale_out(stage, 1),
                   **{r: lambda cl: seen.append(len(_off_chain_copies(cl))) for r in range(7, 10_000)}})
    assert cl.migrated and max(seen) > 0, "the scale-out left copies off the new chain"
    assert cl.stale_backups_dropped > 0 and _off_chain_copies(cl) == []
    assert_equals_serial("long_sum", cl)


def test_a_host_dying_after_stale_copies_were_dropped_recovers_from_the_chain_exactly():
    cl = cluster("long_sum", containers=2, checkpoint_every=1, backup_factor=1)
    stage = operator_stage(cl)

    def kill_a_first_host_once_dropped(cl):
        if cl.stale_backups_dropped and not any(k == "recovery_start" for _, k, _ in cl.timeline):
            cl.kill([min(hosts_of(cl, stage))])

    cl.run(faults={6: lambda cl: cl.scale_out(stage, 1),
                   **{r: kill_a_first_host_once_dropped for r in range(20, 10_000)}})
    assert cl.stale_backups_dropped > 0
    assert any(k == "recovery_end" for _, k, _ in cl.timeline)
    assert_equals_serial("long_sum", cl)


def test_a_scale_in_whose_two_destinations_release_at_different_epochs_finishes():
    """Regression (found by the simulator: ``python -m chronostream.sim``, a scale-in with slow
    hosts). A scale-in empties one container into two others; with one producer slow, the two
    transfers' release markers reach the emptied container at different epochs. Completing
    the first transfer made every producer forget *all* markers for that container, so the
    second slice's marker never came: the container waited for its next epoch forever.
    Producers now forget only the completed transfer's slices."""
    q = BUILDERS["long_sum"][0](6)
    q.epoch_events = 37
    plan, sources = compile_query(q)
    cl = LocalCluster(plan, initial_placement(plan, {0: 2, 1: 3, 2: 3}), sources, seed=3, checkpoint_every=3,
                      async_checkpoints=False)
    stage = plan.stages[1].name
    started = []

    def scale_in_with_a_slow_producer(c: LocalCluster) -> None:
        if c.round == 11:
            c.step_every.update({1: 4, 2: 2})  # a producer's host, and one destination's
            started.extend(c.scale_in(stage))
        if c.round == 35:
            c.step_every.clear()

    cl.run(on_round=scale_in_with_a_slow_producer, max_rounds=600)
    assert len({t.new_id for t in started}) == 2, "the scale-in empties one container into two"
    assert [t.phase for t in started] == [MigrationPhase.DONE] * 2
    released = {t.source: t.released_at for t in started}
    assert_equals_serial("long_sum", cl)
    assert len(released) == 1
