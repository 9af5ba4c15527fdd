"""Memory-sink parts in bulk (``containers.sink_parts``) and in the master's catalog, unit level."""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa

from chronostream.containers.sink_parts import PackedSinkParts, add_sink_parts, pack_sink_parts
from chronostream.master.catalog import MasterCatalog


def part(values, slice_id: int) -> pa.Table:
    return pa.table({"x": values, "_slice": pa.array([slice_id] * len(values), pa.int64())})


def test_packing_then_unpacking_gives_every_part_back_by_sink_slice_and_epoch():
    parts = {3: {(0, 1): part([1, 2], 0), (1, 1): part([3], 1), (0, 2): part([], 0)}, -1: {(1, 4): part([9], 1)}}
    back = pack_sink_parts(parts).unpack()
    assert {k: {p: t.to_pylist() for p, t in v.items()} for k, v in back.items()} == \
        {k: {p: t.to_pylist() for p, t in v.items()} for k, v in parts.items()}


def test_parts_whose_slices_inferred_different_types_keep_their_own_types():
    parts = {0: {(0, 1): part([1], 0), (1, 1): part([1.5], 1), (0, 2): part([2], 0)}}
    packed = pack_sink_parts(parts)
    assert len(packed.groups) == 2 and len(packed) == 3
    back = packed.unpack()[0]
    assert [back[k].schema.field("x").type for k in [(0, 1), (1, 1), (0, 2)]] == [pa.int64(), pa.float64(), pa.int64()]


def test_a_packed_part_sliced_from_a_large_table_pickles_only_its_own_rows():
    big = pa.table({"x": np.arange(1_000_000)})
    packed = pack_sink_parts({0: {(0, 1): big.slice(10, 5)}})
    assert len(pickle.dumps(packed)) < 10_000
    assert packed.unpack()[0][(0, 1)]["x"].to_pylist() == list(range(10, 15))


def test_the_catalog_gives_back_stored_parts_with_a_later_copy_replacing_an_earlier_one(tmp_path):
    cat = MasterCatalog(tmp_path)
    cat.add_sink_parts(pack_sink_parts({0: {(0, 1): part([1], 0), (1, 1): part([2.5], 1)}}))
    cat.add_sink_parts(pack_sink_parts({0: {(0, 1): part([7], 0), (0, 2): part([8], 0)}}))
    cat.close()
    again = MasterCatalog(tmp_path)  # a restarted master goes on numbering after the stored keys
    again.add_sink_parts(pack_sink_parts({0: {(0, 2): part([80], 0)}}))
    loaded: dict = {}
    for group in again.load_sink_groups():  # in the order stored, as a reading client takes them
        add_sink_parts(loaded, PackedSinkParts([group]).unpack())
    loaded = loaded[0]
    assert {k: t["x"].to_pylist() for k, t in loaded.items()} == {(0, 1): [7], (1, 1): [2.5], (0, 2): [80]}


def test_the_stored_groups_read_as_they_came_give_each_part_its_later_copy(tmp_path):
    """A master hands its stored groups on as they came (no join into one pack per read): the
    client's table keeps a part's later copy, as the parts map did."""
    from chronostream.master.results import packed_sink_table

    def row(x: int, slice_id: int, seq: int) -> pa.Table:
        return pa.table({"x": [x], "_slice": [slice_id], "_seq": [seq]})

    cat = MasterCatalog(tmp_path)
    cat.add_sink_parts(pack_sink_parts({0: {(1, 1): row(2, 1, 0), (0, 1): row(1, 0, 0)}, 5: {(0, 1): row(9, 0, 0)}}))
    cat.add_sink_parts(pack_sink_parts({0: {(0, 1): row(7, 0, 0), (0, 2): row(8, 0, 1)}}))
    groups = cat.load_sink_groups()
    assert [(g[0], g[1].num_rows) for g in groups] == [(0, 2), (5, 1), (0, 2)]
    own = PackedSinkParts([g for g in groups if g[0] in [0]])
    assert packed_sink_table([0], [own], []).column("x").to_pylist() == [7, 8, 2]  # parts (0, 1), (0, 2), (1, 1)
