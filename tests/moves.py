"""The status tables as the database's law, for the test session.

``install`` puts triggers on the runs and step-runs tables, generated from
``runs.status.RUN_MOVES`` and ``STEP_MOVES``: an UPDATE that changes a status in a way the
table does not list, or an INSERT with a status no row may start in (``RUN_INITIAL``,
``STEP_INITIAL``), fails its statement. ``tests/conftest.py`` installs them once the test
database exists, so every test of the session is also a test of the tables, and so is every
worker and beat process a test starts (they use the same database).

Each move made is also counted, on a sequence per move: ``nextval`` is kept when the test's
transaction is rolled back, and never makes one transaction wait for another.
:func:`moves_never_made` lists the moves the tables allow that nothing made.

Tests that build rows straight into a status (factories, a test putting a row where it needs
it) say so with :func:`unchecked`: the triggers let that connection's writes through. The
tests of the tables make every move on purpose: they run :func:`uncounted`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from django.db import connection

from runs.models import Run, StepRun
from runs.status import RUN_INITIAL, RUN_MOVES, STEP_INITIAL, STEP_MOVES

_SEQUENCE = "djflow_moves_"


def _sequence(table: str, source: str, target: str) -> str:
    return f"{_SEQUENCE}{table}_{source}_{target}"


# A connection that sets this to "on" writes statuses unchecked (see ``unchecked``).
BYPASS = "djflow.moves_unchecked"
# And this to "on": its moves are checked but not counted (see ``uncounted``).
UNCOUNTED = "djflow.moves_uncounted"


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
    IF current_setting('{UNCOUNTED}', true) IS DISTINCT FROM 'on' THEN
        PERFORM nextval('{_SEQUENCE}' || TG_TABLE_NAME || '_' || OLD.status || '_' || NEW.status);
    END IF;
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


def _all_moves() -> list[tuple[str, str, str]]:
    tables = ((Run._meta.db_table, RUN_MOVES), (StepRun._meta.db_table, STEP_MOVES))
    return [
        (table, str(source), str(target))
        for table, moves in tables
        for source, targets in sorted(moves.items())
        for target in sorted(targets)
    ]


def install() -> None:
    """Install the triggers and their counters, afresh (a reused test database too)."""
    statements = [
        *(
            f"DROP SEQUENCE IF EXISTS {_sequence(*move)}; CREATE SEQUENCE {_sequence(*move)}"
            for move in _all_moves()
        ),
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
    with _setting(BYPASS):
        yield


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Moves of this connection inside the block are checked but not counted: the tests of
    the tables themselves make every move, and the count is of what the engine makes."""
    with _setting(UNCOUNTED):
        yield


@contextlib.contextmanager
def _setting(name: str) -> Iterator[None]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config(%s, 'on', false)", [name])
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config(%s, 'off', false)", [name])


def moves_never_made() -> list[str]:
    """The moves the tables allow that no write of the session made, as ``table: a -> b``."""
    never = []
    with connection.cursor() as cursor:
        for table, source, target in _all_moves():
            cursor.execute(f"SELECT is_called FROM {_sequence(table, source, target)}")
            if not cursor.fetchone()[0]:
                never.append(f"{table}: {source} -> {target}")
    return never
