"""A run input checked against its version's ``input_schema`` (``POST /runs``, a
subworkflow's start)."""

from __future__ import annotations

from itertools import islice
from typing import Any

from referencing.exceptions import Unresolvable

from . import secrets
from .errors import FieldError
from .input_schema import (
    cost_problems,
    input_validator,
    mentions_write_only,
    shown_value,
    write_only_values,
)
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
    # A schema stored before save refused them (its check would never end, or take hours):
    # a start that can never be checked is refused, naming why (contract section 9).
    too_costly = cost_problems(schema)
    if too_costly:
        return [FieldError("input", f"input_schema cannot be checked: {too_costly[0][1]}")]
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
    except RecursionError:
        return [FieldError("input", "input_schema cannot be checked: it nests too deeply")]
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
            # A secret in a branch the value fails (anyOf, oneOf) is not marked, as the value
            # is not valid there: where the failing subschema marks any, the message does not
            # quote the value it judges (security review of the start page, issue 37).
            message = hide(error.message)
            if mentions_write_only(error.schema):
                message = _unquoted(error, message)
            errors.append(FieldError(path, message))
    return errors


def _unquoted(error: Any, message: str) -> str:
    """``message`` without the value ``error`` judges (as jsonschema and ``input_schema``
    quote it): "the value" instead."""
    for shown in (repr(error.instance), shown_value(error.instance)):
        message = message.replace(shown, "the value")
    return message
