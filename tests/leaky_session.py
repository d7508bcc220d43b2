"""A test that leaves a connection to its test database open when its session ends, for
tests/test_processes.py to run as a pytest session of its own (the suite never collects it:
its name is no test module's)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from django.db import connection

# Kept open until the process exits, past pytest-django's drop of the test database.
LEFT_OPEN: list[Any] = []


@pytest.mark.django_db
def test_leaves_a_connection_to_the_test_database_open() -> None:
    given = connection.settings_dict
    LEFT_OPEN.append(
        psycopg.connect(
            dbname=given["NAME"],
            user=given["USER"],
            password=given["PASSWORD"],
            host=given["HOST"],
            port=given["PORT"] or None,
        )
    )
