"""The end-of-input hook (``Operator.on_end``) on Ray: real actors, killed and rescaled near the end.

The sources are slowed (a ``delay`` fault) so the faults land in the job's
last epochs; every sink must equal the serial executor's, the hooks' rows
included (tests/test_end_of_input.py specifies them).
"""

from __future__ import annotations

import pytest

from chronostream.chaos import Fault, run_with_faults
from test_end_of_input import EPOCH, closing_windows_query, totals_query


EPOCHS = 400 // EPOCH + 1  # totals_query's 400 words


def run_totals_with(fault: Fault):
    """``totals_query`` on Ray, its source slowed, with ``fault``; the source slows further while
    the fault settles, so it lands before the job ends. Asserts the output is the serial one."""
    faults = [Fault("delay", at_epoch=0, stage="words", seconds=0.1), fault]
    report = run_with_faults(totals_query(), faults, containers={"words": 1, "totals": 2, "finals": 2},
                             checkpoint_every=2, settle_pace_s=0.3)
    assert report.ok, (report.mismatches, report.format_timeline())
    return report


def test_a_container_killed_in_the_last_epochs_leaves_every_hooks_rows_exact(ray_session):
    report = run_totals_with(Fault("kill", at_epoch=EPOCHS - 12, stage="totals"))
    assert "recovery_end" in [k for _, k, _ in report.timeline], report.format_timeline()


def test_a_scale_out_in_the_last_epochs_leaves_every_hooks_rows_exact(ray_session):
    report = run_totals_with(Fault("scale_out", at_epoch=EPOCHS - 10, stage="finals"))
    assert "migration_end" in [k for _, k, _ in report.timeline], report.format_timeline()


@pytest.mark.parametrize("clock", ["key", "slice"])
def test_windows_emitted_on_close_emit_the_open_ones_at_the_end_through_a_recovery(ray_session, clock):
    q = closing_windows_query("Europe/Paris", clock=clock)
    faults = [Fault("delay", at_epoch=0, stage="payments", seconds=0.05),
              Fault("kill", at_epoch=24, stage="hourly")]
    report = run_with_faults(q, faults, containers={"payments": 1, "hourly": 2}, checkpoint_every=2)
    assert report.ok, (report.mismatches, report.format_timeline())
