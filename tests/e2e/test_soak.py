"""The chaos soak's short version (``make soak`` is the long one, where every kind of fault comes
round): the whole stack as processes, three projects' clients, half a minute of seeded faults (a few
of: workers, a pool process, an API process killed; Redis restarted; PostgreSQL cut; a quota filled),
then every check the soak holds the stack to must find nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.mark.skipif(not os.environ.get("TEST_DATABASE_URL"), reason="the soak runs on PostgreSQL (the CI sets it)")
def test_a_short_soak_loses_nothing(tmp_path: Path) -> None:
    from benchmarks.soak.__main__ import soak

    report = soak(tmp_path, minutes=0.5, seed=7, drain=240, gap=(3.0, 6.0))
    assert report["problems"] == {}, report
    assert len(report["fault_log"]) >= 2 and report["not_recovered"] == [], report
    assert report["jobs"].get("succeeded", 0) >= 1, report
    assert report["5xx_outside_faults"] == 0, report
