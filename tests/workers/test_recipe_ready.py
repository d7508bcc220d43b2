"""What stops a recipe step before its first call is the same at the start (pre-flight, a
400 naming the field) and in the step (a failure naming it): a subworkflow's steps are not
checked at the start, and a recipe or a provider may go meanwhile."""

from __future__ import annotations

from typing import Any

import pytest

from workers.kinds import recipe as recipe_kind
from workflows.failures import KindFailure
from workflows.kinds import PreflightScope

pytestmark = pytest.mark.django_db

INLINE = {"id": "ask", "kind": "recipe", "prompt": "hi", "model": "standin:echo"}


@pytest.mark.parametrize(
    ("step", "field", "message", "class_"),
    [
        ({**INLINE, "context": {"kb": "faq"}}, "context.kb", "does not exist", "fatal"),
        ({"id": "ask", "kind": "recipe", "recipe": "ghost"}, "recipe", "does not exist", "fatal"),
        ({**INLINE, "model": "nowhere:m"}, "model", "model 'nowhere:m'", "fatal"),
    ],
    ids=["context", "missing-recipe", "unknown-provider"],
)
def test_a_step_that_cannot_run_is_refused_at_the_start_and_fails_naming_why(
    step: dict[str, Any], field: str, message: str, class_: str
) -> None:
    [(named, why)] = recipe_kind.preflight(step, PreflightScope())
    assert named == field and message in why
    with pytest.raises(KindFailure) as failed:
        recipe_kind.run_recipe(step, ctx=None, input={}, prior={})  # type: ignore[arg-type]
    assert failed.value.error_class == class_
    assert f"{field}: " in failed.value.message and message in failed.value.message


def test_a_ready_step_passes_pre_flight() -> None:
    assert recipe_kind.preflight(INLINE, PreflightScope()) == []
