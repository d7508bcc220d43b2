"""The two journal writes every step makes, as plain SQL.

An attempt is inserted once and recorded once, on every step of every run: the ORM's query
building was a visible share of a step's cost. Values go through each model field's own
``get_db_prep_save``, so JSON, UUIDs, timestamps and decimals are stored exactly as the ORM
stores them, on Postgres and SQLite alike.
"""

from __future__ import annotations

from typing import Any

from django.db import connection

from ..models import StepRun
from ..status import StepStatus

_TABLE = StepRun._meta.db_table


def _prep(name: str, value: Any) -> Any:
    return StepRun._meta.get_field(name).get_db_prep_save(value, connection)


def insert_attempt(values: dict[str, Any]) -> int:
    """INSERT one step run; returns its id. ``values`` maps field names to values."""
    columns = [StepRun._meta.get_field(name).column for name in values]
    params = [_prep(name, value) for name, value in values.items()]
    placeholders = ", ".join(["%s"] * len(columns))
    sql = f"INSERT INTO {_TABLE} ({', '.join(columns)}) VALUES ({placeholders}) RETURNING id"
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone()[0]


def record_result(step_run_id: int, claim: Any, values: dict[str, Any]) -> bool:
    """Record a running attempt's result, if the claim still holds; True when it did.

    The fencing check: an attempt given up meanwhile (expired, cancelled) has lost its
    claim, and its late result updates no row.
    """
    assignments = ", ".join(f"{StepRun._meta.get_field(n).column} = %s" for n in values)
    params = [_prep(name, value) for name, value in values.items()]
    sql = f"UPDATE {_TABLE} SET {assignments} WHERE id = %s AND status = %s AND claim = %s"
    params += [step_run_id, StepStatus.RUNNING.value, _prep("claim", claim)]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount == 1
