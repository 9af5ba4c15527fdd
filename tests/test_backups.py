"""Chained backups: placement (paper III-B) and the backup store (replication buffer + lmdb).

Placement properties are checked with hypothesis over container counts,
slice counts and backup factors; the store is exercised on real lmdb.
"""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chronostream.containers.backup_store import MERGE_COUNT_CAP, MERGE_SHARE, BackupStore, should_merge
from chronostream.containers.routing import place_slices_evenly
from chronostream.master.backups import backup_plan, chained_backup_peers
from chronostream.slices.checkpoint import (CarriedOutputs, CheckpointCorrupt, SliceCheckpoint, decode_outputs, encode,
                               encode_outputs, read_table_part, table_part)


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


def big_full(epoch: int, n_slots: int) -> bytes:
    table = pa.table({"slot": pa.array(range(n_slots), pa.int64()), "v": pa.array(range(n_slots), pa.int64())})
    return encode(SliceCheckpoint(1, 4, epoch, "full", -1, {0: [epoch]}, {0: 0}, {"t": table_part(table)}))


def small_delta(epoch: int) -> bytes:
    table = pa.table({"slot": pa.array([epoch], pa.int64()), "v": pa.array([-epoch], pa.int64())})
    return encode(SliceCheckpoint(1, 4, epoch, "delta", epoch - 1, {0: [epoch]}, {0: epoch}, {"t": table_part(table)}))


def test_many_small_deltas_of_a_large_state_are_not_merged_until_they_weigh_a_quarter_of_it(tmp_path):
    """A merge rewrites the whole state: past merge_every deltas it waits until they weigh
    MERGE_SHARE of the full checkpoint (a count alone rewrote a 1 GB slice every 13 s)."""
    store = BackupStore(tmp_path, merge_every=32)
    store.put(big_full(0, 20_000))
    full = len(store.chains[(1, 4)][0])
    epoch = 0
    while sum(len(d) for d in store.chains[(1, 4)][1:]) + 2_000 < MERGE_SHARE * full:
        epoch += 1
        store.put(small_delta(epoch))
        assert len(store.chains[(1, 4)]) == epoch + 1, f"merged after {epoch} deltas"
    assert epoch > 32  # past merge_every, below the count cap
    while len(store.chains[(1, 4)]) > 1:
        epoch += 1
        store.put(small_delta(epoch))
    latest = store.latest(1, 4)
    assert latest.epoch == epoch and latest.next_seq == {0: epoch}
    merged = read_table_part(latest.state["t"]).sort_by("slot")
    assert merged["v"].to_pylist() == [0] + [-k for k in range(1, epoch + 1)] + list(range(epoch + 1, 20_000))


def test_a_chain_is_merged_past_the_count_cap_whatever_its_deltas_weigh():
    assert not should_merge(10**9, [100] * (MERGE_COUNT_CAP * 16), 16)
    assert should_merge(10**9, [100] * (MERGE_COUNT_CAP * 16 + 1), 16)


def outputs(from_epoch: int, epoch: int, replace: bool) -> bytes:
    rows = pa.table({"x": pa.array(range(from_epoch, epoch + 1), pa.int64())})
    return encode_outputs(CarriedOutputs(1, 4, from_epoch, epoch, replace, {0: rows}))


def test_a_full_checkpoint_replaces_the_carried_outputs_held_for_its_slice(tmp_path):
    """A full checkpoint starts a new chain; the outputs carried with the old one go with it, and the
    frames that follow it (its own carried outputs, or a restored chain's) are what is held."""
    store = BackupStore(tmp_path)
    store.put(ckpt(3, "full", -1, 30))
    store.put(outputs(0, 3, True))
    store.put(ckpt(5, "delta", 3, 50))
    store.put(outputs(4, 5, False))
    assert len(store.carried_outputs(1, 4)) == 2
    store.put(ckpt(8, "full", -1, 80))
    assert store.carried_outputs(1, 4) == []
    store.put(outputs(6, 8, False))
    assert [decode_outputs(b).from_epoch for b in store.carried_outputs(1, 4)] == [6]


def test_a_restore_point_is_the_merged_chain_its_outputs_and_the_frames_that_rebuild_both(tmp_path):
    """The seed of a restored slice, put into an empty store, gives the same restore point."""
    store = BackupStore(tmp_path / "a")
    frames = [ckpt(3, "full", -1, 30), outputs(0, 3, True), ckpt(5, "delta", 3, 50), outputs(4, 5, False)]
    for f in frames:
        store.put(f)
    latest, outs, seed = store.restore_point(1, 4)
    assert (latest.epoch, latest.next_seq) == (5, {0: 50})
    assert outs == [frames[1], frames[3]]
    other = BackupStore(tmp_path / "b")
    other.put(ckpt(9, "full", -1, 90))
    other.put(outputs(0, 9, True))
    for f in seed:
        assert other.put(f) is None
    again, outs_again, _ = other.restore_point(1, 4)
    assert (again.epoch, again.next_seq, outs_again) == (5, {0: 50}, outs)


def test_a_dropped_slice_leaves_no_checkpoint_nor_carried_output_in_memory_or_after_a_reopen(tmp_path):
    store = BackupStore(tmp_path)
    for f in (ckpt(3, "full", -1, 30), outputs(0, 3, True), ckpt(5, "delta", 3, 50), outputs(4, 5, False)):
        store.put(f)
    store.flush()
    assert store.drop(1, 4) is True
    assert (store.holds(), store.carried_outputs(1, 4), store.size(1, 4), store.epochs()) == ([], [], 0, {})
    assert store.drop(1, 4) is False, "a second drop finds nothing to forget"
    store.close()
    again = BackupStore(tmp_path)
    assert (again.holds(), again.carried_outputs(1, 4)) == ([], [])


def output_keys(store: BackupStore) -> list[bytes]:
    with store.env.begin() as txn:
        return [k for k, _ in txn.cursor() if k.startswith(b"out:")]


def test_carried_outputs_are_persisted_a_frame_at_a_time_and_a_trim_deletes_only_the_trimmed(tmp_path, monkeypatch):
    """A flush writes the carried-outputs frames that arrived since the last one, each under its own
    key and never again (rewriting a slice's outputs whole copied them at every flush); a trim
    deletes the trimmed frames' keys; a reopened store holds what is left, in order."""
    import chronostream.containers.backup_store as backup_store

    store = BackupStore(tmp_path)
    store.put(ckpt(3, "full", -1, 30))
    store.put(outputs(0, 3, True))
    store.flush()
    written: list[bytes] = []
    real_put_all = backup_store.put_all

    def put_all(env, items, *args):
        items = list(items)
        written.extend(k for k, _ in items)
        return real_put_all(env, items, *args)
    monkeypatch.setattr(backup_store, "put_all", put_all)
    for e in (5, 7, 9):
        store.put(ckpt(e, "delta", e - 2, e * 10))
        store.put(outputs(e - 1, e, False))
    store.flush()
    assert [k for k in written if k.startswith(b"out:")] == output_keys(store)[1:], "only the new frames are written"
    assert store.trim_outputs(1, 5) == 2
    store.flush()
    assert [k.split(b":")[-2:] for k in output_keys(store)] == [[b"6", b"7"], [b"8", b"9"]]
    store.close()
    again = BackupStore(tmp_path)
    assert [(o.from_epoch, o.epoch) for o in map(decode_outputs, again.carried_outputs(1, 4))] == [(6, 7), (8, 9)]
    again.put(outputs(10, 11, False))
    again.flush()
    assert [k.split(b":")[-2:] for k in output_keys(again)] == [[b"6", b"7"], [b"8", b"9"], [b"10", b"11"]]


def test_replaced_carried_outputs_leave_no_old_frame_in_lmdb(tmp_path):
    """Outputs that start afresh (``replace``, or a new full checkpoint) delete the persisted ones."""
    store = BackupStore(tmp_path)
    store.put(ckpt(3, "full", -1, 30))
    store.put(outputs(0, 3, True))
    store.put(ckpt(5, "delta", 3, 50))
    store.put(outputs(4, 5, False))
    store.flush()
    assert len(output_keys(store)) == 2
    store.put(outputs(0, 7, True))
    store.flush()
    assert [k.split(b":")[-2:] for k in output_keys(store)] == [[b"0", b"7"]]
    store.put(ckpt(9, "full", -1, 90))
    store.put(outputs(8, 9, False))
    store.flush()
    assert [k.split(b":")[-2:] for k in output_keys(store)] == [[b"8", b"9"]]
    store.close()
    assert [decode_outputs(b).epoch for b in BackupStore(tmp_path).carried_outputs(1, 4)] == [9]


def test_carried_outputs_written_whole_per_slice_still_open_and_are_rewritten_a_frame_per_key(tmp_path):
    import lmdb
    import msgpack

    env = lmdb.open(str(tmp_path))
    with env.begin(write=True) as txn:
        txn.put(b"1:4:00000000", ckpt(3, "full", -1, 30))
        txn.put(b"out:1:4", msgpack.packb([[0, 3, outputs(0, 3, True)]], use_bin_type=True))
    env.close()
    store = BackupStore(tmp_path)
    assert [decode_outputs(b).epoch for b in store.carried_outputs(1, 4)] == [3]
    store.put(outputs(4, 5, False))
    store.flush()
    assert [k.split(b":")[-2:] for k in output_keys(store)] == [[b"0", b"3"], [b"4", b"5"]]
    store.close()
    assert [decode_outputs(b).epoch for b in BackupStore(tmp_path).carried_outputs(1, 4)] == [3, 5]


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


def resident_bytes(path) -> int:
    """Bytes of a file held in the OS page cache (mincore over a read-only map of it; Linux)."""
    import ctypes
    import mmap
    import os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    vec = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec) * mmap.PAGESIZE


def test_a_flush_past_the_release_size_leaves_the_written_pages_out_of_the_page_cache(tmp_path, monkeypatch):
    """The chains are held in memory: their lmdb copy must not also hold page-cache memory."""
    monkeypatch.setattr("chronostream.containers.backup_store.RELEASE_PAGES_BYTES", 1 << 40)
    kept = BackupStore(tmp_path / "kept")
    kept.put(big_full(0, 400_000))  # 6.4 MB of slots and values
    kept.flush()
    monkeypatch.setattr("chronostream.containers.backup_store.RELEASE_PAGES_BYTES", 1 << 20)
    dropped = BackupStore(tmp_path / "dropped")
    dropped.put(big_full(0, 400_000))
    dropped.flush()
    assert resident_bytes(tmp_path / "kept" / "data.mdb") > 4_000_000  # the check can see written pages
    assert resident_bytes(tmp_path / "dropped" / "data.mdb") < 1_000_000
    dropped.close(flush=False)
    assert BackupStore(tmp_path / "dropped").latest(1, 4).epoch == 0  # what was dropped was on disk


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

    store = BackupStore(tmp_path)
    store.put(ckpt(3, "full", -1, 30))
    store.flush()
    store.close()
    import lmdb

    env = lmdb.open(str(tmp_path))
    with env.begin(write=True) as txn:
        full = txn.get(b"1:4:00000000")
        txn.put(b"1:4:00000000", full[:-2] + b"!!")
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


@pytest.mark.parametrize("streamed", [False, True], ids=["folded in a dict", "streamed"])
@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 30), st.integers(-5, 5)), max_size=12), min_size=1, max_size=6),
       st.lists(st.lists(st.tuples(st.integers(0, 20), st.one_of(st.none(), st.integers(-1000, 1000))), max_size=8),
                min_size=1, max_size=6))
def test_a_whole_chain_folds_into_the_state_its_deltas_describe(streamed, table_writes, kv_writes):
    """merge_chain (one fold per state part for the whole chain) gives what applying the deltas one
    by one means: per slot the last row written; per key the last value, or gone if deleted. Both
    ways a kv part folds: in one dict, and streamed (a full part above ``STREAM_PART_BYTES``)."""
    import pyarrow as pa

    from chronostream.slices import checkpoint
    from chronostream.slices.checkpoint import _pack, merge_chain, read_table_part, table_part

    saved = checkpoint.STREAM_PART_BYTES
    checkpoint.STREAM_PART_BYTES = -1 if streamed else saved

    def table(rows):
        return table_part(pa.table({"slot": pa.array([s for s, _ in rows], pa.int64()),
                                    "v": pa.array([v for _, v in rows], pa.int64())}))

    def kv(pairs):
        sets = {k: v for k, v in pairs if v is not None}
        dels = [k for k, v in pairs if v is None and k not in sets]
        return {"shape": "kv", "keys": _pack(list(sets)), "values": _pack(list(sets.values())), "deleted": _pack(dels)}

    parts = [{"t": table(sorted(dict(table_writes[0]).items())), "m": kv(kv_writes[0])}]
    parts += [{"t": table(w), "m": kv(k)} for w, k in zip(table_writes[1:], kv_writes[1:] + [[]] * 6)]
    base = SliceCheckpoint(1, 2, 0, "full", -1, {}, {0: 0}, parts[0])
    deltas = [SliceCheckpoint(1, 2, i, "delta", i - 1, {}, {0: i}, p) for i, p in enumerate(parts[1:], start=1)]
    try:
        merged = merge_chain(base, deltas)
    finally:
        checkpoint.STREAM_PART_BYTES = saved
    want_t: dict = {}
    want_m: dict = {}
    for i, p in enumerate(parts):
        want_t.update(table_writes[i] if i else sorted(dict(table_writes[0]).items()))
        for k, v in (kv_writes + [[]] * 6)[i]:
            if v is None:
                want_m.pop(k, None)
        want_m.update({k: v for k, v in (kv_writes + [[]] * 6)[i] if v is not None})
    got_t = read_table_part(merged.state["t"])
    assert list(zip(got_t["slot"].to_pylist(), got_t["v"].to_pylist())) == sorted(want_t.items())
    import msgpack
    keys = msgpack.unpackb(merged.state["m"]["keys"], raw=False)
    values = msgpack.unpackb(merged.state["m"]["values"], raw=False, strict_map_key=False)
    assert dict(zip(keys, values)) == want_m and len(keys) == len(want_m), "each key once"
    assert merged.kind == "full" and merged.epoch == len(parts) - 1 and merged.next_seq == {0: len(parts) - 1}


@pytest.mark.parametrize("offset", [0, 10**12], ids=["dense slots", "sparse slots"])
def test_folding_table_parts_keeps_the_last_row_per_slot_in_slot_order(offset):
    """Both fold paths (a slot-indexed winner array for dense slots, a sort for sparse ones) keep
    each slot's last write, in slot order."""
    import numpy as np
    import pyarrow as pa

    from chronostream.slices.checkpoint import _merge_table, read_table_part, table_part

    rng = np.random.default_rng(5)
    parts, want = [], {}
    for i in range(4):
        slots = rng.choice(1000, 300 if i else 1000, replace=False) + offset
        vals = rng.integers(0, 10**6, len(slots))
        want.update(zip(slots.tolist(), vals.tolist()))
        parts.append(table_part(pa.table({"slot": pa.array(slots, pa.int64()), "v": pa.array(vals, pa.int64())})))
    got = read_table_part(_merge_table(parts))
    assert list(zip(got["slot"].to_pylist(), got["v"].to_pylist())) == sorted(want.items())


def _slot_table(slots, **cols):
    import pyarrow as pa

    return pa.table({"slot": pa.array(slots, pa.int64()), **{k: pa.array(v) for k, v in cols.items()}})


def test_a_chain_on_a_dense_base_folds_by_copy_and_scatter_with_the_general_folds_result():
    """A full checkpoint holding slots 0..n-1 in order, deltas rewriting old slots (one slot in
    several deltas) and adding new ones: the copy-and-scatter fold runs and gives the rows the
    general fold (concat and take) gives."""
    import numpy as np

    from chronostream.slices import checkpoint as codec
    from chronostream.slices.checkpoint import _merge_table, read_table_part, table_part

    rng = np.random.default_rng(11)
    n = 5000
    tables = [_slot_table(np.arange(n), v=rng.integers(0, 99, n), f=rng.random(n))]
    top = n
    for _ in range(6):
        old = rng.choice(top, 400, replace=False)
        new = np.arange(top, top + 50)
        top += 50
        slots = np.concatenate([old, [7], new])
        tables.append(_slot_table(slots, v=rng.integers(0, 99, len(slots)), f=rng.random(len(slots))))
    assert codec._fold_onto_dense_base(tables[0], tables[1:]) is not None
    got = read_table_part(_merge_table([table_part(t) for t in tables]))
    want = {}
    for t in tables:
        for s, v, f in zip(*(t[c].to_pylist() for c in ("slot", "v", "f"))):
            want[s] = (v, f)
    assert got["slot"].to_pylist() == list(range(top))
    assert list(zip(got["v"].to_pylist(), got["f"].to_pylist())) == [want[s] for s in range(top)]


@pytest.mark.parametrize("case", ["base out of order", "gap in new slots", "null in a delta",
                                  "column added by a delta", "string column"])
def test_a_chain_the_dense_fold_cannot_take_is_folded_by_the_general_path(case):
    """Shapes outside the copy-and-scatter fold (its answer None) still fold to the last write per slot."""
    import numpy as np
    import pyarrow as pa

    from chronostream.slices import checkpoint as codec
    from chronostream.slices.checkpoint import _merge_table, read_table_part, table_part

    base_slots = np.arange(10)[::-1] if case == "base out of order" else np.arange(10)
    base = _slot_table(base_slots, v=np.arange(10) * 10)
    delta_slots = [3, 12] if case == "gap in new slots" else [3, 10]
    if case == "null in a delta":
        delta = pa.table({"slot": pa.array(delta_slots, pa.int64()), "v": pa.array([None, 5], pa.int64())})
    elif case == "column added by a delta":
        delta = _slot_table(delta_slots, v=[1, 5], w=[8, 9])
    elif case == "string column":
        base = _slot_table(base_slots, v=[str(i * 10) for i in range(10)])
        delta = _slot_table(delta_slots, v=["1", "5"])
    else:
        delta = _slot_table(delta_slots, v=[1, 5])
    assert codec._fold_onto_dense_base(base, [delta]) is None
    got = read_table_part(_merge_table([table_part(base), table_part(delta)]))
    want = dict(zip(base["slot"].to_pylist(), base["v"].to_pylist()))
    want.update(zip(delta["slot"].to_pylist(), delta["v"].to_pylist()))
    assert list(zip(got["slot"].to_pylist(), got["v"].to_pylist())) == sorted(want.items())


def test_a_growing_chain_is_persisted_entry_by_entry_and_reopens_whole(tmp_path):
    """flush() writes only the deltas that arrived since the last flush (the full checkpoint once);
    after a merge or a new full checkpoint the old entries go; a reopened store has the chain."""
    import pyarrow as pa

    from chronostream.slices.checkpoint import table_part

    big = table_part(pa.table({"slot": pa.array(range(60), pa.int64())}))  # 3 deltas weigh less, 4 a quarter
    store = BackupStore(tmp_path, merge_every=3)
    store.put(encode(SliceCheckpoint(1, 4, 0, "full", -1, {0: [0]}, {0: 0}, {"t": big})))
    store.flush()
    with store.env.begin() as txn:
        full_bytes = txn.get(b"1:4:00000000")
    for e in range(1, 4):
        store.put(ckpt(e, "delta", e - 1, e * 10))
        store.flush()
    with store.env.begin() as txn:
        keys = [k for k, _ in txn.cursor()]
        assert txn.get(b"1:4:00000000") == full_bytes  # the full one was not rewritten
    assert keys == [b"1:4:%08d" % i for i in range(4)]
    store.put(ckpt(4, "delta", 3, 40))  # a fourth delta: merged into a new full checkpoint
    store.flush()
    with store.env.begin() as txn:
        assert [k for k, _ in txn.cursor()] == [b"1:4:00000000"]
    store.put(ckpt(5, "delta", 4, 50))
    store.close()
    again = BackupStore(tmp_path)
    assert len(again.chains[(1, 4)]) == 2 and again.latest(1, 4).next_seq == {0: 50}
    again.drop(1, 4)
    with again.env.begin() as txn:
        assert [k for k, _ in txn.cursor()] == []


def test_a_store_written_a_whole_chain_per_key_still_opens(tmp_path):
    """Stores written before per-entry keys (one msgpack list per slice) are read, and rewritten in
    the new layout at the next flush."""
    import lmdb
    import msgpack

    env = lmdb.open(str(tmp_path))
    with env.begin(write=True) as txn:
        txn.put(b"1:4", msgpack.packb([ckpt(3, "full", -1, 30), ckpt(4, "delta", 3, 40)], use_bin_type=True))
    env.close()
    store = BackupStore(tmp_path)
    assert store.latest(1, 4).next_seq == {0: 40}
    store.put(ckpt(5, "delta", 4, 50))
    store.flush()
    n = len(store.chains[(1, 4)])
    with store.env.begin() as txn:
        assert [k for k, _ in txn.cursor()] == [b"1:4:%08d" % i for i in range(n)]
    store.close()
    assert BackupStore(tmp_path).latest(1, 4).next_seq == {0: 50}


def as_object_store_view(frame: bytes) -> memoryview:
    """What a large shipment arrives as: a read-only uint8 array in Ray's object store, viewed in place."""
    import numpy as np

    return memoryview(np.frombuffer(frame, np.uint8))


def test_frames_received_as_object_store_views_are_kept_merged_flushed_and_reopened(tmp_path):
    """Large checkpoints and carried outputs arrive as read-only array views (not bytes): the store
    verifies, chains, merges, persists and restores them like bytes."""
    import pyarrow as pa

    from chronostream.slices.checkpoint import CarriedOutputs, decode_outputs, encode_outputs

    store = BackupStore(tmp_path, merge_every=2)
    assert store.put(as_object_store_view(ckpt(0, "full", -1, 0))) is None
    for e in range(1, 4):
        assert store.put(as_object_store_view(ckpt(e, "delta", e - 1, e * 10))) is None
    out = CarriedOutputs(1, 4, 0, 3, True, {7: pa.table({"x": [1, 2]})})
    assert store.put(as_object_store_view(encode_outputs(out))) is None
    assert store.latest(1, 4).next_seq == {0: 30}
    assert store.flush() == 1
    store.close(flush=False)
    reopened = BackupStore(tmp_path)
    assert (reopened.latest(1, 4).epoch, reopened.latest(1, 4).next_seq) == (3, {0: 30})
    [frame] = reopened.carried_outputs(1, 4)
    assert decode_outputs(frame).tables[7].to_pylist() == [{"x": 1}, {"x": 2}]


def test_a_damaged_frame_received_as_a_view_is_refused(tmp_path):
    frame = bytearray(ckpt(2, "full", -1, 5))
    frame[len(frame) // 2] ^= 0xFF
    with pytest.raises(CheckpointCorrupt, match="checksum"):
        BackupStore(tmp_path).put(as_object_store_view(bytes(frame)))
