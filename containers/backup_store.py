"""Owns the backups a container holds for its peers' slices: a replication buffer and its lmdb copy.

Each backed-up slice has a chain: one full checkpoint and the deltas taken
after it. New checkpoints land in memory first (the replication buffer,
paper IV) and are persisted lazily to this container's lmdb store by
``flush``, each checkpoint once under its own key, and each frame of
carried outputs too (deleted when the GC trims it). A chain's deltas are
folded into a new full checkpoint in one pass (``slices.checkpoint.merge_chain``)
when they weigh as much as its full checkpoint (a restore reads at most
about twice a full one), or when they number more than ``merge_every``
(128) and weigh a quarter of it, or number more than 8 x ``merge_every``
(a restore decodes a bounded number of frames). A merge rewrites the whole
state, so it must stay rare for large states with small deltas: with a
count alone, a 1 GB slice updated at 50,000 keys/s was rewritten every 13
s (129 deltas of 0.4 MB: 22 bytes written per byte folded), and its backup
host spent 2-6 s of a core on each merge (``should_merge``).
Every checkpoint is verified (magic, length, CRC-32) when it arrives and
when it is restored; a bad one raises ``CheckpointCorrupt`` naming the
slice and epoch. A delta that cannot extend its chain (no chain, a gap,
or a chain found damaged when merging) is refused without failing the
sender: ``put`` answers that the slice needs a full checkpoint, and the
sender's next checkpoint of it is a full one (the chain heals). Knows no Ray.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import lmdb
import msgpack

from chronostream.slices.errors import StoreFullError
from chronostream.containers.lmdb_store import delete_prefix, put_all, release_written_pages
from chronostream.slices.checkpoint import (CheckpointCorrupt, SliceCheckpoint, decode, decode_outputs, encode, is_outputs,
                               merge_chain, verify)

log = logging.getLogger("chronostream.backups")
#: Flushes writing more than this are logged with their duration (a large state's full checkpoint).
LOG_FLUSH_BYTES = 16 << 20
#: Once flushes wrote this much, the store's written pages are synced and dropped from the page cache
#: (``release_written_pages``): the replication buffer already holds them in memory.
RELEASE_PAGES_BYTES = 64 << 20

SliceKey = tuple[int, int]  # (stage id, slice id)

#: Past ``merge_every`` deltas, a chain is merged once its deltas weigh this share of its full checkpoint.
MERGE_SHARE = 0.25
#: A chain is merged at this many times ``merge_every`` deltas, whatever they weigh.
MERGE_COUNT_CAP = 8


def should_merge(full_bytes: int, delta_bytes: list[int], merge_every: int) -> bool:
    """Whether a chain of a full checkpoint and deltas of these sizes is due for a merge.

    >>> should_merge(1000, [600, 500], 128)  # the deltas outweigh the full one
    True
    >>> should_merge(10**9, [400_000] * 129, 128), should_merge(10**9, [400_000] * 1025, 128)
    (False, True)
    """
    count, size = len(delta_bytes), sum(delta_bytes)
    return size >= full_bytes or (count > merge_every and size >= MERGE_SHARE * full_bytes) \
        or count > MERGE_COUNT_CAP * merge_every


class BackupStore:
    """Chains of checkpoints by (stage, slice), in memory and (lazily) in lmdb.

    >>> import tempfile
    >>> from chronostream.slices.checkpoint import SliceCheckpoint, encode
    >>> store = BackupStore(d := tempfile.mkdtemp())
    >>> store.put(encode(SliceCheckpoint(1, 3, 5, "full", -1, {}, {0: 9})))
    >>> store.latest(1, 3).next_seq
    {0: 9}
    >>> import shutil; store.close(); shutil.rmtree(d)
    """

    def __init__(self, path: str | os.PathLike, merge_every: int = 128, map_size: int = 1 << 30) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        # writemap: a put copies the frame straight into the file's mapped pages. Without it
        # LMDB first copies each value into dirty pages it mallocs, then write()s those into
        # the page cache: a 1 GB frame cost 1.0-3.2 s (0.8-3.0 s of it in the kernel) where
        # the mapped write takes 0.3 s (one process, 1 GB value, 2026-11-25). A torn or
        # stray write is caught by the frames' CRCs like any other damage.
        self.env = lmdb.open(str(self.path), map_size=map_size, sync=False, metasync=False, writemap=True)
        self.merge_every = merge_every
        self.chains: dict[SliceKey, list[bytes]] = {}  # replication buffer: [full, delta, delta, ...]
        # Carried outputs per slice: [(from epoch, to epoch, frame)], oldest first (see CarriedOutputs).
        self.outputs: dict[SliceKey, list[tuple[int, int, bytes]]] = {}
        self.newest: dict[SliceKey, int] = {}  # epoch of the newest checkpoint received (cheap catalog)
        # Epoch the chain ends at, from the headers of what arrived (never re-decoded:
        # a chain's bytes may rot in place, which only a merge or restore notices).
        self.chain_end: dict[SliceKey, int] = {}
        self.damaged: set[SliceKey] = set()  # chains a merge found corrupt: deltas refused until a full
        self.refused = 0  # deltas refused (the sender sends a full checkpoint instead)
        self._unflushed: set[SliceKey] = set()
        # Lazy persistence writes each checkpoint of a chain once, under its own key
        # ("stage:slice:index"): a chain rewritten whole at every flush copied a large
        # state's full checkpoint to lmdb twice a second.
        self._persisted: dict[SliceKey, int] = {}  # leading chain entries already in lmdb
        self._rewrite: set[SliceKey] = set()  # chains replaced since (a full, a merge): rewrite them
        # Carried outputs are persisted the same way, a frame per key (``_outputs_key``: a number
        # per slice, then its epochs), written once and deleted when trimmed: rewritten whole per
        # flush, a slice's outputs held since the low-water mark (GC pauses during a migration)
        # were copied under the GIL twice a second, 700 ms a flush at 140 MB (1 GB migration).
        self._out_first: dict[SliceKey, int] = {}  # number of outputs[key][0]
        self._out_persisted: dict[SliceKey, int] = {}  # leading outputs[key] entries already in lmdb
        self._out_rewrite: set[SliceKey] = set()  # outputs replaced since: delete the old keys first
        self._out_dead: list[bytes] = []  # keys of persisted outputs trimmed since the last flush
        self._written_unreleased = 0  # bytes flushed since the page cache last released them
        with self.env.begin() as txn:
            entries: dict[SliceKey, list[tuple[int, bytes]]] = {}
            segments: dict[SliceKey, list[tuple[int, int, int, bytes]]] = {}
            for k, v in txn.cursor():
                name = k.decode()
                if name.startswith("out:"):
                    fields = [int(x) for x in name[4:].split(":")]
                    if len(fields) == 2:  # a slice's outputs written whole (before a key per frame)
                        self.outputs[(fields[0], fields[1])] = [tuple(x) for x in msgpack.unpackb(v, raw=False)]
                        self._out_rewrite.add((fields[0], fields[1]))
                    else:
                        stage, sl, n, first, last = fields
                        segments.setdefault((stage, sl), []).append((n, first, last, bytes(v)))
                    continue
                fields = [int(x) for x in name.split(":")]
                if len(fields) == 2:  # a store written whole per chain (before per-entry keys)
                    entries[(fields[0], fields[1])] = list(enumerate(msgpack.unpackb(v, raw=False)))
                    self._rewrite.add((fields[0], fields[1]))
                else:
                    entries.setdefault((fields[0], fields[1]), []).append((fields[2], bytes(v)))
            for key, segs in segments.items():
                segs.sort()
                self.outputs[key] = [(first, last, data) for _, first, last, data in segs]
                self._out_first[key], self._out_persisted[key] = segs[0][0], len(segs)
                if [n for n, *_ in segs] != list(range(segs[0][0], segs[0][0] + len(segs))):
                    self._out_rewrite.add(key)  # (numbers with a gap: renumbered at the next flush)
            for key, items in entries.items():
                chain = [data for _, data in sorted(items)]
                self.chains[key] = chain
                self._persisted[key] = len(chain)
                try:
                    self.chain_end[key] = self.newest[key] = verify(chain[-1])["epoch"]
                except CheckpointCorrupt:
                    self.damaged.add(key)

    def put(self, data: bytes) -> SliceKey | None:
        """Receive one encoded checkpoint, or carried outputs, of a peer's slice (verified before it is kept).

        Returns the (stage, slice) when it needs a full checkpoint from its
        sender (this delta did not extend a sound chain and was refused),
        else None. A corrupt frame raises ``CheckpointCorrupt`` (it was
        damaged in transit).
        """
        if is_outputs(data):
            out = decode_outputs(data, "incoming carried outputs")
            key = (out.stage_id, out.slice_id)
            if out.replace:
                self._replace_outputs(key)
            self.outputs.setdefault(key, []).append((out.from_epoch, out.epoch, data))
            self._unflushed.add(key)
            return None
        # The frame is checked (one CRC pass), not parsed: a large full checkpoint is
        # only decoded when it is merged or restored.
        header = verify(data, what="incoming backup")
        key = (header["stage"], header["slice"])
        if header["kind"] == "full":
            self.chains[key] = [data]
            self._rewrite.add(key)
            self.damaged.discard(key)
            if key in self.outputs:
                # A new chain starts: the outputs carried with the old one go too. The
                # full checkpoint's own carried outputs follow it (a seed's follow its chain).
                self._replace_outputs(key)
        else:
            chain = self.chains.get(key)
            if not chain or key in self.damaged or self.chain_end.get(key) != header["prev"]:
                # No chain, a gap, or a damaged chain: keep what we hold (restore
                # reports it and another replica is used) and ask for a full one.
                self.refused += 1
                return key
            chain.append(data)
            # Merge once the deltas cost as much to restore as the full checkpoint, or once
            # they are many and weigh enough that rewriting the whole state is worth it
            # (should_merge): restore stays within about twice a full one.
            if should_merge(len(chain[0]), [len(d) for d in chain[1:]], self.merge_every):
                try:
                    t0 = time.perf_counter()
                    self.chains[key] = [encode(self._merged(key))]
                    self._rewrite.add(key)
                    if len(self.chains[key][0]) > LOG_FLUSH_BYTES:
                        log.info("backup store %s: merged stage %s slice %s, %d deltas into %.0f MB in %.2f s",
                                 self.path, key[0], key[1], len(chain) - 1, len(self.chains[key][0]) / 1e6,
                                 time.perf_counter() - t0)
                except CheckpointCorrupt:
                    self.damaged.add(key)
                    self.refused += 1
                    self._unflushed.add(key)
                    return key
        self.newest[key] = self.chain_end[key] = header["epoch"]
        self._unflushed.add(key)
        return None

    def _replace_outputs(self, key: SliceKey) -> None:
        """Start a slice's carried outputs afresh: the next flush deletes the persisted ones."""
        self.outputs[key] = []
        self._out_rewrite.add(key)

    def _merged(self, key: SliceKey) -> SliceCheckpoint:
        chain = self.chains[key]
        what = f"backup of stage {key[0]} slice {key[1]}"
        return merge_chain(decode(chain[0], what), [decode(d, what) for d in chain[1:]])

    def latest(self, stage_id: int, slice_id: int) -> SliceCheckpoint:
        """The newest full checkpoint of a slice (chain merged), verified."""
        key = (stage_id, slice_id)
        if key not in self.chains:
            raise KeyError(f"no backup of stage {stage_id} slice {slice_id} here")
        return self._merged(key)

    def latest_epoch(self, stage_id: int, slice_id: int) -> int:
        """Epoch of the newest checkpoint held for a slice (-1 when none), verified."""
        chain = self.chains.get((stage_id, slice_id))
        return verify(chain[-1], what=f"backup of stage {stage_id} slice {slice_id}")["epoch"] if chain else -1

    def catalog(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, str]]]:
        """What this store can offer a recovery: ([(stage, slice, epoch)], [(stage, slice, error)]).

        The newest checkpoint of every chain is verified; a damaged one is
        reported in the second list instead of being offered.
        """
        good, bad = [], []
        for st, sl in self.holds():
            try:
                good.append((st, sl, self.latest_epoch(st, sl)))
            except CheckpointCorrupt as exc:
                bad.append((st, sl, str(exc)))
        return good, bad

    def size(self, stage_id: int, slice_id: int) -> int:
        """Bytes of the checkpoints and carried outputs held for a slice."""
        key = (stage_id, slice_id)
        return sum(len(b) for b in self.chains.get(key, [])) + sum(len(b) for *_, b in self.outputs.get(key, []))

    def total_bytes(self) -> int:
        """Bytes held in the replication buffer (every chain and carried output)."""
        return sum(self.size(st, sl) for st, sl in set(self.chains) | set(self.outputs))

    def restore_point(self, stage_id: int, slice_id: int) -> tuple[SliceCheckpoint, list[bytes], list[bytes]]:
        """What a slice restored from this store needs: (the merged full checkpoint, its carried-outputs
        frames, the seed: the frames of its chain and then those carried outputs, as they arrived).

        Received in that order by an empty peer, the seed rebuilds this
        backup there, so the restored slice's first checkpoint can be a delta
        (``SliceCheckpointer.seed``).
        """
        key = (stage_id, slice_id)
        ckpt, outs = self.latest(stage_id, slice_id), self.carried_outputs(stage_id, slice_id)
        return ckpt, outs, list(self.chains[key]) + outs

    def carried_outputs(self, stage_id: int, slice_id: int) -> list[bytes]:
        """The carried-outputs frames held for a slice, oldest first."""
        return [b for *_, b in self.outputs.get((stage_id, slice_id), [])]

    def trim_outputs(self, stage_id: int, upto_epoch: int) -> int:
        """Drop carried outputs of ``stage_id`` that end at or before ``upto_epoch`` (GC); return how many."""
        dropped = 0
        for key in [k for k in self.outputs if k[0] == stage_id]:
            segs = self.outputs[key]
            gone = [i for i, seg in enumerate(segs) if seg[1] <= upto_epoch]
            if not gone:
                continue
            dropped += len(gone)
            if gone[-1] == len(gone) - 1 and key not in self._out_rewrite:
                # The oldest ones (as always: segments come in epoch order): delete their keys.
                first, persisted = self._out_first.get(key, 0), self._out_persisted.get(key, 0)
                self._out_dead += [_outputs_key(key, first + i, segs[i]) for i in range(min(len(gone), persisted))]
                self._out_first[key] = first + len(gone)
                self._out_persisted[key] = max(0, persisted - len(gone))
            else:
                self._out_rewrite.add(key)
            self.outputs[key] = [seg for seg in segs if seg[1] > upto_epoch]
            self._unflushed.add(key)
        return dropped

    def epochs(self) -> dict[SliceKey, int]:
        """(stage, slice) -> epoch of the newest checkpoint received (not re-verified: for GC)."""
        return dict(self.newest)

    def holds(self) -> list[SliceKey]:
        """(stage, slice) of every backup held."""
        return sorted(self.chains)

    def flush(self) -> int:
        """Persist what changed since the last flush; return how many slices it concerned.

        A chain that only grew gets its new deltas written; a replaced one (a
        full checkpoint arrived, or a merge) has its old entries deleted and
        is written again. Carried outputs likewise: the frames that arrived
        since are written, trimmed ones deleted, replaced ones deleted first.
        """
        if not self._unflushed:
            return 0
        # What a refused write (``StoreFullError``: the disk has no room) must leave as it was,
        # so the next flush writes it all again; the chains stay in memory meanwhile.
        undo = (dict(self._persisted), set(self._rewrite), dict(self._out_first), dict(self._out_persisted),
                set(self._out_rewrite))
        try:
            return self._flush()
        except StoreFullError:
            (self._persisted, self._rewrite, self._out_first, self._out_persisted, self._out_rewrite) = undo
            self._rewrite.update(self._unflushed)  # (their old lmdb entries may be deleted already)
            self._out_rewrite.update(k for k in self._unflushed if k in self.outputs)
            raise

    def _flush(self) -> int:
        items = []
        rewrite = sorted(k for k in self._unflushed if k in self._rewrite or k not in self._persisted)
        if rewrite:
            self._delete_chains(rewrite)
        out_rewrite = sorted(k for k in self._unflushed if k in self._out_rewrite)
        if out_rewrite or self._out_dead:
            self._delete_outputs(out_rewrite, self._out_dead)
            self._out_dead = []
        for key in sorted(self._unflushed):
            chain = self.chains.get(key)
            if chain is None:
                continue
            start = 0 if key in rewrite else self._persisted[key]
            items += [(_entry_key(key, i), chain[i]) for i in range(start, len(chain))]
            self._persisted[key] = len(chain)
            self._rewrite.discard(key)
        for key in sorted(self._unflushed):
            segs = self.outputs.get(key)
            if segs is None:
                continue
            if key in self._out_rewrite:
                self._out_first[key], self._out_persisted[key] = 0, 0
                self._out_rewrite.discard(key)
            first, start = self._out_first.get(key, 0), self._out_persisted.get(key, 0)
            items += [(_outputs_key(key, first + i, segs[i]), segs[i][2]) for i in range(start, len(segs))]
            self._out_persisted[key] = len(segs)
        t0 = time.perf_counter()
        put_all(self.env, items, None, "backup store")
        n = len(self._unflushed)
        written = sum(len(v) for _, v in items)
        if written > LOG_FLUSH_BYTES:
            log.info("backup store %s: flushed %d slices, %.0f MB to lmdb in %.2f s", self.path, n, written / 1e6,
                     time.perf_counter() - t0)
        self._unflushed.clear()
        self._written_unreleased += written
        if self._written_unreleased >= RELEASE_PAGES_BYTES:
            self.release_pages()
        return n

    def release_pages(self) -> None:
        """Sync the lmdb file and drop its pages from the OS page cache (the chains are in memory)."""
        t0 = time.perf_counter()
        release_written_pages(self.env, self.path)
        if self._written_unreleased > LOG_FLUSH_BYTES:
            log.info("backup store %s: %.0f MB synced and dropped from the page cache in %.2f s", self.path,
                     self._written_unreleased / 1e6, time.perf_counter() - t0)
        self._written_unreleased = 0

    def _delete_chains(self, keys: list[SliceKey]) -> None:
        """Delete the lmdb entries of these chains (both key layouts)."""
        with self.env.begin(write=True) as txn:
            for s, sl in keys:
                txn.delete(f"{s}:{sl}".encode())
                delete_prefix(txn, f"{s}:{sl}:".encode())

    def _delete_outputs(self, keys: list[SliceKey], dead: list[bytes]) -> None:
        """Delete every persisted carried output of these slices (both layouts), and the ``dead`` keys."""
        with self.env.begin(write=True) as txn:
            for s, sl in keys:
                txn.delete(f"out:{s}:{sl}".encode())
                delete_prefix(txn, f"out:{s}:{sl}:".encode())
            for k in dead:
                txn.delete(k)

    def corrupt(self, stage_id: int, slice_id: int, truncate: bool = False) -> None:
        """Damage the newest checkpoint held for a slice (failure injection: bit rot or a torn write).

        Flips one payload byte, or with ``truncate`` cuts the checkpoint in
        half, in memory and in lmdb. Restoring it then raises ``CheckpointCorrupt``.
        """
        chain = self.chains[(stage_id, slice_id)]
        data = bytearray(chain[-1])
        if truncate:
            data = data[: len(data) // 2]
        else:
            data[len(data) // 2] ^= 0xFF
        chain[-1] = bytes(data)
        self._unflushed.add((stage_id, slice_id))
        self._rewrite.add((stage_id, slice_id))
        self.flush()

    def drop(self, stage_id: int, slice_id: int) -> bool:
        """Forget a slice's backups and the outputs carried with them (it moved, or this container
        no longer backs it up), in memory and in lmdb. Returns whether it held a chain for it."""
        key = (stage_id, slice_id)
        held = self.chains.pop(key, None) is not None
        self.outputs.pop(key, None)
        self.chain_end.pop(key, None)
        self.newest.pop(key, None)
        self.damaged.discard(key)
        self._unflushed.discard(key)
        self._persisted.pop(key, None)
        self._rewrite.discard(key)
        self._out_first.pop(key, None)
        self._out_persisted.pop(key, None)
        self._out_rewrite.discard(key)
        self._delete_chains([key])
        self._delete_outputs([key], [])
        return held

    def close(self, flush: bool = True) -> None:
        """Close the lmdb environment (after a flush unless ``flush=False``: the buffer is then lost)."""
        if flush:
            self.flush()
        self.env.close()


def _entry_key(key: SliceKey, index: int) -> bytes:
    """lmdb key of a chain's ``index``-th checkpoint (0: the full one); sorts by index."""
    return f"{key[0]}:{key[1]}:{index:08d}".encode()


def _outputs_key(key: SliceKey, number: int, segment: tuple[int, int, bytes]) -> bytes:
    """lmdb key of a slice's carried-outputs frame: its number (sorts oldest first), then the
    epochs it covers (read back at a reopen), so the value is the frame itself."""
    return f"out:{key[0]}:{key[1]}:{number:010d}:{segment[0]}:{segment[1]}".encode()


__all__ = ["BackupStore", "CheckpointCorrupt"]
