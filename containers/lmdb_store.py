"""Owns the one way this package writes to lmdb: a batch of puts in one transaction, growing the map when full."""

from __future__ import annotations

from typing import Iterable

import lmdb


def put_all(env: lmdb.Environment, items: Iterable[tuple[bytes, bytes]]) -> None:
    """Write every (key, value) in one transaction; double ``map_size`` and retry when the map is full.

    ``map_size`` is address space, not disk, so growing it is cheap.
    """
    items = list(items)
    if not items:
        return
    while True:
        try:
            with env.begin(write=True) as txn:
                for k, v in items:
                    txn.put(k, v)
            return
        except lmdb.MapFullError:
            env.set_mapsize(env.info()["map_size"] * 2)
