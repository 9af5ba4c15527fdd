"""Checkpoint cost per epoch (paper Fig. 18), in one process: no checkpoint vs delta vs full.

A ``KeyedAggregate`` slice (count, sum, min, max, mean of one column per
key) is loaded with enough keys to hold the given state size, then fed
epochs of 50,000 updates touching 1% of the keys (Zipf-skewed, seeded).
Per epoch we time processing alone, processing + a delta checkpoint
(capture + encode of the dirty slots), and processing + a full checkpoint
(capture + encode of every slot, the synchronous baseline).

What this is not yet: the paper's asynchronous three-phase checkpoint
(the delta here is taken synchronously, so its cost lands in the epoch),
and the shipping of the bytes to peers (measured in the runtime tests, not
here). Sizes are the operator's numpy state (``state_mb``), not RSS.

    python -m benchmarks.checkpoint --json            # 100 and 500 MB
    python -m benchmarks.checkpoint --json --sizes 100,500,1000,2000
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from benchmarks.common import emit, median, parser
from chronostream.operators import KeyedAggregate, OperatorContext
from slices.checkpoint import encode, SliceCheckpoint

BYTES_PER_KEY = 8 * 7 + 16  # count + sum/min/max for int and float + key index share (approx.)


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


def timed_epochs(op: KeyedAggregate, n_keys: int, epochs: int, mode: str, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    times = []
    for e in range(epochs):
        hot = np.minimum(rng.zipf(1.2, 50_000) - 1, max(1, n_keys // 100) - 1)
        keys = rng.permutation(n_keys)[:max(1, n_keys // 100)][hot]
        b = batch(keys, rng, e * 50_000)
        t = time.perf_counter()
        op.consume_batch("in", b)
        op._ctx.take_outputs({})
        if mode != "none":
            parts = op.checkpoint_state(delta=(mode == "delta"))
            encode(SliceCheckpoint(0, 0, e, "delta" if mode == "delta" else "full", e - 1 if mode == "delta" else -1,
                                   {}, {}, parts))
        times.append((time.perf_counter() - t) * 1000)
    return times


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100,500", help="state sizes in MB, comma-separated")
    p.add_argument("--epochs", type=int, default=8)
    args = p.parse_args()
    sizes = [50] if args.quick else [int(x) for x in args.sizes.split(",")]
    rows = []
    for mb in sizes:
        n_keys = mb * 1_000_000 // BYTES_PER_KEY
        op = make_op()
        rng = np.random.default_rng(1)
        for i in range(0, n_keys, 1_000_000):  # load the state
            op.consume_batch("in", batch(np.arange(i, min(n_keys, i + 1_000_000)), rng, 0))
            op._ctx.take_outputs({})
        op.checkpoint_state(delta=False)  # start deltas from here
        state_mb = sum(a.nbytes for a in op.arrays.values()) / 1e6
        res = {m: timed_epochs(op, n_keys, args.epochs, m, seed=7) for m in ("none", "delta", "full")}
        rows.append({
            "state_mb": round(state_mb), "keys": n_keys,
            "no_ckpt_mean_ms": round(float(np.mean(res["none"])), 1), "no_ckpt_max_ms": round(max(res["none"]), 1),
            "delta_mean_ms": round(float(np.mean(res["delta"])), 1), "delta_max_ms": round(max(res["delta"]), 1),
            "sync_mean_ms": round(float(np.mean(res["full"])), 1), "sync_max_ms": round(max(res["full"]), 1),
            "delta_throughput_ratio": round(median(res["none"]) / median(res["delta"]), 3),
        })
    emit({"epoch_updates": 50_000, "dirty_fraction": 0.01, "epochs": args.epochs, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
