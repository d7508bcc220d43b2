"""A bounded schemathesis run over the whole API: no input a client can send gets a 500.

The OpenAPI schema is read from the running app, so every endpoint added later is fuzzed too.
Hypothesis is capped per operation (``FUZZ_EXAMPLES``) to keep the run around a minute.
"""

from __future__ import annotations

import re
import zlib
from collections import Counter

import pytest
import schemathesis
from django.contrib.auth.models import Permission
from django.core.signals import request_finished, request_started
from django.db import close_old_connections, transaction
from django.urls import get_resolver
from hypothesis import HealthCheck, settings
from hypothesis.internal.conjecture import providers
from hypothesis.internal.constants_ast import Constants
from rest_framework.authtoken.models import Token
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from config.wsgi import application
from runs.services import run_start
from workflows.services import definition_save, recipe_save

from .workflows.documents import support_ticket

pytestmark = [pytest.mark.slow, pytest.mark.django_db]


@pytest.fixture(autouse=True)
def keep_connection_open():
    """The raw WSGI handler closes the connection after each request; the test's transaction
    lives on it, so keep it open as Django's own test client does."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture(autouse=True)
def no_local_constants(monkeypatch):
    """The same draws in every process. Hypothesis (6.170) mixes into its draws literals
    taken from every module of this project the process has imported so far, and which those
    are depends on the tests pytest-xdist gave this process first: a full run drew other
    cases than this file alone, and once the linked run below reached no run it had made
    (CI at b8474f9). With none of them, ``derandomize`` draws the same cases everywhere.
    A private function of the pinned version: monkeypatch raises if it is renamed."""
    monkeypatch.setattr(providers, "_get_local_constants", Constants)
    providers.CONSTANTS_CACHE.cache.clear()
    yield
    providers.CONSTANTS_CACHE.cache.clear()


# Read from the app itself, so every endpoint added later is fuzzed too.
schema = schemathesis.openapi.from_wsgi("/api/v1/schema/?format=json", application)


@pytest.fixture
def token(user) -> str:
    # Something to read, so GETs on known ids reach the code past the 404.
    definition_save(document={k: v for k, v in support_ticket().items() if k != "version"})
    run_start(workflow="support_ticket", input={"ticket": "Q: where is my parcel?"})
    # Recipes too: one to read, and the rights to save more, so the fuzz reaches past 403.
    recipe_save(document={"name": "triage", "prompt": "Sort: ${input}"})
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=["add_recipe", "change_recipe"])
    )
    return Token.objects.get_or_create(user=user)[0].key


# Random cases per operation, on top of what schemathesis generates without counting them
# against this cap: the schema's own examples and its coverage phase (every parameter's
# boundaries, missing and wrongly typed required fields, unexpected methods, drawn the same
# in every run). 300 took about 150 s of the suite's 17 minutes on 2 cores for the 33
# operations; 100 keeps every operation fuzzed in every run, with the same draws
# (derandomize), in half the time (about 70 s).
FUZZ_EXAMPLES = 100


@schema.parametrize()
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_input_gets_a_server_error(case, token: str) -> None:
    check_answer(case, case.call(headers={"Authorization": f"Token {token}"}))


def check_answer(case, response) -> None:
    case.validate_response(
        response,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )
    # Every error body is the contract's shape.
    if response.status_code >= 400:
        body = response.json()
        assert isinstance(body.get("errors"), list) and body["errors"], body
        assert all(isinstance(e.get("message"), str) for e in body["errors"]), body


def _api_routes(patterns, prefix: str = "") -> list[str]:
    routes = []
    for pattern in patterns:
        route = prefix + str(pattern.pattern)
        if hasattr(pattern, "url_patterns"):
            routes += _api_routes(pattern.url_patterns, route)
        elif route.startswith("api/v1/"):
            routes.append("/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route))
    return routes


def test_every_api_route_is_in_the_fuzzed_schema() -> None:
    """The fuzz covers what the schema lists: a route missing from it (a view left out of
    drf-spectacular) would never be fuzzed."""
    fuzzed = {result.ok().path for result in schema.get_all_operations()}
    served = set(_api_routes(get_resolver().url_patterns))
    assert served - fuzzed == {"/api/v1/schema/", "/api/v1/docs/"}


# Links between operations: the schema declares none (drf-spectacular writes no OpenAPI
# links), so schemathesis infers them from the schema's shapes (a run's ``id`` from
# ``POST /runs`` into ``GET /runs/{run_id}``, ``/cancel``, ``/retry``, ...): sequences of
# calls on what earlier calls made, each answer held to the same checks.
Linked = schema.as_state_machine()


def test_linked_calls_get_no_server_error(token: str) -> None:
    links = {
        (source, link.target.label)
        for source, entry in Linked._transitions.operations.items()
        for link in entry.outgoing
    }
    # A run made by POST /runs is read and operated through the links.
    for target in ("GET /api/v1/runs/{run_id}", "POST /api/v1/runs/{run_id}/cancel"):
        assert ("POST /api/v1/runs", target) in links, sorted(links)

    answers: Counter[tuple[str, int]] = Counter()

    class Calls(Linked):
        def before_call(self, case) -> None:
            # About half the starts are made ones that succeed, so the calls linked to them
            # (read, cancel, pause, resume, retry) act on real runs, not only on 404s. Which
            # ones is a function of the drawn body: Hypothesis replays a case exactly.
            drawn = zlib.crc32(repr(case.body).encode())
            if case.operation.label == "POST /api/v1/runs" and drawn % 2 == 0:
                case.body = {"workflow": "support_ticket", "input": {"ticket": "Q: linked?"}}

        def after_call(self, response, case) -> None:
            answers[(case.operation.label, response.status_code)] += 1

        def get_call_kwargs(self, case):
            return {"headers": {"Authorization": f"Token {token}"}}

        def validate_response(self, response, case, **kwargs) -> None:
            check_answer(case, response)

        # Each sequence starts from the same rows: what one made (a run whose idempotency
        # key a later sequence draws again, answering 200 where it answered 201) would
        # change which calls the next can link, and Hypothesis requires the same draws to
        # lead to the same calls. The app runs in this thread, on this connection.
        def setup(self) -> None:
            self.rows = transaction.atomic()
            self.rows.__enter__()

        def teardown(self) -> None:
            transaction.set_rollback(True)
            self.rows.__exit__(None, None, None)

    Calls.run(
        settings=settings(
            max_examples=80,
            stateful_step_count=8,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
    )
    # The sequences reached runs that exist (the calls did not all end at 404): an action
    # done, or refused in the run's state (409), on a run a start made.
    done = {label for (label, status), _ in answers.items() if status < 300}
    assert "POST /api/v1/runs" in done, answers
    reached = {
        label
        for (label, status), _ in answers.items()
        if label.startswith("POST /api/v1/runs/{run_id}/") and (status < 300 or status == 409)
    }
    assert reached, answers
