"""Chained backups in a running job: checkpoints flow to the right peers and restore the live state.

Method: the running-sum query (a per-event operator and the vectorized
aggregate) runs on Ray with 3 containers per stage, a checkpoint every 2
epochs (a full one every 3) and backup factor 2. Afterwards: the output
still equals the serial executor's; every slice's backups sit exactly on
the peers the chain names, at the last epoch; and each backup, merged from
its chain and read back from the peer's lmdb, holds the same state as the
live slice. The same holds when every host fails to store one shipment
mid-stream: the chains heal through a refused delta and a full checkpoint.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import ray

import chronostream as cs
from chronostream.chaos import Fault, apply_schedule
from chronostream.containers.ray_backup_host import from_wire
from queries import running_sum
from chronostream.slices.checkpoint import CarriedOutputs, decode, decode_outputs, encode_outputs


@pytest.mark.parametrize("ship_by_reference_bytes,ship_piece_bytes", [(8 << 20, 64 << 20), (0, 64 << 20),
                                                                     (0, 700)])
def test_backups_follow_the_chain_and_match_the_live_slices(ray_session, ship_by_reference_bytes,
                                                            ship_piece_bytes):
    """Backups land on the chained peers, at the final epoch, and equal the live slices' state; also
    when every checkpoint travels through the object store as arrays (kept there as views), and
    when every shipment above 700 bytes travels in pieces the peer assembles. Frames received
    those ways are fetched back as arrays, with their carried outputs."""
    job = cs.run(running_sum(7), containers=3, checkpoint_every=2, full_checkpoint_every=3, backup_factor=2,
                 ship_by_reference_bytes=ship_by_reference_bytes, ship_piece_bytes=ship_piece_bytes)
    try:
        job.wait(timeout_s=120)
        expected = cs.run(running_sum(7), executor="serial")
        for sink in ("sums", "stats"):
            assert job.results(sink).to_pylist() == expected.results(sink).to_pylist()
        assert _check_backups_match_live_slices(job) == 2 * 2 * 7
        # Two hosts a stage and more on the others: every slice gets its two copies, and no warning.
        assert job.placement().backup_copies == {"payments": 2, "running_sum": 2, "stats": 2}
        assert not [e for e in job.timeline() if e[1] == "backups_short"]
        chain = ray.get(job.master.backup_plan.remote())
        handles = ray.get(job.master.container_handles.remote())
        last_epoch = job.plan.num_epochs - 1
        # Carried outputs shipped as an object-store array come back (as an array) and decode.
        sid = job.plan.stage("running_sum").stage_id
        p = chain[sid][0][0]
        sent = CarriedOutputs(sid, 0, last_epoch, last_epoch, False, {0: pa.table({"card": ["c"], "total": [5]})})
        assert ray.get(handles[p].receive_backups.remote(ray.put([np.frombuffer(encode_outputs(sent), np.uint8)]))) == []
        _data, outs = ray.get(handles[p].backup_bytes.remote(sid, 0, with_outputs=True))
        assert isinstance(outs[-1], np.ndarray)
        assert decode_outputs(from_wire(outs[-1])).tables[0].to_pylist() == [{"card": "c", "total": 5}]
    finally:
        job.stop()


def test_a_peer_that_misses_a_shipment_asks_for_a_full_checkpoint_and_its_backups_heal(ray_session):
    """Every host's next received frame (a checkpoint, or carried outputs) fails to be stored, once,
    as a shipment lost on its way: the sender logs it and goes on; the host then refuses the next delta of that slice (a gap
    in its chain), the slice's next checkpoint is a full one, and at the end every backup equals its
    live slice again. The output is the serial executor's."""

    def fail_next_put(host) -> None:
        # Ray calls the class's methods, so the failure goes one level down: the host's store.
        store = host.backup_store
        put = store.put
        host.puts_failed = 0

        def failing_once(data):
            if not host.puts_failed:
                host.puts_failed += 1
                raise RuntimeError("injected: a checkpoint shipment lost on its way")
            return put(data)

        store.put = failing_once

    job = cs.run(running_sum(7, n=10_000), containers=3, checkpoint_every=2, backup_factor=2, source_pace_s=0.1)
    try:
        hosts = list(ray.get(job.master.host_handles.remote()).values())
        ray.get([h.__ray_call__.remote(fail_next_put) for h in hosts])
        assert job.progress()["state"] == "running"  # the failures land mid-stream
        job.wait(timeout_s=180)
        failed = ray.get([h.__ray_call__.remote(lambda host: host.puts_failed) for h in hosts])
        assert set(failed) <= {0, 1} and sum(failed) >= 2  # (a host of the source stage may back up nothing)
        expected = cs.run(running_sum(7, n=10_000), executor="serial")
        for sink in ("sums", "stats"):
            assert job.results(sink).to_pylist() == expected.results(sink).to_pylist()
        assert _check_backups_match_live_slices(job) == 2 * 2 * 7
    finally:
        job.stop()


def _check_backups_match_live_slices(job: cs.Job, copies: int = 2) -> int:
    """Every slice's backups sit on the ``copies`` peers its chain names, at the last epoch, and hold
    the live slice's state, progress and sequence numbers. Returns how many backups were compared."""
    catalog = ray.get(job.master.backup_catalog.remote())
    chain = ray.get(job.master.backup_plan.remote())
    handles = ray.get(job.master.container_handles.remote())
    hosts = ray.get(job.master.host_handles.remote())  # (chains name hosts; after a scale-out not the containers' ids)
    placement = job.placement().stages
    last_epoch = job.plan.num_epochs - 1
    checked = 0
    for stage in ("running_sum", "stats"):
        sid = job.plan.stage(stage).stage_id
        owner = {s: int(c) for c, slices in placement[stage].items() for s in slices}
        for s, peers in chain[sid].items():
            holders = sorted(c for c, held in catalog.items() if (sid, s, last_epoch) in held)
            assert holders == sorted(peers) and len(peers) == copies, (stage, s, holders, peers)
            live = decode(from_wire(ray.get(handles[owner[s]].slice_snapshot.remote(s, owner[s]))))
            for p in peers:
                data, outs = ray.get(hosts[p].backup_bytes.remote(sid, s, with_outputs=True))
                backup = decode(from_wire(data))
                assert all(decode_outputs(from_wire(b)).slice_id == s for b in outs)
                assert backup.epoch == live.epoch == last_epoch
                assert backup.progress == live.progress and backup.next_seq == live.next_seq
                assert set(backup.state) == set(live.state)
                for name in live.state:
                    assert _state_of(backup.state[name]) == _state_of(live.state[name]), (stage, s, name)
                checked += 1
    return checked


def _state_of(part: dict):
    """Comparable content of a state part (kv: dict; table: rows by slot)."""
    from chronostream.slices.checkpoint import _kv_items, read_table_part

    if part["shape"] == "kv":
        keys, values, _ = _kv_items(part)
        return dict(zip(keys, values))
    return read_table_part(part).sort_by("slot").to_pylist()


def test_a_scale_out_gives_a_short_job_its_copies_and_every_stage_backs_up_where_the_master_says(ray_session):
    """Three one-host stages and factor 3 start with 2 copies a slice; a scale-out of one stage adds
    a host, and every stage's chains (not only the moved stage's) are re-planned over it: all get
    their 3 copies (``backups_restored``), on exactly the hosts ``backup_plan`` names, each holding
    the live slice's state at the end, and the output equals the serial run's."""

    q = running_sum(7)
    q.epoch_events = 25  # 100 epochs
    job = cs.run(q, containers=1, checkpoint_every=2, backup_factor=3)
    try:
        apply_schedule(job, [Fault("delay", 0, stage="payments", seconds=0.05),
                             Fault("scale_out", 20, stage="running_sum", n=1)])
        job.wait(timeout_s=120)
        assert job.placement().backup_copies == {"payments": 3, "running_sum": 3, "stats": 3}
        said = [(k, i["stage"], i["copies"]) for _, k, i in job.timeline() if k.startswith("backups_")]
        assert sorted(said[:3]) == [("backups_short", st, 2) for st in ("payments", "running_sum", "stats")]
        assert sorted(said[3:]) == [("backups_restored", st, 3) for st in ("payments", "running_sum", "stats")]
        assert _check_backups_match_live_slices(job, copies=3) == 2 * 3 * 7
        expected = cs.run(running_sum(7), executor="serial")
        for sink in ("sums", "stats"):
            assert job.results(sink).to_pylist() == expected.results(sink).to_pylist()
    finally:
        job.stop()


def test_a_job_with_too_few_hosts_for_its_backup_factor_says_how_many_copies_its_slices_get(ray_session):
    """Three stages of one host each cannot give a slice 3 copies on other hosts: the job runs with 2
    and says so at deploy (event ``backups_short`` per stage, a warning) and in
    ``placement().backup_copies``, instead of a user finding out when a third host dies."""
    job = cs.run(running_sum(5), containers=1, checkpoint_every=2, backup_factor=3)
    try:
        job.wait(timeout_s=120)
        assert job.placement().backup_copies == {"payments": 2, "running_sum": 2, "stats": 2}
        short = sorted((i["stage"], i["copies"], i["backup_factor"], i["hosts"])
                       for _, kind, i in job.timeline() if kind == "backups_short")
        assert short == [("payments", 2, 3, 3), ("running_sum", 2, 3, 3), ("stats", 2, 3, 3)]
        expected = cs.run(running_sum(5), executor="serial")
        assert job.results("sums").to_pylist() == expected.results("sums").to_pylist()
    finally:
        job.stop()
