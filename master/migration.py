"""Owns live slice migration's phases, their legal order, transfers, and the plans for scaling.

Pure data and planning; no Ray, no I/O. When each transfer moves on, and
what the drivers do for it, is ``master.protocols.migration``'s (one
machine, run by ``master.ray_migration`` on Ray and by ``master.local`` in
process; paper III-C; docs/design.md section 7f):

0. ``PREPARING``: the destination host exists (a new one for scale-out);
1. ``WARMING``: the destination holds a backup of every moving slice,
   its own chained copy if it is the newest, else a snapshot the source
   container ships (a new host has no backups yet);
2. ``REBUILDING``: a new container on the destination restores the slices
   from that local backup and reports their progress vectors; consumers
   accept it as a sender;
3. ``DUAL``: upstream containers route the slices' rows to the source *and*
   the destination, replaying to the destination from its progress vectors;
   both run the slices, consumers take one copy (same rows, same out_seq);
4. ``RELEASING``: once the destination has caught up, upstream containers
   route the slices to the destination only and mark their messages to the
   source, which stops running the slices at the first marked epoch;
5. ``DONE``: the placement moves, backups are re-planned. ``ABORTED`` when a
   host involved dies: the source keeps the slices, dual copies stop.

A migration always creates a *new* container for the destination: one per
destination host, which takes the slices of every source container moving
there (a ``Transfer`` per source container, sharing the new container's
id: ``by_destination``). Its id is higher than every other, which keeps
consumers' choice of one copy per epoch simple (see
``ContainerCore._epoch_messages``): they take senders in id order and skip
one whose coverage overlaps what is taken, so the new container's
messages are used from the epoch on which *every* source of its slices has
released them. Its sources release at one epoch because each producer
switches all the new container's slices in one call (``release_route``)
and marks that epoch to each source. A source stage has no producers to
mark it (each source releases at its own next step): there, one new
container per source container and host, as before.

A compaction (``compaction_moves``: containers of one host merged into a
new one there) goes through the same phases without a copy
(``Transfer.handover``): WARMING has nothing to snapshot; REBUILDING makes
the new container empty and waiting; in DUAL producers send it the slices'
rows too, with no replay, and the host fixes a handover epoch no source
has reached; at RELEASING the sources have handed their slice runtimes
over in process at that epoch (``containers.core.hand_over``).
"""

from __future__ import annotations

import collections
import copy
import enum
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from chronostream.slices.errors import ChronoStreamError, QueryError
from chronostream.master.recovery import host_backup_peers

log = logging.getLogger("chronostream.migration")


class MigrationError(ChronoStreamError, RuntimeError):
    """A migration request that cannot be carried out, or a phase that got stuck."""


class MigrationPhase(enum.Enum):
    """Where one transfer is in the protocol (see the module docstring)."""

    PREPARING = "preparing"
    WARMING = "warming"
    REBUILDING = "rebuilding"
    DUAL = "dual"
    RELEASING = "releasing"
    DONE = "done"
    ABORTED = "aborted"


_P = MigrationPhase
#: Allowed transitions, each with the event that triggers it.
TRANSITIONS: dict[tuple[MigrationPhase, MigrationPhase], str] = {
    (_P.PREPARING, _P.WARMING): "the destination host is up",
    (_P.WARMING, _P.REBUILDING): "the destination holds a backup of every moving slice",
    (_P.REBUILDING, _P.DUAL): "the new container restored the slices and consumers accept it",
    (_P.DUAL, _P.RELEASING): "the new container caught up with the source",
    (_P.RELEASING, _P.DONE): "the source released every moving slice",
}
for _p in (_P.PREPARING, _P.WARMING, _P.REBUILDING, _P.DUAL, _P.RELEASING):
    TRANSITIONS[(_p, _P.ABORTED)] = "a host involved died or a phase timed out"

_story_ids = itertools.count(1)


@dataclass
class Transfer:
    """One new container ``new_id`` on host ``host`` taking ``slices`` of container ``source``.

    ``host`` is None until PREPARING starts a new host for it. ``story``
    records every transition (id from a counter, phase, epoch, details).
    """

    new_id: int
    source: int
    stage_id: int
    host: int | None
    slices: list[int]
    target: int = -1  # destination host id as planned (negative: a host PREPARING creates)
    phase: MigrationPhase = MigrationPhase.PREPARING
    story: list[tuple[int, str, int | None, dict[str, Any]]] = field(default_factory=list)
    # Filled as it runs: slices snapshotted at warm-up (the others were rebuilt from the
    # destination's own backup), resume epoch, release epoch and pause per slice.
    snapshot: list[int] = field(default_factory=list)
    on_advance: Any = field(default=None, repr=False, compare=False)  # persists the phase (the Ray master)
    resume: dict[int, int] = field(default_factory=dict)
    released_at: dict[int, int] = field(default_factory=dict)
    pause_ms: dict[int, float] = field(default_factory=dict)
    catch_up: dict[int, dict[str, int]] = field(default_factory=dict)  # producer -> {"epochs", "rounds"} (Ray)
    # A compaction's transfer: the slices stay in their process and are handed over, not copied
    # (no snapshot, no restore, no replay; ``hand_over_epoch``: the first epoch the new container runs them).
    handover: bool = False
    hand_over_epoch: int | None = None

    def to_plain(self) -> dict[str, Any]:
        """What a restarted master needs to settle it (``master.catalog``)."""
        return {"new_id": self.new_id, "source": self.source, "stage_id": self.stage_id, "host": self.host,
                "slices": list(self.slices), "target": self.target, "phase": self.phase.value,
                "handover": self.handover}

    @staticmethod
    def from_plain(d: dict[str, Any]) -> "Transfer":
        """Inverse of ``to_plain``; its story begins with the saved phase (a restarted master's
        view: the transfer got there before the catalog was read)."""
        phase = MigrationPhase(d["phase"])
        return Transfer(d["new_id"], d["source"], d["stage_id"], d["host"], list(d["slices"]), d["target"], phase,
                        [(next(_story_ids), phase.value, None, {"from_catalog": True, "at": round(time.time(), 3)})],
                        handover=bool(d.get("handover", False)))

    def describe(self) -> str:
        """``stage 1 slices [0, 4] container 3 -> 9 (host 5)``: for logs and errors."""
        return f"stage {self.stage_id} slices {self.slices} container {self.source} -> {self.new_id} (host {self.host})"

    def advance(self, to: MigrationPhase, epoch: int | None = None, **info: Any) -> None:
        """Move to phase ``to`` (only along ``TRANSITIONS``), logging the step with slices and epoch."""
        if (self.phase, to) not in TRANSITIONS:
            raise MigrationError(f"{self.describe()}: no transition {self.phase.value} -> {to.value}; "
                                 f"story: {self.story}")
        # (the id orders the story; the wall time is for people reading a timeline)
        self.story.append((next(_story_ids), to.value, epoch, {**info, "at": round(time.time(), 3)}))
        log.info("migration %s: %s -> %s at epoch %s %s", self.describe(), self.phase.value, to.value, epoch,
                 info or "")
        self.phase = to
        if self.on_advance is not None:
            self.on_advance(self)


# -- planning --------------------------------------------------------------------


def stage_hosts(placement: Any, host_of: dict[int, int], stage_id: int) -> dict[int, list[int]]:
    """Host -> the slices of ``stage_id`` it runs (over all its containers), hosts sorted."""
    out: dict[int, list[int]] = {}
    for c in placement.containers[stage_id]:
        out.setdefault(host_of[c], []).extend(placement.slices_of(c))
    return {h: sorted(v) for h, v in sorted(out.items())}


def balanced_moves(layout: dict[int, list[int]], targets: list[int],
                   load: dict[int, float] | None = None,
                   holders: dict[int, set[int]] | None = None,
                   container_of: dict[int, int] | None = None) -> list[tuple[int, int, int]]:
    """Moves (slice, from host, to host) that even out slice counts over ``layout`` + ``targets``.

    ``layout``: host -> its slices now (hosts leaving have been removed by the
    caller and their slices are listed under key -1). ``targets``: hosts that
    may receive (new or remaining). The most loaded host gives first, its
    heaviest slice by ``load``; among equally heavy slices (all of them
    without ``load``), one of the container with the fewest slices left on
    that host (``container_of``: slice -> container), so that small
    containers empty and retire instead of every container shrinking (a host
    collects containers: recoveries and scale-ins each add one); then the
    highest slice id. It goes to the least loaded target; among equally
    loaded targets, one holding the slice's backup (``holders[slice]``: it
    rebuilds the slice locally, no snapshot). Deterministic.

    >>> balanced_moves({0: [0, 1, 2, 3]}, [0, 1])
    [(3, 0, 1), (2, 0, 1)]
    >>> balanced_moves({-1: [4, 5], 0: [0, 2], 1: [1, 3]}, [0, 1])
    [(5, -1, 0), (4, -1, 1)]
    >>> balanced_moves({-1: [4, 5], 0: [0, 2], 1: [1, 3]}, [0, 1], holders={5: {1}, 4: {0}})
    [(5, -1, 1), (4, -1, 0)]
    >>> balanced_moves({0: [0, 1, 2, 3, 4, 5]}, [0, 1], container_of={0: 9, 1: 9, 2: 8, 3: 8, 4: 8, 5: 8})
    [(1, 0, 1), (0, 0, 1), (5, 0, 1)]
    """
    weight, owner = load or {}, container_of or {}
    have = {h: list(v) for h, v in layout.items()}
    for t in targets:
        have.setdefault(t, [])
    moves = []
    total = sum(len(v) for v in have.values())
    n = len(targets)
    if n == 0:
        raise QueryError("no host to place the slices on")
    cap = {t: total // n + (1 if i < total % n else 0) for i, t in enumerate(sorted(targets, key=lambda t: (len(have[t]), t), reverse=True))}
    while True:
        # Leaving hosts (not targets) give everything; targets give what exceeds their share.
        givers = [h for h in have if have[h] and (h not in cap or len(have[h]) > cap[h])]
        takers = [t for t in cap if len(have[t]) < cap[t]]
        if not givers or not takers:
            return moves
        g = max(givers, key=lambda h: (h not in cap, len(have[h]) - cap.get(h, 0), -h))
        left = collections.Counter(owner.get(x) for x in have[g])  # slices per container on the giver
        s = max(have[g], key=lambda s: (weight.get(s, 0.0), -left[owner.get(s)] if owner else 0, s))
        held_by = (holders or {}).get(s, set())
        t = min(takers, key=lambda t: (len(have[t]) - cap[t], t not in held_by, t))
        have[g].remove(s)
        have[t].append(s)
        moves.append((s, g, t))


def compaction_moves(placement: Any, host_of: dict[int, int], stage_id: int) -> list[tuple[int, int, int]]:
    """Moves (slice, host, same host) that merge every host's containers of ``stage_id`` into one:
    all slices of each host that runs two or more of them (recoveries, migrations and scale-ins
    leave several). One new container a host takes them all (``group_transfers``), handed over
    in process by the old ones at one epoch (``Transfer.handover``: no snapshot, no copy).

    >>> import numpy as np
    >>> from chronostream.master.placement import Placement
    >>> p = Placement()
    >>> p.slice_to_container[0] = np.array([1, 2, 3, 1])
    >>> p.containers[0], p.stage_of = [1, 2, 3], {1: 0, 2: 0, 3: 0}
    >>> compaction_moves(p, {1: 7, 2: 7, 3: 8}, 0)
    [(0, 7, 7), (1, 7, 7), (3, 7, 7)]
    """
    by_host: dict[int, set[int]] = {}
    for c in placement.containers[stage_id]:
        by_host.setdefault(host_of[c], set()).add(c)
    return sorted((s, h, h) for h, cs in by_host.items() if len(cs) > 1 for c in cs for s in placement.slices_of(c))


def warm_up_goals(stage_id: int, transfers: list[Transfer], peers: dict[int, dict[int, list[int]]],
                  held: dict[int, dict[tuple[int, int], int]],
                  sources: dict[int, dict[str, Any]]) -> dict[int, tuple[list[int], int]]:
    """What a migration's warm-up waits for: transfer index -> (its slices whose backup at the
    destination host is still to come, the epoch that backup must reach: the source's last).

    Only slices whose chain at the destination is live: the destination host is one of the
    slice's backup peers now (``peers``: source container -> slice -> hosts) and holds a chain
    of it (``held``: host -> (stage, slice) -> epoch). A host that was a peer under an earlier
    placement (before a previous migration of the slice) keeps an old chain that no round
    extends any more: waiting for it lasted the whole ``migration_warm_up_s`` (30 s); the
    migration goes on with the newest backup there is (that chain, or a snapshot). A source that is done (``sources``: container ->
    its ``migration_state``; missing: gone) takes no more checkpoints: nothing to wait for.

    >>> t = Transfer(9, 1, 0, 4, [4, 5])
    >>> warm_up_goals(0, [t], {1: {4: [4], 5: [7]}}, {4: {(0, 4): 10, (0, 5): 3}}, {1: {"done": False, "next_epoch": 17}})
    {0: ([4], 16)}
    >>> warm_up_goals(0, [t], {1: {4: [4], 5: [7]}}, {4: {(0, 4): 10}}, {1: {"done": True, "next_epoch": 60}})
    {}
    """
    goals: dict[int, tuple[list[int], int]] = {}
    for i, t in enumerate(transfers):
        st = sources.get(t.source)
        if st is None or st["done"] or t.host is None:
            continue
        own, chains = held.get(t.host, {}), peers.get(t.source, {})
        waiting = [s for s in t.slices if own.get((stage_id, s), -1) >= 0 and t.host in chains.get(s, [])]
        if waiting:
            goals[i] = (waiting, st["next_epoch"] - 1)
    return goals


def group_transfers(moves: list[tuple[int, int, int]], container_of: dict[int, int], stage_id: int,
                    next_id: int, new_hosts: dict[int, int | None] | None = None,
                    shared_destination: bool = True) -> list[Transfer]:
    """One ``Transfer`` per (source container, destination host); new container ids from ``next_id``,
    one per destination host (``shared_destination``, see the module docstring), else one per transfer.

    ``moves``: (slice, from host, to host); ``container_of``: slice -> its
    container now; ``new_hosts`` maps placeholder host ids of hosts still to
    be created to None.

    >>> ts = group_transfers([(0, 5, 7), (1, 5, 7), (2, 6, 7), (3, 6, 8)], {0: 1, 1: 1, 2: 2, 3: 2}, 0, 20)
    >>> [(t.source, t.new_id, t.slices) for t in ts]
    [(1, 20, [0, 1]), (2, 20, [2]), (2, 21, [3])]
    >>> [t.new_id for t in group_transfers([(0, 5, 7), (2, 6, 7)], {0: 1, 2: 2}, 0, 20, shared_destination=False)]
    [20, 21]
    """
    groups: dict[tuple[int, int], Transfer] = {}
    new_ids: dict[int, int] = {}
    for s, _frm, to in sorted(moves, key=lambda m: (container_of[m[0]], m[2], m[0])):
        key = (container_of[s], to)
        if key not in groups:
            host = None if new_hosts and to in new_hosts else to
            if not shared_destination or to not in new_ids:
                new_ids[to] = next_id
                next_id += 1
            groups[key] = Transfer(new_ids[to], container_of[s], stage_id, host, [], target=to)
        groups[key].slices.append(s)
    return list(groups.values())


def backup_peers_after(placement: Any, host_of: dict[int, int], transfers: list[Transfer], stage_id: int,
                       backup_factor: int, job_hosts: Sequence[int] = (),
                       node_of: dict[int, str] | None = None) -> dict[int, dict[int, list[int]]]:
    """``master.recovery.host_backup_peers`` of the placement as it will be once every transfer is done:
    what each new container's slices get as backup peers from the start (``backed_up_off_host``)."""

    after = copy.deepcopy(placement)
    for t in transfers:
        after.rehost(t.source, t.new_id, t.slices)
    return host_backup_peers(after, {**host_of, **{t.new_id: t.host for t in transfers}}, stage_id, backup_factor,
                             job_hosts, node_of)


def backed_up_off_host(t: Transfer, held: dict[int, dict[tuple[int, int], int]]) -> bool:
    """Whether every slice of ``t`` has a backup at least as new as its restore point on a live
    host other than its new one (``held``: live host -> (stage, slice) -> epoch).

    Until then the slice lives only on the destination host: the backup it was rebuilt from is
    often that host's own chained copy, and the source drops its copy at the release. Releasing
    before the new container's first checkpoint reached a peer lost the slice when that host
    died in the next epochs (two hosts; ``BackupsLost``).

    >>> t = Transfer(9, 1, 0, 4, [3])
    >>> t.resume = {3: 11}
    >>> backed_up_off_host(t, {4: {(0, 3): 10}}), backed_up_off_host(t, {4: {}, 5: {(0, 3): 10}})
    (False, True)
    """
    return all(any(h != t.host and own.get((t.stage_id, s), -1) >= t.resume.get(s, 0) - 1
                   for h, own in held.items()) for s in t.slices)


def settled_by_finishing(phase: MigrationPhase, handover: bool, dst_alive: bool, handed_over: bool = False) -> bool:
    """How a host's death (or a stuck phase) settles the live transfers to one new container:
    True to finish them (producers release the slices to it; a source still alive lets go of
    them, ``ContainerCore.request_release``), False to abort them (the sources keep their
    slices, dual copies stop). Both masters decide by this rule.

    Finish once producers switched (RELEASING), or in DUAL while the destination runs (it has
    every epoch from its resume point on); a compaction only once handed over (``handed_over``:
    its slices live in the new container only).

    >>> P = MigrationPhase
    >>> [settled_by_finishing(p, False, True) for p in (P.WARMING, P.REBUILDING, P.DUAL, P.RELEASING)]
    [False, False, True, True]
    >>> settled_by_finishing(P.DUAL, False, dst_alive=False), settled_by_finishing(P.RELEASING, False, False)
    (False, True)
    >>> settled_by_finishing(P.DUAL, True, True), settled_by_finishing(P.DUAL, True, True, handed_over=True)
    (False, True)
    """
    if phase is MigrationPhase.RELEASING:
        return True
    if handover:
        return handed_over
    return phase is MigrationPhase.DUAL and dst_alive


def by_destination(transfers: list[Transfer]) -> dict[int, list[Transfer]]:
    """New container id -> its transfers (one per source container), in the transfers' order.

    The steps that act on the new container (consumers accepting it, creating and
    restoring it, producers rerouting and releasing its slices) are one per new
    container, with the slices of all its transfers (``slices_of``).
    """
    out: dict[int, list[Transfer]] = {}
    for t in transfers:
        out.setdefault(t.new_id, []).append(t)
    return out


def resume_transfers(left: list[dict[str, Any]], placement: Any, host_of: dict[int, int]
                     ) -> tuple[list[Transfer], list[Transfer]]:
    """A restarted master's migration record read back: (the transfers, those it rehosted now).

    The new containers of transfers past PREPARING get their host and stage in the books (the
    layout is saved at the migration's end), and done transfers the saved placement does not
    show yet are rehosted (``rehost_finished``)."""
    transfers = [Transfer.from_plain(d) for d in left]
    for t in transfers:
        if t.host is not None and t.phase is not MigrationPhase.PREPARING:
            host_of.setdefault(t.new_id, t.host)
            placement.stage_of.setdefault(t.new_id, t.stage_id)
    return transfers, rehost_finished(placement, transfers)


def rehost_finished(placement: Any, transfers: list[Transfer]) -> list[Transfer]:
    """A restarted master's catch-up: the transfers its catalog has DONE whose slices the saved
    placement still puts on their source, rehosted now; returns them.

    The migration record is saved at every phase change and the layout once the migration ends:
    a master dying in between (one transfer done, another still waiting for its pause to be
    measured) leaves a DONE transfer the placement does not show.

    >>> from chronostream.master.placement import Placement
    >>> import numpy as np
    >>> p = Placement({1: [3]}, {1: np.array([3, 3])}, {3: 1})
    >>> t = Transfer(9, 3, 1, 5, [1], phase=MigrationPhase.DONE)
    >>> [x.new_id for x in rehost_finished(p, [t])], p.slice_to_container[1].tolist()
    ([9], [3, 9])
    >>> rehost_finished(p, [t])  # (once only)
    []
    """
    out = []
    for t in transfers:
        on = placement.slice_to_container.get(t.stage_id)
        if t.phase is MigrationPhase.DONE and on is not None and all(int(on[s]) == t.source for s in t.slices):
            placement.rehost(t.source, t.new_id, list(t.slices))
            out.append(t)
    return out


def slices_of(transfers: list[Transfer]) -> list[int]:
    """Every slice the ``transfers`` move, sorted."""
    return sorted(s for t in transfers for s in t.slices)


def stage_id_of(plan: Any, stage: str | int) -> int:
    """A stage's id from its name (``JobPlan.stage``) or id; ``MigrationError`` for an unknown one."""
    if isinstance(stage, int) and 0 <= stage < len(plan.stages):
        return stage
    try:
        return plan.stage(stage).stage_id
    except KeyError as exc:
        raise MigrationError(exc.args[0]) from None


def container_of_slices(placement: Any, stage_id: int) -> dict[int, int]:
    """Slice -> container, for one stage."""
    return {s: int(c) for s, c in enumerate(placement.slice_to_container[stage_id].tolist())}


def migration_pauses(released_at: dict[int, int], source_done_at: dict[int, float],
                     dest_done_at: dict[int, float]) -> dict[int, float]:
    """Per moved slice, the pause its output saw (ms): how long after the source's last epoch
    (``r - 1``) the destination finished the release epoch ``r``; 0 when it was already ahead.

    ``*_done_at``: epoch -> wall time the container finished it (``ContainerCore.epoch_done_at``).

    >>> migration_pauses({3: 10}, {9: 100.0}, {10: 100.25})
    {3: 250.0}
    """
    out = {}
    for s, r in released_at.items():
        if r - 1 in source_done_at and r in dest_done_at:
            out[s] = round(max(0.0, dest_done_at[r] - source_done_at[r - 1]) * 1000, 1)
    return out
