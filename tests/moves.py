"""The status tables as the database's law, for the test session.

``install`` puts triggers on the runs and step-runs tables, generated from
``runs.status.RUN_MOVES`` and ``STEP_MOVES``: an UPDATE that changes a status in a way the
table does not list, or an INSERT with a status no row may start in (``RUN_INITIAL``,
``STEP_INITIAL``), fails its statement. ``tests/conftest.py`` installs them once the test
database exists, so every test of the session is also a test of the tables, and so is every
worker and beat process a test starts (they use the same database).

Each move made is also noted (an unlogged table, no index, so concurrent transactions never
wait on one another to note the same move): :func:`moves_never_made` lists the moves the
tables allow that nothing made.

Tests that build rows straight into a status (factories, a test putting a row where it needs
it) say so with :func:`unchecked`: the triggers let that connection's writes through.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from django.db import connection

from runs.models import Run, StepRun
from runs.status import RUN_INITIAL, RUN_MOVES, STEP_INITIAL, STEP_MOVES

SEEN = "djflow_test_moves_seen"
# A connection that sets this to "on" writes statuses unchecked (see ``unchecked``).
BYPASS = "djflow.moves_unchecked"


def _literal(value: str) -> str:
    # Statuses are identifiers ([a-z_]+): a check keeps a quote from ever reaching the SQL.
    if not value.replace("_", "").isalpha():
        raise ValueError(f"not a status: {value!r}")
    return f"'{value}'"


def _moves(moves: Mapping[str, frozenset[str]]) -> str:
    pairs = [
        f"({_literal(str(source))}, {_literal(str(target))})"
        for source, targets in sorted(moves.items())
        for target in sorted(targets)
    ]
    return ", ".join(pairs)


def _statuses(statuses: frozenset[str]) -> str:
    return ", ".join(_literal(str(status)) for status in sorted(statuses))


def trigger_sql(
    table: str, noun: str, moves: Mapping[str, frozenset[str]], initial: frozenset[str]
) -> list[str]:
    function = f"djflow_check_{table}_status"
    return [
        f"""
CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('{BYPASS}', true) = 'on' THEN
        RETURN NEW;
    END IF;
    IF TG_OP = 'INSERT' THEN
        RAISE EXCEPTION 'a {noun} cannot start %: not in the initial statuses', NEW.status
            USING ERRCODE = 'check_violation';
    END IF;
    IF (OLD.status, NEW.status) NOT IN ({_moves(moves)}) THEN
        RAISE EXCEPTION 'a % {noun} cannot become %: not in the table', OLD.status, NEW.status
            USING ERRCODE = 'check_violation';
    END IF;
    INSERT INTO {SEEN} VALUES ('{table}', OLD.status, NEW.status);
    RETURN NEW;
END
$$""",
        f"DROP TRIGGER IF EXISTS djflow_status_moves ON {table}",
        f"""CREATE TRIGGER djflow_status_moves BEFORE UPDATE OF status ON {table}
FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status) EXECUTE FUNCTION {function}()""",
        f"DROP TRIGGER IF EXISTS djflow_status_initial ON {table}",
        f"""CREATE TRIGGER djflow_status_initial BEFORE INSERT ON {table}
FOR EACH ROW WHEN (NEW.status NOT IN ({_statuses(initial)})) EXECUTE FUNCTION {function}()""",
    ]


def install() -> None:
    """Install the triggers (idempotent: a reused test database gets them afresh)."""
    statements = [
        f"CREATE UNLOGGED TABLE IF NOT EXISTS {SEEN} (tab text, source text, target text)",
        *trigger_sql(Run._meta.db_table, "run", RUN_MOVES, RUN_INITIAL),
        *trigger_sql(StepRun._meta.db_table, "step run", STEP_MOVES, STEP_INITIAL),
    ]
    with connection.cursor() as cursor:
        for statement in statements:
            cursor.execute(statement)


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Writes of this connection inside the block are not checked: a test building rows
    into the state it needs, not a code path of the engine."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config(%s, 'on', false)", [BYPASS])
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config(%s, 'off', false)", [BYPASS])


def moves_never_made() -> list[str]:
    """The moves the tables allow that no write of the session made, as ``table: a -> b``."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT DISTINCT tab, source, target FROM {SEEN}")
        seen = set(cursor.fetchall())
    never = []
    for table, moves in ((Run._meta.db_table, RUN_MOVES), (StepRun._meta.db_table, STEP_MOVES)):
        for source, targets in sorted(moves.items()):
            for target in sorted(targets):
                if (table, str(source), str(target)) not in seen:
                    never.append(f"{table}: {source} -> {target}")
    return never
