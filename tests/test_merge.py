"""Merge order: the fast path equals the full lexicographic order, always.

Method: hypothesis draws epochs' worth of rows from several producers and
inputs, each producer's rows in out_seq order with non-decreasing lineage
(as producers emit them), sometimes not; ``merge_order`` must equal the
reference ``np.lexsort`` on the full key in every case.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from chronostream.slices.slice import merge_order


@st.composite
def merged_inputs(draw):
    n_prod = draw(st.integers(1, 4))
    n_inp = draw(st.integers(1, 2))
    cols = {k: [] for k in ("order", "sub", "inp", "prod", "seq")}
    for i in range(n_inp):
        for p in range(n_prod):
            k = draw(st.integers(0, 12))
            order = sorted(draw(st.lists(st.integers(0, 6), min_size=k, max_size=k)))
            sub = draw(st.lists(st.integers(0, 3), min_size=k, max_size=k))
            if draw(st.booleans()):
                pairs = sorted(zip(order, sub))
                order, sub = [a for a, _ in pairs], [b for _, b in pairs]
            cols["order"] += order
            cols["sub"] += sub
            cols["inp"] += [i] * k
            cols["prod"] += [p] * k
            cols["seq"] += list(range(k))
    return {k: np.array(v, dtype=np.int64) for k, v in cols.items()}


@settings(max_examples=300, deadline=None)
@given(merged_inputs())
def test_merge_order_equals_full_lexicographic_order(cols):
    """Whatever the producers sent, merge_order is (order, sub, input, producer, seq) order."""
    got = merge_order(cols["order"], cols["sub"], cols["inp"], cols["prod"], cols["seq"])
    ref = np.lexsort((cols["seq"], cols["prod"], cols["inp"], cols["sub"], cols["order"]))
    assert got.tolist() == ref.tolist()


@st.composite
def routed_inputs(draw):
    """``merged_inputs`` interleaved (each producer's rows of an input still in out_seq order),
    then sorted by (order, sub) keeping ties as they came: what routing sends a consumer slice
    from a producer's many slices (``containers.routing.by_consumer_slice``)."""
    cols = draw(merged_inputs())
    n = len(cols["order"])
    stream = cols["inp"] * 8 + cols["prod"]
    keys = np.array(draw(st.lists(st.integers(0, 99), min_size=n, max_size=n)), dtype=np.int64)
    for s in np.unique(stream):  # each stream's keys ascend with its rows: its order survives
        keys[stream == s] = np.sort(keys[stream == s])
    arrival = np.argsort(keys, kind="stable")
    routed = arrival[np.lexsort((cols["sub"][arrival], cols["order"][arrival]))]
    return {k: v[routed] for k, v in cols.items()}


@settings(max_examples=300, deadline=None)
@given(routed_inputs())
def test_merge_order_of_rows_routed_in_source_order_equals_full_lexicographic_order(cols):
    """Rows already in (order, sub) order, of several producers and inputs: still the full
    order, ties of two producers included (the fast path must not trust those)."""
    got = merge_order(cols["order"], cols["sub"], cols["inp"], cols["prod"], cols["seq"])
    ref = np.lexsort((cols["seq"], cols["prod"], cols["inp"], cols["sub"], cols["order"]))
    assert got.tolist() == ref.tolist()
