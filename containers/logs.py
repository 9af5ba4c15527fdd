"""Owns how the runtime's own processes (Ray actors) set up logging; nothing else.

The protocol steps (migration phases, recovery, checkpoint phases) are
logged under ``chronostream.*`` at INFO. Ray actors start with Python's
default (WARNING), so that timeline is silent unless asked for: set
``CHRONOSTREAM_LOG=INFO`` (any ``logging`` level name) in the environment
of the driver that starts Ray, and every master and container process
logs with wall-clock milliseconds, which Ray forwards to the driver.

    CHRONOSTREAM_LOG=INFO python -m chronostream demo
"""

from __future__ import annotations

import logging
import os

ENV = "CHRONOSTREAM_LOG"
FORMAT = "%(asctime)s.%(msecs)03d %(name)s %(levelname)s %(message)s"


def configure_from_env() -> str | None:
    """Set the ``chronostream`` loggers to ``$CHRONOSTREAM_LOG``'s level (a handler on stderr, once);
    return the level set, or None when the variable is unset or empty. A name that is not
    a level raises ``ValueError`` (a typo must not silently leave the log off).
    """
    level = os.environ.get(ENV, "").strip().upper()
    if not level:
        return None
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"{ENV}={level!r} is not a logging level (DEBUG, INFO, WARNING, ERROR)")
    root = logging.getLogger("chronostream")
    root.setLevel(level)
    if not any(getattr(h, "_chronostream", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT, "%H:%M:%S"))
        handler._chronostream = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    return level
