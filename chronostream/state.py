"""Key-value state handles given to operators by ``register_state``.

Owns: the in-memory key-value store of one slice's named state and its dirty
set (every mutation marks its key dirty, deletes included; the checkpoint
layer reads and clears it). Values must be plain data (None, bool, int,
float, str, bytes, list, dict): checkpoints must be readable by another
process, version and machine, so nothing is pickled. Knows no Ray, no lmdb.

**Cold values.** A state may be given a cold tier (the host's spill store,
``containers/spill.py``, duck-typed: ``put``/``get``/``pop``/``delete``/
``clear``). ``spill(key)`` moves a value out of memory to it, ``promote(key)``
brings it back; ``get``, ``in``, ``len`` and ``items`` see both tiers, so a
spilled value is still read, checkpointed and restored like any other (a
restore loads everything into memory; the state library re-spills). Reads
of cold values go through a small cache of the last ``COLD_CACHE`` values.
Which values go cold is the caller's choice (``chronostream.statelib``).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from collections.abc import Iterator
from typing import Any

#: The one NaN object used as a key: float("nan") != float("nan"), so every
#: NaN key is mapped to this object, which a dict finds by identity.
NAN_KEY = float("nan")
#: Cold values a state keeps decoded after reading them (several windows' heads per key).
COLD_CACHE = 256
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


class KeyValueState:
    """A slice-local key-value store: ``get``, ``set``, ``delete``.

    >>> s = KeyValueState("counts")
    >>> s.set("a", 1); s.get("a"), s.get("b", 0)
    (1, 0)
    >>> s.delete("a"); sorted(s.dirty_keys())
    ['a']
    """

    __slots__ = ("_cache", "_cold", "_cold_keys", "_data", "_dirty", "name")

    def __init__(self, name: str, cold: Any = None) -> None:
        self.name = name
        self._data: dict[Any, Any] = {}
        self._dirty: set[Any] = set()
        self._cold = cold  # a SpillTier, or None: everything stays in memory
        self._cold_keys: set[Any] = set()
        self._cache: OrderedDict[Any, Any] = OrderedDict()

    def get(self, key: Any, default: Any = None) -> Any:
        """Return the value of ``key``, or ``default`` when it has none."""
        v = self._data.get(key, _MISSING)
        if v is not _MISSING:
            return v
        if key in self._cold_keys:
            return self._read_cold(key)
        return default

    def _read_cold(self, key: Any) -> Any:
        v = self._cache.get(key, _MISSING)
        if v is _MISSING:
            v = self._cold.get(key)
            self._cache[key] = v
            if len(self._cache) > COLD_CACHE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return v

    def _forget_cold(self, key: Any) -> None:
        self._cold_keys.discard(key)
        self._cache.pop(key, None)
        self._cold.delete(key)

    def set(self, key: Any, value: Any) -> None:
        """Set ``key`` to ``value`` (plain data only) and mark it dirty."""
        self._data[key] = value
        self._dirty.add(key)
        if self._cold_keys and key in self._cold_keys:
            self._forget_cold(key)

    def delete(self, key: Any) -> None:
        """Remove ``key`` (no error when absent) and mark it dirty."""
        self._data.pop(key, None)
        self._dirty.add(key)
        if self._cold_keys and key in self._cold_keys:
            self._forget_cold(key)

    def spill(self, key: Any) -> bool:
        """Move ``key``'s value to the cold tier (no-op without one, or when absent); True when moved.

        Spill values that will not change soon: a later ``set`` brings the
        key back to memory (and deletes the cold copy).
        """
        if self._cold is None or key not in self._data:
            return False
        self._cold.put(key, self._data.pop(key))
        self._cold_keys.add(key)
        return True

    def promote(self, key: Any) -> None:
        """Bring a cold value back to memory (no-op when it is not cold). Does not mark it dirty."""
        if key in self._cold_keys:
            self._cold_keys.discard(key)
            self._cache.pop(key, None)
            self._data[key] = self._cold.pop(key)

    @property
    def spills(self) -> bool:
        """True when this state has a cold tier."""
        return self._cold is not None

    def hot_len(self) -> int:
        """How many values are in memory (``len`` minus the cold ones)."""
        return len(self._data)

    def __contains__(self, key: Any) -> bool:
        return key in self._data or key in self._cold_keys

    def __len__(self) -> int:
        return len(self._data) + len(self._cold_keys)

    def items(self) -> Iterator[tuple[Any, Any]]:
        """Iterate over (key, value) pairs: in memory (insertion order), then cold ones."""
        yield from self._data.items()
        for k in list(self._cold_keys):
            yield k, self._cache[k] if k in self._cache else self._cold.get(k)

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
        """Forget the dirty set (called by the checkpoint layer)."""
        self._dirty.clear()

    def snapshot(self) -> dict[Any, Any]:
        """A shallow copy of the contents (cold values read back)."""
        return dict(self.items())

    def drop_cold(self) -> None:
        """Forget every cold value (the slice leaves this host): frees its disk."""
        if self._cold is not None:
            self._cold.clear()
        self._cold_keys.clear()
        self._cache.clear()
