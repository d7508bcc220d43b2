"""A database that refuses to change one run's rows: a trigger raising on them, as a DBA's
rule, a constraint or a broken row would. Made in the test's transaction, gone with it."""

from __future__ import annotations

from typing import Any

from django.db import connection


def refuse(*, table: str, event: str, column: str, value: Any) -> None:
    """Every ``event`` (UPDATE, DELETE) of a ``table`` row whose ``column`` is ``value``
    raises "refused by a trigger"."""
    name = f"djflow_test_refuse_{table}_{event.lower()}"
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN RAISE EXCEPTION 'refused by a trigger'; END $$;
            """
        )
        cursor.execute(
            f"""
            CREATE TRIGGER {name} BEFORE {event} ON {table} FOR EACH ROW
            WHEN (OLD.{column} = '{value}') EXECUTE FUNCTION {name}()
            """
        )
