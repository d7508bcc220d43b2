"""A run input checked against its version's ``input_schema`` (``POST /runs``, a
subworkflow's start)."""

from __future__ import annotations

from itertools import islice
from typing import Any

from referencing.exceptions import Unresolvable

from . import secrets
from .errors import FieldError
from .input_schema import input_validator, write_only_values
from .validation import field_path

# The most problems one input is checked for: an input of 100,000 bad items made as many
# errors, each kept and sorted (12 s of a web worker for 1 MiB); the first are enough to act on.
MAX_INPUT_ERRORS = 100


def input_errors(version: Any, value: Any) -> list[FieldError]:
    """Problems with a run input against the version's ``input_schema``, each naming its field:
    the first :data:`MAX_INPUT_ERRORS` found, in the order of their fields."""
    schema = version.document.get("input_schema")
    if schema is None:
        return []
    validator = input_validator(schema)
    try:
        found = sorted(
            islice(validator.iter_errors(value), MAX_INPUT_ERRORS),
            key=lambda e: list(e.absolute_path),
        )
        # jsonschema's messages repeat the value ("'sk-…' does not match ..."): not a secret's.
        marked = write_only_values(schema, value) if found else []
        hide = secrets.masker(secret for _, secret in marked)
    except Unresolvable as exc:
        # Only a document stored before remote $refs were refused at save gets here; the
        # registry fetched nothing.
        return [FieldError("input", f"input_schema has a reference that is not local: {exc}")]
    errors = []
    for error in found:
        path = field_path(["input", *error.absolute_path])
        if error.validator == "required":
            for name in error.validator_value:
                if isinstance(error.instance, dict) and name not in error.instance:
                    errors.append(
                        FieldError(f"{path}.{name}", f"required field '{name}' is missing")
                    )
        else:
            errors.append(FieldError(path, hide(error.message)))
    return errors
