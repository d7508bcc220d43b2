"""The queues a step may name (``workflows.queues``; issue 36, deliver 7): a person names only
``DJFLOW_STEP_QUEUES`` (and ``default``); nobody names the engine's own (``engine``,
``timers``, ``mail``), the deployment's own code and superusers included; a stored version
that breaks the rule is refused at start, through ``POST /runs`` and as a subworkflow.

Before: any queue was saved and started; three slow steps on ``timers`` made an unrelated
2-s run take 53 s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from runs import services
from runs.engine.advance import run_advance
from runs.models import Run
from workflows.errors import InvalidDocument
from workflows.models import WorkflowVersion
from workflows.services import definition_save

from ..settings_probe import last_line, probe_settings

pytestmark = pytest.mark.django_db

ENGINE_QUEUES = ["engine", "timers", "mail"]


def _document(queue: str, workflow_id: str = "queued") -> dict[str, Any]:
    """A step naming ``queue`` at the top level (``steps[2]``) and at every nesting: a
    parallel branch, a condition, a foreach body, a loop body and on_failure."""
    return {
        "id": workflow_id,
        "steps": [
            {"id": "first", "kind": "task"},
            {"id": "nap", "kind": "sleep", "ms": 1},
            {"id": "top", "kind": "task", "queue": queue},
            {
                "id": "fan",
                "kind": "parallel",
                "branches": {"left": [{"id": "branch", "kind": "task", "queue": queue}]},
            },
            {
                "id": "check",
                "kind": "condition",
                "if": {"path": "input.x", "op": "eq", "value": 1},
                "then": [{"id": "inside", "kind": "task", "queue": queue}],
            },
            {
                "id": "each",
                "kind": "foreach",
                "items": "${input.items}",
                "do": {"id": "item", "kind": "task", "queue": queue},
            },
            {
                "id": "again",
                "kind": "loop",
                "max_iterations": 2,
                "until": {"path": "iter.index", "op": "gte", "value": 1},
                "do": [{"id": "body", "kind": "task", "queue": queue}],
            },
        ],
        "on_failure": [{"id": "tidy", "kind": "task", "queue": queue}],
    }


EVERY_FIELD = [
    "steps[2].queue",
    "steps[3].branches.left[0].queue",
    "steps[4].then[0].queue",
    "steps[5].do.queue",
    "steps[6].do[0].queue",
    "on_failure[0].queue",
]


def _fields(response: Any) -> list[str]:
    return [error.get("field") for error in response.json()["errors"]]


def _client(user: Any) -> APIClient:
    client = APIClient()
    token, _ = Token.objects.get_or_create(user=user)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


@pytest.fixture
def root(db) -> Any:
    return get_user_model().objects.create_superuser(
        username="root", email="root@example.com", password="a-long-password-1"
    )


@pytest.mark.parametrize("queue", ENGINE_QUEUES)
def test_an_engine_queue_is_a_400_naming_every_step_field(api: APIClient, queue: str) -> None:
    response = api.post("/api/v1/definitions", _document(queue), format="json")
    assert response.status_code == 400, response.content
    assert sorted(_fields(response)) == sorted(EVERY_FIELD)
    message = response.json()["errors"][0]["message"]
    assert f"'{queue}' is one of the engine's own queues" in message
    assert not WorkflowVersion.objects.exists()


@pytest.mark.parametrize("queue", ENGINE_QUEUES)
def test_no_one_names_an_engine_queue_not_even_trusted_code(root, queue: str) -> None:
    with pytest.raises(InvalidDocument) as caught:
        definition_save(document=_document(queue))
    assert sorted(e.field for e in caught.value.errors) == sorted(EVERY_FIELD)
    response = _client(root).post("/api/v1/definitions", _document(queue), format="json")
    assert response.status_code == 400, response.content
    assert sorted(_fields(response)) == sorted(EVERY_FIELD)


def test_a_person_names_only_the_listed_queues(api: APIClient, settings) -> None:
    response = api.post("/api/v1/definitions", _document("gpu"), format="json")
    assert response.status_code == 400, response.content
    assert sorted(_fields(response)) == sorted(EVERY_FIELD)
    assert "DJFLOW_STEP_QUEUES: default" in response.json()["errors"][0]["message"]
    assert not WorkflowVersion.objects.exists()

    # default is always allowed, listed or not.
    response = api.post("/api/v1/definitions", _document("default"), format="json")
    assert response.status_code == 201, response.content

    settings.DJFLOW = {**settings.DJFLOW, "STEP_QUEUES": ["gpu", "io"]}
    response = api.post("/api/v1/definitions", _document("gpu", "listed"), format="json")
    assert response.status_code == 201, response.content


def test_trusted_code_and_superusers_may_name_other_queues(root) -> None:
    assert definition_save(document=_document("gpu")).created
    response = _client(root).post("/api/v1/definitions", _document("io", "by_root"), format="json")
    assert response.status_code == 201, response.content


def test_the_admin_refuses_an_engine_queue_at_its_field(admin_client) -> None:
    text = json.dumps(_document("timers"))
    response = admin_client.post(reverse("admin:workflows_workflow_add"), {"document": text})
    assert response.status_code == 200
    fields = [e.field for e in response.context["form"].document_errors]
    assert sorted(fields) == sorted(EVERY_FIELD)
    assert not WorkflowVersion.objects.exists()


# --- a start of a version stored before the rule ---------------------------------------------


def _stored(queue: str, *, by: Any, workflow_id: str = "queued") -> WorkflowVersion:
    """A version saved by ``by`` with ``default`` queues, then its document changed to name
    ``queue``: what a save before this rule (or before the list shrank) left."""
    version = definition_save(document=_document("default", workflow_id), user=by).version
    document = _document(queue, workflow_id)
    WorkflowVersion.objects.filter(pk=version.pk).update(document=document)
    version.refresh_from_db()
    return version


@pytest.mark.parametrize("queue", ["timers", "gpu"])
def test_a_stored_version_a_person_may_not_save_now_does_not_start(
    api: APIClient, user, queue: str
) -> None:
    _stored(queue, by=user)
    response = api.post("/api/v1/runs", {"workflow": "queued", "input": {}}, format="json")
    assert response.status_code == 400, response.content
    assert sorted(_fields(response)) == sorted(EVERY_FIELD)
    assert not Run.objects.exists()


def test_a_trusted_version_starts_on_its_queue_but_never_on_an_engine_one(
    api: APIClient,
) -> None:
    _stored("gpu", by=None)
    response = api.post("/api/v1/runs", {"workflow": "queued", "input": {}}, format="json")
    assert response.status_code == 201, response.content

    _stored("mail", by=None, workflow_id="on_mail")
    response = api.post("/api/v1/runs", {"workflow": "on_mail", "input": {}}, format="json")
    assert response.status_code == 400, response.content
    assert sorted(_fields(response)) == sorted(EVERY_FIELD)


def test_a_subworkflow_naming_an_engine_queue_fails_its_step_clearly(user) -> None:
    _stored("timers", by=None, workflow_id="child")
    definition_save(
        document={
            "id": "parent",
            "steps": [{"id": "call", "kind": "subworkflow", "workflow": "child", "input": {}}],
        },
        user=user,
    )
    run = services.run_start(workflow="parent", input={}, user=user).run
    run_advance(run_id=run.id)
    run.refresh_from_db()
    assert run.status == "failed", run.status
    assert run.error["class"] == "invalid_input", run.error
    assert "subworkflow 'child' cannot start" in run.error["message"]
    assert "steps[2].queue" in run.error["message"]
    assert not Run.objects.filter(workflow_id="child").exists()


@pytest.mark.parametrize("queue", ["timers", "gpu"])
def test_a_retry_of_such_a_version_is_refused_the_same_way(
    api: APIClient, user, queue: str
) -> None:
    """A retry runs steps again: the run, started before the rule, may not rerun them on a
    queue its version's saver may not name now."""
    from runs.status import RunStatus

    from ..runs.factories import RunFactory

    version = _stored(queue, by=user)
    run = RunFactory(version=version, status=RunStatus.COMPLETED, input={})
    response = api.post(f"/api/v1/runs/{run.id}/retry", {"from_step": "first"}, format="json")
    assert response.status_code == 400, response.content
    assert sorted(_fields(response)) == sorted(EVERY_FIELD)
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.generation == 1


# --- the operator's list ---------------------------------------------------------------------


@pytest.mark.parametrize("listed", ["timers", "default,mail", " engine ,gpu"])
def test_listing_an_engine_queue_refuses_to_start(tmp_path: Path, listed: str) -> None:
    done = probe_settings(tmp_path, DJFLOW_STEP_QUEUES=listed)
    assert done.returncode != 0
    assert "ImproperlyConfigured" in done.stderr and "DJFLOW_STEP_QUEUES" in done.stderr


def test_the_list_is_read_from_the_environment(tmp_path: Path) -> None:
    probe = "import django; django.setup(); from django.conf import settings; "
    probe += "print(settings.DJFLOW['STEP_QUEUES'])"
    done = probe_settings(tmp_path, probe, DJFLOW_STEP_QUEUES="gpu, io,,gpu")
    assert last_line(done) == "['gpu', 'io']"
