"""One computation slice: operator instance, state, progress vector, merge and numbering.

Imports only ``chronostream`` core types; knows nothing of Ray or containers.
"""

from chronostream.slices.progress import ProgressVector
from chronostream.slices.slice import SliceRuntime

__all__ = ["ProgressVector", "SliceRuntime"]
