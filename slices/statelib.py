"""The extended state library: value, map, list, queue and top-K handles over ``KeyValueState``.

Owns: the layout of each handle kind inside one ``KeyValueState`` (which
keys hold what), and the chunking that keeps delta checkpoints small. Must
not touch: checkpoints, slices or executors. Every handle keeps *all* of its
contents in its key-value state and nothing on the side (no cache), so the
checkpoint layer captures a handle as the dirty keys of that state, and a
slice restored from a checkpoint (``slices/checkpoint.py: restore``) sees
exactly the restored contents through handles created by ``setup()``.

**Keying.** Every method takes the key first: ``queue.append(card, item)``.
The runtime does not tell an operator "the current key": an operator may
have several inputs keyed by different columns, and the key only decides the
slice. ``handle.at(key)`` returns a view bound to one key for readability.
Keys must be hashable values ``chronostream.slices.codec`` carries (None, bool,
int, float, str, bytes, dates and times, Decimal, or tuples of them); they
are canonicalized (``canonical_key``: one NaN, -0.0 is 0.0) so they survive
a checkpoint round trip.

**Values** are what ``chronostream.slices.codec`` carries: plain data (None, bool,
int, float, str, bytes, lists and dicts of them), dates, times, durations,
Decimal, Arrow tables and arrays. A checkpoint round trip turns tuples inside values into
lists. Never mutate a value a handle returned without writing it back: the
handle would not know the key is dirty.

**Layout and chunking** (``S`` = the handle's ``KeyValueState``)::

    ValueState  S[key]                    -> value
    ListState,  S[("m", key)]             -> [head, tail]   absolute item indices
    QueueState  S[("c", key, n)]          -> chunk n: items head.. of [n*C, (n+1)*C)
    MapState    S[("h", key)]             -> [pages, size, cur, free]  cur: the page taking inserts
                S[("p", key, i)]          -> page i: list of <= C map keys
                S[("e", key, map_key)]    -> [page, value]
    TopKState   S[key]                    -> [next_seq, [[score, seq, item], ...]]  (<= k)

A list or queue of ``n`` items is ``ceil(n / C)`` chunks of ``C`` items
(``chunk_size``, default 64) addressed by absolute index: item ``i`` lives in
chunk ``i // C`` at offset ``i % C``. ``append`` rewrites only the tail chunk
and the meta entry; ``popleft`` rewrites only the meta entry (the popped item
stays in its chunk until the chunk is exhausted, then the chunk is deleted).
So a delta checkpoint holds O(chunks touched) entries, never the whole list,
whatever its length. A map stores each entry under its own key (a set or
update rewrites one entry); its key directory, needed only to iterate, is
paged the same way (insert rewrites the page taking inserts, delete one
page; a page emptied by deletes is reused before the directory grows, so a
churning map keeps O(live entries) pages).

**Cold chunks** (Railgun's event reservoir). When the state has a cold tier
(on Ray: the host's lmdb spill store, ``containers/spill.py``), a list or
queue keeps in memory only its head chunk and its last two chunks: when
``append`` starts chunk ``n``, chunk ``n - 2`` is spilled (full, and no
longer written); when ``popleft`` enters chunk ``n``, it is promoted back.
A window's other heads (several windows over one queue) read cold chunks
through the state's small read cache. So a long window's memory is
O(chunks at its ends) per key plus one small key per spilled chunk, whatever
its length; checkpoints read spilled chunks back, and ``settle`` re-spills
after a restore.

**Hot limits** (``register_value(name, hot_entries=N)``, and the same
option of ``register_map``, ``register_list`` and ``register_queue``). A
value or map entry is written anywhere at any time, and a million idle
keys' short queues have no middle chunks, so cold chunks alone do not
bound memory: the state keeps at most
``N`` entries in memory and sends the ones written longest ago to the cold
tier (``KeyValueState.hot_limit``); a read of a cold entry goes through the
state's read cache, a write brings it back. A map of millions of entries
per slice then holds ``N`` of them in memory and nothing for the others
(the spill store is the record of which keys are cold). Checkpoints read cold entries back; a restore re-spills as it
loads. Without a cold tier (the serial executor) the limit does nothing.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Iterator

from chronostream.slices.state import KeyValueState, canonical_key, check_hot_limit

#: Items per list/queue chunk and map keys per directory page.
DEFAULT_CHUNK_SIZE = 64


def _hashable(value: Any) -> Any:
    """Lists back to tuples: a map key read from a checkpointed page comes back as a list."""
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


class _Handle:
    """Shared by all handles: the backing state and the bound-view helper."""

    kind = "handle"

    def __init__(self, state: KeyValueState) -> None:
        self.state = state
        self.name = state.name

    def at(self, key: Any) -> "BoundHandle":
        """A view of this handle for one key: ``h.at(k).append(x)`` is ``h.append(k, x)``."""
        return BoundHandle(self, canonical_key(key))


class BoundHandle:
    """A handle with its key filled in (see ``_Handle.at``)."""

    __slots__ = ("_handle", "_key")

    def __init__(self, handle: _Handle, key: Any) -> None:
        self._handle = handle
        self._key = key

    def __getattr__(self, attr: str) -> Callable[..., Any]:
        fn = getattr(self._handle, attr)
        return lambda *args, **kwargs: fn(self._key, *args, **kwargs)

    def __len__(self) -> int:
        return self._handle.len(self._key)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._handle.items(self._key))  # type: ignore[attr-defined]


class ValueState(_Handle):
    """One value per key. ``hot_entries``: at most that many values in memory, the rest in the
    host's spill store (see *Hot limits* in the module docstring).

    >>> v = ValueState(KeyValueState("last"))
    >>> v.set("card1", 42.5); v.get("card1"), v.get("card2", 0)
    (42.5, 0)
    """

    kind = "value"

    def __init__(self, state: KeyValueState, hot_entries: int | None = None) -> None:
        super().__init__(state)
        self.hot_entries = state.hot_limit = check_hot_limit(state.name, hot_entries)

    def get(self, key: Any, default: Any = None) -> Any:
        """The value of ``key``, or ``default``."""
        return self.state.get(canonical_key(key), default)

    def set(self, key: Any, value: Any) -> None:
        """Set the value of ``key``."""
        self.state.set(canonical_key(key), value)

    def clear(self, key: Any) -> None:
        """Remove the value of ``key``."""
        self.state.delete(canonical_key(key))


class ListState(_Handle):
    """A list per key, stored in chunks of ``chunk_size`` items (see the module docstring).

    Indices are relative to the first item, as in a Python list.

    ``hot_entries``: at most that many state entries (chunks and per-key headers together)
    in memory, the rest in the host's spill store (*Hot limits*, module docstring): the
    chunks of idle keys go cold too, not only the middle chunks of long lists.

    >>> l = ListState(KeyValueState("seen"), chunk_size=2)
    >>> for x in "abcde": l.append("k", x)
    >>> l.len("k"), l.get("k", 3), list(l.items("k"))
    (5, 'd', ['a', 'b', 'c', 'd', 'e'])
    """

    kind = "list"

    def __init__(self, state: KeyValueState, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 hot_entries: int | None = None) -> None:
        super().__init__(state)
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        self.chunk_size = chunk_size
        self.hot_entries = state.hot_limit = check_hot_limit(state.name, hot_entries)

    # -- layout helpers (absolute indices) -------------------------------------------

    def index_range(self, key: Any) -> tuple[int, int]:
        """``(head, tail)``: absolute indices of the first item and one past the last.

        Absolute indices never move: ``popleft`` raises ``head``, ``append``
        raises ``tail``. They stay valid handles on items across pops.
        """
        meta = self.state.get(("m", canonical_key(key)))
        return (0, 0) if meta is None else (meta[0], meta[1])

    def item_at(self, key: Any, index: int) -> Any:
        """The item at absolute ``index`` (``head <= index < tail``)."""
        key = canonical_key(key)
        head, tail = self.index_range(key)
        if not head <= index < tail:
            raise IndexError(f"{self.name}[{key!r}]: index {index} outside [{head}, {tail})")
        return self.state.get(("c", key, index // self.chunk_size))[index % self.chunk_size]

    def _set_meta(self, key: Any, head: int, tail: int) -> None:
        self.state.set(("m", key), [head, tail])

    # -- list API ---------------------------------------------------------------------

    def len(self, key: Any) -> int:
        """Number of items of ``key``."""
        head, tail = self.index_range(key)
        return tail - head

    def append(self, key: Any, item: Any) -> None:
        """Add ``item`` at the end: rewrites the tail chunk and the meta entry only."""
        key = canonical_key(key)
        head, tail = self.index_range(key)
        n, off = divmod(tail, self.chunk_size)
        ck = ("c", key, n)
        chunk = self.state.get(ck) if off else None
        if chunk is None:
            # A new chunk, or one deleted when a queue emptied mid-chunk: pad the
            # slots before ``off`` (they are below ``head``, never read).
            chunk = [None] * off
        assert len(chunk) == off, f"{self.name}[{key!r}]: chunk {n} has {len(chunk)} items, expected {off}"
        chunk.append(item)
        self.state.set(ck, chunk)
        self._set_meta(key, head, tail + 1)
        if off == 0 and n - 2 > head // self.chunk_size and self.state.spills:
            self.state.spill(("c", key, n - 2))  # full, and written no more: to the cold tier

    def extend(self, key: Any, items: Any) -> None:
        """Append every item of ``items``."""
        for item in items:
            self.append(key, item)

    def _abs(self, key: Any, i: int) -> int:
        head, tail = self.index_range(key)
        j = i + tail if i < 0 else i + head
        if not head <= j < tail:
            raise IndexError(f"{self.name}[{key!r}]: index {i} out of range (length {tail - head})")
        return j

    def get(self, key: Any, i: int) -> Any:
        """The ``i``-th item (negative counts from the end)."""
        key = canonical_key(key)
        return self.item_at(key, self._abs(key, i))

    def set(self, key: Any, i: int, item: Any) -> None:
        """Replace the ``i``-th item: rewrites its chunk only."""
        key = canonical_key(key)
        j = self._abs(key, i)
        ck = ("c", key, j // self.chunk_size)
        chunk = self.state.get(ck)
        chunk[j % self.chunk_size] = item
        self.state.set(ck, chunk)

    def pop(self, key: Any) -> Any:
        """Remove and return the last item: rewrites (or deletes) the tail chunk."""
        key = canonical_key(key)
        head, tail = self.index_range(key)
        if tail == head:
            raise IndexError(f"pop from the empty {self.kind} {self.name}[{key!r}]")
        last = tail - 1
        n, off = divmod(last, self.chunk_size)
        ck = ("c", key, n)
        chunk = self.state.get(ck)
        item = chunk[off]
        if off == 0 or last == head:
            self.state.delete(ck)  # nothing of this chunk is left in the list
        else:
            del chunk[off:]
            self.state.set(ck, chunk)
        self._set_meta(key, head, last)
        return item

    def items(self, key: Any) -> Iterator[Any]:
        """The items of ``key``, first to last (a chunk at a time)."""
        return self.scan(key)

    def scan(self, key: Any, start: int | None = None) -> Iterator[Any]:
        """The items from absolute index ``start`` (default: the head) to the last, a chunk at a time."""
        key = canonical_key(key)
        head, tail = self.index_range(key)
        head = head if start is None else max(start, head)
        if tail <= head:
            return
        c = self.chunk_size
        get = self.state.get
        for n in range(head // c, (tail - 1) // c + 1):
            chunk = get(("c", key, n))
            yield from chunk[max(head - n * c, 0):min(tail - n * c, c)]

    def settle(self) -> int:
        """Spill every key's middle chunks (after a restore loaded them all); returns how many."""
        if not self.state.spills:
            return 0
        c, n = self.chunk_size, 0
        metas = [(k[1], v) for k, v in list(self.state.items()) if isinstance(k, tuple) and k[0] == "m"]
        for key, (head, tail) in metas:
            for chunk in range(head // c + 1, (tail - 1) // c - 1):
                n += self.state.spill(("c", key, chunk))
        return n

    def clear(self, key: Any) -> None:
        """Remove every item and the meta entry of ``key`` (indices restart at 0)."""
        key = canonical_key(key)
        head, tail = self.index_range(key)
        if tail > head:
            for n in range(head // self.chunk_size, (tail - 1) // self.chunk_size + 1):
                self.state.delete(("c", key, n))
        self.state.delete(("m", key))


class QueueState(ListState):
    """A FIFO (double-ended) queue per key: a chunked list that also pops from the front.

    ``popleft`` rewrites only the meta entry, so a long queue that slides
    (appends at the tail, pops at the head) costs O(1) dirty keys per event.

    >>> q = QueueState(KeyValueState("events"), chunk_size=2)
    >>> for x in range(5): q.append("k", x)
    >>> q.popleft("k"), q.popleft("k"), q.peekleft("k"), q.peek("k"), q.index_range("k")
    (0, 1, 2, 4, (2, 5))
    """

    kind = "queue"

    def popleft(self, key: Any) -> Any:
        """Remove and return the first item; deletes its chunk once every item of it is popped."""
        key = canonical_key(key)
        head, tail = self.index_range(key)
        if tail == head:
            raise IndexError(f"popleft from the empty queue {self.name}[{key!r}]")
        n, off = divmod(head, self.chunk_size)
        ck = ("c", key, n)
        item = self.state.get(ck)[off]
        if off == self.chunk_size - 1 or head + 1 == tail:
            self.state.delete(ck)  # every item of this chunk is popped (or the queue is empty)
            self.state.promote(("c", key, n + 1))  # the new head chunk comes back to memory
        self._set_meta(key, head + 1, tail)
        return item

    def peekleft(self, key: Any) -> Any:
        """The first item (IndexError when empty)."""
        return self.get(key, 0)

    def peek(self, key: Any) -> Any:
        """The last item (IndexError when empty)."""
        return self.get(key, -1)


class MapState(_Handle):
    """A map per key: each entry under its own state key, plus a paged key directory.
    ``hot_entries``: at most that many state entries (map entries, directory pages and
    headers together) in memory, the rest in the host's spill store (*Hot limits*, module
    docstring).

    >>> m = MapState(KeyValueState("per_merchant"))
    >>> m.set("card1", "shopA", 2); m.set("card1", "shopB", 1); m.delete("card1", "shopA")
    >>> m.get("card1", "shopB"), m.len("card1"), list(m.items("card1"))
    (1, 1, [('shopB', 1)])
    """

    kind = "map"

    def __init__(self, state: KeyValueState, page_size: int = DEFAULT_CHUNK_SIZE,
                 hot_entries: int | None = None) -> None:
        super().__init__(state)
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.hot_entries = state.hot_limit = check_hot_limit(state.name, hot_entries)

    def _header(self, key: Any) -> list:
        """``[pages, size, cur, free]``: pages allocated, entries, the page taking inserts, emptied pages to reuse."""
        h = self.state.get(("h", key))
        if h is None:
            return [0, 0, -1, []]
        pages, size = h[0], h[1]
        return [pages, size, h[2], list(h[3])] if len(h) > 2 else [pages, size, pages - 1, []]

    def get(self, key: Any, map_key: Any, default: Any = None) -> Any:
        """The value of ``map_key`` in ``key``'s map, or ``default``."""
        e = self.state.get(("e", canonical_key(key), canonical_key(map_key)))
        return default if e is None else e[1]

    def contains(self, key: Any, map_key: Any) -> bool:
        """True when ``key``'s map has ``map_key``."""
        return ("e", canonical_key(key), canonical_key(map_key)) in self.state

    def len(self, key: Any) -> int:
        """Number of entries of ``key``'s map."""
        return self._header(canonical_key(key))[1]

    def set(self, key: Any, map_key: Any, value: Any) -> None:
        """Set one entry: rewrites that entry (and, for a new one, its directory page and the header)."""
        key, map_key = canonical_key(key), canonical_key(map_key)
        ek = ("e", key, map_key)
        e = self.state.get(ek)
        if e is not None:
            self.state.set(ek, [e[0], value])
            return
        pages, size, cur, free = self._header(key)
        page = self.state.get(("p", key, cur)) if 0 <= cur < pages else None
        if page is None and 0 <= cur < pages:
            page = []  # the insert page emptied out: fill it again
        if page is None or len(page) >= self.page_size:
            # A page emptied by deletes is reused before the directory grows, so a map
            # that churns (insert new, delete old) keeps O(live entries) pages.
            if free:
                cur = free.pop(0)
            else:
                cur, pages = pages, pages + 1
            page = []
        page.append(map_key)
        self.state.set(("p", key, cur), page)
        self.state.set(ek, [cur, value])
        self.state.set(("h", key), [pages, size + 1, cur, free])

    def delete(self, key: Any, map_key: Any) -> None:
        """Remove one entry (no error when absent): rewrites it, its directory page and the header."""
        key, map_key = canonical_key(key), canonical_key(map_key)
        ek = ("e", key, map_key)
        e = self.state.get(ek)
        if e is None:
            return
        pk = ("p", key, e[0])
        page = [_hashable(k) for k in self.state.get(pk)]
        page.remove(map_key)
        pages, size, cur, free = self._header(key)
        if page:
            self.state.set(pk, page)
        else:
            self.state.delete(pk)
            if e[0] != cur:
                free.append(e[0])
                free.sort()
            while pages and ("p", key, pages - 1) not in self.state and pages - 1 != cur:
                pages -= 1  # trailing empty pages go
                free = [f for f in free if f < pages]
        self.state.delete(ek)
        if size == 1:
            self.state.delete(("h", key))  # (every page is empty, hence deleted, by now)
        else:
            self.state.set(("h", key), [pages, size - 1, cur, free])

    def increment(self, key: Any, map_key: Any, by: int = 1) -> int:
        """Add ``by`` to an integer entry (missing = 0); delete it when it reaches 0. Returns the new value."""
        n = self.get(key, map_key, 0) + by
        if n:
            self.set(key, map_key, n)
        else:
            self.delete(key, map_key)
        return n

    def keys(self, key: Any) -> Iterator[Any]:
        """The map keys of ``key``, in directory order (page by page; emptied pages are reused)."""
        key = canonical_key(key)
        pages = self._header(key)[0]
        for i in range(pages):
            for k in self.state.get(("p", key, i)) or ():
                yield _hashable(k)

    def items(self, key: Any) -> Iterator[tuple[Any, Any]]:
        """``(map_key, value)`` pairs of ``key``'s map."""
        for mk in self.keys(key):
            yield mk, self.get(key, mk)

    def clear(self, key: Any) -> None:
        """Remove every entry of ``key``'s map."""
        key = canonical_key(key)
        pages = self._header(key)[0]
        for i in range(pages):
            for mk in self.state.get(("p", key, i)) or ():
                self.state.delete(("e", key, _hashable(mk)))
            self.state.delete(("p", key, i))
        self.state.delete(("h", key))


class TopKState(_Handle):
    """The ``k`` items with the largest scores per key (ties: the earlier offer wins).

    The whole top list of a key is one value of at most ``k`` entries, so a
    rewrite per offer is bounded by ``k``.

    >>> t = TopKState(KeyValueState("biggest"), k=2)
    >>> [t.offer("card1", amount, shop) for amount, shop in [(5, "a"), (9, "b"), (5, "c"), (7, "d")]]
    [True, True, False, True]
    >>> t.items("card1")
    [(9, 'b'), (7, 'd')]
    """

    kind = "topk"

    def __init__(self, state: KeyValueState, k: int) -> None:
        super().__init__(state)
        if k < 1:
            raise ValueError("k must be >= 1")
        self.k = k

    def offer(self, key: Any, score: float, item: Any) -> bool:
        """Offer ``item`` with ``score``; True when it is now among the top k."""
        key = canonical_key(key)
        cur = self.state.get(key)
        seq, entries = (0, []) if cur is None else (cur[0], cur[1])
        # Order: larger score first, then smaller seq (earlier offer) first.
        entries = entries + [[score, seq, item]]
        top = heapq.nsmallest(self.k, entries, key=lambda e: (-e[0], e[1]))
        self.state.set(key, [seq + 1, top])
        return any(e[1] == seq for e in top)

    def items(self, key: Any) -> list[tuple[Any, Any]]:
        """``(score, item)`` pairs, best first."""
        cur = self.state.get(canonical_key(key))
        return [] if cur is None else [(e[0], e[2]) for e in cur[1]]

    def len(self, key: Any) -> int:
        """How many items ``key`` holds (at most k)."""
        cur = self.state.get(canonical_key(key))
        return 0 if cur is None else len(cur[1])

    def clear(self, key: Any) -> None:
        """Forget ``key``'s items."""
        self.state.delete(canonical_key(key))


HANDLE_KINDS: dict[str, type[_Handle]] = {
    "value": ValueState, "list": ListState, "queue": QueueState, "map": MapState, "topk": TopKState,
}
