"""Key-value state handles given to operators by ``register_state``.

Owns: the in-memory key-value store of one slice's named state and its dirty
set (every mutation marks its key dirty, deletes included; the checkpoint
layer reads and clears it). Values must be what ``chronostream.slices.codec``
carries (plain data: None, bool, int, float, str, bytes, list, dict; dates,
times, durations, Decimal, Arrow tables and arrays): checkpoints must be
readable by another process, version and machine, so nothing is pickled.
Knows no Ray, no lmdb.

**Cold values.** A state may be given a cold tier (the host's spill store,
``containers/spill.py``, duck-typed: ``put``/``get``/``get_or``/``contains``/
``pop``/``write_many``/``items``/``clear``). ``spill(key)`` moves a value out
of memory to it, ``promote(key)`` brings it back; ``get``, ``in``, ``len``
and ``items`` see both tiers, so a spilled value is still read,
checkpointed and restored like any other. The cold tier is the record of
which keys are cold (the state keeps only their count): a key not in memory
costs one lmdb read to tell cold from absent. Reads of cold values go
through a small cache of the last ``COLD_CACHE`` values. Which values go
cold is the caller's choice (``chronostream.slices.statelib``: a long queue's
middle chunks), or, with a **hot limit** (``hot_limit``: at most that many
values in memory), the state's own: when a write would hold more, the
values written longest ago go cold, an eighth of the limit more at a time
so that one lmdb transaction carries many (a write makes its key the most
recent; reads do not reorder). The cold copy of a value written again, or
deleted, is dead at once (listed in ``_stale``) and deleted with the next
such transaction, or once ``STALE_BATCH`` are pending. Without a cold tier
(the serial executor, ``spill_state=False``) the limit has no effect:
everything stays in memory.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from collections.abc import Iterator
from typing import Any

from chronostream.slices.errors import StateEncodingError

#: The one NaN object used as a key: float("nan") != float("nan"), so every
#: NaN key is mapped to this object, which a dict finds by identity.
NAN_KEY = float("nan")
#: Cold values a state keeps decoded after reading them (several windows' heads per key).
COLD_CACHE = 256
#: Cold copies of rewritten or deleted values pending deletion before one transaction drops them.
STALE_BATCH = 256
_MISSING = object()


def canonical_key(value: Any) -> Any:
    """A key value as state dicts see it: every NaN is ``NAN_KEY``, -0.0 is 0.0, inside tuples too.

    Tuples are canonicalized element-wise because state keys such as
    ``(user_key, chunk_no)`` come back from a checkpoint as new tuples
    holding new float objects, and a NaN inside a tuple compares unequal
    unless it is the same object.

    >>> canonical_key(("a", float("nan")))[1] is NAN_KEY, canonical_key(-0.0)
    (True, 0.0)
    """
    if type(value) is str:  # the common case first: state keys are mostly strings
        return value
    if isinstance(value, float):
        if value != value:
            return NAN_KEY
        if value == 0.0:
            return 0.0
    elif isinstance(value, tuple):
        return tuple(canonical_key(v) for v in value)
    return value


def check_hot_limit(name: str, hot_limit: int | None, what: str = "state") -> int | None:
    """``hot_limit`` if it is None or a positive int, else a ValueError naming the state
    (or the ``what`` it is given to: a window).

    >>> check_hot_limit("seen", 0)
    Traceback (most recent call last):
    ValueError: state 'seen': hot_entries must be a positive int or None, got 0
    """
    if hot_limit is None or (isinstance(hot_limit, int) and not isinstance(hot_limit, bool) and hot_limit >= 1):
        return hot_limit
    raise ValueError(f"{what} {name!r}: hot_entries must be a positive int or None, got {hot_limit!r}")


class KeyValueState:
    """A slice-local key-value store: ``get``, ``set``, ``delete``.

    >>> s = KeyValueState("counts")
    >>> s.set("a", 1); s.get("a"), s.get("b", 0)
    (1, 0)
    >>> s.delete("a"); sorted(s.dirty_keys())
    ['a']
    """

    __slots__ = ("_absent", "_cache", "_cold", "_cold_count", "_data", "_dirty", "_stale", "hot_limit", "name")

    def __init__(self, name: str, cold: Any = None, hot_limit: int | None = None) -> None:
        self.name = name
        self._data: dict[Any, Any] = {}
        self._dirty: set[Any] = set()
        # The cold tier (a SpillTier, or None: everything stays in memory) is the record of
        # which keys are cold: no Python object per cold key, so a map of millions of
        # entries holds only its hot ones. A key is never hot and cold at once.
        self._cold = cold
        self._cold_count = 0  # live cold copies
        self._stale: set[Any] = set()  # keys whose cold copy is dead, not deleted yet
        self._cache: OrderedDict[Any, Any] = OrderedDict()  # decoded live cold values
        # The last key the cold tier was asked for and did not have: a map's insert reads the
        # new entry (absent), then writes it, which would ask again. Reset when anything goes cold.
        self._absent: Any = _MISSING
        self.hot_limit = check_hot_limit(name, hot_limit)

    def get(self, key: Any, default: Any = None) -> Any:
        """Return the value of ``key``, or ``default`` when it has none."""
        v = self._data.get(key, _MISSING)
        if v is not _MISSING:
            return v
        if self._cold_count:
            v = self._read_cold(key)
            if v is not _MISSING:
                return v
        return default

    def _read_cold(self, key: Any) -> Any:
        """The live cold value of ``key``, or ``_MISSING`` (a key not in memory: cold or absent)."""
        v = self._cache.get(key, _MISSING)
        if v is not _MISSING:
            self._cache.move_to_end(key)
            return v
        if key in self._stale or (self._absent is not _MISSING and self._absent == key):
            return _MISSING
        v = self._cold.get_or(key, _MISSING)
        if v is not _MISSING:
            self._cache[key] = v
            if len(self._cache) > COLD_CACHE:
                self._cache.popitem(last=False)
        else:
            self._absent = key
        return v

    def _is_cold(self, key: Any) -> bool:
        """Whether ``key`` (not in memory) has a live cold copy."""
        if not self._cold_count or key in self._stale:
            return False
        if key in self._cache:
            return True
        if self._absent is not _MISSING and self._absent == key:
            return False
        return self._cold.contains(key)

    def _forget_cold(self, key: Any) -> None:
        """``key``'s cold copy is dead (written again, or deleted): deleted with the next batch."""
        self._cold_count -= 1
        self._cache.pop(key, None)
        self._stale.add(key)
        if len(self._stale) >= STALE_BATCH:
            self._cold.write_many((), self._stale)
            self._stale.clear()

    def set(self, key: Any, value: Any) -> None:
        """Set ``key`` to ``value`` (a value ``chronostream.slices.codec`` carries) and mark it dirty."""
        data = self._data
        bounded = self.hot_limit is not None and self._cold is not None
        was_hot = (data.pop(key, _MISSING) if bounded  # the key becomes the most recent write: cold last
                   else data.get(key, _MISSING)) is not _MISSING
        data[key] = value
        self._dirty.add(key)
        if not was_hot and self._cold_count and self._is_cold(key):
            self._forget_cold(key)
        if bounded:
            self._evict_if_over()

    def _evict_if_over(self) -> None:
        if self.hot_limit is not None and len(self._data) > self.hot_limit:
            self._evict()

    def _evict(self) -> None:
        """Move the values written longest ago to the cold tier: down to 7/8 of the hot limit."""
        data = self._data
        n = len(data) - self.hot_limit + self.hot_limit // 8
        keys = list(islice(data, n))
        try:  # (a key both stale and evicted: deleted, then written, in one transaction)
            self._cold.write_many([(k, data[k]) for k in keys], self._stale)
        except StateEncodingError as exc:  # the codec refused a value: nothing moved
            raise StateEncodingError(f"state {self.name!r} holds a value the spill store cannot encode: {exc}") from None
        for k in keys:
            del data[k]
        self._stale.clear()
        self._cold_count += len(keys)
        self._absent = _MISSING

    def delete(self, key: Any) -> None:
        """Remove ``key`` (no error when absent) and mark it dirty."""
        was_hot = self._data.pop(key, _MISSING) is not _MISSING
        self._dirty.add(key)
        if not was_hot and self._cold_count and self._is_cold(key):
            self._forget_cold(key)

    def spill(self, key: Any) -> bool:
        """Move ``key``'s value to the cold tier (no-op without one, or when absent); True when moved.

        Spill values that will not change soon: a later ``set`` brings the
        key back to memory (and deletes the cold copy).
        """
        if self._cold is None or key not in self._data:
            return False
        self._stale.discard(key)  # (its dead copy is overwritten here)
        self._cold.put(key, self._data.pop(key))
        self._cold_count += 1
        self._absent = _MISSING
        return True

    def promote(self, key: Any) -> None:
        """Bring a cold value back to memory (no-op when it is not cold). Does not mark it dirty."""
        if key not in self._data and self._is_cold(key):
            self._cold_count -= 1
            self._cache.pop(key, None)
            self._data[key] = self._cold.pop(key)
            self._evict_if_over()

    @property
    def spills(self) -> bool:
        """True when this state has a cold tier."""
        return self._cold is not None

    def hot_len(self) -> int:
        """How many values are in memory (``len`` minus the cold ones)."""
        return len(self._data)

    def __contains__(self, key: Any) -> bool:
        return key in self._data or self._is_cold(key)

    def __len__(self) -> int:
        return len(self._data) + self._cold_count

    def items(self) -> Iterator[tuple[Any, Any]]:
        """Iterate over (key, value) pairs: in memory (insertion order), then cold ones (in the
        cold tier's key order, one read transaction)."""
        yield from self._data.items()
        if self._cold_count:
            stale = self._stale
            for k, v in self._cold.items():
                k = canonical_key(k)
                if k not in stale:
                    yield k, v

    def sample(self, n: int) -> list[tuple[Any, Any]]:
        """Up to ``n`` in-memory (key, value) pairs spread evenly over insertion order (for size estimates).

        Strided, not the first ``n``: in a churning map the oldest entries
        are unlike the rest (the longest-lived, often the largest).
        """
        step = max(1, len(self._data) // max(n, 1))
        return list(islice(self._data.items(), 0, None, step))[:n]

    def dirty_keys(self) -> set[Any]:
        """Keys mutated since the last ``clear_dirty`` (for delta checkpoints)."""
        return set(self._dirty)

    def clear_dirty(self) -> None:
        """Forget the dirty set (called by the checkpoint layer, and each epoch by a container
        that takes no checkpoints: nothing would read it)."""
        self._dirty.clear()

    def snapshot(self) -> dict[Any, Any]:
        """A shallow copy of the contents (cold values read back)."""
        return dict(self.items())

    def drop_cold(self) -> None:
        """Forget every cold value (the slice leaves this host): frees its disk."""
        if self._cold is not None:
            self._cold.clear()
        self._cold_count = 0
        self._stale.clear()
        self._cache.clear()
