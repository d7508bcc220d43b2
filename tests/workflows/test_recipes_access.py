"""Naming a stored recipe in a workflow needs the right to read recipes (workflows.access,
"recipes"; ``services.recipe_name_errors``): a run of the workflow would show the recipe's
prompts, and its start whether the name exists. Held at every save that carries a user (the
API, the admin, the builder); code acting for no one passes, as for handlers."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from workflows import client, registry
from workflows.errors import InvalidDocument
from workflows.models import WorkflowVersion
from workflows.services import recipe_save
from workflows.sync import SyncError, sync_modules

pytestmark = pytest.mark.django_db

MESSAGE = "naming a recipe needs the permission to read recipes (workflows.view_recipe)"
SAMPLE = "tests.workflows.sample_modules.named_recipe"


def author(*recipe_codenames: str, staff: bool = False) -> Any:
    """A user who may create workflows and start runs (no recipe right unless given)."""
    person = get_user_model().objects.create_user(
        "writer", "writer@example.com", "a-long-password-1", is_staff=staff
    )
    wanted = [("workflows", "add_workflow"), ("runs", "add_run")]
    wanted += [("workflows", codename) for codename in recipe_codenames]
    for app, codename in wanted:
        person.user_permissions.add(
            Permission.objects.get(content_type__app_label=app, codename=codename)
        )
    return get_user_model().objects.get(pk=person.pk)


def api_for(user: Any) -> APIClient:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return api


def naming(*recipes: str, workflow_id: str = "asks") -> dict[str, Any]:
    """A workflow whose top-level recipe steps name ``recipes``, after an inline one."""
    steps: list[dict[str, Any]] = [{"id": "inline", "kind": "recipe", "prompt": "Hi ${input}"}]
    steps += [
        {"id": f"ask_{index}", "kind": "recipe", "recipe": name}
        for index, name in enumerate(recipes)
    ]
    return {"id": workflow_id, "steps": steps}


@pytest.fixture
def triage() -> None:
    recipe_save(document={"name": "triage", "prompt": "Secret instructions: ${input}"})


def test_an_author_without_recipe_rights_cannot_name_recipes_existing_or_not(
    triage: None,
) -> None:
    api = api_for(author())
    response = api.post("/api/v1/definitions", naming("triage", "no_such"), format="json")
    assert response.status_code == 400
    # One message for the recipe that exists and the one that does not: nothing leaks.
    assert response.json()["errors"] == [
        {"field": "steps[1].recipe", "message": MESSAGE},
        {"field": "steps[2].recipe", "message": MESSAGE},
    ]
    assert not WorkflowVersion.objects.exists()
    # Alone, each gives the same answer too.
    answers = [
        api.post("/api/v1/definitions", naming(name), format="json").json()
        for name in ("triage", "no_such")
    ]
    assert (
        answers[0] == answers[1] == {"errors": [{"field": "steps[1].recipe", "message": MESSAGE}]}
    )


def test_inline_recipe_steps_need_no_recipe_right() -> None:
    response = api_for(author()).post("/api/v1/definitions", naming(), format="json")
    assert response.status_code == 201, response.json()


@pytest.mark.parametrize("codename", ["view_recipe", "add_recipe", "change_recipe"])
def test_any_right_to_read_recipes_allows_naming_them(triage: None, codename: str) -> None:
    response = api_for(author(codename)).post(
        "/api/v1/definitions", naming("triage", "no_such"), format="json"
    )
    assert response.status_code == 201, response.json()


def test_a_recipe_named_in_a_nested_step_is_named_by_its_path(triage: None) -> None:
    document = {
        "id": "asks",
        "steps": [
            {
                "id": "route",
                "kind": "condition",
                "if": {"path": "input.ask", "op": "eq", "value": True},
                "then": [
                    {
                        "id": "each",
                        "kind": "foreach",
                        "items": "${input.items}",
                        "do": {"id": "ask", "kind": "recipe", "recipe": "triage"},
                    }
                ],
                "else": [
                    {
                        "id": "both",
                        "kind": "parallel",
                        "branches": {
                            "one": {"id": "one", "kind": "recipe", "recipe": "triage"},
                            "two": {"id": "two", "kind": "recipe", "prompt": "inline"},
                        },
                    }
                ],
            }
        ],
    }
    response = api_for(author()).post("/api/v1/definitions", document, format="json")
    assert response.status_code == 400
    assert response.json()["errors"] == [
        {"field": "steps[0].then[0].do.recipe", "message": MESSAGE},
        {"field": "steps[0].else[0].branches.one.recipe", "message": MESSAGE},
    ]


def test_the_admin_refuses_the_save_naming_the_field(triage: None) -> None:
    browser = Client()
    browser.force_login(author("view_workflow", staff=True))
    response = browser.post(
        "/admin/workflows/workflow/add/", {"document": json.dumps(naming("triage"))}
    )
    assert response.status_code == 200
    errors = [(e.field, e.message) for e in response.context["form"].document_errors]
    assert errors == [("steps[1].recipe", MESSAGE)]
    assert not WorkflowVersion.objects.exists()


def test_the_builder_with_a_user_is_held_to_the_rule_and_without_one_is_not() -> None:
    state = registry.snapshot()
    registry.clear()
    sys.modules.pop(SAMPLE, None)
    try:
        writer = author()
        with pytest.raises(SyncError) as refused:
            sync_modules([SAMPLE], user=writer)
        assert f"steps[0].then[0].recipe: {MESSAGE}" in str(refused.value)
        assert not WorkflowVersion.objects.exists()
        # Worker start-up and sync_workflows act for no one: trusted, as for handlers.
        saved = sync_modules([SAMPLE])
        assert [(workflow_id, result.created) for workflow_id, result in saved] == [
            ("sample_named_recipe", True)
        ]
        (builder,) = registry.builders()
        with pytest.raises(InvalidDocument) as again:
            client.document_save(document=builder.document(), user=writer)
        assert [(e.field, e.message) for e in again.value.errors] == [
            ("steps[0].then[0].recipe", MESSAGE)
        ]
    finally:
        sys.modules.pop(SAMPLE, None)
        registry.restore(state)


def test_a_superuser_names_any_recipe() -> None:
    root = get_user_model().objects.create_superuser("boss", "boss@example.com", "a-long-pass-1")
    response = api_for(root).post("/api/v1/definitions", naming("no_such"), format="json")
    assert response.status_code == 201, response.json()
