"""The autoscaling policies users pass to ``cs.run(q, autoscale=...)``, and their offline replay.

The policies are defined where the master reads them (``chronostream.master.policies``);
this module is their public name::

    from chronostream.autoscale import RatePolicy, simulate
    job = cs.run(q, autoscale=RatePolicy(catch_up_s=10), autoscale_interval_s=1.0)
    simulate(RatePolicy(catch_up_s=10), [d.snapshot for d in job.autoscale_trace()])
"""

from chronostream.master.policies import (BUILTIN, CompactionRule, Decision, HotSliceRule, LatencyPolicy, Policies,
                                          Policy, RatePolicy, ScalingAction, ScheduledPolicy, UtilizationPolicy,
                                          read_trace, simulate, write_trace)

__all__ = ["BUILTIN", "CompactionRule", "Decision", "HotSliceRule", "LatencyPolicy", "Policies", "Policy",
           "RatePolicy", "ScalingAction", "ScheduledPolicy", "UtilizationPolicy", "read_trace", "simulate",
           "write_trace"]
