"""The container's checkpointer: capture in the epoch, encode in the background, ship in order.

Method: a real ``KeyedAggregate`` slice (the built-in vectorized
aggregation) fed seeded batches; checkpoints taken by
``containers.checkpointing.SliceCheckpointer`` in asynchronous mode are
compared byte for byte with the synchronous mode's, and decoded to check
they hold the state as of their epoch even when the operator moved on
before they were encoded. Then whole jobs (in-process runtime) checkpoint
on a time trigger and still recover exactly.
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pytest

from chronostream.slices.operators import KeyedAggregate, OperatorContext
from chronostream.containers import checkpointing
from chronostream.containers.checkpointing import SliceCheckpointer
from chronostream.containers.backup_store import BackupStore
from chronostream.slices.checkpoint import capture, decode, is_outputs, read_table_part, restore
from test_recovery_local import BUILDERS, assert_equals_serial, cluster, operator_hosts


class _Slice:
    """The part of a slice runtime the checkpointer reads: one vectorized operator."""

    def __init__(self) -> None:
        self.op = KeyedAggregate(["k"], [("count", None), ("sum", "v")])
        self.op.bind(OperatorContext("agg", 0, ["out"]))
        self.op.setup()
        self.ctx = type("Ctx", (), {"states": {}, "handles": {}})()
        self.progress = type("Progress", (), {"consumed": {}})()
        self.stage = type("Stage", (), {"stage_id": 0})()
        self.slice_id = 0
        self.last_epoch = -1
        self.next_seq: dict[int, int] = {}

    def feed(self, epoch: int, rng: np.random.Generator, n: int = 500) -> None:
        keys = rng.integers(0, 200, n)
        self.op.consume_batch("in", pa.table({"k": keys, "v": rng.integers(0, 100, n),
                                              "_order": np.arange(epoch * n, (epoch + 1) * n),
                                              "_sub": np.zeros(n, np.int64)}))
        self.op._ctx.take_outputs({})
        self.last_epoch = epoch


def _run(async_encode: bool, epochs: int = 9, full_every: int = 0) -> list[bytes]:
    rt, rng = _Slice(), np.random.default_rng(5)
    ck = SliceCheckpointer({0: rt}, {0: [7]}, every_epochs=2, full_every=full_every, async_encode=async_encode)
    shipped: list[bytes] = []
    for e in range(epochs):
        rt.feed(e, rng)
        shipped += ck.after_epoch(e, last=e == epochs - 1).get(7, [])
    assert ck.pending == 0
    ck.close()
    return shipped


def test_async_checkpoints_are_byte_identical_to_sync_ones_and_ship_in_capture_order():
    """Encoding in the background changes when bytes are ready, not what they are or their order."""
    sync, asyn = _run(False), _run(True)
    assert asyn == sync
    epochs = [decode(b).epoch for b in asyn]
    assert epochs == sorted(epochs) == [1, 3, 5, 7, 8]


def test_after_the_first_full_checkpoint_only_deltas_are_taken_by_default():
    """The backups merge deltas (bounded restore), so no periodic full checkpoint stalls an epoch."""
    kinds = [decode(b).kind for b in _run(True, epochs=40)]
    assert kinds[0] == "full" and set(kinds[1:]) == {"delta"}
    forced = [decode(b).kind for b in _run(True, epochs=40, full_every=4)]
    assert forced.count("full") == 5


def test_new_backup_peers_force_a_full_checkpoint_only_for_the_slices_whose_peers_changed():
    """After a placement change only slices with new peers start a new chain; the others go on with
    deltas (full checkpoints of a whole stage at once stalled the job after every migration)."""
    rts, rng = {0: _Slice(), 1: _Slice()}, np.random.default_rng(2)
    rts[1].slice_id = 1
    ck = SliceCheckpointer(rts, {0: [7], 1: [7]}, every_epochs=1, async_encode=False)
    kinds: list[tuple[int, int, str]] = []
    for e in range(6):
        for rt in rts.values():
            rt.feed(e, rng)
        if e == 3:
            assert ck.retarget({0: [7], 1: [8]}) == [1]
        kinds += [(e, decode(b).slice_id, decode(b).kind) for blobs in ck.after_epoch(e).values() for b in blobs]
    ck.close()
    assert [k for e, s, k in kinds if s == 0] == ["full"] + ["delta"] * 5
    assert [k for e, s, k in kinds if s == 1] == ["full", "delta", "delta", "full", "delta", "delta"]



def test_chains_handed_to_another_checkpointer_go_on_with_deltas_after_the_givers_rounds():
    """Compaction: a checkpointer gives its slices' chains to another one in the same process.
    The giver's rounds still encoding ship first, then the receiver's, deltas on the same chain
    (the slice's dirty sets moved with its state); a slice whose peers differ there starts anew."""
    gate = threading.Event()
    real = checkpointing._encode_round
    rts, rng = {0: _Slice(), 1: _Slice()}, np.random.default_rng(4)
    rts[1].slice_id = 1
    giver = SliceCheckpointer(rts, {0: [7], 1: [7]}, every_epochs=1, async_encode=True)
    receiver = SliceCheckpointer({}, {0: [7], 1: [8]}, every_epochs=1, async_encode=True)
    shipped: list[tuple[int, int, str, int]] = []

    def ship(out):
        shipped.extend((p, decode(b).slice_id, decode(b).kind, decode(b).epoch) for p, bs in out.items() for b in bs)
    for e in range(2):
        for rt in rts.values():
            rt.feed(e, rng)
        ship(giver.after_epoch(e))
    import unittest.mock as mock
    with mock.patch.object(checkpointing, "_encode_round", lambda c, s=0.0: (gate.wait(10), real(c, s))[1]):
        for rt in rts.values():
            rt.feed(2, rng)
        ship(giver.after_epoch(2))  # captured, still encoding when handed over
        assert receiver.take_chains(giver.give_chains([0, 1])) == [1], "slice 1's peers differ"
    receiver.slices.update(rts)
    gate.set()
    for e in range(3, 5):
        for rt in rts.values():
            rt.feed(e, rng)
        ship(receiver.after_epoch(e))
    ship(receiver.ready(wait=True))
    giver.close()
    receiver.close()
    assert [(k, e) for p, s, k, e in shipped if s == 0] == [("full", 0), ("delta", 1), ("delta", 2), ("delta", 3),
                                                         ("delta", 4)]
    assert [(p, k, e) for p, s, k, e in shipped if s == 1] == [(7, "full", 0), (7, "delta", 1), (7, "delta", 2),
                                                            (8, "full", 3), (8, "delta", 4)]


def test_a_slice_that_left_the_container_is_not_logged_as_due_for_a_full_checkpoint(caplog):
    """After a migration the source container's new peer map lacks the released slice: its
    timeline must not claim a full checkpoint of a slice it no longer runs."""
    rts = {0: _Slice(), 1: _Slice()}
    rts[1].slice_id = 1
    ck = SliceCheckpointer(rts, {0: [7], 1: [7]}, every_epochs=1, async_encode=False)
    with caplog.at_level("INFO", logger="chronostream.checkpoint"):
        assert ck.retarget({1: [8]}) == [0, 1]
    ck.close()
    assert [r.getMessage() for r in caplog.records if "new backup peers" in r.getMessage()] == \
        ["checkpoint slices [1]: new backup peers, next checkpoint full"]

def test_a_captured_checkpoint_holds_the_state_of_its_epoch_though_encoded_later(monkeypatch):
    """The CAPTURE phase takes a frozen copy: updates made while the encoder waits do not leak in."""
    gate = threading.Event()
    real = checkpointing._encode_round
    monkeypatch.setattr(checkpointing, "_encode_round", lambda captured, s=0.0: (gate.wait(10), real(captured, s))[1])
    rt, rng = _Slice(), np.random.default_rng(1)
    ck = SliceCheckpointer({0: rt}, {0: [3]}, every_epochs=1, async_encode=True)
    rt.feed(0, rng)
    expected = rt.op.arrays["count"][:len(rt.op.key_index)].copy()
    assert ck.after_epoch(0) == {}  # captured; the encoder is held
    for e in range(1, 4):
        rt.feed(e, rng)  # the operator moves on (in place) before encoding
    gate.set()
    (blob,) = ck.ready(wait=True)[3]
    t = read_table_part(decode(blob).state["__op__aggregate"])
    assert np.array_equal(np.asarray(t.column("count")), expected)
    ck.close()


def test_a_time_trigger_checkpoints_at_the_first_epoch_boundary_after_the_interval(monkeypatch):
    """every_s=T: no round before T seconds have passed, one at the next boundary after, decided once per epoch."""
    now = [100.0]
    monkeypatch.setattr(checkpointing.time, "monotonic", lambda: now[0])
    ck = SliceCheckpointer({}, {}, every_epochs=0, every_s=2.0, async_encode=False)
    assert not ck.due(0, last=False)
    now[0] += 1.0
    assert not ck.due(1, last=False)
    now[0] += 1.5
    assert ck.due(2, last=False)
    ck.after_epoch(2)  # the round resets the clock
    now[0] += 1.0
    assert ck.due(2, last=False), "decided once for epoch 2"
    assert not ck.due(3, last=False)
    assert ck.due(4, last=True)


def test_checkpointing_needs_an_epoch_or_a_time_period():
    """Neither K nor T is a configuration error, not a silent no-op."""
    with pytest.raises(ValueError, match="every K"):
        SliceCheckpointer({}, {}, every_epochs=0, every_s=0.0)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_time_triggered_checkpoints_recover_a_killed_container_exactly(name):
    """checkpoint_interval_s alone (no K): a container killed mid-run is rebuilt and the output is the oracle's."""
    cl = cluster(name, checkpoint_every=0, checkpoint_interval_s=1e-6)
    cl.run(kills={3: [operator_hosts(cl)[0]]})
    assert any(kind == "recovery_end" for _, kind, _ in cl.timeline)
    assert_equals_serial(name, cl)


def test_when_encoding_falls_behind_capture_waits_and_nothing_is_lost_or_reordered(monkeypatch):
    """Backpressure: at most ``max_pending`` rounds wait for the encoder; a slow encoder makes
    capture wait for the oldest round, and every round still ships, in capture order."""
    import time as _time

    real = checkpointing._encode_round
    monkeypatch.setattr(checkpointing, "_encode_round", lambda captured, s=0.0: (_time.sleep(0.02), real(captured, s))[1])
    rt, rng = _Slice(), np.random.default_rng(2)
    ck = SliceCheckpointer({0: rt}, {0: [4]}, every_epochs=1, async_encode=True, max_pending=1)
    shipped: list[bytes] = []
    for e in range(6):
        rt.feed(e, rng)
        shipped += ck.after_epoch(e, last=e == 5).get(4, [])
        assert ck.pending <= 2
    assert [decode(b).epoch for b in shipped] == list(range(6))
    ck.close()


def test_a_round_is_skipped_while_backups_are_behind_and_the_next_delta_covers_both_periods():
    """Peers slower than the checkpoint period: with ``max_unshipped`` rounds not yet accepted,
    the next boundary takes no checkpoint; the following delta holds the skipped changes."""
    rt, rng = _Slice(), np.random.default_rng(3)
    ck = SliceCheckpointer({0: rt}, {0: [7]}, every_epochs=1, async_encode=False)
    ck.max_unshipped = 1
    shipped = []
    rt.feed(0, rng)
    shipped += ck.after_epoch(0).get(7, [])
    ck.unshipped = 1  # the shell has not had it accepted yet
    rt.feed(1, rng)
    assert ck.after_epoch(1) == {} and ck.deferred == 1
    ck.unshipped = 0
    rt.feed(2, rng)
    shipped += ck.after_epoch(2).get(7, [])
    first, second = decode(shipped[0]), decode(shipped[1])
    assert (first.kind, second.kind, second.prev_epoch, second.epoch) == ("full", "delta", 0, 2)
    ck.close()


def _restored_copy(tmp_path, epochs: int = 4):
    """A slice checkpointed to a backup store for ``epochs`` epochs, and a copy of it restored from
    that store (``restore_point``), with one random stream to feed both the same batches."""
    import copy

    rt, rng = _Slice(), np.random.default_rng(3)
    primary = BackupStore(tmp_path / "primary")
    ck = SliceCheckpointer({0: rt}, {0: [7]}, every_epochs=1, async_encode=False)
    for e in range(epochs):
        rt.feed(e, rng)
        for b in ck.after_epoch(e).get(7, []):
            assert primary.put(b) is None
    ck.close()
    ckpt, _outs, seed = primary.restore_point(0, 0)
    moved = _Slice()
    restore(moved, ckpt)
    return rt, moved, rng, copy.deepcopy(rng), ckpt, seed


def test_a_restored_slice_ships_the_frames_it_came_from_and_then_a_delta_instead_of_a_full_checkpoint(tmp_path):
    """After a migration or recovery the new host's first checkpoint is a delta since the restore
    point, preceded by the restored chain's own frames (no capture or encoding of the whole state);
    a peer that held nothing then holds exactly the live state, and later rounds are plain deltas."""
    rt, moved, rng, rng_copy, ckpt, seed = _restored_copy(tmp_path)
    kinds = [decode(b).kind for b in seed]
    assert kinds[0] == "full" and set(kinds[1:]) <= {"delta"} and decode(seed[-1]).epoch == 3
    ck = SliceCheckpointer({0: moved}, {}, every_epochs=1, async_encode=False)
    ck.seed(0, ckpt.epoch, seed)
    assert ck.retarget({0: [8]}) == [0], "the peers changed; the seed goes to the new ones"
    peer = BackupStore(tmp_path / "peer")
    rounds = []
    for e in range(4, 7):
        rt.feed(e, rng)
        moved.feed(e, rng_copy)
        blobs = ck.after_epoch(e).get(8, [])
        rounds.append(blobs)
        for b in blobs:
            assert peer.put(b) is None, "every frame extends the peer's chain"
    ck.close()
    first = [decode(b) for b in rounds[0]]
    assert [bytes(b) for b in rounds[0][:len(seed)]] == [bytes(b) for b in seed]
    assert (first[-1].kind, first[-1].prev_epoch, first[-1].epoch) == ("delta", 3, 4)
    assert [decode(b).kind for r in rounds[1:] for b in r] == ["delta", "delta"]
    assert (ck.seeded, ck.seed_bytes) == (1, sum(len(b) for b in seed))
    held = peer.latest(0, 0)
    live = capture(rt, delta=False, clear=False)
    assert held.epoch == live.epoch == 6
    assert read_table_part(held.state["__op__aggregate"]).equals(read_table_part(live.state["__op__aggregate"]))


@pytest.mark.parametrize("undo", ["refused", "no_peers"])
def test_a_seed_is_dropped_when_a_peer_refuses_a_delta_or_the_slice_loses_its_peers(tmp_path, undo):
    """The seed only stands for a chain the next delta extends: after a refusal, or a time with no
    peers (nothing captured, nothing shipped), the next checkpoint is a full one and ships alone."""
    _rt, moved, _rng, rng_copy, ckpt, seed = _restored_copy(tmp_path)
    ck = SliceCheckpointer({0: moved}, {0: [8]}, every_epochs=1, async_encode=False)
    ck.seed(0, ckpt.epoch, seed)
    if undo == "refused":
        ck.force_full([0])
    else:
        ck.retarget({})
        ck.retarget({0: [8]})
    moved.feed(4, rng_copy)
    blobs = [b for b in ck.after_epoch(4).get(8, []) if not is_outputs(b)]
    ck.close()
    assert [(decode(b).kind, decode(b).epoch) for b in blobs] == [("full", 4)]
    assert ck.seeded == 0
