"""The tick's claim of due timers (``runs.engine.timers.claim_due``) as Postgres plans it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from runs.engine import timers
from runs.models import Timer

from .factories import RunFactory

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif("connection.vendor != 'postgresql'"),
]


def test_the_claim_never_joins_every_due_timer_with_every_claimed_one() -> None:
    """With the timers table's statistics estimating one due row (as between bursts), a
    claim written as a join of the due ids was planned as a nested loop that compared every
    due row with every claimed one: about a second for 1,000 of 3,000 (bench/README.md). The
    claim matches an array of ids instead, whatever the estimates."""
    with connection.cursor() as cursor:
        # Statistics from an empty table: the estimate a quiet day leaves.
        cursor.execute("ANALYZE runs_timer")
    past = timezone.now() - timedelta(seconds=1)
    runs = [RunFactory() for _ in range(20)]
    Timer.objects.bulk_create(
        Timer(run=run, purpose="sleep", key=f"k{index}", fire_at=past)
        for run in runs
        for index in range(30)
    )
    sql = timers._CLAIM_POSTGRES.format(timer=Timer._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {sql}", {"now": timezone.now(), "batch": 100})
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "Join Filter" not in plan and "Nested Loop" not in plan, plan
    claimed = timers.claim_due(timezone.now(), 100)
    assert len(claimed) == 100
    assert Timer.objects.filter(fired_at__isnull=False).count() == 100
    assert len(timers.claim_due(timezone.now(), 1000)) == 500
