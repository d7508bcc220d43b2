"""What a knowledge base's name and a document's key may be (pure: the validator of
documents, the ``write_kb`` step's planner half and the models share it)."""

from __future__ import annotations

import re
from typing import Any, Final

from .errors import echo

# URL-safe as it stands: the API's paths carry it.
NAME_PATTERN: Final = r"^[a-z0-9][a-z0-9_-]*$"
NAME_MAX_LENGTH: Final = 100
KEY_MAX_LENGTH: Final = 200
TITLE_MAX_LENGTH: Final = 500
_NAME = re.compile(NAME_PATTERN)


def name_problem(name: Any) -> str | None:
    """What is wrong with ``name`` as a knowledge base's name, or None."""
    if not isinstance(name, str) or not name:
        return "must be a non-empty string"
    if len(name) > NAME_MAX_LENGTH:
        return f"must be at most {NAME_MAX_LENGTH} characters"
    if not _NAME.fullmatch(name):
        return f"'{echo(name)}' is not a knowledge base name (^[a-z0-9][a-z0-9_-]*$)"
    return None


def is_template(value: Any) -> bool:
    """Whether a field's value holds a ``${...}`` reference (known only when a run resolves
    it), rather than being the literal name."""
    return isinstance(value, str) and "${" in value.replace("$${", "")
