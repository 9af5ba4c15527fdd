"""The ResourceContainer: hosts slices, routes their data, logs their outputs.

Imports ``chronostream`` core types and ``slices``; never the master.
"""
