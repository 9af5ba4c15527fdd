"""The runtime's protocols as sans-IO state machines: events in, commands out.

Each module owns one protocol: its states, its transitions, the story of
every transition and the invariants asserted at each. None knows Ray, a
clock or a file: a driver (``master.local.LocalCluster`` in this process,
``master.actor.JobMaster`` on Ray) carries out the commands and feeds the
results back as events, so both drivers and the simulator run the same
protocol code.
"""
