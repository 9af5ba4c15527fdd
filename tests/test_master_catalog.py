"""The master's catalog (``master.catalog``): what a restarted master reads back, unit level (real lmdb)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from chronostream.master.catalog import CatalogError, MasterCatalog
from chronostream.master.launch import JobLaunch
from chronostream.master.placement import Placement


def placement() -> Placement:
    return Placement({0: [0, 1]}, {0: np.array([0, 1, 0])}, {0: 0, 1: 0})


def test_a_recovery_record_is_saved_with_the_layout_and_read_back(tmp_path):
    cat = MasterCatalog(tmp_path)
    record = {"dead": [], "plans": [{"dead": [1], "lost": {1: [0, [1]]}, "plan": [{"new_id": 2, "slices": [1]}],
                                     "new_hosts": [], "t0": 1.5}]}
    cat.save_layout(placement(), {0: 0, 1: 1, 2: 0}, {0}, {0: "n"}, 3, record)
    assert cat.load_recovery() == record
    assert cat.load_layout()[4] == 3


def test_a_layout_saved_without_a_recovery_argument_keeps_the_record(tmp_path):
    cat = MasterCatalog(tmp_path)
    cat.save_layout(placement(), {0: 0, 1: 1}, {0, 1}, {}, 2, {"dead": [1], "plans": []})
    cat.save_layout(placement(), {0: 0, 1: 1}, {0, 1}, {}, 2)
    assert cat.load_recovery() == {"dead": [1], "plans": []}


def test_the_record_is_cleared_by_the_final_layout(tmp_path):
    cat = MasterCatalog(tmp_path)
    cat.save_layout(placement(), {0: 0, 1: 1}, {0, 1}, {}, 2, {"dead": [1], "plans": []})
    cat.save_layout(placement(), {0: 0, 1: 1}, {0}, {}, 2, None)
    assert cat.load_recovery() is None


def test_a_new_catalog_has_no_recovery_in_progress(tmp_path):
    assert MasterCatalog(tmp_path).load_recovery() is None


def test_adopted_spare_names_survive_a_reopen_and_a_dropped_name_stays_dropped(tmp_path):
    cat = MasterCatalog(tmp_path)
    cat.save_host_name(2, "chronostream-spare-aa")
    cat.save_host_name(5, "chronostream-spare-bb")
    cat.save_host_name(2, None)  # host 2 became a host of the job's own naming
    cat.close()
    assert MasterCatalog(tmp_path).load_host_names() == {5: "chronostream-spare-bb"}


def test_a_new_catalog_names_no_spare(tmp_path):
    assert MasterCatalog(tmp_path).load_host_names() == {}


def test_a_launch_with_user_code_is_read_back_by_a_new_catalog_of_the_same_directory(tmp_path):
    launch = JobLaunch(plan=None, containers_per_stage={0: 2, 1: 3}, policy=lambda snapshot: [], source_stages=[0])
    MasterCatalog(tmp_path).save_launch(launch.pack())
    back = JobLaunch.unpack(MasterCatalog(tmp_path).load_launch())
    assert back.containers_per_stage == {0: 2, 1: 3} and back.source_stages == [0]
    assert back.policy("any") == []


def test_a_corrupt_launch_is_refused_rather_than_resumed(tmp_path):
    cat = MasterCatalog(tmp_path)
    cat.save_launch(b"job bytes")
    with cat.env.begin(write=True) as txn:
        saved = msgpack.unpackb(txn.get(b"launch"))
        txn.put(b"launch", msgpack.packb({**saved, "bytes": b"job bytez"}))
    with pytest.raises(CatalogError, match="HMAC"):
        cat.load_launch()


def test_a_catalog_without_a_launch_says_the_master_cannot_resume(tmp_path):
    with pytest.raises(CatalogError, match="no job launch"):
        MasterCatalog(tmp_path).load_launch()
