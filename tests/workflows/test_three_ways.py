"""The contract's support_ticket, authored three ways, is stored as one identical document."""

from __future__ import annotations

import json

import pytest
from django.urls import reverse

from workflows.examples.support_ticket import support
from workflows.models import WorkflowVersion

from .documents import support_ticket

pytestmark = pytest.mark.django_db


def contract_body() -> dict:
    return {k: v for k, v in support_ticket().items() if k != "version"}


@pytest.mark.parametrize(
    "order", [("builder", "api", "admin"), ("admin", "api", "builder"), ("api", "admin", "builder")]
)
def test_builder_api_and_admin_store_the_same_document(order, api, admin_client) -> None:
    assert support.document() == contract_body()

    def through(way: str) -> tuple[int, bool]:
        if way == "builder":
            result = support.save()
            return result.version.number, result.created
        if way == "api":
            response = api.post("/api/v1/definitions", contract_body(), format="json")
            assert response.status_code in (200, 201), response.json()
            return response.json()["version"], response.status_code == 201
        before = WorkflowVersion.objects.count()
        text = json.dumps(contract_body(), indent=2)
        admin_client.post(reverse("admin:workflows_workflow_add"), {"document": text})
        version = WorkflowVersion.objects.get(workflow_id="support_ticket")
        return version.number, WorkflowVersion.objects.count() > before

    outcomes = [through(way) for way in order]
    # The first way stores version 1; the other two recognise the very same body.
    assert outcomes == [(1, True), (1, False), (1, False)]
    stored = WorkflowVersion.objects.get(workflow_id="support_ticket")
    assert stored.document == {"id": "support_ticket", "version": 1, **contract_body()}
