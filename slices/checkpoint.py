"""Slice checkpoints: capture, encode (checksummed), merge deltas, restore. No Ray, no I/O.

Owns: what a slice checkpoint holds and its byte format. A checkpoint is
taken at an epoch boundary and holds the slice's progress vector, its
output numbering (``next_seq``), the epoch, and the operator's state: a
full snapshot, or a delta of what changed since the previous checkpoint
(dirty keys, deletes included). Deltas are merged onto a full snapshot at
the backup side (``merge``), so restore cost stays bounded.

Operator state comes in two shapes:

- ``kv``: registered ``KeyValueState``s, as (keys, values, deleted keys);
- ``table``: an Arrow table keyed by a ``slot`` column (last write wins),
  for vectorized operators such as ``KeyedAggregate``.

An operator may provide ``checkpoint_state(delta: bool) -> dict`` and
``restore_state(parts: dict)``; otherwise its registered key-value states
are captured; their keys and values are encoded by ``chronostream.slices.codec``
(plain data, dates and times, Decimal, Arrow values). Byte format: ``b"CSCK"``, header length, msgpack header
(stage, slice, epoch, kind, previous epoch, payload length), the payload,
and a CRC-32 over all of it. The payload is a msgpack body in which every
binary above 64 KiB is a reference (msgpack ext type 1: index, size) to
an attachment: the binaries follow the body, raw (version 2; the header
gives the body's length and the attachments' sizes). Decoding hands out
the attachments as views of the frame: a 500 MB state read back through
``msgpack.unpackb`` was copied into a bytes object holding the GIL for
0.25 s, which stalled every slice of the host restoring it. Version 1
frames (binaries inline) still decode. ``decode`` and ``verify`` refuse
anything whose magic, length or checksum does not match, naming the slice
and epoch.
"""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Iterable, Iterator, NamedTuple

import msgpack
import numpy as np
import pyarrow as pa

from chronostream.slices import codec
from chronostream.slices.arrow_ipc import read_stream, stream_size, write_stream
from chronostream.slices.errors import StateEncodingError
from chronostream.slices.state import canonical_key
from chronostream.slices.state import KeyValueState

MAGIC = b"CSCK"
VERSION = 2
_LEN = struct.Struct(">I")
_ATTACHED = 1  # msgpack ext type of a reference to an attached binary (version 2; codec codes are >= 16)
_REF = struct.Struct(">IQ")  # its data: attachment index, size
_REF_HEAD = bytes([0xC7, _REF.size, _ATTACHED])  # msgpack "ext 8" with that data length and type


class CheckpointCorrupt(Exception):
    """A checkpoint's bytes do not match their header (torn, truncated or altered)."""


@dataclass
class SliceCheckpoint:
    """One slice's state at the end of ``epoch`` (full, or a delta on ``prev_epoch``)."""

    stage_id: int
    slice_id: int
    epoch: int
    kind: str  # "full" | "delta"
    prev_epoch: int  # epoch of the checkpoint this delta applies to (-1 for a full one)
    progress: dict[int, list[int]]
    next_seq: dict[int, int]
    state: dict[str, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[int, bytes] = field(default_factory=dict)  # output-log rows since the previous checkpoint

    def describe(self) -> str:
        """``stage 1 slice 3 epoch 12 (delta on 10)``: for logs and errors."""
        on = f" on {self.prev_epoch}" if self.kind == "delta" else ""
        return f"stage {self.stage_id} slice {self.slice_id} epoch {self.epoch} ({self.kind}{on})"


# -- key-value states ----------------------------------------------------------------


def _pack(obj: Any) -> bytes:
    return codec.packb(obj)


_ABSENT = object()  # a dirty key the state no longer holds

#: Entries packed (or unpacked) per call when a whole state streams through a checkpoint.
KV_CHUNK = 4096


def capture_kv(state: KeyValueState, delta: bool) -> dict[str, Any]:
    """A key-value state as plain data: everything, or what changed since ``clear_dirty``.

    A full capture packs the entries ``KV_CHUNK`` at a time as they come (the cold ones
    read from the spill store a batch at a time): a state kept mostly on disk
    (``hot_entries``) is never all in memory as Python objects, only as the packed bytes.
    """
    try:
        if delta:
            keys, values, deleted = [], [], []
            for k in state.dirty_keys():  # one read each (a cold one costs an lmdb read)
                v = state.get(k, _ABSENT)
                if v is _ABSENT:
                    deleted.append(k)
                else:
                    keys.append(k)
                    values.append(v)
            return {"shape": "kv", "keys": _pack(keys), "values": _pack(values), "deleted": _pack(deleted)}
        keys_b, values_b = _packed_columns(state.items())
        return {"shape": "kv", "keys": keys_b, "values": values_b, "deleted": _pack([])}
    except StateEncodingError as exc:
        raise StateEncodingError(f"state {state.name!r} holds a value a checkpoint cannot encode: {exc}") from None


def _packed_columns(pairs: Iterator[tuple[Any, Any]]) -> tuple[bytes, bytes]:
    """``(packb(keys), packb(values))`` of ``pairs``, byte for byte, packed a chunk at a time:
    each chunk is one ``packb`` of a list, its array header cut off, and the whole gets one
    header for the total count."""
    keys_parts: list[bytes] = []
    values_parts: list[bytes] = []
    n = 0
    while True:
        chunk = list(islice(pairs, KV_CHUNK))
        if not chunk:
            break
        n += len(chunk)
        head = _array_header_len(len(chunk))
        keys_parts.append(_pack([k for k, _ in chunk])[head:])
        values_parts.append(_pack([v for _, v in chunk])[head:])
    header = msgpack.Packer(use_bin_type=True).pack_array_header(n)
    return header + b"".join(keys_parts), header + b"".join(values_parts)


def _array_header_len(n: int) -> int:
    """Bytes of msgpack's array header for ``n`` items (fixarray, array 16, array 32)."""
    return 1 if n < 16 else 3 if n < 1 << 16 else 5


def _kv_items(part: dict[str, Any]) -> tuple[list, list, list]:
    # Keys and deleted keys come back as tuples (hashable); values keep lists.
    keys = [canonical_key(k) for k in codec.unpackb(part["keys"], use_list=False)]
    deleted = [canonical_key(k) for k in codec.unpackb(part["deleted"], use_list=False)]
    values = codec.unpackb(part["values"], use_list=True)
    return keys, values, deleted


#: Packed arrays of a kv part larger than this are unpacked one item at a time, so a large
#: state's part is never decoded into one list; smaller ones in one call, which is faster.
STREAM_PART_BYTES = 64 << 20


def _array_items(blob: bytes, use_list: bool) -> Iterable[Any]:
    """The items of a packed msgpack array: a list, or for a blob above ``STREAM_PART_BYTES``
    an iterator that unpacks them one at a time."""
    if len(blob) <= STREAM_PART_BYTES:
        return codec.unpackb(blob, use_list=use_list)
    return _streamed_array(blob, use_list)


def _streamed_array(blob: bytes, use_list: bool) -> Iterator[Any]:
    u = codec.unpacker(io.BytesIO(blob), use_list=use_list)
    for _ in range(u.read_array_header()):
        yield u.unpack()


def restore_kv(state: KeyValueState, part: dict[str, Any]) -> None:
    """Apply a kv part (full or delta) to ``state``; the dirty set stays empty. A large part
    (``STREAM_PART_BYTES``) is unpacked entry by entry as it is set, so a state with a hot
    limit spills as it loads instead of holding the whole part as Python objects first."""
    for k in _array_items(part["deleted"], use_list=False):
        state.delete(canonical_key(k))
    keys = _array_items(part["keys"], use_list=False)
    for k, v in zip(keys, _array_items(part["values"], use_list=True)):
        state.set(canonical_key(k), v)
    state.clear_dirty()


_GONE = object()  # a key a delta deleted


def _merge_kv(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold kv parts, oldest first (a full one, then deltas), into one full part: contents as
    ``dict(full)`` updated by each delta in turn.

    A full part above ``STREAM_PART_BYTES`` is streamed: the deltas (small: what changed
    between checkpoints) are folded into one dict, then the full part's entries are unpacked
    one by one, replaced or dropped by it, and packed a chunk at a time, the deltas' new keys
    after them (a key a delta deleted and a later one set again keeps its place). So a holder
    merging the chain of a large state (a map with a hot limit) holds its packed bytes, not
    its entries as Python objects. Smaller parts fold in one dict, which is faster.
    """
    if len(parts[0]["keys"]) + len(parts[0]["values"]) <= STREAM_PART_BYTES:
        keys, values, _ = _kv_items(parts[0])
        folded = dict(zip(keys, values))
        for delta in parts[1:]:
            d_keys, d_values, d_deleted = _kv_items(delta)
            for k in d_deleted:
                folded.pop(k, None)
            folded.update(zip(d_keys, d_values))
        return {"shape": "kv", "keys": _pack(list(folded)), "values": _pack(list(folded.values())),
                "deleted": _pack([])}
    later: dict[Any, Any] = {}
    for delta in parts[1:]:
        d_keys, d_values, d_deleted = _kv_items(delta)
        for k in d_deleted:
            later[k] = _GONE
        later.update(zip(d_keys, d_values))

    def merged() -> Iterator[tuple[Any, Any]]:
        seen = set()
        full = parts[0]
        for k, v in zip(_streamed_array(full["keys"], use_list=False),
                        _streamed_array(full["values"], use_list=True)):
            k = canonical_key(k)
            if k in later:
                seen.add(k)
                v = later[k]
                if v is _GONE:
                    continue
            yield k, v
        for k, v in later.items():
            if v is not _GONE and k not in seen:
                yield k, v

    keys_b, values_b = _packed_columns(merged())
    return {"shape": "kv", "keys": keys_b, "values": values_b, "deleted": _pack([])}


# -- slot tables (vectorized operators) ----------------------------------------------


def table_part(table: pa.Table) -> dict[str, Any]:
    """A ``table`` state part: Arrow IPC of rows keyed by an int ``slot`` column."""
    return {"shape": "table", "ipc": ipc_buffer(table)}


def ipc_buffer(table: pa.Table) -> pa.Buffer:
    """``table`` as an Arrow IPC stream, written once into a buffer of the right size.

    Sized by a first pass that writes nothing: a growing output stream
    reallocates (copies) a large state several times.
    """
    return IpcAttachment(table).buffer()


class IpcAttachment:
    """A table to be serialized as an Arrow IPC stream where its bytes will live.

    ``encode`` of a large state used to write the IPC into a buffer of its
    own and then copy that buffer into the frame: two fresh copies of the
    state (a fresh 1 GB buffer costs 0.2-0.8 s of page faults on the VMs
    here, docs/design.md section 8). ``_frame`` instead asks for the size
    (``nbytes``, from a pass that writes nothing) and has the IPC written
    straight into the frame's buffer (``write_into``).

    >>> a = IpcAttachment(pa.table({"x": [1, 2]}))
    >>> pa.ipc.open_stream(a.buffer()).read_all().column("x").to_pylist(), a.nbytes == a.buffer().size
    ([1, 2], True)
    """

    __slots__ = ("table", "nbytes")

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.nbytes: int = stream_size(table)

    def write_into(self, dest: pa.Buffer) -> None:
        """Write the IPC stream into ``dest``, a mutable buffer of exactly ``nbytes``."""
        write_stream(pa.FixedSizeBufferWriter(dest), self.table)

    def buffer(self) -> pa.Buffer:
        """The IPC stream in a buffer of its own."""
        buf = pa.allocate_buffer(self.nbytes)
        self.write_into(buf)
        return buf


def frozen_table_part(table: pa.Table) -> dict[str, Any]:
    """A ``table`` part not yet serialized: ``encode`` writes its IPC (off the epoch, when async).

    ``table`` must not share buffers with live operator state (take a copy).
    """
    return {"shape": "table", "frozen": table}


def read_table_part(part: dict[str, Any]) -> pa.Table:
    """The table of a ``table`` part (serialized or frozen)."""
    if "frozen" in part:
        return part["frozen"]
    return read_stream(part["ipc"])


def _serialized(state: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    # Frozen tables are written by _frame straight into the frame (IpcAttachment).
    return {name: {"shape": "table", "ipc": IpcAttachment(part["frozen"])} if "frozen" in part else part
            for name, part in state.items()}


def _merge_table(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold table parts, oldest first, into one (frozen: encoded only if it is sent or stored).

    Last write wins per slot. When the oldest part holds slots 0..n-1 in
    order (a full checkpoint of the built-in aggregate) and every column is
    numeric without nulls, each column is copied once and the deltas' last
    writes are scattered into it (``_fold_onto_dense_base``). Otherwise one
    concat for the whole chain: dense slots (0..n-1) find the winner of
    each slot with one ``maximum.at`` over a slot-indexed array, already in
    slot order; sparse ones sort. No sort of the whole state either way.
    """
    tables = [read_table_part(p) for p in parts]
    folded = _fold_onto_dense_base(tables[0], tables[1:])
    if folded is not None:
        return frozen_table_part(folded)
    t = pa.concat_tables(tables, promote_options="permissive")
    if t.num_rows == 0:
        return parts[0]
    slots = np.asarray(t.column("slot"))
    lo, hi = int(slots.min()), int(slots.max())
    if lo >= 0 and hi < 4 * len(slots):
        winner = np.full(hi + 1, -1, dtype=np.int64)
        np.maximum.at(winner, slots, np.arange(len(slots), dtype=np.int64))
        keep = winner[winner >= 0]
        return frozen_table_part(t.take(pa.array(keep)))
    # Sparse slots: keep the last occurrence of each slot, sorted by slot.
    rev = slots[::-1]
    _, first_in_rev = np.unique(rev, return_index=True)
    keep = len(slots) - 1 - first_in_rev
    return frozen_table_part(t.take(pa.array(np.sort(keep))).sort_by("slot"))


def _plain_numbers(col: pa.ChunkedArray | pa.Array) -> np.ndarray | None:
    """A numeric column without nulls as numpy (a view when it is one chunk); None otherwise."""
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)) or col.null_count:
        return None
    if isinstance(col, pa.ChunkedArray):
        col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return col.to_numpy(zero_copy_only=False)


def _is_arange(values: np.ndarray, block: int = 1 << 20) -> bool:
    """Whether ``values`` is 0, 1, ..., n-1 (checked a block at a time: no state-sized temporaries)."""
    return all(np.array_equal(values[i:i + block], np.arange(i, min(i + block, len(values))))
               for i in range(0, len(values), block))


def _fold_onto_dense_base(base: pa.Table, deltas: list[pa.Table]) -> pa.Table | None:
    """``base`` (slots 0..n-1 in order) with ``deltas``' last write per slot, new slots n..m-1
    appended; None when that shape does not hold (the caller's general fold handles it).

    One copy of the state per column and a scatter of the deltas' rows: the
    general fold's ``take`` over the concatenated chain cost about twice as
    much (a 1 GB chain of 129 deltas, one process: 0.54-0.66 s against
    0.33-0.34 s). Columns must be numeric without nulls, with the same
    schema in every part.
    """
    n = base.num_rows
    if n == 0 or any(d.schema != base.schema for d in deltas):
        return None
    slots = _plain_numbers(base.column("slot"))
    if slots is None or int(slots[0]) != 0 or int(slots[-1]) != n - 1 or not _is_arange(slots):
        return None
    delta = pa.concat_tables(deltas) if deltas else base.slice(0, 0)
    d_slots = _plain_numbers(delta.column("slot"))
    if d_slots is None:
        return None
    if len(d_slots) and int(d_slots.min()) < 0:
        return None
    m = max(n, int(d_slots.max()) + 1 if len(d_slots) else 0)
    # The last write of each slot among the deltas (stable: a later delta's row wins).
    by_slot = np.argsort(d_slots, kind="stable")
    sorted_slots = d_slots[by_slot]
    last = np.append(sorted_slots[1:] != sorted_slots[:-1], True) if len(sorted_slots) else np.zeros(0, bool)
    won_slots, won_rows = sorted_slots[last], by_slot[last]
    if m > n and not np.array_equal(won_slots[won_slots >= n], np.arange(n, m)):
        return None  # new slots with a gap: not dense
    cols: dict[str, np.ndarray] = {}
    for name in base.schema.names:
        if name == "slot":
            cols[name] = np.arange(m, dtype=slots.dtype)
            continue
        old, new = _plain_numbers(base.column(name)), _plain_numbers(delta.column(name))
        if old is None or new is None:
            return None
        out = np.empty(m, dtype=old.dtype)
        out[:n] = old
        out[won_slots] = new[won_rows]
        cols[name] = out
    return pa.table({name: pa.array(cols[name], base.schema.field(name).type) for name in base.schema.names})


# -- whole checkpoints -----------------------------------------------------------------


def merge(base: SliceCheckpoint, delta: SliceCheckpoint) -> SliceCheckpoint:
    """Apply ``delta`` to the full checkpoint ``base``: the full checkpoint at ``delta.epoch``."""
    return merge_chain(base, [delta])


def merge_chain(base: SliceCheckpoint, deltas: list[SliceCheckpoint]) -> SliceCheckpoint:
    """Apply ``deltas`` (in epoch order, each following the previous) to the full ``base``.

    Every state part is folded once for the whole chain: a large state with
    many small deltas costs one pass over the state, not one per delta
    (merging a 100 MB slot table per delta made a backup peer spend seconds
    per checkpoint round).
    """
    if base.kind != "full":
        raise ValueError(f"merge needs a full base, got {base.describe()}")
    prev = base
    for delta in deltas:
        if delta.kind != "delta" or delta.prev_epoch != prev.epoch:
            raise ValueError(f"{delta.describe()} does not apply to {prev.describe()}")
        assert (base.stage_id, base.slice_id) == (delta.stage_id, delta.slice_id)
        prev = delta
    if not deltas:
        return base
    parts: dict[str, list[dict[str, Any]]] = {name: [part] for name, part in base.state.items()}
    for delta in deltas:
        for name, part in delta.state.items():
            parts.setdefault(name, []).append(part)
    state = {}
    for name, chain in parts.items():
        if len(chain) == 1:
            state[name] = chain[0]
        elif chain[-1]["shape"] == "kv":
            state[name] = _merge_kv(chain)
        else:
            state[name] = _merge_table(chain)
    last = deltas[-1]
    return SliceCheckpoint(base.stage_id, base.slice_id, last.epoch, "full", -1, last.progress,
                           last.next_seq, state, {})


_BIG = 1 << 16  # binaries above this are attached after the body, never copied into (or out of) msgpack


def _pack_parts(obj: Any, out: list, attached: list) -> None:
    """Append the msgpack encoding of ``obj`` to ``out`` as pieces; each binary above 64 KiB is
    appended to ``attached`` instead, and ``out`` gets a reference to it (ext type 1: index, size).
    """
    if isinstance(obj, dict):
        out.append(msgpack.Packer().pack_map_header(len(obj)))
        for k, v in obj.items():
            out.append(_pack(k))
            _pack_parts(v, out, attached)
    elif isinstance(obj, IpcAttachment):
        if obj.nbytes > _BIG:
            out.append(_REF_HEAD + _REF.pack(len(attached), obj.nbytes))
            attached.append(obj)
        else:
            out.append(_pack(memoryview(obj.buffer())))
    elif isinstance(obj, (bytes, bytearray, memoryview, pa.Buffer)) and (size := memoryview(obj).nbytes) > _BIG:
        out.append(_REF_HEAD + _REF.pack(len(attached), size))
        attached.append(obj)
    else:
        out.append(_pack(memoryview(obj) if isinstance(obj, pa.Buffer) else obj))


def _unpack_payload(header: dict[str, Any], payload: memoryview, what: str, **options: Any) -> Any:
    """The body of a frame's payload, its attachments as views of ``payload`` (no copy)."""
    if "body" not in header:  # version 1: binaries inline
        return msgpack.unpackb(payload, raw=False, ext_hook=codec.ext_hook, **options)
    body, sizes = header["body"], header["attached"]
    starts = [body]
    for size in sizes:
        starts.append(starts[-1] + size)
    if starts[-1] != len(payload):
        raise CheckpointCorrupt(f"{what}: attachments of {starts[-1] - body} bytes in a payload of "
                                f"{len(payload) - body} after the body")

    def attachment(code: int, data: bytes) -> Any:
        if code != _ATTACHED:
            return codec.ext_hook(code, data)
        i, size = _REF.unpack(data)
        if i >= len(sizes) or sizes[i] != size:
            raise CheckpointCorrupt(f"{what}: reference to attachment {i} of {size} bytes does not match "
                                    f"the header ({len(sizes)} attachments)")
        return payload[starts[i]:starts[i] + size]
    return msgpack.unpackb(payload[:body], raw=False, ext_hook=attachment, **options)


_BIG_FRAME = 1 << 23  # frames above this are assembled in a numpy buffer (see _frame)


def _frame(magic: bytes, header: dict[str, Any], body: dict[str, Any]) -> bytes | memoryview:
    """magic, header length, msgpack header (with the payload's length), payload (msgpack body, then
    its attachments), trailing CRC-32.

    The trailing CRC covers header and payload, computed in one pass
    and the frame is joined with one copy: for a state of hundreds of MB
    every extra pass or copy is a visible share of a checkpoint's cost
    (tables, ``IpcAttachment``, are serialized straight into their place:
    no copy at all). A frame above 8 MB is assembled in a numpy buffer and
    returned as a memoryview of it (bytes-like: what every reader of frames
    takes): ``bytes.join`` of a 500 MB frame held the GIL for 0.6 s in the
    encoding thread, stalling the epoch loop it runs beside; numpy's copy
    releases it (and is faster).
    """
    parts: list = []
    attached: list = []
    _pack_parts(body, parts, attached)
    body_len = sum(memoryview(p).nbytes for p in parts)
    sizes = [a.nbytes if isinstance(a, IpcAttachment) else memoryview(a).nbytes for a in attached]
    hb = _pack({**header, "len": body_len + sum(sizes), "body": body_len, "attached": sizes})
    head = magic + _LEN.pack(len(hb)) + hb
    parts.insert(0, head)
    parts.extend(attached)
    total = len(head) + body_len + sum(sizes) + _LEN.size
    if total <= _BIG_FRAME:
        parts = [p.buffer() if isinstance(p, IpcAttachment) else p for p in parts]
        crc = 0
        for p in parts:
            crc = zlib.crc32(p, crc)
        return b"".join([*parts, _LEN.pack(crc)])
    out = np.empty(total, dtype=np.uint8)
    at = 0
    for p in parts:
        if isinstance(p, IpcAttachment):  # written in place: no buffer of its own, no second copy
            p.write_into(pa.py_buffer(out[at:at + p.nbytes]))
            at += p.nbytes
            continue
        piece = np.frombuffer(p, dtype=np.uint8)
        out[at:at + len(piece)] = piece
        at += len(piece)
    out[at:] = np.frombuffer(_LEN.pack(zlib.crc32(out[:at])), dtype=np.uint8)
    return memoryview(out)


def verify(data: bytes, magic: bytes = MAGIC, what: str = "checkpoint") -> dict[str, Any]:
    """Check a frame (magic, length, trailing CRC-32) without parsing its payload; return its header.

    Costs one CRC pass over the bytes and no copy: what a backup holder
    does when a checkpoint arrives and when it lists what it holds.
    ``CheckpointCorrupt`` names the slice and epoch (when the header is
    readable) and says whether the frame is truncated.
    """
    if len(data) < 12 or data[:4] != magic:
        raise CheckpointCorrupt(f"{what}: not a {magic.decode()} frame (bad magic or too short)")
    view = memoryview(data)
    (hlen,) = _LEN.unpack(view[4:8])
    try:
        header = msgpack.unpackb(view[8:8 + hlen], raw=False)
        name = f"stage {header.get('stage')} slice {header.get('slice')} epoch {header.get('epoch')}"
    except Exception:  # noqa: BLE001 - best effort: the name is for the message only
        header, name = None, "unknown slice"
    (trailer,) = _LEN.unpack(view[-4:])
    if zlib.crc32(view[:-4]) != trailer:
        expected_len = None if not isinstance(header, dict) else 8 + hlen + header.get("len", 0) + 4
        if expected_len is not None and len(data) < expected_len:
            raise CheckpointCorrupt(f"{what} ({name}): truncated: {len(data)} of {expected_len} bytes")
        raise CheckpointCorrupt(f"{what} ({name}): checksum mismatch")
    assert isinstance(header, dict)
    if len(data) - 12 - hlen != header["len"]:
        raise CheckpointCorrupt(f"{what} ({name}): truncated: {len(data) - 12 - hlen} of {header['len']} "
                                "payload bytes")
    return header


def _unframe(data: bytes, magic: bytes, what: str) -> tuple[dict[str, Any], memoryview]:
    """Verify a frame; return (header, a view of the payload) or raise ``CheckpointCorrupt``."""
    header = verify(data, magic, what)
    (hlen,) = _LEN.unpack(data[4:8])
    return header, memoryview(data)[8 + hlen:-4]


def encode(ckpt: SliceCheckpoint) -> bytes | memoryview:
    """Bytes of a checkpoint: magic, header, payload, trailing CRC-32 (a memoryview above 8 MB)."""
    payload = {"progress": {str(k): v for k, v in ckpt.progress.items()},
               "next_seq": {str(k): v for k, v in ckpt.next_seq.items()},
               "state": _serialized(ckpt.state), "outputs": {str(k): v for k, v in ckpt.outputs.items()}}
    return _frame(MAGIC, {"v": VERSION, "stage": ckpt.stage_id, "slice": ckpt.slice_id, "epoch": ckpt.epoch,
                          "kind": ckpt.kind, "prev": ckpt.prev_epoch}, payload)


def decode(data: bytes, what: str = "checkpoint") -> SliceCheckpoint:
    """Parse and verify checkpoint bytes; ``CheckpointCorrupt`` names what is wrong."""
    header, payload = _unframe(data, MAGIC, what)
    body = _unpack_payload(header, payload, what, strict_map_key=False)
    return SliceCheckpoint(header["stage"], header["slice"], header["epoch"], header["kind"], header["prev"],
                           {int(k): list(v) for k, v in body["progress"].items()},
                           {int(k): v for k, v in body["next_seq"].items()},
                           body["state"], {int(k): v for k, v in body["outputs"].items()})


# -- carried outputs ---------------------------------------------------------------------

OUTPUTS_MAGIC = b"CSOL"


class RestorePoint(NamedTuple):
    """What rebuilds one slice: its full checkpoint (None: from the start), its carried
    outputs (oldest first), and the encoded frames both came from (``seed``: shipped before
    the slice's first delta at its new place, ``SliceCheckpointer.seed``)."""

    checkpoint: "SliceCheckpoint | None"
    carried: "list[CarriedOutputs]"
    seed: list


@dataclass
class CarriedOutputs:
    """A slice's logged outputs of epochs ``from_epoch..epoch`` (stream id -> rows), shipped with its checkpoints.

    A container that dies takes its output log with it; its consumers may
    still need those rows (a consumer restored from an older checkpoint
    than the producer's). So each checkpoint ships the outputs since the
    previous one (``replace=False``), and each full checkpoint the outputs
    since the job's low-water mark (``replace=True``): a backup holder can
    rebuild the output log of a restored slice from there.
    """

    stage_id: int
    slice_id: int
    from_epoch: int
    epoch: int
    replace: bool
    tables: dict[int, pa.Table]

    def nbytes(self) -> int:
        """Bytes of the rows carried."""
        return sum(t.nbytes for t in self.tables.values())


def encode_outputs(out: CarriedOutputs) -> bytes | memoryview:
    """Bytes of carried outputs: the checkpoint frame with magic ``CSOL`` and Arrow IPC per stream."""
    payload = {str(sid): IpcAttachment(t) for sid, t in out.tables.items()}
    return _frame(OUTPUTS_MAGIC, {"v": VERSION, "stage": out.stage_id, "slice": out.slice_id, "epoch": out.epoch,
                                  "from": out.from_epoch, "replace": out.replace}, payload)


def decode_outputs(data: bytes, what: str = "carried outputs") -> CarriedOutputs:
    """Parse and verify carried outputs (``CheckpointCorrupt`` when damaged)."""
    header, payload = _unframe(data, OUTPUTS_MAGIC, what)
    body = _unpack_payload(header, payload, what)
    return CarriedOutputs(header["stage"], header["slice"], header["from"], header["epoch"], header["replace"],
                          {int(k): read_table_part({"ipc": v}) for k, v in body.items()})


def is_outputs(data: bytes) -> bool:
    """True when ``data`` is a carried-outputs frame (not a checkpoint)."""
    return data[:4] == OUTPUTS_MAGIC


# -- slices ------------------------------------------------------------------------------


def capture(rt: Any, delta: bool, prev_epoch: int = -1, epoch: int | None = None,
            clear: bool = True) -> SliceCheckpoint:
    """Checkpoint a ``SliceRuntime`` at the end of ``epoch`` (default: its last processed one).

    With ``delta``, only what changed since the previous capture (whose
    epoch is ``prev_epoch``) is taken. With ``clear`` (the default) the
    dirty sets are cleared: the next delta starts here; ``clear=False``
    takes a look without starting a new delta.
    """
    if delta and prev_epoch < 0:
        raise ValueError("a delta checkpoint needs the epoch of the previous checkpoint")
    state: dict[str, dict[str, Any]] = {}
    op = rt.op
    if op is not None:
        if hasattr(op, "checkpoint_state"):
            state.update(op.checkpoint_state(delta, clear=clear))
        for name, st in rt.ctx.states.items():
            try:
                state[name] = capture_kv(st, delta)
            except StateEncodingError as exc:
                raise StateEncodingError(f"stage {rt.stage.name!r} slice {rt.slice_id}: checkpoint of {exc}") from None
            if clear:
                st.clear_dirty()
    progress = {sid: arr.tolist() for sid, arr in rt.progress.consumed.items()}
    at = rt.last_epoch if epoch is None else max(epoch, rt.last_epoch)
    return SliceCheckpoint(rt.stage.stage_id, rt.slice_id, at, "delta" if delta else "full",
                           prev_epoch if delta else -1, progress, dict(rt.next_seq), state)


def restore(rt: Any, ckpt: SliceCheckpoint) -> None:
    """Load a full checkpoint into a fresh ``SliceRuntime`` (same plan, stage and slice)."""
    if ckpt.kind != "full":
        raise ValueError(f"restore needs a full checkpoint (merge deltas first), got {ckpt.describe()}")
    if (ckpt.stage_id, ckpt.slice_id) != (rt.stage.stage_id, rt.slice_id):
        raise ValueError(f"{ckpt.describe()} is not stage {rt.stage.stage_id} slice {rt.slice_id}")
    rt.progress.consumed = {sid: np.array(v, dtype=np.int64) for sid, v in ckpt.progress.items()}
    rt.next_seq.update(ckpt.next_seq)
    rt.last_epoch = ckpt.epoch
    op = rt.op
    if op is None:
        return
    own = {}
    for name, part in ckpt.state.items():
        if part["shape"] == "kv" and not name.startswith("__op__"):
            st = rt.ctx.states.get(name)
            if st is None:
                tiers = rt.ctx.cold_tiers
                st = rt.ctx.states[name] = KeyValueState(name, cold=tiers(name) if tiers is not None else None)
            restore_kv(st, part)
        else:
            own[name] = part
    for handle in rt.ctx.handles.values():
        if hasattr(handle, "settle"):
            handle.settle()  # long lists and queues send their middle chunks back to disk
    if own:
        if not hasattr(op, "restore_state"):
            raise ValueError(f"{type(op).__name__} has operator state parts {sorted(own)} but no restore_state()")
        op.restore_state(own)
