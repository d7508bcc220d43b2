"""Recipes: named, versioned prompts (CONTRACT section 10), and the ``recipe`` step's view
of them. Pure Python, no Django: the service that saves recipes, the validator of workflow
documents, the admin's preview and the worker's ``recipe`` step all use this module.

A recipe document::

    {"name": "triage", "version": 2, "description": "...",
     "system": "You sort tickets.", "prompt": "Ticket: ${input.text}\\n\\n${context}",
     "model": "openai:gpt-4o-mini", "output": "json", "output_schema": {...},
     "temperature": 0.2, "max_tokens": 1024}

Invariants
----------
* :func:`prepare_recipe` either raises :class:`InvalidDocument` listing every problem, each
  naming its field, or returns the document to store: known fields only, ``output`` and
  ``max_tokens`` filled in with their defaults (so a body that spells a default out and one
  that leaves it out are the same body, one version), ``name`` and ``version`` first.
* Templates in ``system`` and ``prompt`` read only two roots: ``input`` (the step's input,
  not the run's: ``${input}`` is all of it, ``${input.x}`` a field) and ``context`` (the
  retrieved passages, one string: ``${context}`` only). Any other root (``${steps.a}``,
  ``${run.id}``) is an error naming the field at save, never a blank at run time.
* :func:`render` is string interpolation, as ``workflows.templates.interpolate``: a string
  reads as itself, an object or array as compact JSON, ``null`` *and a path that is not
  there* as the empty text (the same as an embedded reference in any workflow template, so a
  prompt never fails on an optional field); ``$${`` is a literal ``${``. Rendered text never
  renders again (an input containing ``${...}`` stays as typed). ``system`` and ``prompt``
  together are at most ``max_bytes`` of UTF-8 (default 1 MiB, the contract's bound on a
  step's input): past it :class:`RenderTooLarge` is raised while rendering, naming the field.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .errors import FieldError, InvalidDocument, echo
from .input_schema import schema_errors
from .kb_names import name_problem as kb_name_problem
from .templates import (
    TooLarge,
    interpolate,
    is_valid_path,
    join_location,
    reference_errors,
    references,
    split_path,
)

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "INLINE_FIELDS",
    "MAX_RENDERED_BYTES",
    "OVERRIDABLE_FIELDS",
    "RenderTooLarge",
    "Rendered",
    "prepare_recipe",
    "recipe_of_step",
    "render",
    "step_recipe_errors",
]

NAME_PATTERN: Final = re.compile(r"[a-z][a-z0-9_]*")
MAX_NAME_LENGTH: Final = 100
MAX_VERSION: Final = 2_147_483_647
MAX_DESCRIPTION_LENGTH: Final = 10_000
# A prompt or a system text as stored, in UTF-8 bytes (the rendered text may be larger).
MAX_TEXT_BYTES: Final = 100 * 1024
# "<provider>:<model>"; which providers exist is the worker's business (pre-flight checks it).
MODEL_PATTERN: Final = re.compile(r"[a-z][a-z0-9_-]*:\S+")
MAX_MODEL_LENGTH: Final = 200
OUTPUTS: Final = ("text", "json")
MAX_TEMPERATURE: Final = 2
MAX_TOKENS_LIMIT: Final = 200_000
DEFAULT_MAX_TOKENS: Final = 1024
# system + prompt after rendering, in UTF-8 bytes.
MAX_RENDERED_BYTES: Final = 1024 * 1024

ROOTS: Final = ("input", "context")
# The recipe fields a ``recipe`` step may give inline (an inline recipe).
INLINE_FIELDS: Final = (
    "system",
    "prompt",
    "model",
    "output",
    "output_schema",
    "temperature",
    "max_tokens",
)
# What a step that names a stored recipe may still say for itself.
OVERRIDABLE_FIELDS: Final = ("model", "temperature", "max_tokens")
FIELDS: Final = ("name", "version", "description", *INLINE_FIELDS)
_TEXT_FIELDS: Final = ("system", "prompt")
# The body of POST /recipes in the OpenAPI document: the fields above and no others (the save
# refuses an unknown one), with the bounds the save checks.
BODY_SCHEMA: Final = {
    "type": "object",
    "required": ["name", "prompt"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z][a-z0-9_]*$", "maxLength": MAX_NAME_LENGTH},
        "version": {"type": "integer", "minimum": 1, "maximum": MAX_VERSION},
        "description": {"type": "string", "maxLength": MAX_DESCRIPTION_LENGTH},
        "system": {"type": "string", "minLength": 1, "description": "a template, at most 100 KB"},
        "prompt": {"type": "string", "minLength": 1, "description": "a template, at most 100 KB"},
        "model": {"type": "string", "maxLength": MAX_MODEL_LENGTH, "example": "openai:gpt-4o-mini"},
        "output": {"type": "string", "enum": list(OUTPUTS)},
        "output_schema": {"type": "object", "description": "a JSON Schema of a json output"},
        "temperature": {"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_LIMIT},
    },
}


@dataclass(frozen=True)
class Rendered:
    system: str | None
    prompt: str


class RenderTooLarge(ValueError):
    """The rendered ``system`` and ``prompt`` would be over ``limit`` bytes; ``field`` is the
    one being rendered when the budget ran out. The worker fails the attempt with class
    ``invalid_input``."""

    def __init__(self, field: str, limit: int) -> None:
        self.field, self.limit = field, limit
        super().__init__(
            f"the rendered {field} is over {limit} bytes (system and prompt together, as "
            "UTF-8): the step input or the context is too large for this recipe"
        )


# --- documents -------------------------------------------------------------------------------


def prepare_recipe(document: Any) -> dict[str, Any]:
    """Validate a recipe document and return it normalised for storing (see the module
    docstring). Raises :class:`InvalidDocument` naming every bad field."""
    if not isinstance(document, dict):
        raise InvalidDocument(errors=[FieldError("body", "a recipe must be a JSON object")])
    errors = _unknown_fields(document, FIELDS, "")
    errors += _name_errors(document)
    if "version" in document and not _is_int_in(document["version"], 1, MAX_VERSION):
        errors.append(
            FieldError(
                "version",
                f"must be an integer from 1 to {MAX_VERSION}; got {_shown(document['version'])}",
            )
        )
    description = document.get("description", "")
    if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_LENGTH:
        errors.append(
            FieldError(
                "description", f"must be text of at most {MAX_DESCRIPTION_LENGTH} characters"
            )
        )
    fields, field_errors = _normalise({k: v for k, v in document.items() if k in INLINE_FIELDS})
    errors += field_errors
    if errors:
        raise InvalidDocument(errors=errors)
    head = {k: document[k] for k in ("name", "version", "description") if k in document}
    return {**head, **fields}


def _name_errors(document: Mapping[str, Any]) -> list[FieldError]:
    if "name" not in document:
        return [FieldError("name", "required field 'name' is missing")]
    name = document["name"]
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        return [FieldError("name", f"must match ^[a-z][a-z0-9_]*$; got {_shown(name)}")]
    if len(name) > MAX_NAME_LENGTH:
        return [FieldError("name", f"must be at most {MAX_NAME_LENGTH} characters")]
    return []


def _normalise(
    fields: Mapping[str, Any], where: str = ""
) -> tuple[dict[str, Any], list[FieldError]]:
    """The recipe fields (``INLINE_FIELDS``) checked, defaults filled in, in a fixed order."""
    errors: list[FieldError] = []
    if "prompt" not in fields:
        errors.append(FieldError(_at(where, "prompt"), "required field 'prompt' is missing"))
    for name in _TEXT_FIELDS:
        if name in fields:
            errors += _text_errors(fields[name], _at(where, name))
    model = fields.get("model")
    if "model" in fields and not (
        isinstance(model, str) and len(model) <= MAX_MODEL_LENGTH and MODEL_PATTERN.fullmatch(model)
    ):
        errors.append(
            FieldError(
                _at(where, "model"),
                f"must be '<provider>:<model>' (e.g. 'openai:gpt-4o-mini'), at most "
                f"{MAX_MODEL_LENGTH} characters; got {_shown(model)}",
            )
        )
    output = fields.get("output", "text")
    if output not in OUTPUTS:
        errors.append(
            FieldError(_at(where, "output"), f'must be "text" or "json"; got {_shown(output)}')
        )
    if "output_schema" in fields and not isinstance(fields["output_schema"], dict):
        errors.append(FieldError(_at(where, "output_schema"), "must be a JSON Schema object"))
    else:
        errors += _output_schema_errors(fields, where)
    temperature = fields.get("temperature")
    if "temperature" in fields and not _is_number_in(temperature, 0, MAX_TEMPERATURE):
        errors.append(
            FieldError(
                _at(where, "temperature"),
                f"must be a number from 0 to {MAX_TEMPERATURE}; got {_shown(temperature)}",
            )
        )
    max_tokens = fields.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not _is_int_in(max_tokens, 1, MAX_TOKENS_LIMIT):
        errors.append(
            FieldError(
                _at(where, "max_tokens"),
                f"must be an integer from 1 to {MAX_TOKENS_LIMIT}; got {_shown(max_tokens)}",
            )
        )
    defaults = {"output": output, "max_tokens": max_tokens}
    normalised = {
        k: defaults[k] if k in defaults else fields[k]
        for k in INLINE_FIELDS
        if k in defaults or k in fields
    }
    return normalised, errors


def _text_errors(text: Any, where: str) -> list[FieldError]:
    if not isinstance(text, str) or not text:
        return [FieldError(where, "must be non-empty text (leave the field out for none)")]
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TEXT_BYTES:
        return [FieldError(where, f"is {size} bytes; at most {MAX_TEXT_BYTES} are allowed")]
    return template_errors(text, where)


def template_errors(text: Any, where: str) -> list[FieldError]:
    """Problems with the ``${}`` references of a recipe's ``system`` or ``prompt``: malformed
    ones, and any that reads something other than ``input`` or ``context`` (whole)."""
    if not isinstance(text, str):
        return []
    errors = [FieldError(where, message) for _, message in reference_errors(text)]
    for _, path in references(text):
        if not is_valid_path(path):
            continue  # reported above as malformed
        root, *rest = split_path(path)
        if root not in ROOTS:
            errors.append(
                FieldError(
                    where,
                    f"'${{{echo(path)}}}' reads '{echo(root)}': a recipe's templates read only "
                    "${input} (the step input, ${input.x} for a field) and ${context}; give "
                    "the step an 'input' that passes what the prompt needs",
                )
            )
        elif root == "context" and rest:
            errors.append(
                FieldError(
                    where,
                    f"'${{{echo(path)}}}': the context is one text (the retrieved passages); "
                    "reference it whole as ${context}",
                )
            )
    return errors


def _output_schema_errors(fields: Mapping[str, Any], where: str) -> list[FieldError]:
    if "output_schema" not in fields:
        return []
    here = _at(where, "output_schema")
    if fields.get("output", "text") != "json":
        return [FieldError(here, 'is only for output "json" (a text reply is not checked)')]
    schema = fields["output_schema"]
    if not isinstance(schema, dict):
        return []  # a type error, reported by whoever checks types
    return [FieldError(field, message) for field, message in schema_errors(schema, here)]


def _unknown_fields(
    document: Mapping[str, Any], known: tuple[str, ...], where: str
) -> list[FieldError]:
    errors = []
    for key in document:
        if key in known:
            continue
        hint = difflib.get_close_matches(str(key), known, n=1)
        message = f"unknown field '{echo(key)}'"
        message += f" (did you mean '{hint[0]}'?)" if hint else f"; allowed: {', '.join(known)}"
        errors.append(FieldError(_at(where, str(key)), message))
    return errors


# --- the recipe step --------------------------------------------------------------------------


def step_recipe_errors(step: Mapping[str, Any], where: str) -> list[FieldError]:
    """What the schema cannot say about a ``recipe`` step, checked when its workflow is saved:
    exactly one of ``recipe`` and ``prompt``; a step naming a recipe overrides only
    ``OVERRIDABLE_FIELDS``; inline templates read only ``input`` and ``context``; an inline
    ``output_schema`` is a valid, local JSON Schema and comes with ``output: "json"``. Whether a
    named recipe exists is not checked here: recipes may be saved after the workflow, and a
    run's start checks it. Types are the schema's to report (skipped here)."""
    named, inline = "recipe" in step, "prompt" in step
    if named and inline:
        return [
            FieldError(
                _at(where, "prompt"),
                "a recipe step needs exactly one of 'recipe' (a stored recipe's name) or "
                "'prompt' (an inline recipe), not both",
            )
        ]
    if not named and not inline:
        return [
            FieldError(
                where or None,
                "a recipe step needs exactly one of 'recipe' (a stored recipe's name) or "
                "'prompt' (an inline recipe)",
            )
        ]
    if named:
        return _override_errors(step, where) + _context_errors(step, where)
    errors = _context_errors(step, where)
    if "recipe_version" in step:
        errors.append(
            FieldError(_at(where, "recipe_version"), "is only for a step naming a 'recipe'")
        )
    for name in _TEXT_FIELDS:
        if isinstance(step.get(name), str):
            errors += _text_errors(step[name], _at(where, name))
    return errors + _output_schema_errors(step, where)


def _context_errors(step: Mapping[str, Any], where: str) -> list[FieldError]:
    """A ``context`` names its knowledge base literally (pre-flight and the saving user's
    rights need the name), and its ``query`` is a text template over the step input only
    (``${input}``, ``${input.x}``), rendered as the prompt is."""
    context = step.get("context")
    if not isinstance(context, Mapping):
        return []  # the schema's to report
    here = _at(where, "context")
    errors = []
    if "kb" in context:
        problem = kb_name_problem(context["kb"])
        if problem:
            errors.append(FieldError(_at(here, "kb"), f"{problem}; it is a name, not a template"))
    if "query" in context:
        query = context["query"]
        if not isinstance(query, str) or not query:
            errors.append(FieldError(_at(here, "query"), "must be non-empty text (a template)"))
        elif len(query.encode("utf-8", "surrogatepass")) > MAX_TEXT_BYTES:
            errors.append(FieldError(_at(here, "query"), f"is over {MAX_TEXT_BYTES} bytes"))
        else:
            errors += _query_errors(query, _at(here, "query"))
    return errors


def _query_errors(query: str, where: str) -> list[FieldError]:
    errors = [FieldError(where, message) for _, message in reference_errors(query)]
    for _, path in references(query):
        if is_valid_path(path) and split_path(path)[0] != "input":
            errors.append(
                FieldError(
                    where,
                    f"'${{{echo(path)}}}': a context's query reads only ${{input}} (the step "
                    "input, ${input.x} for a field); give the step an 'input' that passes what "
                    "the query needs",
                )
            )
    return errors


def _override_errors(step: Mapping[str, Any], where: str) -> list[FieldError]:
    return [
        FieldError(
            _at(where, name),
            f"a step naming a recipe may override only {', '.join(OVERRIDABLE_FIELDS)}; "
            f"'{name}' is the recipe's own (save a new version of it, or give the step an "
            "inline 'prompt' instead)",
        )
        for name in INLINE_FIELDS
        if name in step and name not in OVERRIDABLE_FIELDS
    ]


def recipe_of_step(
    step: Mapping[str, Any], stored: Mapping[str, Any] | None, *, where: str = ""
) -> dict[str, Any]:
    """The recipe a ``recipe`` step runs, normalised as :func:`prepare_recipe` returns it.

    An inline step (``prompt``) is its own recipe (no ``name``, no ``version``). A step naming
    ``recipe`` runs ``stored`` (the document of the version the caller resolved: the pinned
    ``recipe_version``, else the newest) with the step's ``model``, ``temperature`` and
    ``max_tokens`` over it; ``description`` is left out. Raises :class:`InvalidDocument`
    naming the step field (under ``where``, e.g. ``steps[1]``) when the step gives both or
    neither of ``recipe`` and ``prompt``, overrides another field, names a recipe that
    ``stored`` is not (``None``: unknown), or a merged value is out of bounds.
    """
    errors = step_recipe_errors(step, where)
    if errors:
        raise InvalidDocument(errors=errors)
    if "prompt" in step:
        fields = {k: step[k] for k in INLINE_FIELDS if k in step}
        head: dict[str, Any] = {}
    else:
        fields = _named_fields(step, stored, where)
        head = {k: stored[k] for k in ("name", "version") if stored is not None and k in stored}
    normalised, errors = _normalise(fields, where)
    if errors:
        raise InvalidDocument(errors=errors)
    return {**head, **normalised}


def _named_fields(
    step: Mapping[str, Any], stored: Mapping[str, Any] | None, where: str
) -> dict[str, Any]:
    name = step["recipe"]
    pinned = step.get("recipe_version")
    if stored is None or stored.get("name") != name:
        shown = f"'{echo(name)}'" + (f" version {pinned}" if pinned is not None else "")
        raise InvalidDocument(errors=[FieldError(_at(where, "recipe"), f"unknown recipe {shown}")])
    if pinned is not None and stored.get("version") != pinned:
        raise InvalidDocument(
            errors=[
                FieldError(
                    _at(where, "recipe_version"),
                    f"recipe '{echo(name)}' has no version {_shown(pinned)}",
                )
            ]
        )
    fields = {k: stored[k] for k in INLINE_FIELDS if k in stored}
    return {**fields, **{k: step[k] for k in OVERRIDABLE_FIELDS if k in step}}


# --- rendering --------------------------------------------------------------------------------


def render(
    recipe: Mapping[str, Any],
    step_input: Any,
    context: str | None = "",
    *,
    max_bytes: int = MAX_RENDERED_BYTES,
) -> Rendered:
    """``recipe``'s ``system`` (None when it has none) and ``prompt`` with their templates
    resolved against ``{"input": step_input, "context": context}`` (see the module docstring
    for how values read as text). Raises :class:`RenderTooLarge` when the two together would
    be over ``max_bytes`` of UTF-8."""
    scope = {"input": step_input, "context": context or ""}
    left = max_bytes
    system = None
    if recipe.get("system") is not None:
        system = _render_field(recipe["system"], scope, "system", left, max_bytes)
        left -= len(system.encode("utf-8", "surrogatepass"))
    prompt = _render_field(recipe["prompt"], scope, "prompt", left, max_bytes)
    return Rendered(system=system, prompt=prompt)


def _render_field(text: str, scope: Mapping[str, Any], field: str, left: int, limit: int) -> str:
    try:
        return interpolate(text, scope, max_bytes=left)
    except TooLarge:
        raise RenderTooLarge(field, limit) from None


# --- small helpers ----------------------------------------------------------------------------


def _at(where: str, name: str) -> str:
    return join_location(where, name)


def _shown(value: Any) -> str:
    return echo(repr(value) if isinstance(value, str) else _json_text(value))


def _json_text(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _is_int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number_in(value: Any, low: float, high: float) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and low <= value <= high
