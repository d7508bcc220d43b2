"""A bounded schemathesis run over the whole API: no input a client can send gets a 500.

The OpenAPI schema is read from the running app, so every endpoint added later is fuzzed too.
Hypothesis is capped per operation to keep the run around a minute.
"""

from __future__ import annotations

import pytest
import schemathesis
from django.contrib.auth.models import Permission
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
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


@schema.parametrize()
@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_input_gets_a_server_error(case, token: str) -> None:
    response = case.call(headers={"Authorization": f"Token {token}"})
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
