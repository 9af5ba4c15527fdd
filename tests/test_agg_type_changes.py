"""Specification of the built-in aggregate when a value column's inferred type changes between epochs.

Without a declared schema each epoch's batches infer their types on their
own: a ``map`` that turns null prices into ``1`` gives an int64 column in an
epoch of nulls only and a double column in the others. A key's running
sum/min/max/mean must not depend on that: its values are exact ints until
its first float value, floats from then on (the int values so far promoted
once), across checkpoints and restores, in every executor.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import chronostream as cs
from chronostream.slices import operators
from chronostream.dag import compile_query
from chronostream.slices.hashing import slice_of
from chronostream.slices.operators import KeyedAggregate, OperatorContext
from chronostream.slices.types import ORDER, SUB
from chronostream.master.local import collect, run_local
from chronostream.master.placement import containers_per_stage, initial_placement
from chronostream.slices.checkpoint import SliceCheckpoint, merge_chain

SPECS = [("count", None), ("sum", "p"), ("min", "p"), ("max", "p"), ("mean", "p")]
EPOCH = 12


def priced_rows() -> list[dict]:
    """Six epochs of 12 rows over 5 keys; epochs 0, 3 and 4 have only null prices (the map
    makes them int64 1s), the others quarter prices (double, exact sums)."""
    rows = []
    for e in range(6):
        for i in range(EPOCH):
            n = e * EPOCH + i
            price = None if e in (0, 3, 4) else (n * 7 % 13) * 0.25 - 1.0
            rows.append({"k": f"k{n * 3 % 5}", "price": price})
    return rows


def priced_query(rows: list[dict]) -> cs.Query:
    q = cs.Query(epoch_events=EPOCH)
    q.source("s", rows).map(lambda e: {"k": e["k"], "p": e["price"] if e["price"] is not None else 1}) \
        .key_by("k").aggregate(count=True, sum=["p"], min=["p"], max=["p"], mean=["p"], slices=3).sink(name="o")
    return q


def test_running_aggregates_do_not_restart_when_the_inferred_type_changes():
    """Regression (issue 59, aggregates restart on a type change): epochs of null prices infer
    the mapped ``p`` as int64, the others as double. The local executor's rows equal the serial
    executor's row for row (values, lineage, ``_slice``/``_seq``), and both equal a pandas
    running sum/min/max/mean per key of the prices with nulls as 1 (the local executor gave
    the running values of the current type's variant alone: sums restarted, minima of 0)."""
    rows = priced_rows()
    serial = cs.run_serial(priced_query(rows)).results("o")
    plan, sources = compile_query(priced_query(rows))
    cores = run_local(plan, initial_placement(plan, containers_per_stage(plan, 2)), sources)
    local = collect(plan, cores, "o")
    assert local.to_pylist() == serial.to_pylist()
    assert local.num_rows == len(rows)

    df = pd.DataFrame(rows)
    df["p"] = df["price"].fillna(1).astype(float)
    g = df.groupby("k")["p"]
    want = pd.DataFrame({"k": df["k"], "count": g.cumcount() + 1, "sum_p": g.cumsum(), "min_p": g.cummin(),
                         "max_p": g.cummax()})
    want["mean_p"] = want["sum_p"] / want["count"]
    got = local.to_pandas().set_index(ORDER).sort_index()
    assert got.index.tolist() == list(range(len(rows)))  # each update keeps its input row's order
    for col in ("k", "count", "sum_p", "min_p", "max_p", "mean_p"):
        assert got[col].tolist() == want[col].tolist(), col


def make_ops(n: int) -> list[KeyedAggregate]:
    ops = []
    for s in range(n):
        op = KeyedAggregate(["k"], SPECS)
        op.bind(OperatorContext("agg", s, ["out"]))
        op.setup()
        ops.append(op)
    return ops


def batch_of(pairs: list[tuple[str, int | float]], as_float: bool, first_order: int) -> pa.Table:
    return pa.table({"k": pa.array([k for k, _ in pairs], pa.string()),
                     "p": pa.array([v for _, v in pairs], pa.float64() if as_float else pa.int64()),
                     ORDER: pa.array(np.arange(first_order, first_order + len(pairs), dtype=np.int64)),
                     SUB: pa.array(np.zeros(len(pairs), np.int64))})


class Model:
    """The running values per key in plain Python: exact ints until the key's first float."""

    def __init__(self) -> None:
        self.keys: dict[str, dict] = {}

    def add(self, key: str, v: int | float) -> dict:
        s = self.keys.get(key)
        if s is None:
            s = self.keys[key] = {"count": 0, "float": isinstance(v, float), "sum": 0, "min": v, "max": v}
        if isinstance(v, float) and not s["float"]:
            s.update(float=True, sum=float(s["sum"]), min=float(s["min"]), max=float(s["max"]))
        if s["float"]:
            v = float(v)
        s["count"] += 1
        s["sum"] += v
        s["min"], s["max"] = min(s["min"], v), max(s["max"], v)
        return dict(s)


def check_rows(out: pa.Table, pairs: list, model: Model) -> None:
    """``out`` (one row per input pair, in order) equals the model bit for bit; an int64 output
    column only when no key of the batch is in float."""
    got = out.to_pylist()
    states = [model.add(k, v) for k, v in pairs]
    for r, s in zip(got, states):
        assert r["count"] == s["count"]
        for a in ("sum", "min", "max"):
            assert float(r[f"{a}_p"]).hex() == float(s[a]).hex(), (a, r, s)
        assert r["mean_p"].hex() == (float(s["sum"]) / s["count"]).hex()
    any_float = any(s["float"] for s in states)
    for a in ("sum", "min", "max"):
        assert out.schema.field(f"{a}_p").type == (pa.float64() if any_float else pa.int64())


def checkpoint(op: KeyedAggregate, epoch: int, delta: bool) -> SliceCheckpoint:
    return SliceCheckpoint(0, op._ctx.slice_id, epoch, "delta" if delta else "full", epoch - 1 if delta else -1,
                           {}, {}, op.checkpoint_state(delta=delta), {})


def test_a_restore_after_a_type_change_gives_the_same_running_values():
    """Regression (issue 59, aggregates restart on a type change): int, float, int, float
    batches, a full checkpoint after the first and a delta after each other; after every
    checkpoint the chain so far, merged and restored, holds the live operator's arrays and
    both go on with the same rows, equal to the model: keys promoted to float stay float
    after a restore, keys never seen as float keep exact int64 sums (2**60 + 3 in the
    state), and an int batch of int keys alone comes out int64."""
    big = 2**60
    batches = [
        ([("a", 1), ("b", big + 1), ("a", 3), ("c", -2)], False),
        ([("a", 0.5), ("c", 2.25), ("d", -1.5)], True),  # a and c promoted; b stays int
        ([("a", 1), ("b", 2), ("c", -7), ("e", 4)], False),  # mixed: a, c in float; b, e int
        ([("b", 2.0), ("e", 0.25), ("f", 9.5)], True),
    ]
    live = make_ops(1)[0]
    model = Model()
    chain: list[SliceCheckpoint] = []
    order = 0
    for epoch, (pairs, as_float) in enumerate(batches):
        live.consume_batch("in", batch_of(pairs, as_float, order))
        check_rows(live._ctx.take_outputs({})["out"], pairs, model)
        order += len(pairs)
        if epoch == 2:  # b, never float so far, holds its exact int64 sum (the float64 output rounds it)
            assert int(live.arrays["sum_p_i"][int(live.key_index.slots([pa.array(["b"])])[0])]) == big + 3
        chain.append(checkpoint(live, epoch, delta=epoch > 0))
        restored = make_ops(1)[0]
        restored.restore_state(merge_chain(chain[0], chain[1:]).state)
        n = len(live.key_index)
        assert sorted(restored.arrays) == sorted(live.arrays)
        for name in live.arrays:
            assert restored.arrays[name][:n].tolist() == live.arrays[name][:n].tolist(), name
        for op in (live, restored):  # both go on alike, from an int batch and from a float one
            for as_float_next in (False, True):
                probe = [("a", 2 if not as_float_next else 2.0), ("b", 1), ("g", 5)]
                clone = make_ops(1)[0]
                clone.restore_state(op.checkpoint_state(delta=False, clear=False))
                clone.consume_batch("in", batch_of(probe, as_float_next, order))
                copy = Model()
                copy.keys = {k: dict(s) for k, s in model.keys.items()}
                check_rows(clone._ctx.take_outputs({})["out"], probe, copy)
    assert model.keys["b"]["sum"] == float(big + 3) + 2.0


def test_an_int_key_keeps_an_exact_int64_sum_beside_float_keys():
    """Keys never seen as float keep exact int64 sums in the state, whatever their neighbours
    do: only the output batch of a mixed int batch is float64."""
    op = make_ops(1)[0]
    big = 2**62
    for pairs, as_float, order in (([("a", big), ("b", 1)], False, 0), ([("b", 0.5)], True, 2)):
        op.consume_batch("in", batch_of(pairs, as_float, order))
        op._ctx.take_outputs({})
    op.consume_batch("in", batch_of([("a", 3), ("a", -1)], False, 3))
    out = op._ctx.take_outputs({})["out"]
    assert out.schema.field("sum_p").type == pa.int64()
    assert out.column("sum_p").to_pylist() == [big + 3, big + 2]
    slot = int(op.key_index.slots([pa.array(["a"])])[0])
    assert int(op.arrays["sum_p_i"][slot]) == big + 2 and op.arrays["float_p_b"][slot] == 0


pairs_st = st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d", "e", "f"]), st.integers(-50, 50)),
                    min_size=1, max_size=25)


@pytest.mark.parametrize("arena", [True, False], ids=["arena", "per-op"])
@settings(max_examples=25, deadline=None)
@given(epochs=st.lists(st.tuples(pairs_st, st.booleans()), min_size=1, max_size=6), n_ops=st.integers(1, 3))
def test_grouped_slices_follow_the_model_for_any_sequence_of_types(arena, epochs, n_ops):
    """Epochs of int or float values (quarters: exact sums) routed by key over 1-3 ops in one
    ``consume_slices`` call, the ops' arrays in a shared slot arena or each its own: every
    row equals the model bit for bit, and the batch is float64 exactly when one of its keys
    is in float."""
    saved = operators.ARENA_MAX_BYTES
    operators.ARENA_MAX_BYTES = saved if arena else 0
    try:
        ops = make_ops(n_ops)
        model = Model()
        order = 0
        for pairs, as_float in epochs:
            pairs = [(k, v / 4 if as_float else v) for k, v in pairs]
            owner = slice_of([pa.array([k for k, _ in pairs])], n_ops)
            by_owner = np.argsort(owner, kind="stable")
            sorted_pairs = [pairs[i] for i in by_owner.tolist()]
            bounds = np.searchsorted(owner[by_owner], np.arange(n_ops + 1))
            out, _ = KeyedAggregate.consume_slices(ops, "in", batch_of(sorted_pairs, as_float, order), bounds)["out"]
            check_rows(out, sorted_pairs, model)
            order += len(pairs)
    finally:
        operators.ARENA_MAX_BYTES = saved
