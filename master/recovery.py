"""Owns the recovery plan: which live container re-hosts each slice of a dead one, from which backup.

Pure planning over plain data; no Ray, no I/O. The master (``master.actor``)
and the in-process driver (``master.local``) both execute the plan the same
way (see docs/design.md, "Recovery"):

1. every consumer of the dead container's stage accepts the new containers
   as senders (``ContainerCore.add_senders``);
2. each host restores its share of slices from the newest backup that
   verifies (falling back to the next replica), creating a new container
   id per (dead container, host) pair;
3. every producer of the stage reroutes the slices and replays its output
   log from the restored progress vectors (``ContainerCore.reroute``);
4. backups are re-planned over the stage's live hosts (and those of
   every stage on one host, whose copies live on other stages' hosts).

Slices are spread so that each peer holding a backup rebuilds a share:
recovery is parallel. A slice with no backup anywhere is rebuilt from the
start (replaying upstream output logs from epoch 0) when it never had a
checkpoint (a job with one host has no backup peers), when it is a
source's, or when the job allows it; otherwise planning fails, naming the
slice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from chronostream.slices.errors import RecoveryError
from chronostream.master.backups import backup_plan, chained_backup_peers

SliceKey = tuple[int, int]  # (stage id, slice id)

#: Points of a recovery at which failure injection can stop the master (``JobMaster.crash_in_recovery``):
#: the dead hosts saved, no plan yet; the plan saved, no host told yet; the slices restored, not
#: started; producers rerouted, backups not re-planned yet.
RECOVERY_STEPS = ("detected", "planned", "restored", "rerouted")

#: Hosts failure injection can kill in the middle of a recovery (``JobMaster.kill_in_recovery``):
#: one that adopts lost slices (before a plan exists: a live host of a lost container's stage), one
#: of a stage upstream of a lost container's (it is told to reroute), one downstream (it is told
#: of new senders).
RECOVERY_ROLES = ("adopter", "producer", "consumer")


class BackupsLost(RecoveryError):
    """Every copy of a slice's checkpoints is gone; recovering it would need a full recompute."""


@dataclass
class Adoption:
    """One new container: ``host`` re-hosts ``slices`` of dead container ``replaces``.

    ``holders[s]`` lists the containers holding a backup of slice ``s``,
    newest first (the host tries them in order); empty means: rebuild from
    the start. ``host`` is None when the stage has no live container left
    (the executor starts a new one).
    """

    new_id: int
    replaces: int
    stage_id: int
    host: int | None
    slices: list[int]
    holders: dict[int, list[int]] = field(default_factory=dict)
    epochs: dict[int, int] = field(default_factory=dict)  # slice -> epoch of the backup planned from

    def to_plain(self) -> dict[str, Any]:
        """What a restarted master needs to run the plan again (``master.catalog``; msgpack keeps
        the int keys)."""
        return asdict(self)

    @staticmethod
    def from_plain(d: dict[str, Any]) -> "Adoption":
        """Inverse of ``to_plain``."""
        return Adoption(**d)


def plan_recovery(lost: dict[int, tuple[int, list[int]]], backups: dict[SliceKey, list[tuple[int, int]]],
                  live: dict[int, list[int]], next_id: int,
                  checkpointed: set[SliceKey] | frozenset = frozenset(),
                  recompute_lost: bool = False, stage_names: dict[int, str] | None = None,
                  chain: dict[SliceKey, list[int]] | None = None,
                  damaged: dict[SliceKey, list[str]] | None = None,
                  floor: dict[int, int] | None = None, slack: int = 0,
                  rebuildable: set[int] | frozenset = frozenset()) -> list[Adoption]:
    """Plan the adoption of every slice of the ``lost`` containers.

    ``lost``: dead container -> (stage, slices); ``backups``: (stage, slice)
    -> [(holder, epoch)] over live holders; ``live``: stage -> its live
    hosts (the candidates; a stage with none left is adopted by the live
    holders of its backups, or, with none, by a new host: ``Adoption.host``
    None); ``checkpointed``: slices known to have shipped a checkpoint
    (their loss of every copy is an error unless ``recompute_lost``, the
    stage is ``rebuildable``, or ``floor`` shows that no upstream output log
    was trimmed yet: then the slice is rebuilt from the start, exactly, as
    one never checkpointed is); ``chain``: each slice's backup holders in chain
    order, to break ties: the l = 1 holders of a container's slices are
    all different peers, so preferring them spreads the work; ``damaged``:
    checkpoints refused by their checksum, named in the error when no
    copy is left. ``floor[stage]`` is the oldest checkpoint epoch of the
    stage a restore may start from (upstream output logs were trimmed up to
    it by GC); when it is known, a holder whose backup is at most ``slack``
    epochs older than the newest (a checkpoint still being shipped when the
    container died) is as good a candidate: it costs a little more replay
    and keeps recovery parallel. Stages in ``rebuildable`` (sources: their
    input is still there, and they need no upstream log) are rebuilt from
    the start when every copy is lost.

    >>> plan = plan_recovery({0: (1, [0, 2])}, {(1, 0): [(1, 4)], (1, 2): [(2, 4), (1, 0)]}, {1: [1, 2]}, 3)
    >>> [(a.new_id, a.host, a.slices) for a in plan]
    [(3, 1, [0]), (4, 2, [2])]

    A slice whose only copy is a savepoint's (holder -1) goes to the least loaded live host,
    which restores it from there:

    >>> [(a.host, a.holders, a.epochs) for a in plan_recovery({0: (1, [0])}, {(1, 0): [(-1, 9)]}, {1: [1, 2]}, 3)]
    [(1, {0: [-1]}, {0: 9})]
    """
    names = stage_names or {}
    load: dict[int, int] = {}
    groups: dict[tuple[int, int | None], Adoption] = {}
    adoptions: list[Adoption] = []
    for dead in sorted(lost):
        stage, slices = lost[dead]
        hosts = list(live.get(stage, []))
        for s in sorted(slices):
            copies = sorted(backups.get((stage, s), []), key=lambda he: (-he[1], he[0]))
            if copies:
                newest = copies[0][1]
                oldest_ok = newest if floor is None or stage not in floor else max(newest - slack, floor[stage])
                epoch_of = dict(copies)
                best = [h for h, e in copies if e >= oldest_ok]
                if not best:  # (the holders of newer copies died; logs were trimmed past these)
                    raise BackupsLost(
                        f"every usable backup of stage {names.get(stage, stage)!r} slice {s} is lost: the copies "
                        f"left ({', '.join(f'host {h} at epoch {e}' for h, e in copies)}) are older than epoch "
                        f"{oldest_ok}, where its producers' output logs now begin")
                # A negative holder keeps copies without being a host (a savepoint a job started
                # from: ``SAVEPOINT_HOLDER``): it hands its copy over and adopts nothing.
                hostable = [h for h in best if h >= 0]
                if hostable:
                    # Holders on the stage's live hosts first (the stage stays where it was); else
                    # any: a stage on fewer hosts than the backup factor + 1 keeps copies on other
                    # stages' hosts too, and one with no live host left has only those.
                    best = [h for h in hostable if h in hosts] or hostable
                    # Among the holders of a recent enough backup, the least loaded so far
                    # (a dead container's slices spread over all its peers), then the newest.
                    order = (chain or {}).get((stage, s), [])
                    rank = {h: i for i, h in enumerate(order)}
                    host = min(best, key=lambda h: (load.get(h, 0), -epoch_of[h], rank.get(h, len(order)), h))
                else:
                    host = min(hosts, key=lambda h: (load.get(h, 0), h)) if hosts else None
                    best = [h for h in best if h < 0]
                first = host if host in epoch_of and host >= 0 else best[0]
                copies = [(first, epoch_of[first])] + [(h, e) for h, e in copies if h != first]
            else:
                bad = (damaged or {}).get((stage, s), [])
                # Upstream logs still whole from epoch 0 (no GC mark applied to them yet): a
                # rebuild from the start replays them and is exact, checkpointed or not.
                logs_whole = floor is not None and floor.get(stage, 0) < 0
                # Logs trimmed: the slice was checkpointed, whether this master saw it or not (a
                # restarted one has no statistics of the containers that died before it came).
                trimmed = floor is not None and floor.get(stage, -1) >= 0
                if ((stage, s) in checkpointed or bad or trimmed) and not (recompute_lost or logs_whole) \
                        and stage not in rebuildable:
                    holders = (chain or {}).get((stage, s), [])
                    why = (f"damaged: {'; '.join(bad)}" if bad
                           else f"container {dead} died and no live host holds a copy"
                           + (f"; its chain's holders were hosts {holders}" if holders else ""))
                    raise BackupsLost(f"every backup of stage {names.get(stage, stage)!r} slice {s} is lost ({why}); "
                                      "pass recompute_lost=True to rebuild it from the start")
                host = min(hosts, key=lambda h: (load.get(h, 0), h)) if hosts else None
            if host is not None:
                load[host] = load.get(host, 0) + 1
            key = (dead, host)
            if key not in groups:
                groups[key] = Adoption(next_id, dead, stage, host, [])
                adoptions.append(groups[key])
                next_id += 1
            a = groups[key]
            a.slices.append(s)
            a.holders[s] = [h for h, _ in copies]
            a.epochs[s] = copies[0][1] if copies else -1
    return adoptions


def off_stage_backup_stages(placement, hosts: dict[int, int], backup_factor: int) -> set[int]:
    """Stages on too few hosts for ``backup_factor`` copies a slice among their own (at most
    ``backup_factor`` hosts, one among them): their chains go on over other stages' hosts
    (``host_backup_peers``), so a host that dies or is released may hold their backups."""
    return {st for st, ids in placement.containers.items()
            if backs_up_off_stage(len({hosts[c] for c in ids}), backup_factor)}


def backs_up_off_stage(stage_hosts: int, backup_factor: int) -> bool:
    """Whether a stage on ``stage_hosts`` hosts has too few of its own for ``backup_factor``
    copies a slice (one host always: it has no peer), so its chains go on over other hosts.

    >>> backs_up_off_stage(1, 2), backs_up_off_stage(2, 2), backs_up_off_stage(3, 2), backs_up_off_stage(2, 1)
    (True, True, False, False)
    """
    return stage_hosts <= max(backup_factor, 1)


def rebuildable_stages(plan) -> set[int]:
    """Stages whose slices can always be rebuilt from the start when every copy is lost
    (``plan_recovery(rebuildable=...)``): sources, which re-read their input and need no
    upstream log."""
    return {st.stage_id for st in plan.stages if st.kind == "source"}


def restore_order(holders: list[int], host: int | None) -> list[int]:
    """Holders to try for one slice: the host's own copy first (no transfer), then the others.

    >>> restore_order([5, 7], 7)
    [7, 5]
    """
    return sorted(holders, key=lambda h: h != host)


def lost_containers(placement, hosts: dict[int, int], dead_hosts: set[int]) -> dict[int, tuple[int, list[int]]]:
    """Containers hosted by a dead host -> (stage, slices): what a recovery must re-host."""
    return {c: (placement.stage_of[c], placement.slices_of(c))
            for ids in placement.containers.values() for c in ids if hosts[c] in dead_hosts}


def live_hosts(placement, hosts: dict[int, int], alive: set[int]) -> dict[int, list[int]]:
    """Stage -> the live hosts (actors) of its containers: the candidates to re-host its slices."""
    return {st: sorted({hosts[c] for c in ids if hosts[c] in alive}) for st, ids in placement.containers.items()}


def host_backup_peers(placement, hosts: dict[int, int], stage_id: int, backup_factor: int,
                      job_hosts: Sequence[int] = (), node_of: dict[int, str] | None = None
                      ) -> dict[int, dict[int, list[int]]]:
    """Container of ``stage_id`` -> slice -> the hosts that keep its backups (the chain over hosts).

    After a recovery one host may run several containers of a stage, so the
    chain is laid over hosts (each with the union of its containers' slices).
    A stage on one host has no peer of its own: its slices are chained over
    ``job_hosts`` (the job's live hosts; ``off_stage_backup_hosts`` orders
    them), so its host's death is a restore from a backup, not a rebuild from
    epoch 0. Without ``job_hosts`` such a stage has no backups. A stage on
    fewer hosts than ``backup_factor`` + 1 chains each slice over its own
    other hosts first and goes on over ``job_hosts`` to ``backup_factor``
    copies (2 containers with the default factor 2: one copy on the other
    host of the stage, one on another stage's), so its hosts dying together
    leave a copy.

    >>> import numpy as np
    >>> from chronostream.master.placement import Placement
    >>> p = Placement({0: [5]}, {0: np.array([5, 5, 5])}, {5: 0})
    >>> host_backup_peers(p, {5: 5}, 0, 1, job_hosts=[2, 5, 7, 9])
    {5: {0: [7], 1: [9], 2: [2]}}
    """

    by_host: dict[int, list[int]] = {}
    for c in placement.containers[stage_id]:
        by_host.setdefault(hosts[c], []).extend(placement.slices_of(c))
    chain = backup_plan(sorted(by_host), by_host, backup_factor)
    others = [h for h in job_hosts if h not in by_host]
    if backs_up_off_stage(len(by_host), backup_factor) and others:
        # Too few hosts of its own for ``backup_factor`` copies (one host: none): each slice's
        # chain goes on over the job's other hosts, spread by slice id (s // hosts: a slice's
        # place on its host under the initial round-robin placement; on one host, its place),
        # not by its place on its host now: a slice moving in or out would shift its siblings'
        # copies, and each shift costs a full checkpoint.
        for home, slices in by_host.items():
            off = off_stage_backup_hosts(home, others, node_of)
            for s in slices:
                more = backup_factor - len(chain[s])
                chain[s] = chain[s] + chained_backup_peers(s // len(by_host) - 1, off, more)
    return {c: {s: chain[s] for s in placement.slices_of(c)} for c in placement.containers[stage_id]}


def off_stage_backup_hosts(home: int, job_hosts: Sequence[int], node_of: dict[int, str] | None = None) -> list[int]:
    """The hosts a stage living on ``home`` alone backs up to: every other host, those on
    another node first (a backup on ``home``'s node dies with it), each group in id order
    starting after ``home`` (so stages on different hosts spread their backups).

    >>> off_stage_backup_hosts(5, [2, 5, 7, 9])
    [7, 9, 2]
    >>> off_stage_backup_hosts(5, [2, 5, 7, 9], {2: "a", 5: "a", 7: "a", 9: "b"})
    [9, 7, 2]
    """
    others = sorted(h for h in set(job_hosts) if h != home)
    others = [h for h in others if h > home] + [h for h in others if h < home]
    if node_of:
        others.sort(key=lambda h: node_of.get(h) is not None and node_of.get(h) == node_of.get(home))
    return others


def low_water_marks(plan, backup_epochs: list[dict[SliceKey, int]], slack: int = 0) -> dict[int, int]:
    """Producer stage -> the last epoch whose outputs no consumer can need again (GC).

    A consumer slice restored after a failure resumes after the checkpoint
    it is restored from: its newest backup, or one at most ``slack`` epochs
    older (``plan_recovery`` takes those as good, and takes them when the
    holder of the newest died with the slice). So a slice needs its
    producers' outputs after the oldest of its copies within ``slack`` of
    its newest, and a producer's outputs of epochs up to the oldest such
    checkpoint over all slices of all its consumer stages are never
    replayed again (-1: keep everything). ``backup_epochs``: what each live
    holder reports (``BackupStore.epochs``). A copy more than ``slack``
    behind (a holder the chain left) holds nothing back.

    >>> import chronostream as cs
    >>> from chronostream.dag import compile_query
    >>> q = cs.Query()
    >>> _ = q.source("w", [{"w": "a"}]).key_by("w").count(slices=2).sink(name="c")
    >>> plan, _ = compile_query(q)
    >>> low_water_marks(plan, [{(1, 0): 7}, {(1, 1): 5, (1, 0): 9}])
    {0: 5}
    >>> low_water_marks(plan, [{(1, 0): 7, (1, 1): 9}, {(1, 1): 8, (1, 0): 9}], slack=2)
    {0: 7}
    >>> low_water_marks(plan, [{(1, 0): 1, (1, 1): 9}, {(1, 1): 8, (1, 0): 9}], slack=2)
    {0: 8}
    """
    return gc_marks_and_source_floors(plan, backup_epochs, slack)[0]


def gc_marks_and_source_floors(plan, backup_epochs: list[dict[SliceKey, int]], slack: int = 0
                               ) -> tuple[dict[int, int], dict[str, int]]:
    """``low_water_marks`` and ``source_log_floors`` of one GC round, from one pass over what
    the holders report (both rest on ``oldest_restorable_epochs``)."""
    covered = oldest_restorable_epochs(plan, backup_epochs, slack)
    marks = {st.stage_id: min(covered[d] for d in plan.downstream_stages(st.stage_id))
             for st in plan.stages if plan.downstream_stages(st.stage_id)}
    floors = {st.name: (covered[st.stage_id] + 1) * plan.epoch_events for st in plan.stages if st.kind == "source"}
    return marks, floors


def raised(known: dict, new: dict, unknown: int) -> dict:
    """``known`` raised to ``new`` key by key (a GC mark or a source floor never falls; a key
    missing on one side counts as ``unknown``).

    >>> raised({0: 5, 1: 2}, {1: 4, 2: 0}, -1)
    {0: 5, 1: 4, 2: 0}
    """
    return {k: max(new.get(k, unknown), known.get(k, unknown)) for k in sorted(set(new) | set(known))}


def floors_of_sources(plan, floors: dict[str, int]) -> dict[str, int]:
    """Every source stage's floor (``source_log_floors``; 0 for one no GC round has seen): a
    recovery or migration of its slices restores them from checkpoints no older, and the floor
    only grows. Computed at each GC round; 0 without checkpoints or with ``recompute_lost``
    (a lost slice is then rebuilt from the start)."""
    return {st.name: floors.get(st.name, 0) for st in plan.stages if st.kind == "source"}


def oldest_restorable_epochs(plan, backup_epochs: list[dict[SliceKey, int]], slack: int = 0) -> dict[int, int]:
    """Stage -> the oldest checkpoint epoch a recovery or migration may restore one of its slices
    from (-1: some slice has no copy, so it would be rebuilt from the start): per slice its newest
    copy, or the oldest within ``slack`` of it (see ``low_water_marks``), then the oldest over
    the stage's slices."""
    newest: dict[SliceKey, int] = {}
    for held in backup_epochs:
        for key, e in held.items():
            newest[key] = max(newest.get(key, -1), e)
    if slack > 0:  # the oldest copy a recovery would still take
        kept = dict(newest)
        for held in backup_epochs:
            for key, e in held.items():
                if e >= newest[key] - slack:
                    kept[key] = min(kept[key], e)
        newest = kept
    return {st.stage_id: min(newest.get((st.stage_id, s), -1) for s in range(st.num_slices))
            for st in plan.stages}


def source_log_floors(plan, backup_epochs: list[dict[SliceKey, int]], slack: int = 0) -> dict[str, int]:
    """Source stage name -> the first global order it may read again: a source slice restored
    from a checkpoint of epoch c re-reads from epoch c + 1, so rows below ``(c + 1) *
    epoch_events`` for the stage's oldest restorable c are never read again (0 while some
    source slice has no copy). What a feeder may trim its source log to
    (``SourceLogWriter.trim``).

    >>> import chronostream as cs
    >>> from chronostream.dag import compile_query
    >>> q = cs.Query(epoch_events=10)
    >>> _ = q.source("w", [{"w": "a"}], slices=2).key_by("w").count(slices=1).sink(name="c")
    >>> plan, _ = compile_query(q)
    >>> source_log_floors(plan, [{(0, 0): 7, (0, 1): 4}, {(0, 0): 8}]), source_log_floors(plan, [{(0, 0): 7}])
    ({'w': 50}, {'w': 0})
    """
    return gc_marks_and_source_floors(plan, backup_epochs, slack)[1]


def restore_floor(plan, gc_marks: dict[int, int] | None) -> dict[int, int] | None:
    """Stage -> the oldest checkpoint epoch a restore of its slices may start from.

    Upstream output logs were trimmed up to ``gc_marks[producer]`` (the
    highest mark ever applied); a slice restored at epoch c replays from
    c + 1, so c must be at least every producer's mark. Source stages
    re-read their input: no floor. None when the marks are not known.

    >>> import chronostream as cs
    >>> from chronostream.dag import compile_query
    >>> q = cs.Query()
    >>> _ = q.source("w", [{"w": "a"}]).key_by("w").count(slices=2).sink(name="c")
    >>> restore_floor(compile_query(q)[0], {0: 5})
    {0: -1, 1: 5}
    """
    if gc_marks is None:
        return None
    return {st.stage_id: max([gc_marks.get(u, -1) for u in plan.upstream_stages(st.stage_id)], default=-1)
            for st in plan.stages}


def recovery_slack(options) -> int:
    """Epochs a backup may lag the newest and still be restored from (see ``plan_recovery``)."""
    return max(2, 2 * options.checkpoint_every)


def replay_targets(plan, stage_of: dict[int, int], stage_id: int, adopted: set[int]) -> list[tuple[int, int]]:
    """(consumer, its stage) for every container downstream of ``stage_id`` that a recovered
    container of that stage replays to from the consumer's own position (recovery step 3b:
    the dead container's messages of epochs before the replacement's resume epoch may never
    have arrived). ``stage_of``: every container of the job, migration destinations included;
    ``adopted`` containers are left out (their producers reroute to them).

    >>> import chronostream as cs
    >>> from chronostream.dag import compile_query
    >>> q = cs.Query()
    >>> _ = q.source("w", [{"w": "a"}]).key_by("w").count(slices=2).sink(name="c")
    >>> replay_targets(compile_query(q)[0], {0: 0, 1: 1, 2: 1, 3: 1}, 0, {3})
    [(1, 1), (2, 1)]
    """
    downstream = set(plan.downstream_stages(stage_id))
    return [(c, st) for c, st in sorted(stage_of.items()) if st in downstream and c not in adopted]

