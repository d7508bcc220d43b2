"""The start form in headless Chromium (CONTRACT section 15): sign in, follow the home page's
start link to a form made from a schema with every kind of field, send it with mistakes and see
each named beside its field with what was typed kept (the secret blank), then send it right
and land on the run's inspector, and from there "Run again".

Needs Debian's Chromium (``apt-get install -y chromium``); Playwright drives it. Screenshots
go to ``test-artifacts/``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from runs.models import Run
from tests.approvals.builders import PASSWORD, make_user
from tests.browser import ARTIFACTS, chromium_page
from workflows import access, secrets
from workflows.services import definition_save

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

SCHEMA = {
    "type": "object",
    "required": ["ticket", "priority", "api_key"],
    "properties": {
        "ticket": {"type": "string", "description": "What the customer wrote."},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5, "default": 3},
        "score": {"type": "number"},
        "urgent": {"type": "boolean"},
        "kind": {"enum": ["bug", "question"], "default": "question"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "meta": {"type": "object"},
        "api_key": {"type": "string", "writeOnly": True, "minLength": 8},
    },
}


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from chromium_page(monkeypatch)


@pytest.fixture
def starter() -> Any:
    definition_save(
        document={
            "id": "triage",
            "description": "Triage a support ticket.",
            "input_schema": SCHEMA,
            "steps": [{"id": "classify", "kind": "task"}],
        }
    )
    sam = make_user("sam")
    access.grant(access.STARTER, "triage", user=sam)
    return sam


def _error(page: Any, name: str) -> str:
    return page.inner_text(f'[data-field="{name}"] .field-error')


def test_start_a_run_from_the_form(page, live_server, starter) -> None:
    page.goto(f"{live_server.url}/")
    page.fill("#id_username", "sam")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.click("#start-runs a.start-link")
    page.wait_for_url("**/workflows/triage/start")
    assert "Triage a support ticket." in page.inner_text("#about")
    # A control of its kind for each property, the defaults in them.
    assert page.get_attribute("#id_ticket", "name") == "ticket"
    assert page.evaluate("() => document.getElementById('id_ticket').tagName") == "TEXTAREA"
    assert page.get_attribute("#id_priority", "type") == "number"
    assert page.input_value("#id_priority") == "3"
    assert page.get_attribute("#id_score", "type") == "number"
    assert page.get_attribute("#id_urgent", "type") == "checkbox"
    assert page.input_value("#id_kind") == "question"
    assert page.get_attribute("#id_tags", "class") == "json"
    assert page.get_attribute("#id_api_key", "type") == "password"
    assert "What the customer wrote." in page.inner_text('[data-field="ticket"]')
    page.screenshot(path=str(ARTIFACTS / "start-form.png"), full_page=True)

    # Refused: each problem beside its field, what was typed kept, the secret blank.
    page.fill("#id_priority", "9")
    page.fill("#id_tags", '["web",')
    page.fill("#id_meta", '{"source": "mail"}')
    page.fill("#id_api_key", "abc1234")
    page.select_option("#id_kind", "bug")
    page.click("#start-submit")
    page.wait_for_selector("#start-problems")
    assert _error(page, "ticket") == "required field 'ticket' is missing"
    assert _error(page, "priority") == "9 is greater than the maximum of 5"
    assert _error(page, "tags").startswith("Malformed JSON")
    assert _error(page, "api_key") == "•••• is too short"
    assert "abc1234" not in page.content()
    assert page.locator(".field-error").count() == 4
    assert page.input_value("#id_priority") == "9"
    assert page.input_value("#id_tags") == '["web",'
    assert page.input_value("#id_meta") == '{"source": "mail"}'
    assert page.input_value("#id_kind") == "bug"
    assert page.input_value("#id_api_key") == ""
    page.screenshot(path=str(ARTIFACTS / "start-form-refused.png"), full_page=True)
    assert not Run.objects.exists()

    # Put right, it starts the run and shows it in the inspector.
    page.fill("#id_ticket", "The login page says 500.")
    page.fill("#id_priority", "2")
    page.fill("#id_score", "0.5")
    page.check("#id_urgent")
    page.fill("#id_tags", '["web", "login"]')
    page.fill("#id_api_key", "sk-0123456789")
    page.click("#start-submit")
    page.wait_for_url(re.compile(r".*/runs/[0-9a-f-]{36}/$"))
    run = Run.objects.get()
    assert page.url.endswith(f"/runs/{run.id}/")
    assert "Run started" in page.inner_text("#messages")
    assert secrets.shown(run.input) == {
        "ticket": "The login page says 500.",
        "priority": 2,
        "score": 0.5,
        "urgent": True,
        "kind": "bug",
        "tags": ["web", "login"],
        "meta": {"source": "mail"},
        "api_key": secrets.MASK,
    }
    page.screenshot(path=str(ARTIFACTS / "start-form-started.png"), full_page=True)

    # Run again: the same form with the run's input, the secret left to type again.
    page.click("#run-again-link")
    page.wait_for_selector("#run-again-of")
    assert page.input_value("#id_ticket") == "The login page says 500."
    assert page.input_value("#id_priority") == "2"
    assert page.is_checked("#id_urgent")
    assert page.input_value("#id_api_key") == ""
