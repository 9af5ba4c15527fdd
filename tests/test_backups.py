"""Chained backups: placement (paper III-B) and the backup store (replication buffer + lmdb).

Placement properties are checked with hypothesis over container counts,
slice counts and backup factors; the store is exercised on real lmdb.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from containers.backup_store import BackupStore
from containers.routing import place_slices_evenly
from master.backups import backup_plan, chained_backup_peers
from slices.checkpoint import CheckpointCorrupt, SliceCheckpoint, encode


def stage_layout(n_containers: int, n_slices: int):
    containers = list(range(100, 100 + n_containers))
    owner = place_slices_evenly(n_slices, containers)
    return containers, {c: [s for s in range(n_slices) if owner[s] == c] for c in containers}


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 64), st.integers(0, 3))
def test_backups_never_land_on_the_owner_and_never_twice_on_one_peer(n_containers, n_slices, factor):
    """Each slice gets min(L, N-1) backups on distinct peers, none on its own container."""
    containers, slices_of = stage_layout(n_containers, n_slices)
    plan = backup_plan(containers, slices_of, factor)
    for c, mine in slices_of.items():
        for s in mine:
            assert c not in plan[s]
            assert len(plan[s]) == len(set(plan[s])) == min(factor, n_containers - 1)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 8), st.integers(1, 64), st.integers(1, 3))
def test_a_containers_backups_spread_over_all_its_peers(n_containers, n_slices, factor):
    """The chain spreads one container's backups over its peers: every peer gets a share
    once there are enough slices (M + L - 1 >= N), and loads differ by at most L."""
    containers, slices_of = stage_layout(n_containers, n_slices)
    plan = backup_plan(containers, slices_of, factor)
    for c, mine in slices_of.items():
        load = Counter(p for s in mine for p in plan[s])
        peers = [p for p in containers if p != c]
        counts = [load.get(p, 0) for p in peers]
        l_eff = min(factor, len(peers))
        assert max(counts) - min(counts) <= l_eff
        if len(mine) + l_eff - 1 >= len(peers):
            assert min(counts) >= 1


def test_chain_matches_the_paper_formula():
    """The l-th backup of the m-th slice goes to peer (m + l) mod N."""
    peers = [7, 8, 9, 10]
    for m in range(6):
        assert chained_backup_peers(m, peers, 3) == [peers[(m + l) % 4] for l in (1, 2, 3)]


def ckpt(epoch: int, kind: str, prev: int, n: int) -> bytes:
    return encode(SliceCheckpoint(1, 4, epoch, kind, prev, {0: [epoch]}, {0: n}, {}))


def test_store_merges_long_delta_chains(tmp_path):
    """Past merge_every deltas the chain is folded into one full checkpoint; latest() is unchanged."""
    store = BackupStore(tmp_path, merge_every=2)
    store.put(ckpt(0, "full", -1, 0))
    for e in range(1, 6):
        store.put(ckpt(e, "delta", e - 1, e * 10))
    assert len(store.chains[(1, 4)]) <= 3
    latest = store.latest(1, 4)
    assert (latest.epoch, latest.next_seq, latest.progress) == (5, {0: 50}, {0: [5]})


def test_store_persists_lazily_and_survives_a_reopen(tmp_path):
    """Backups live in memory until flush(); after it, a new store on the same path has them."""
    store = BackupStore(tmp_path / "a")
    store.put(ckpt(3, "full", -1, 30))
    store.close(flush=False)  # a crash before the lazy flush: the buffer is gone
    assert BackupStore(tmp_path / "a").holds() == []
    store = BackupStore(tmp_path / "b")
    store.put(ckpt(3, "full", -1, 30))
    assert store.flush() == 1
    store.close(flush=False)
    assert BackupStore(tmp_path / "b").latest(1, 4).epoch == 3


def test_store_refuses_a_delta_that_does_not_continue_the_chain(tmp_path):
    """A delta on an epoch the chain does not end at is refused; put() names the slice that needs a full one."""
    store = BackupStore(tmp_path)
    assert store.put(ckpt(3, "full", -1, 30)) is None
    assert store.put(ckpt(6, "delta", 5, 60)) == (1, 4)
    assert store.latest(1, 4).epoch == 3, "the chain held is kept as it was"
    assert store.put(ckpt(6, "full", -1, 60)) is None
    assert store.latest(1, 4).epoch == 6


def test_a_chain_found_damaged_at_merge_refuses_deltas_until_a_full_checkpoint_heals_it(tmp_path):
    """Bit rot in a held delta is found when the chain is merged: no exception reaches the
    sender; every later delta is answered with "send a full one", and a full one repairs the chain."""
    store = BackupStore(tmp_path, merge_every=2)
    store.put(ckpt(0, "full", -1, 1))
    store.put(ckpt(1, "delta", 0, 2))
    store.corrupt(1, 4)  # damages the newest link (epoch 1) in memory and lmdb
    store.put(ckpt(2, "delta", 1, 3))
    assert store.put(ckpt(3, "delta", 2, 4)) == (1, 4), "the merge found the damage"
    assert store.put(ckpt(4, "delta", 3, 5)) == (1, 4), "deltas are refused while the chain is damaged"
    with pytest.raises(CheckpointCorrupt):
        store.latest(1, 4)
    assert store.put(ckpt(5, "full", -1, 6)) is None
    assert store.latest(1, 4).next_seq == {0: 6}
    assert store.put(ckpt(6, "delta", 5, 7)) is None


def test_store_detects_a_corrupted_backup_on_restore(tmp_path):
    """A backup damaged at rest (in lmdb) raises CheckpointCorrupt naming slice and epoch."""
    import msgpack

    store = BackupStore(tmp_path)
    store.put(ckpt(3, "full", -1, 30))
    store.flush()
    store.close()
    import lmdb

    env = lmdb.open(str(tmp_path))
    with env.begin(write=True) as txn:
        chain = msgpack.unpackb(txn.get(b"1:4"), raw=False)
        chain[0] = chain[0][:-2] + b"!!"
        txn.put(b"1:4", msgpack.packb(chain, use_bin_type=True))
    env.close()
    with pytest.raises(CheckpointCorrupt, match="stage 1 slice 4 epoch 3"):
        BackupStore(tmp_path).latest(1, 4)


def test_store_refuses_a_damaged_incoming_backup(tmp_path):
    """A checkpoint torn in transit is refused at put(), before it can replace a good one."""
    store = BackupStore(tmp_path)
    store.put(ckpt(3, "full", -1, 30))
    with pytest.raises(CheckpointCorrupt):
        store.put(ckpt(4, "full", -1, 40)[:-5])
    assert store.latest(1, 4).epoch == 3
