"""Slice checkpoints: the codec refuses damage, deltas merge to the full state, restore replays exactly.

Method: property tests on the codec and on delta merging over random
mutation sequences; then real slices of the acceptance queries are run
epoch by epoch (in-process containers), checkpointed (a full one, then
deltas), restored into fresh slices from the merged chain, and fed the
remaining epochs: their outputs must equal the uninterrupted slices',
row for row and out_seq for out_seq.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chronostream.dag import compile_query
from chronostream.slices.state import KeyValueState
from chronostream.containers.backup_store import BackupStore
from chronostream.master.local import build_cores
from chronostream.master.placement import containers_per_stage, initial_placement
from queries import QUERIES
from chronostream.slices.checkpoint import (CheckpointCorrupt, SliceCheckpoint, capture, capture_kv, decode, encode, merge,
                               restore, restore_kv)
from chronostream.slices.slice import SliceRuntime

keys = st.one_of(st.text(max_size=5), st.integers(-5, 50), st.tuples(st.text(max_size=3), st.integers(0, 9)))
values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False),
                                st.text(max_size=8)),
                      lambda inner: st.one_of(st.lists(inner, max_size=4),
                                              st.dictionaries(st.text(max_size=4), inner, max_size=4)),
                      max_leaves=8)


def kv_checkpoint(state: KeyValueState, epoch: int, delta: bool, prev: int) -> SliceCheckpoint:
    return SliceCheckpoint(0, 0, epoch, "delta" if delta else "full", prev if delta else -1, {}, {},
                           {"s": capture_kv(state, delta)})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), keys, values), max_size=60), st.integers(1, 6), st.randoms())
def test_full_checkpoint_plus_deltas_equals_the_final_state(ops, n_ckpts, rnd):
    """Merging a full checkpoint with the deltas taken after it restores exactly the final state."""
    state = KeyValueState("s")
    cuts = sorted(rnd.sample(range(len(ops) + 1), min(n_ckpts, len(ops) + 1)))
    chain: list[SliceCheckpoint] = []
    done = 0
    for epoch, cut in enumerate(cuts + [len(ops)]):
        for is_set, k, v in ops[done:cut]:
            state.set(k, v) if is_set else state.delete(k)
        done = cut
        ckpt = kv_checkpoint(state, epoch, bool(chain), chain[-1].epoch if chain else -1)
        state.clear_dirty()
        chain.append(decode(encode(ckpt)))
    full = chain[0]
    for d in chain[1:]:
        full = merge(full, d)
    rebuilt = KeyValueState("s")
    restore_kv(rebuilt, full.state["s"])
    assert rebuilt.snapshot() == {k: v for k, v in state.snapshot().items()}


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(keys, values, max_size=20), st.data())
def test_any_damaged_checkpoint_is_refused(contents, data):
    """Flipping any byte or truncating a checkpoint makes decode raise CheckpointCorrupt."""
    state = KeyValueState("s")
    for k, v in contents.items():
        state.set(k, v)
    raw = encode(kv_checkpoint(state, 7, False, -1))
    assert decode(raw).epoch == 7
    i = data.draw(st.integers(0, len(raw) - 1))
    flipped = bytearray(raw)
    flipped[i] ^= 0x5A
    with pytest.raises(CheckpointCorrupt):
        decode(bytes(flipped))
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(CheckpointCorrupt):
        decode(raw[:cut])


binaries = st.one_of(st.binary(max_size=40), st.integers(0, 3).map(lambda i: bytes([i]) * (65_530 + 4 * i)))
bodies = st.recursive(st.one_of(st.none(), st.integers(-2**40, 2**40), st.text(max_size=6), binaries),
                      lambda inner: st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=10)


def _as_bytes(obj):
    if isinstance(obj, dict):
        return {k: _as_bytes(v) for k, v in obj.items()}
    return bytes(obj) if isinstance(obj, memoryview) else obj


def _leaves(obj):
    if isinstance(obj, dict):
        return [v for x in obj.values() for v in _leaves(x)]
    return [obj]


@settings(max_examples=60, deadline=None)
@given(bodies)
def test_large_binaries_come_back_as_views_of_the_frame_and_the_rest_as_msgpack(body):
    """Binaries above 64 KiB travel after the msgpack body and decode as views of the frame (no
    copy held under the GIL); everything else decodes to what was framed."""
    from chronostream.slices.checkpoint import MAGIC, _BIG, _frame, _unframe, _unpack_payload

    frame = _frame(MAGIC, {"v": 2}, body)
    header, payload = _unframe(frame, MAGIC, "test")
    got = _unpack_payload(header, payload, "test")
    assert _as_bytes(got) == body
    views = [v for v in _leaves(got) if isinstance(v, memoryview)]
    assert all(v.obj is frame for v in views)
    big = [b for b in _leaves(body) if isinstance(b, bytes) and len(b) > _BIG]
    assert len(views) == len(header["attached"]) == len(big)


def test_an_attachment_the_header_does_not_describe_is_refused():
    """A frame whose checksum holds but whose attachment sizes disagree with its body is refused
    (a writer bug, not transit damage), naming what it is."""
    import struct
    import zlib

    import msgpack

    from chronostream.slices.checkpoint import MAGIC, _frame

    frame = bytes(_frame(MAGIC, {"v": 2, "stage": 1, "slice": 2, "epoch": 3, "kind": "full", "prev": -1},
                         {"progress": {}, "next_seq": {}, "state": {"t": {"shape": "table", "ipc": b"x" * 70_000}},
                          "outputs": {}}))
    (hlen,) = struct.unpack(">I", frame[4:8])
    header = msgpack.unpackb(frame[8:8 + hlen])
    header["attached"] = [60_000, 10_000]
    hb = msgpack.packb(header, use_bin_type=True)
    body = frame[:4] + struct.pack(">I", len(hb)) + hb + frame[8 + hlen:-4]
    with pytest.raises(CheckpointCorrupt, match="attachment 0 of 70000 bytes"):
        decode(body + struct.pack(">I", zlib.crc32(body)))


def test_a_frame_written_by_the_previous_codec_still_decodes():
    """Frames written before the one-pass codec (payload CRC in the header, msgpack-packed payload)
    still decode; damage to their payload is still refused."""
    import struct
    import zlib

    import msgpack
    import pyarrow as pa

    from chronostream.slices.checkpoint import read_table_part, table_part

    table = pa.table({"slot": pa.array(range(5000), pa.int64()), "v": pa.array(range(5000), pa.float64())})
    payload = msgpack.packb({"progress": {"0": [4, 5]}, "next_seq": {"0": 9},
                             "state": {"t": {"shape": "table", "ipc": bytes(table_part(table)["ipc"])}},
                             "outputs": {}}, use_bin_type=True)
    hb = msgpack.packb({"v": 1, "stage": 1, "slice": 2, "epoch": 6, "kind": "full", "prev": -1,
                        "len": len(payload), "crc": zlib.crc32(payload)}, use_bin_type=True)
    body = b"CSCK" + struct.pack(">I", len(hb)) + hb + payload
    old = body + struct.pack(">I", zlib.crc32(body))
    ckpt = decode(old)
    assert (ckpt.epoch, ckpt.progress, ckpt.next_seq) == (6, {0: [4, 5]}, {0: 9})
    assert read_table_part(ckpt.state["t"]).equals(table)
    assert decode(encode(ckpt)).epoch == 6  # and re-encodes in the new framing
    damaged = bytearray(old)
    damaged[len(old) // 2] ^= 1
    with pytest.raises(CheckpointCorrupt, match="stage 1 slice 2 epoch 6"):
        decode(bytes(damaged))


def _encoded_large_and_joined(ckpt):
    """``ckpt`` encoded as a large frame (asserted to take the numpy-buffer path) and, with that
    path turned off, by the small-frame join."""
    import chronostream.slices.checkpoint as codec

    large = encode(ckpt)
    assert isinstance(large, memoryview) and large.nbytes > codec._BIG_FRAME
    small_limit, codec._BIG_FRAME = codec._BIG_FRAME, 1 << 40
    try:
        return large, encode(ckpt)
    finally:
        codec._BIG_FRAME = small_limit


def test_a_frame_above_8_mb_is_a_view_with_the_bytes_a_join_would_give():
    """Large frames are assembled in a numpy buffer (no GIL-held join); the bytes are the same
    as the small-frame path's, they decode, and damage is still refused."""
    import numpy as np
    import pyarrow as pa

    from chronostream.slices.checkpoint import frozen_table_part, read_table_part, verify

    n = 1_200_000  # 2 int64 columns: about 19 MB
    table = pa.table({"slot": pa.array(np.arange(n)), "v": pa.array(np.arange(n) * 3)})
    ckpt = SliceCheckpoint(1, 2, 9, "full", -1, {0: [7]}, {0: 3}, {"t": frozen_table_part(table)})
    big, joined = _encoded_large_and_joined(ckpt)
    assert isinstance(joined, bytes) and bytes(big) == joined
    assert verify(big)["epoch"] == 9
    assert read_table_part(decode(big).state["t"]).equals(table)
    damaged = bytearray(big)
    damaged[len(damaged) // 2] ^= 1
    with pytest.raises(CheckpointCorrupt, match="checksum"):
        decode(memoryview(np.frombuffer(bytes(damaged), np.uint8)))


def test_a_large_frame_mixing_tables_written_in_place_and_raw_attachments_equals_the_joined_frame():
    """Frozen tables are serialized straight into the frame (IpcAttachment); beside an attached
    IPC buffer and a small inline table the bytes equal the small-frame join, and all decode."""
    import numpy as np
    import pyarrow as pa

    from chronostream.slices.checkpoint import frozen_table_part, read_table_part, table_part

    n = 700_000
    big = pa.table({"slot": pa.array(np.arange(n)), "v": pa.array(np.arange(n) * 7)})
    raw = pa.table({"slot": pa.array(np.arange(n // 2)), "w": pa.array(np.arange(n // 2) - 5)})
    tiny = pa.table({"slot": pa.array([0, 1]), "x": pa.array([2.5, 3.5])})
    state = {"a": frozen_table_part(big), "b": table_part(raw), "c": frozen_table_part(tiny)}
    ckpt = SliceCheckpoint(3, 1, 4, "full", -1, {0: [3]}, {0: 2}, state)
    framed, joined = _encoded_large_and_joined(ckpt)
    assert bytes(framed) == joined
    back = decode(framed).state
    assert [read_table_part(back[k]).equals(t) for k, t in (("a", big), ("b", raw), ("c", tiny))] == [True] * 3


def test_verify_checks_a_frame_and_returns_its_header():
    """verify() is the cheap check a backup holder runs: header back, damage refused, no payload parse."""
    from chronostream.slices.checkpoint import verify

    raw = encode(SliceCheckpoint(3, 1, 12, "delta", 8, {}, {}, {}))
    header = verify(raw)
    assert (header["stage"], header["slice"], header["epoch"], header["kind"], header["prev"]) == (3, 1, 12, "delta", 8)
    with pytest.raises(CheckpointCorrupt, match="truncated"):
        verify(raw[:-10])
    with pytest.raises(CheckpointCorrupt, match="checksum"):
        verify(raw[:20] + bytes([raw[20] ^ 0xFF]) + raw[21:])


def test_corrupt_checkpoint_error_names_slice_and_epoch():
    """The error of a damaged checkpoint says which slice and epoch it was."""
    raw = encode(SliceCheckpoint(2, 5, 11, "full", -1, {}, {}, {}))
    with pytest.raises(CheckpointCorrupt, match="stage 2 slice 5 epoch 11"):
        decode(raw[:-3] + b"xyz")


def run_with_checkpoints(query_name: str, slices: int, full_at: int, every: int):
    """Run a query epoch by epoch; record each operator slice's inputs/outputs and checkpoints."""
    build = QUERIES[query_name][0]
    query = build(slices)
    query.epoch_events = 97  # more epochs: several checkpoints before and after the "failure"
    plan, sources = compile_query(query)
    placement = initial_placement(plan, containers_per_stage(plan, 2))
    cores = build_cores(plan, placement, sources)
    records: dict = defaultdict(list)
    chains: dict = defaultdict(list)
    for core in cores.values():
        core.group_slices = False  # record per slice: each slice's process() is wrapped below
        for rt in core.slices.values():
            if rt.op is None:
                continue
            orig = rt.process

            def recorded(epoch, inputs, rt=rt, orig=orig):
                out = orig(epoch, inputs)
                key = (rt.stage.stage_id, rt.slice_id)
                records[key].append((epoch, inputs, out))
                if epoch >= full_at and (epoch - full_at) % every == 0:
                    chain = chains[key]
                    chain.append(encode(capture(rt, delta=bool(chain), prev_epoch=decode(chain[-1]).epoch if chain else -1)))
                return out

            rt.process = recorded
    rng = random.Random(3)
    pending = []
    while not all(c.done for c in cores.values()):
        for cid in sorted(cores):
            if cores[cid].ready():
                e = cores[cid].next_epoch
                pending += [(d, e, cid, m) for d, m in cores[cid].step().items()]
        rng.shuffle(pending)
        while pending:
            d, e, cid, m = pending.pop()
            cores[d].deliver(e, cid, m)
    return plan, records, chains


@pytest.mark.parametrize("query_name", ["running_sum", "join", "rekey", "word_count"])
def test_restored_slice_continues_exactly_like_the_original(query_name, tmp_path):
    """Restore from a backup chain (full + deltas, via a BackupStore), replay the rest: same outputs."""
    plan, records, chains = run_with_checkpoints(query_name, slices=3, full_at=0, every=1)
    store = BackupStore(tmp_path / "backups", merge_every=2)
    for chain in chains.values():
        for raw in chain[: max(1, len(chain) // 2)]:  # the slice "dies" half-way
            store.put(raw)
    store.close()
    store = BackupStore(tmp_path / "backups")  # reopened: everything read back from lmdb
    checked = 0
    for key in chains:
        ckpt = store.latest(*key)
        fresh = SliceRuntime(plan, key[0], key[1])
        restore(fresh, ckpt)
        later = [(e, i, o) for e, i, o in records[key] if e > ckpt.epoch]
        for epoch, inputs, expected in later:
            got = fresh.process(epoch, inputs)
            assert {s: t.to_pylist() for s, t in got.items()} == {s: t.to_pylist() for s, t in expected.items()}
            checked += 1
        # Input it had already consumed is dropped by the restored progress vector.
        earlier = [i for e, i, _ in records[key] if e <= ckpt.epoch]
        if earlier:
            assert fresh.process(fresh.last_epoch + 1, earlier[-1]) == {}
    assert checked > 0
