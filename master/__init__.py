"""The job master: compiles placement, deploys containers, watches them.

Imports ``chronostream``, ``slices`` and ``containers``; the client imports
it lazily (``chronostream.client``), so there is no import cycle.
"""
