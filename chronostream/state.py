"""Key-value state handles given to operators by ``register_state``.

Owns: the in-memory key-value store of one slice's named state and its dirty
set (every mutation marks its key dirty, deletes included; the checkpoint
layer reads and clears it). Values must be plain data (None, bool, int,
float, str, bytes, list, dict): checkpoints must be readable by another
process, version and machine, so nothing is pickled. Knows no Ray, no lmdb.
"""

from __future__ import annotations

from typing import Any, Iterator

#: The one NaN object used as a key: float("nan") != float("nan"), so every
#: NaN key is mapped to this object, which a dict finds by identity.
NAN_KEY = float("nan")


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

    __slots__ = ("name", "_data", "_dirty")

    def __init__(self, name: str) -> None:
        self.name = name
        self._data: dict[Any, Any] = {}
        self._dirty: set[Any] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        """Return the value of ``key``, or ``default`` when it has none."""
        return self._data.get(key, default)

    def set(self, key: Any, value: Any) -> None:
        """Set ``key`` to ``value`` (plain data only) and mark it dirty."""
        self._data[key] = value
        self._dirty.add(key)

    def delete(self, key: Any) -> None:
        """Remove ``key`` (no error when absent) and mark it dirty."""
        self._data.pop(key, None)
        self._dirty.add(key)

    def __contains__(self, key: Any) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def items(self) -> Iterator[tuple[Any, Any]]:
        """Iterate over (key, value) pairs (in insertion order)."""
        return iter(self._data.items())

    def dirty_keys(self) -> set[Any]:
        """Keys mutated since the last ``clear_dirty`` (for delta checkpoints)."""
        return set(self._dirty)

    def clear_dirty(self) -> None:
        """Forget the dirty set (called by the checkpoint layer)."""
        self._dirty.clear()

    def snapshot(self) -> dict[Any, Any]:
        """A shallow copy of the contents."""
        return dict(self._data)
