"""Owns chained-backup placement: which peer containers hold each slice's backups.

Paper III-B: with backup factor L, a container with active slices
S_1..S_M and peers P_1..P_N (the other containers of its stage) sends the
l-th backup (1 <= l <= L) of its m-th slice to peer P_((m + l) mod N). The
chain spreads a container's backups evenly over all its peers, so when it
dies every peer rebuilds a share of its slices: recovery is parallel.
Pure functions over the placement; no Ray.
"""

from __future__ import annotations

from chronostream.slices.errors import QueryError


def chained_backup_peers(m: int, peers: list[int], backup_factor: int) -> list[int]:
    """Peers holding the backups of the m-th local slice (0-based m), in order l = 1..L.

    >>> chained_backup_peers(0, [10, 11, 12], 2)
    [11, 12]
    >>> chained_backup_peers(2, [10, 11, 12], 2)
    [10, 11]
    """
    n = len(peers)
    if backup_factor < 0:
        raise QueryError(f"backup factor must be >= 0, got {backup_factor}")
    if n == 0 or backup_factor == 0:
        return []
    # With fewer peers than L, each peer holds one copy (never two of one slice).
    return [peers[(m + l) % n] for l in range(1, min(backup_factor, n) + 1)]


def backup_plan(containers: list[int], slices_of: dict[int, list[int]], backup_factor: int) -> dict[int, list[int]]:
    """Slice -> its backup containers, for one stage (``slices_of``: container -> its slices)."""
    plan: dict[int, list[int]] = {}
    for c in containers:
        peers = [p for p in containers if p != c]
        for m, s in enumerate(sorted(slices_of[c])):
            plan[s] = chained_backup_peers(m, peers, backup_factor)
    return plan


SliceKey = tuple[int, int]  # (stage id, slice id)


def chains_by_slice(per_stage: dict[int, dict[int, dict[int, list[int]]]]) -> dict[SliceKey, list[int]]:
    """Flatten stage -> container -> slice -> its backup hosts (each stage's
    ``host_backup_peers``) into (stage, slice) -> its backup hosts, in chain order.

    >>> chains_by_slice({1: {10: {0: [2], 2: [3]}, 11: {1: [1]}}, 4: {12: {0: []}}})
    {(1, 0): [2], (1, 2): [3], (1, 1): [1], (4, 0): []}
    """
    return {(st, s): hosts for st, by_container in per_stage.items()
            for peers in by_container.values() for s, hosts in peers.items()}


def fewest_backup_copies(chains: dict[int, dict[int, list[int]]]) -> int:
    """The fewest backup copies any slice of a stage gets (``chains``: the stage's
    ``host_backup_peers``, container -> slice -> its backup hosts); 0 for no slices.

    Why: a stage on too few hosts keeps fewer than ``backup_factor`` copies a slice
    (a job of two hosts: one), and a user who asked for two must be told, not find out
    when a second death loses a slice.

    >>> fewest_backup_copies({10: {0: [2, 3], 2: [3, 1]}, 11: {1: [1]}})
    1
    >>> fewest_backup_copies({})
    0
    """
    return min((len(hosts) for peers in chains.values() for hosts in peers.values()), default=0)


def stale_backups(chains: dict[SliceKey, list[int]], held: dict[int, dict[SliceKey, int]],
                  slack: int) -> dict[int, list[SliceKey]]:
    """Host -> the backup copies it holds that no recovery can take any more.

    A copy is stale when its holder is not in the slice's chain now (the
    slice moved, or its stage's hosts changed: ``chains``, slice -> the hosts
    its checkpoints go to) and a host of the chain holds a copy more than
    ``slack`` epochs newer. A recovery only restores from copies within
    ``slack`` of the newest (``master.recovery.plan_recovery``), and GC trims
    the logs an older one would replay (``low_water_marks``), so such a copy
    only takes disk. A copy whose chain holds nothing newer yet is kept: the
    chain is still filling (a retarget makes each slice's next checkpoint a
    full one).

    >>> held = {1: {(1, 0): 9, (1, 1): 9}, 2: {(1, 0): 3, (1, 1): 8}, 3: {(1, 0): 12}}
    >>> stale_backups({(1, 0): [1, 3], (1, 1): [1]}, held, slack=2)
    {2: [(1, 0)]}
    """
    stale: dict[int, list[SliceKey]] = {}
    for h in sorted(held):
        for key, epoch in sorted(held[h].items()):
            chain = chains.get(key, [])
            if h in chain:
                continue
            newest = max((held[c][key] for c in chain if key in held.get(c, {})), default=None)
            if newest is not None and epoch < newest - slack:
                stale.setdefault(h, []).append(key)
    return stale
