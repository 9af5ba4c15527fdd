"""The deterministic simulator (``python -m chronostream.sim``): seeded random queries run under
seeded fault schedules through the in-process runtime, every output checked.

``chronostream.sim.queries`` draws a query from a seed and checks a run's outputs (against the
serial executor, the exactly-once identities and an independent pandas oracle).
"""
