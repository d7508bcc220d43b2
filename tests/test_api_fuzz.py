"""Schemathesis with every check, against a live gunicorn: the OpenAPI document says what
the server accepts and answers, and no input a client can send gets a 500.

The test starts gunicorn (``config.gunicorn``, two workers) on a free port over this test's
database, then the schemathesis CLI with ``--checks all`` (not_a_server_error,
status_code_conformance, content_type_conformance, response_headers_conformance,
response_schema_conformance, negative_data_rejection, positive_data_acceptance,
missing_required_header, unsupported_method, allow_header_conformance, use_after_free,
ensure_resource_availability, ignored_auth, object_level_authorization) and all its phases:
the schema's examples, coverage (every parameter's boundaries, missing and wrongly typed
fields, undeclared methods), random fuzzing and stateful sequences that follow the document's
OpenAPI links (a run ``POST /runs`` made, read, cancelled, paused, resumed, retried). The
narrowings are in tests/schemathesis.toml and tests/fuzz_hooks.py, each with its reason.

``FUZZ_EXAMPLES`` random cases per operation bound the run: 37 operations, 5,728 cases in all
phases, 2 minutes on 2 cores beside another test run (2026-12-07). The
in-process fuzz this replaced ran 4 checks of the 14 through the WSGI handler (no gunicorn, so
no 414), and saw none of the 20 disagreements of issue 37.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import schemathesis
from django.conf import settings
from django.contrib.auth.models import Permission
from django.db import connection
from django.urls import get_resolver
from rest_framework.authtoken.models import Token

from config.wsgi import application
from runs.services import run_start
from workflows import knowledge
from workflows.services import definition_save, recipe_save

from .processes import (
    BASE_DIR,
    CeleryProcess,
    database_url,
    gunicorn_argv,
    service_env,
    wait_for,
)
from .workflows.documents import support_ticket

# Random cases per operation in the fuzzing phase; the examples and coverage phases add
# theirs (about 1,500), the stateful phase its sequences over the document's links.
FUZZ_EXAMPLES = 100
SCHEMATHESIS = str(Path(sys.executable).with_name("schemathesis"))
CONFIG = BASE_DIR / "tests" / "schemathesis.toml"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


@pytest.fixture
def token(transactional_db, user, monkeypatch) -> str:
    """Rows committed where gunicorn reads them: a workflow, a run, a recipe, and a user who
    may author, start, operate and read every workflow, save recipes and read and set the
    accounts' budgets."""
    # Without its input_schema: a start's input is checked against the workflow's own
    # schema (a 400 naming the field, tests/runs/test_runs_api.py), which no OpenAPI document
    # can state; any input then starts a run, as the document's `input` (any JSON) says.
    document = {k: v for k, v in support_ticket().items() if k not in ("version", "input_schema")}
    definition_save(document=document)
    run = run_start(workflow="support_ticket", input={"ticket": "Q: where is my parcel?"}).run
    recipe_save(document={"name": "triage", "prompt": "Sort: ${input}"})
    # A knowledge base to list and search (tests/schemathesis.toml names it).
    knowledge.kb_write(kb="answers", key="crash", title="Export crashes", content="Update.")
    # The operations on one attempt of the run read it (tests/schemathesis.toml).
    monkeypatch.setenv("DJFLOW_FUZZ_RUN", str(run.id))
    monkeypatch.setenv("DJFLOW_FUZZ_STEP_RUN", str(run.steps.order_by("id").first().id))
    user.user_permissions.add(
        *Permission.objects.filter(
            codename__in=["add_recipe", "change_recipe", "view_account", "change_account"]
        )
    )
    return Token.objects.get_or_create(user=user)[0].key


@pytest.fixture
def server(token, tmp_path: Path):
    port = _free_port()
    env = service_env(
        database_url=database_url(connection.settings_dict),
        broker_url=settings.CELERY_BROKER_URL,
        result_backend=settings.CELERY_RESULT_BACKEND,
        extra={
            # No worker runs: a start is accepted and waits for one (tests/conftest.py).
            "DJFLOW_START_CHECKS_WORKERS": "false",
            # The fuzz sends thousands of requests: the throttles (429, documented on every
            # operation) are tested in tests/test_throttling.py.
            "DJFLOW_API_THROTTLE_USER": "1000000/min",
            "DJFLOW_API_THROTTLE_ANON": "1000000/min",
            "CACHE_URL": "locmemcache://",
            # The stateful phase creates schedules of the one workflow: the per-user cap
            # (400 naming workflow) is tested in tests/schedules.
            "DJFLOW_SCHEDULES_PER_WORKFLOW": "100000",
        },
    )
    web = CeleryProcess(
        kind="web", argv=gunicorn_argv(port), env=env, log_path=tmp_path / "gunicorn.log"
    ).start()
    origin = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: _status(f"{origin}/api/v1/definition.schema.json") == 200,
            timeout=60,
            interval=0.2,
            message=web.logs,
        )
        yield origin
    finally:
        web.stop(timeout=20)


@pytest.mark.slow
def test_schemathesis_with_every_check_finds_nothing(server: str, token: str, tmp_path) -> None:
    started = time.monotonic()
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "tests.fuzz_hooks",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(BASE_DIR), os.environ.get("PYTHONPATH")])),
    }
    run = subprocess.run(
        [
            SCHEMATHESIS,
            "--config-file",
            str(CONFIG),
            "--no-color",
            "run",
            f"{server}/api/v1/schema/?format=json",
            "--url",
            server,
            "--header",
            f"Authorization: Token {token}",
            "--checks",
            "all",
            "--max-examples",
            str(FUZZ_EXAMPLES),
            "--generation-deterministic",
            # One thread: Hypothesis parses lambdas' source while drawing, and with two
            # threads CPython 3.11.7's ast.parse failed now and then with "SystemError: AST
            # constructor recursion depth mismatch" (threaded use, as in
            # https://github.com/python/cpython/issues/106905), an error of the run, not of
            # the API.
            "--workers",
            "1",
            "--request-timeout",
            "30",
        ],
        cwd=tmp_path,  # schemathesis keeps its files (.schemathesis/) there
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = run.stdout + run.stderr
    (tmp_path / "schemathesis.txt").write_text(output)
    summary = output[output.rfind("SUMMARY") :]
    assert run.returncode == 0, output[-20000:]
    # Every operation was tested, in every phase.
    tested = re.search(r"Tested: (\d+)", summary)
    assert tested is not None and int(tested.group(1)) >= 37, summary
    for phase in ("Examples", "Coverage", "Fuzzing", "Stateful"):
        assert re.search(rf"✅ {phase}", summary), summary
    print(summary, f"in {time.monotonic() - started:.0f} s")


def _api_routes(patterns, prefix: str = "") -> list[str]:
    routes = []
    for pattern in patterns:
        route = prefix + str(pattern.pattern)
        if hasattr(pattern, "url_patterns"):
            routes += _api_routes(pattern.url_patterns, route)
        elif route.startswith("api/v1/"):
            routes.append("/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route))
    return routes


@pytest.mark.django_db
def test_every_api_route_is_in_the_fuzzed_schema() -> None:
    """The fuzz covers what the schema lists: a route missing from it (a view left out of
    drf-spectacular) would never be fuzzed."""
    schema = schemathesis.openapi.from_wsgi("/api/v1/schema/?format=json", application)
    fuzzed = {result.ok().path for result in schema.get_all_operations()}
    served = set(_api_routes(get_resolver().url_patterns))
    assert served - fuzzed == {"/api/v1/schema/", "/api/v1/docs/"}
