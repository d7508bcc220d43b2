"""Shared fixtures. Tests run against the real Postgres and Redis on loopback."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from config import metrics_files
from tests import moves
from tests.processes import CeleryProcess, CeleryProcesses, purge_broker, xdist_services
from workflows import heartbeats, testing

# With pytest-xdist (the README's `pytest` runs `-n 2`), each test process gets Redis
# databases of its own for the broker and the results, as pytest-django gives it a test
# database of its own: a message one sends must not reach the worker processes another
# started, and one's purge must not empty the other's queues. Set before anything connects
# (Celery reads its settings lazily). The worker end-to-end tests run in both processes:
# xdist's --dist loadgroup would keep them in one, but xdist 3.8 names a test's group by
# setting Node._nodeid, which pytest 9 no longer reads (Node.nodeid comes from Node._id).
xdist_services(os.environ.get("PYTEST_XDIST_WORKER"))

# pyproject.toml names the tests' var folder (and so their metrics folder) relative to the
# checkout, where pytest runs; the worker, beat and web processes the tests start get it
# absolute, so a child started in another folder writes its metric files beside this one's.
os.environ["DJFLOW_VAR_DIR"] = str(settings.VAR_DIR.resolve())
if (_metrics := metrics_files.this_host()) is not None:
    os.environ[metrics_files.ENV] = str(_metrics.resolve())


# Modules whose tests take half a minute to a minute and more each on 2 cores (a pip install,
# the README pasted into a fresh clone, a whole standalone, a cron's wall-clock minute).
# They run first: with --dist worksteal a process left without tests takes half of what the
# other has not started yet, never the test it is running, and the production install started
# last kept the other process idle for 53 s (2026-12-05). A module missing here costs time,
# nothing else.
LONGEST_FIRST = (
    "tests/test_production_install.py",
    "tests/test_readme.py",
    "tests/schedules/test_schedules_e2e.py",
    "tests/test_standalone_soak.py",
    "tests/test_standalone.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """The ``djflow`` fixture's plugin, as its ``pytest11`` entry point loads it."""
    testing.load(config.pluginmanager)


# tryfirst: before pytest-django's own reordering (database tests, then transactional ones,
# then the rest), which is a stable sort and so keeps this order within each of its groups.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that starts real worker or beat processes is a worker end-to-end test
    (marker ``worker_e2e``): .ci/run runs them a second time with the broker on RabbitMQ."""
    for item in items:
        if "celery_processes" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.worker_e2e)
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in LONGEST_FIRST)


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker, request) -> Iterator[None]:
    """The test database, with the status tables installed as triggers (tests/moves.py):
    every test that writes a run or a step run, in this process or in the worker processes
    it starts, fails on a move the tables do not list. ``DJFLOW_MOVES_REPORT=1`` lists, at
    the end, the moves the tables allow that no test made."""
    with django_db_blocker.unblock():
        moves.install()
    yield
    with django_db_blocker.unblock():
        if os.environ.get("DJFLOW_MOVES_REPORT"):
            request.config.stash[_MOVES_NEVER_MADE] = moves.moves_never_made()
        _end_other_sessions()


def _end_other_sessions() -> None:
    """End every other session on the test database, just before pytest-django drops it.
    Postgres refuses to drop a database in use, and pytest-django then leaves it behind
    ("database ... is being accessed by other users"): a connection a test left open (one
    made in a browser test's thread, a worker process killed after it connected) kept a
    test database of every such run (issue 37)."""
    from django.db import DatabaseError, connection

    if connection.vendor != "postgresql":
        return
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
    except DatabaseError:
        # Not allowed to (a role without pg_signal_backend): the drop says what is left.
        pass


_MOVES_NEVER_MADE = pytest.StashKey[list[str]]()


def pytest_terminal_summary(terminalreporter, config) -> None:
    never = config.stash.get(_MOVES_NEVER_MADE, None)
    if never is not None:
        terminalreporter.section("status moves the tables allow that no test made")
        terminalreporter.write_line(f"{len(never)}: " + (", ".join(never) or "none"))


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings) -> None:
    """PBKDF2 at Django's iteration count costs about half a second per password set or
    checked; no test is about hashing, and many create users."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def _start_checks_workers(request, settings) -> None:
    """Starting a run checks that a live worker serves its handlers (``START_CHECKS_WORKERS``)
    in tests with real worker processes, which write their own heartbeats; elsewhere no
    worker runs, and the many tests that start runs to look at the engine's rows would all be
    refused. ``@pytest.mark.start_checks_workers(True)`` (or ``False``) says otherwise; the
    tests of the check itself set it."""
    marker = request.node.get_closest_marker("start_checks_workers")
    checks = marker.args[0] if marker else "celery_processes" in request.fixturenames
    settings.DJFLOW = {**settings.DJFLOW, "START_CHECKS_WORKERS": checks}
    # Heartbeats another test wrote (and rolled back) are not this one's live workers.
    heartbeats.forget_live_read()


@pytest.fixture
def user(db):
    """Ada, a trusted member of the team: she may author, start, operate and read every
    workflow (the global permissions of CONTRACT section 8), as most tests need. Tests of who
    may do what make their own users (tests/test_access.py)."""
    ada = get_user_model().objects.create_user(
        username="ada", email="ada@example.com", password="a-long-password-1"
    )
    ada.user_permissions.add(*team_permissions())
    return ada


def team_permissions() -> list[Permission]:
    wanted = [
        ("workflows", "add_workflow"),
        ("workflows", "change_workflow"),
        ("workflows", "add_knowledgebase"),
        ("workflows", "change_knowledgebase"),
        ("runs", "add_run"),
        ("runs", "change_run"),
        ("runs", "view_run"),
    ]
    return [
        Permission.objects.get(content_type__app_label=app, codename=codename)
        for app, codename in wanted
    ]


@pytest.fixture
def admin_user(db):
    return get_user_model().objects.create_superuser(
        username="root", email="root@example.com", password="a-long-password-1"
    )


@pytest.fixture
def api(user) -> APIClient:
    """An API client authenticated with the user's token."""
    client = APIClient()
    token, _ = Token.objects.get_or_create(user=user)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


@pytest.fixture
def anon_api() -> APIClient:
    return APIClient()


@pytest.fixture
def stranger(db) -> APIClient:
    """Eve, a user with no permission: she may start runs of nothing and read none but her
    own (what a 404 for another's run is tested with)."""
    eve = get_user_model().objects.create_user(username="eve", password="a-long-password-1")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=eve).key}")
    return client


# --- Real worker and beat processes (tests/processes.py) -----------------------------------


@pytest.fixture
def celery_processes(transactional_db, tmp_path, request) -> Iterator[CeleryProcesses]:
    """Worker and beat processes for this test, on its test database and the test broker.

    Requesting it makes the test transactional: rows the test writes are committed, so the
    processes see them. The broker is purged first (messages left by earlier tests or runs
    must not reach this test's workers); that happens at set-up, so messages the test body
    sends before it starts a worker are kept. Every process still running is killed at
    teardown (``kill_all``), and when the test failed the tail of each log is printed.
    """
    cluster = CeleryProcesses(tmp_path / "celery")
    purge_broker()
    failed_before = request.session.testsfailed
    try:
        yield cluster
    finally:
        cluster.kill_all()
        if request.session.testsfailed > failed_before and cluster.processes:
            reporter = request.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line("")
                reporter.write_line(cluster.logs(tail=200))


@pytest.fixture
def celery_worker(celery_processes: CeleryProcesses) -> Callable[..., CeleryProcess]:
    """``celery_worker(workflow_modules=..., env=..., queues=..., concurrency=2, ...)`` starts
    a ``celery -A config worker`` and returns it once it answers a ping."""
    return celery_processes.worker


@pytest.fixture
def celery_beat(celery_processes: CeleryProcesses) -> Callable[..., CeleryProcess]:
    """``celery_beat(env=..., ...)`` starts ``celery -A config beat`` on the DatabaseScheduler."""
    return celery_processes.beat
