"""A master that dies and comes back from its catalog alone, in process (``LocalCluster.crash_master``).

Method: the running sum on 3 containers a stage with checkpoints; the master
dies while a migration's transfer is in each phase, or while a recovery is at
each step; the new master reads only its catalog (``master.catalog``) and the
live hosts. The output must equal the serial executor's, the migration must
end done or undone, the recovery must rebuild every lost container.
"""

from __future__ import annotations

import pytest

from chronostream.master.local import LocalCluster
from chronostream.master.migration import MigrationPhase
from chronostream.master.recovery import RECOVERY_STEPS
from chronostream.slices.errors import RecoveryError
from test_recovery_local import assert_equals_serial, cluster, operator_hosts

MOVING_PHASES = [MigrationPhase.WARMING, MigrationPhase.REBUILDING, MigrationPhase.DUAL, MigrationPhase.RELEASING]


def kinds(cl: LocalCluster) -> list[str]:
    return [k for _, k, _ in cl.timeline]


@pytest.mark.parametrize("phase", MOVING_PHASES, ids=lambda p: p.value)
def test_a_master_dying_mid_migration_is_settled_by_the_next_one(phase):
    cl = cluster("running_sum")
    stage = next(st.stage_id for st in cl.plan.stages if st.kind == "operator")
    met = []

    def on_round(c: LocalCluster) -> None:
        if c.round == 3:
            c.migrate(stage, [0])
        if not met and any(t.phase is phase for t in c.migrations):
            met.append(c.round)
            c.crash_master()

    cl.run(on_round=on_round)
    assert met, f"the migration never reached {phase.value}"
    assert cl.master_restarts == 1 and "migration_resumed" in kinds(cl)
    assert cl.migration is None
    (settled,) = [t for t in cl.migrated if t.new_id == cl.migrated[-1].new_id]
    assert settled.phase in (MigrationPhase.DONE, MigrationPhase.ABORTED)
    # (the settled transfer's story starts where the catalog had it)
    assert settled.story[0][1] == phase.value and settled.story[0][3].get("from_catalog")
    assert_equals_serial("running_sum", cl)


@pytest.mark.parametrize("step", RECOVERY_STEPS)
def test_a_master_dying_mid_recovery_finishes_it_once_restarted(step):
    cl = cluster("running_sum")
    victim = operator_hosts(cl)[0]
    lost = sorted(c for c, h in cl.hosts.items() if h == victim)

    def hook(c: LocalCluster, cmd) -> None:
        if cmd.step == step and c.master_restarts == 0:
            c.crash_master()

    cl.recovery_hook = hook
    cl.run(kills={3: [victim]})
    assert cl.master_restarts == 1 and "recovery_resumed" in kinds(cl)
    ended = {i["container"] for _, k, i in cl.timeline if k == "recovery_end"}
    assert set(lost) <= ended, f"lost {lost}, rebuilt {sorted(ended)}"
    assert cl.catalog is not None and cl.catalog.load_recovery() is None, "the record ends with the recovery"
    assert_equals_serial("running_sum", cl)


def test_a_master_restarted_between_faults_keeps_its_books():
    """A crash with nothing in progress changes nothing: the same placement, hosts and ids."""
    cl = cluster("running_sum")
    before = []

    def on_round(c: LocalCluster) -> None:
        if c.round == 4:
            before.append((dict(c.placement.containers), dict(c.hosts), set(c.alive), c.next_id))
            c.crash_master()
            assert (dict(c.placement.containers), dict(c.hosts), set(c.alive), c.next_id) == before[0]

    cl.run(on_round=on_round)
    assert before and cl.master_restarts == 1
    assert_equals_serial("running_sum", cl)


def test_a_master_without_checkpoints_has_no_catalog_to_restart_from():
    cl = cluster("running_sum", checkpoint_every=0)
    with pytest.raises(RecoveryError, match="no catalog"):
        cl.crash_master()


def test_a_master_dying_after_a_transfer_finished_but_before_its_layout_was_saved_rehosts_it():
    """The window a pause measurement opens on Ray: one transfer DONE in the migration record,
    the layout still the one before it. The catalog is put in that state, then the master dies:
    the new one moves the slices to the new container before anything else reads the placement."""
    cl = cluster("running_sum")
    stage = next(st.stage_id for st in cl.plan.stages if st.kind == "operator")
    before = []

    def on_round(c: LocalCluster) -> None:
        if c.round == 3:
            c.migrate(stage, [0])
        if not before and any(t.phase is MigrationPhase.RELEASING for t in c.migrations):
            before.append(c.catalog.load_layout())
        if before and len(before) == 1 and c.migrated and c.migration is None:
            (t,) = c.migrated
            assert t.phase is MigrationPhase.DONE
            placement, hosts, alive, nodes, next_id = before[0]
            c.catalog.save_layout(placement, hosts, alive, nodes, next_id)
            c.catalog.save_migration(None, [t.to_plain()])
            before.append(t)
            c.crash_master()

    cl.run(on_round=on_round)
    assert len(before) == 2, "the migration finished mid-stream"
    t = before[1]
    assert [i["container"] for _, k, i in cl.timeline if k == "migration_rehosted"] == [t.new_id]
    assert cl.placement.slice_to_container[stage][0] == t.new_id
    assert cl.catalog.load_layout()[0].slice_to_container[stage][0] == t.new_id, "and saved"
    assert_equals_serial("running_sum", cl)
