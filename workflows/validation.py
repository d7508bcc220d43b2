"""Validation of workflow documents: the JSON Schema plus the cross-reference rules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

WorkflowExists = Callable[[str, "int | None"], bool]


def prepare_document(document: Any, *, workflow_exists: WorkflowExists) -> dict[str, Any]:
    """Translate legacy template syntax, validate, and return the document to store.

    Raises ``InvalidDocument`` listing every problem found.
    """
    raise NotImplementedError
