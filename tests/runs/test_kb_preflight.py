"""Pre-flight of a recipe's context (CONTRACT section 10): its knowledge base exists, or an
earlier step of the same workflow writes it; otherwise ``POST /runs`` is a 400 naming
``steps[i].context.kb`` and nothing starts."""

from __future__ import annotations

from typing import Any

import pytest

from runs.models import Run
from workflows import knowledge
from workflows.services import definition_save

pytestmark = pytest.mark.django_db

ASK = {
    "id": "ask",
    "kind": "recipe",
    "model": "standin:echo",
    "prompt": "${context}",
    "context": {"kb": "answers"},
}
KEEP = {"id": "keep", "kind": "write_kb", "kb": "answers", "key": "k", "content": "c"}


def _start(api: Any, *steps: dict[str, Any]) -> Any:
    definition_save(document={"id": "kb_flight", "steps": list(steps)})
    return api.post("/api/v1/runs", {"workflow": "kb_flight", "input": {}}, format="json")


def test_an_unknown_knowledge_base_is_a_400_naming_the_field(api: Any) -> None:
    response = _start(api, {"id": "first", "kind": "sleep", "ms": 1}, ASK)
    assert response.status_code == 400, response.content
    assert response.json()["errors"] == [
        {
            "field": "steps[1].context.kb",
            "message": "knowledge base 'answers' does not exist, and no earlier write_kb step of "
            "this workflow writes it",
        }
    ]
    assert not Run.objects.exists()


def test_a_write_to_another_base_does_not_count(api: Any) -> None:
    elsewhere = {**KEEP, "kb": "elsewhere"}
    templated = {**KEEP, "id": "keep2", "kb": "${input.kb}"}
    assert _start(api, elsewhere, templated, ASK).status_code == 400


def test_a_later_literal_write_reserved_the_name_at_save(api: Any) -> None:
    """Every save that names a knowledge base in a write_kb makes it, the deployment's
    included (issue 36): it exists, empty, before the first run starts."""
    assert _start(api, ASK, KEEP).status_code == 201


@pytest.mark.parametrize(
    "steps",
    [
        [KEEP, ASK],
        [
            {
                "id": "c",
                "kind": "condition",
                "if": {"path": "input.x", "op": "exists"},
                "then": [KEEP],
            },
            ASK,
        ],
    ],
    ids=["earlier", "nested-earlier"],
)
def test_an_earlier_write_of_the_base_passes(api: Any, steps: list[dict[str, Any]]) -> None:
    assert _start(api, *steps).status_code == 201


def test_an_existing_knowledge_base_passes(api: Any) -> None:
    knowledge.kb_write(kb="answers", key="k", content="c")
    assert _start(api, ASK).status_code == 201
