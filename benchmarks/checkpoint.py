"""Checkpoint cost per epoch (paper Fig. 18), in one process: no checkpoint vs async delta vs sync full.

A ``KeyedAggregate`` slice (count, sum, min, max, mean of one column per
key) is loaded with enough keys to hold the given state size, then fed
epochs of 50,000 updates touching 1% of the keys (Zipf-skewed, seeded),
with a checkpoint after every epoch (the worst case: the runtime
checkpoints every K epochs). Per epoch we time, with the runtime's own
``SliceCheckpointer``:

- ``none``: processing alone;
- ``delta``: processing + an asynchronous delta checkpoint: the CAPTURE
  phase (a frozen copy of the dirty slots) in the epoch, ENCODE (Arrow
  IPC, msgpack, CRC-32) in the checkpointer's background thread while the
  next epochs run (its GIL share lands in whatever epoch it overlaps);
- ``sync``: processing + a synchronous full checkpoint (capture and encode
  of every slot in the epoch): the baseline.

``none`` and ``delta`` run in alternating blocks of 4 epochs on the same
slice (so drift and noise hit them alike); a delta block's last encoding
finishes, untimed, before a ``none`` block starts, so background work
never lands in the baseline. The slow ``sync`` epochs come last. Shipping the bytes to peers is not timed
here (the runtime does it after the epoch's pushes; see the recovery
tests). Sizes are the operator's numpy state (``state_mb``), not RSS.

    python -m benchmarks.checkpoint --json                       # 100 and 500 MB
    python -m benchmarks.checkpoint --json --sizes 100,500,1000,2000
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from benchmarks.common import AGGREGATE_BYTES_PER_KEY, emit, median, parser
from chronostream.slices.operators import KeyedAggregate, OperatorContext
from chronostream.containers.checkpointing import SliceCheckpointer



def make_op() -> KeyedAggregate:
    op = KeyedAggregate(["k"], [("count", None), ("sum", "v"), ("min", "v"), ("max", "v"), ("mean", "v")])
    op.bind(OperatorContext("agg", 0, ["out"]))
    op.setup()
    return op


def batch(keys: np.ndarray, rng: np.random.Generator, order0: int) -> pa.Table:
    n = len(keys)
    return pa.table({"k": pa.array(keys, pa.int64()), "v": pa.array(rng.integers(0, 1000, n), pa.int64()),
                     "_order": pa.array(np.arange(order0, order0 + n), pa.int64()),
                     "_sub": pa.array(np.zeros(n, np.int64))})


class _Slice:
    """The least a ``SliceCheckpointer`` needs of a slice runtime: the operator, no kv states."""

    def __init__(self, op: KeyedAggregate) -> None:
        self.op = op
        self.ctx = type("Ctx", (), {"states": {}})()
        self.progress = type("Progress", (), {"consumed": {}})()
        self.stage = type("Stage", (), {"stage_id": 0})()
        self.slice_id = 0
        self.last_epoch = -1
        self.next_seq: dict[int, int] = {}


def epoch_batch(rng: np.random.Generator, n_keys: int, e: int) -> pa.Table:
    """50,000 updates on a Zipf-skewed 1% of the keys."""
    hot = np.minimum(rng.zipf(1.2, 50_000) - 1, max(1, n_keys // 100) - 1)
    keys = rng.permutation(n_keys)[:max(1, n_keys // 100)][hot]
    return batch(keys, rng, e * 50_000)


def timed_epochs(op: KeyedAggregate, n_keys: int, epochs: int, sync_epochs: int, seed: int,
                 block: int = 4) -> dict[str, list[float]]:
    """Per-epoch milliseconds for each mode: blocks of ``block`` epochs, ``none`` and ``delta``
    alternating (a delta block's background encoding is finished, untimed, before a ``none``
    block starts, so it never lands in the baseline), then the ``sync`` epochs."""
    rng = np.random.default_rng(seed)
    rt = _Slice(op)
    checkpointers = {"delta": SliceCheckpointer({0: rt}, {0: [1]}, 1, full_every=0, async_encode=True),
                     "sync": SliceCheckpointer({0: rt}, {0: [1]}, 1, full_every=1, async_encode=False)}
    times: dict[str, list[float]] = {"none": [], "delta": [], "sync": []}
    # none x4, delta x4, delta x4, none x4, none x4, ... then the sync epochs.
    blocks = [m for i in range(-(-epochs // block)) for m in [("none", "delta"), ("delta", "none")][i % 2]]
    order = [m for m in blocks for _ in range(block)][:2 * epochs] + ["sync"] * sync_epochs
    e = 0
    for i, mode in enumerate(order):
        if i and order[i - 1] == "delta" and mode != "delta":
            checkpointers["delta"].ready(wait=True)  # the block's encoding ends before the next block
        b = epoch_batch(rng, n_keys, e)
        ck = checkpointers.get(mode)
        if ck is not None:  # deltas on the previous epoch (the state is loaded: no first full one)
            ck.schedule.last_epoch[0] = e - 1
        else:
            op.forget_dirty()  # (no checkpoint this epoch: what it dirtied is not carried over)
        t = time.perf_counter()
        op.consume_batch("in", b)
        op._ctx.take_outputs({})
        rt.last_epoch = e
        if ck is not None:
            for blobs in ck.after_epoch(e).values():
                del blobs  # shipped elsewhere: not timed here
        times[mode].append((time.perf_counter() - t) * 1000)
        e += 1
    checkpointers["delta"].ready(wait=True)
    checkpointers["delta"].close()
    return times


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100,500", help="state sizes in MB, comma-separated")
    p.add_argument("--epochs", type=int, default=16, help="epochs per mode (none, delta)")
    p.add_argument("--sync-epochs", type=int, default=3, help="epochs of the (slow) synchronous full mode")
    args = p.parse_args()
    sizes = [50] if args.quick else [int(x) for x in args.sizes.split(",")]
    rows = []
    for mb in sizes:
        n_keys = mb * 1_000_000 // AGGREGATE_BYTES_PER_KEY
        op = make_op()
        rng = np.random.default_rng(1)
        for i in range(0, n_keys, 1_000_000):  # load the state
            op.consume_batch("in", batch(np.arange(i, min(n_keys, i + 1_000_000)), rng, 0))
            op._ctx.take_outputs({})
        state_mb = sum(a.nbytes for a in op.arrays.values()) / 1e6
        res = timed_epochs(op, n_keys, args.epochs, args.sync_epochs, seed=7)
        rows.append({
            "state_mb": round(state_mb), "keys": n_keys,
            "no_ckpt_mean_ms": round(float(np.mean(res["none"])), 1), "no_ckpt_max_ms": round(max(res["none"]), 1),
            "delta_mean_ms": round(float(np.mean(res["delta"])), 1), "delta_max_ms": round(max(res["delta"]), 1),
            "sync_mean_ms": round(float(np.mean(res["sync"])), 1), "sync_max_ms": round(max(res["sync"]), 1),
            "delta_throughput_ratio": round(median(res["none"]) / median(res["delta"]), 3),
            "delta_max_over_no_ckpt_max": round(max(res["delta"]) / max(res["none"]), 2),
        })
        del op
    emit({"epoch_updates": 50_000, "dirty_fraction": 0.01, "epochs": args.epochs, "sync_epochs": args.sync_epochs,
          "checkpoint_every_epochs": 1, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
