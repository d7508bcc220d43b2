"""Knowledge bases belong to someone from the first save that names them, the deployment's
own saves included (issue 36). Before, the builders of ``WORKFLOW_MODULES`` (synced at
worker start-up and by ``manage.py sync_workflows``, with no user) reserved nothing: a user
who may add knowledge bases created ``support-answers`` first, read every later write of
the deployment's workflow into it, and planted text its recipe put into prompts. Now the
sync creates the names its steps write and read, with no creator (the deployment's), and a
name a person took first is a 400 naming the step's field."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client

from tests.workflows.test_kb_api import api_for, person
from workflows import access, knowledge, registry
from workflows.models import KnowledgeBase, WorkflowVersion
from workflows.sync import SyncError, sync_modules

pytestmark = pytest.mark.django_db

MODULE = "tests.workflows.sample_modules.kb_deploy"


@pytest.fixture(autouse=True)
def isolated_registry() -> Iterator[None]:
    state = registry.snapshot()
    registry.clear()
    sys.modules.pop(MODULE, None)
    yield
    sys.modules.pop(MODULE, None)
    registry.restore(state)


def writing(kb: str, workflow: str = "mine") -> dict[str, Any]:
    return {
        "id": workflow,
        "steps": [{"id": "keep", "kind": "write_kb", "kb": kb, "key": "k", "content": "c"}],
    }


def test_a_name_a_person_took_first_fails_the_deployments_sync_naming_the_field() -> None:
    """The squat: mallory, who may add knowledge bases, creates the name before the
    deployment's first sync. The sync must not send the workflow's writes to her."""
    mallory = person("mallory", "add_knowledgebase")
    taken = api_for(mallory).post("/api/v1/definitions", writing("support-answers"), format="json")
    assert taken.status_code == 201
    assert KnowledgeBase.objects.get(name="support-answers").created_by == mallory

    with pytest.raises(SyncError) as caught:
        sync_modules([MODULE])
    assert "steps[0].kb" in str(caught.value)
    assert "created by user 'mallory'" in str(caught.value)
    assert not WorkflowVersion.objects.filter(workflow_id="sample_support").exists()


def test_a_name_the_deployment_only_reads_is_not_reserved() -> None:
    """Curated by people (the admin), and the run's pre-flight asks that it exists."""
    sync_modules([MODULE])
    assert not KnowledgeBase.objects.filter(name="support-style").exists()


def test_the_sync_reserves_every_name_for_the_deployment_before_any_person() -> None:
    ((workflow_id, saved),) = sync_modules([MODULE])
    assert (workflow_id, saved.created) == ("sample_support", True)
    kb = KnowledgeBase.objects.get(name="support-answers")
    assert kb.created_by is None  # the deployment's: no person reads it without a grant

    mallory = person("mallory", "add_knowledgebase")
    # Her own workflow may not write into it, nor read it in a recipe: 400 naming the field.
    answer = api_for(mallory).post("/api/v1/definitions", writing("support-answers"), format="json")
    assert answer.status_code == 400
    assert [e["field"] for e in answer.json()["errors"]] == ["steps[0].kb"]
    reading = {
        "id": "peek",
        "steps": [
            {
                "id": "ask",
                "kind": "recipe",
                "prompt": "${context}",
                "context": {"kb": "support-answers"},
            }
        ],
    }
    answer = api_for(mallory).post("/api/v1/definitions", reading, format="json")
    assert answer.status_code == 400
    assert [e["field"] for e in answer.json()["errors"]] == ["steps[0].context.kb"]
    # Nor create it in the admin, nor read it over the API.
    kb = KnowledgeBase.objects.get(name="support-answers")
    assert not access.may_read_kb(mallory, kb) and not access.may_write_kb(mallory, kb)
    assert api_for(mallory).get("/api/v1/kbs/support-answers/documents").status_code == 404
    mallory.is_staff = True
    mallory.save()
    admin = Client()
    admin.force_login(mallory)
    page = admin.post("/admin/workflows/knowledgebase/add/", {"name": "support-answers"})
    assert page.status_code == 200  # the form again, with the error
    assert KnowledgeBase.objects.get(name="support-answers").created_by is None

    # A second sync (a worker restart) finds its own names and saves nothing new.
    registry.clear()
    sys.modules.pop(MODULE, None)
    ((_, again),) = sync_modules([MODULE])
    assert not again.created


def test_a_superusers_knowledge_base_is_the_deployments_to_name(admin_user) -> None:
    knowledge.kb_get_or_create(name="support-answers", user=admin_user)
    ((_, saved),) = sync_modules([MODULE])
    assert saved.created
