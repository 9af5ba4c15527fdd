"""The Ray migration driver's answer when a destination's own copy does not verify (one module,
stand-ins for the master and its hosts: the Ray path itself needs a checksum failure timed between
the warm-up and the restore, which the simulator's seed 290 reaches in process)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from chronostream.containers.options import JobOptions
from chronostream.master.migration import Transfer
from chronostream.master.protocols.migration import RestoreFailed, StartContainer, Started
from chronostream.master.ray_migration import RayMigration
from chronostream.slices.errors import RecoveryError


class _Call:
    def __init__(self, log: list, name: str, result=None) -> None:
        self.log, self.name, self.result = log, name, result

    def remote(self, *args):
        self.log.append((self.name, args))

        async def done():
            return self.result
        return done()


class _Host:
    def __init__(self, log: list) -> None:
        self.remove_container = _Call(log, "remove_container")
        self.set_extra_window = _Call(log, "set_extra_window")
        self.start = _Call(log, "start")


def _master(log: list, add_container) -> SimpleNamespace:
    stage = SimpleNamespace(kind="stateful", name="running_sum")
    return SimpleNamespace(opts=JobOptions(checkpoint_interval_s=0), plan=SimpleNamespace(stages=[stage, stage]),
                           handles={5: _Host(log)}, deployer=SimpleNamespace(add_container=add_container),
                           _event=lambda kind, **info: log.append((kind, info)),
                           chains=SimpleNamespace(of_stage=lambda sid: {}))


def test_a_restore_that_fails_its_checksum_removes_the_container_and_reports_restore_failed():
    log: list = []

    async def add_container(*args, **kwargs):
        raise RecoveryError("no usable backup of stage 'running_sum' slice 4: host 5: checksum mismatch\nmore")

    driver = RayMigration(_master(log, add_container), 1, [Transfer(9, 3, 1, 5, [4])])
    out = asyncio.run(driver._start(StartContainer(9, 1, (4,), 5)))
    assert out == RestoreFailed(9, (4,), "no usable backup of stage 'running_sum' slice 4: host 5: checksum mismatch")
    assert ("remove_container", (9,)) in log and not any(name == "start" for name, _ in log)
    assert any(kind == "migration_restore_failed" for kind, _ in log)


def test_a_restore_that_verifies_starts_the_container_with_room_to_catch_up():
    log: list = []

    async def add_container(*args, **kwargs):
        return {"progress": {4: {}}, "resume": {4: 12}, "restore_start": 1.0, "restore_end": 1.25}

    driver = RayMigration(_master(log, add_container), 1, [Transfer(9, 3, 1, 5, [4])])
    out = asyncio.run(driver._start(StartContainer(9, 1, (4,), 5)))
    assert out == Started(9, {4: {}}, {4: 12}, 250.0)
    assert [name for name, _ in log] == ["set_extra_window", "start"]
