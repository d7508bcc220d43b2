"""Recipes without a database: the document rules, rendering, a step's recipe, and the
``recipe`` step's checks when its workflow is saved (workflows.recipes, workflows.validation)."""

from __future__ import annotations

from typing import Any

import pytest

from workflows.errors import InvalidDocument
from workflows.recipes import (
    DEFAULT_MAX_TOKENS,
    INLINE_FIELDS,
    MAX_RENDERED_BYTES,
    Rendered,
    RenderTooLarge,
    prepare_recipe,
    recipe_of_step,
    render,
)
from workflows.validation import validate_document


def fields_of(exc: pytest.ExceptionInfo[InvalidDocument]) -> dict[str | None, str]:
    return {e.field: e.message for e in exc.value.errors}


# --- prepare_recipe ---------------------------------------------------------------------------


def test_a_minimal_recipe_gets_its_defaults() -> None:
    assert prepare_recipe({"name": "hello", "prompt": "Hi ${input.who}"}) == {
        "name": "hello",
        "prompt": "Hi ${input.who}",
        "output": "text",
        "max_tokens": DEFAULT_MAX_TOKENS,
    }


def test_a_full_recipe_is_kept_in_a_fixed_order() -> None:
    document = {
        "max_tokens": 50,
        "temperature": 0,
        "output_schema": {
            "type": "object",
            "$defs": {"a": {}},
            "properties": {"a": {"$ref": "#/$defs/a"}},
        },
        "output": "json",
        "model": "anthropic:claude-sonnet-4",
        "prompt": "${input}",
        "system": "Be brief. ${context}",
        "description": "d",
        "version": 3,
        "name": "full",
    }
    prepared = prepare_recipe(document)
    assert prepared == document
    assert list(prepared) == ["name", "version", "description", *INLINE_FIELDS]


@pytest.mark.parametrize(
    ("document", "field", "words"),
    [
        (None, "body", "JSON object"),
        ({"name": "r", "prompt": "p", "promt": "q"}, "promt", "did you mean 'prompt'"),
        ({"prompt": "p"}, "name", "missing"),
        ({"name": "9lives", "prompt": "p"}, "name", "^[a-z][a-z0-9_]*$"),
        ({"name": "a" * 101, "prompt": "p"}, "name", "at most 100"),
        ({"name": "r"}, "prompt", "missing"),
        ({"name": "r", "prompt": ""}, "prompt", "non-empty"),
        ({"name": "r", "prompt": "é" * 60_000}, "prompt", "at most 102400"),
        ({"name": "r", "prompt": "p", "system": ""}, "system", "non-empty"),
        ({"name": "r", "prompt": "p", "model": "gpt-4o"}, "model", "<provider>:<model>"),
        ({"name": "r", "prompt": "p", "model": "openai: gpt"}, "model", "<provider>:<model>"),
        ({"name": "r", "prompt": "p", "output": "yaml"}, "output", '"text" or "json"'),
        (
            {"name": "r", "prompt": "p", "output_schema": {}},
            "output_schema",
            'only for output "json"',
        ),
        (
            {"name": "r", "prompt": "p", "output": "json", "output_schema": {"minLength": -1}},
            "output_schema.minLength",
            "not a valid JSON Schema",
        ),
        (
            {"name": "r", "prompt": "p", "output": "json", "output_schema": {"$ref": "http://x/s"}},
            "output_schema.$ref",
            "not a local reference",
        ),
        (
            {
                "name": "r",
                "prompt": "p",
                "output": "json",
                "output_schema": {"properties": {"a": {"pattern": "(?<=a)b"}}},
            },
            "output_schema.properties.a.pattern",
            "not a regular expression",
        ),
        ({"name": "r", "prompt": "p", "temperature": -0.1}, "temperature", "from 0 to 2"),
        ({"name": "r", "prompt": "p", "temperature": float("nan")}, "temperature", "from 0 to 2"),
        ({"name": "r", "prompt": "p", "temperature": True}, "temperature", "from 0 to 2"),
        ({"name": "r", "prompt": "p", "max_tokens": 0}, "max_tokens", "from 1 to 200000"),
        ({"name": "r", "prompt": "p", "max_tokens": "10"}, "max_tokens", "from 1 to 200000"),
        ({"name": "r", "prompt": "p", "version": 2**31}, "version", "from 1 to"),
        ({"name": "r", "prompt": "${steps.a.output}"}, "prompt", "reads 'steps'"),
        ({"name": "r", "prompt": "p", "system": "${run.id}"}, "system", "reads 'run'"),
        ({"name": "r", "prompt": "${context.title}"}, "prompt", "reference it whole"),
        ({"name": "r", "prompt": "Hi ${input"}, "prompt", "unclosed reference"),
        ({"name": "r", "prompt": "Hi ${input..x}"}, "prompt", "malformed reference path"),
    ],
)
def test_bad_recipes_are_refused_naming_the_field(document: Any, field: str, words: str) -> None:
    with pytest.raises(InvalidDocument) as exc:
        prepare_recipe(document)
    found = fields_of(exc)
    assert field in found, found
    assert words in found[field]


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(InvalidDocument) as exc:
        prepare_recipe({"name": "R", "prompt": "${steps.x}", "max_tokens": 0, "extra": 1})
    assert set(fields_of(exc)) == {"name", "prompt", "max_tokens", "extra"}


def test_escaped_references_are_text_not_templates() -> None:
    prepared = prepare_recipe({"name": "r", "prompt": "Write $${steps.a} literally"})
    assert render(prepared, {}).prompt == "Write ${steps.a} literally"


# --- render -----------------------------------------------------------------------------------


RECIPE = prepare_recipe(
    {
        "name": "r",
        "system": "You answer about ${input.product}.",
        "prompt": "Q: ${input.question}\nUser: ${input.user}\nTags: ${input.tags}\n"
        "Missing: [${input.nope}] Null: [${input.none}]\n---\n${context}",
    }
)


def test_render_interpolates_input_and_context() -> None:
    step_input = {
        "product": "the kettle",
        "question": "Why does it click?",
        "user": {"id": 7, "name": "Zoë"},
        "tags": ["a", "b"],
        "none": None,
    }
    rendered = render(RECIPE, step_input, "Passage one.\nPassage two.")
    assert rendered == Rendered(
        system="You answer about the kettle.",
        prompt='Q: Why does it click?\nUser: {"id":7,"name":"Zoë"}\nTags: ["a","b"]\n'
        "Missing: [] Null: []\n---\nPassage one.\nPassage two.",
    )


def test_a_whole_reference_is_text_too() -> None:
    recipe = prepare_recipe({"name": "r", "prompt": "${input}"})
    assert render(recipe, {"a": [1, True]}).prompt == '{"a":[1,true]}'
    assert render(recipe, 42).prompt == "42"
    assert render(recipe, None).prompt == ""
    assert render(recipe, "plain").prompt == "plain"


def test_no_system_and_no_context() -> None:
    recipe = prepare_recipe({"name": "r", "prompt": "[${context}] ${input.x}"})
    assert render(recipe, {"x": 1}) == Rendered(system=None, prompt="[] 1")
    assert render(recipe, {"x": 1}, None).prompt == "[] 1"


def test_rendered_text_is_never_rendered_again() -> None:
    recipe = prepare_recipe({"name": "r", "prompt": "${input.a} ${context}"})
    rendered = render(recipe, {"a": "${context}"}, "${input.a}")
    assert rendered.prompt == "${context} ${input.a}"


def test_a_rendered_prompt_over_the_bound_is_refused_naming_the_field() -> None:
    recipe = prepare_recipe({"name": "r", "prompt": "${input}" * 100})
    big = {"text": "x" * 20_000}
    with pytest.raises(RenderTooLarge) as exc:
        render(recipe, big)
    assert exc.value.field == "prompt"
    assert exc.value.limit == MAX_RENDERED_BYTES
    assert "over 1048576 bytes" in str(exc.value)
    # Just under the bound is fine.
    assert len(render(recipe, {"t": "x" * 10_000}).prompt) < MAX_RENDERED_BYTES


def test_system_and_prompt_share_the_bound() -> None:
    recipe = prepare_recipe({"name": "r", "system": "${input}", "prompt": "${context}"})
    assert render(recipe, "s" * 60, "p" * 40, max_bytes=100).prompt == "p" * 40
    with pytest.raises(RenderTooLarge) as exc:
        render(recipe, "s" * 60, "p" * 41, max_bytes=100)
    assert exc.value.field == "prompt"
    with pytest.raises(RenderTooLarge) as exc:
        render(recipe, "s" * 101, "", max_bytes=100)
    assert exc.value.field == "system"


def test_the_bound_counts_utf8_bytes() -> None:
    recipe = prepare_recipe({"name": "r", "prompt": "${context}"})
    assert render(recipe, None, "é" * 50, max_bytes=100).prompt == "é" * 50
    with pytest.raises(RenderTooLarge):
        render(recipe, None, "é" * 51, max_bytes=100)


def test_a_template_bomb_is_refused_before_it_is_built() -> None:
    recipe = prepare_recipe({"name": "r", "prompt": "${input}" * 5000})
    with pytest.raises(RenderTooLarge):
        render(recipe, {"a": ["y" * 1000] * 1000})


# --- recipe_of_step ---------------------------------------------------------------------------

STORED = {
    "name": "triage",
    "version": 2,
    "description": "not part of what runs",
    "system": "S",
    "prompt": "P ${input}",
    "model": "openai:gpt-4o-mini",
    "output": "json",
    "output_schema": {"type": "object"},
    "temperature": 0.5,
    "max_tokens": 300,
}


def test_a_named_step_runs_the_stored_recipe_with_its_overrides() -> None:
    step = {
        "id": "s",
        "kind": "recipe",
        "recipe": "triage",
        "model": "anthropic:claude",
        "max_tokens": 99,
    }
    assert recipe_of_step(step, STORED) == {
        "name": "triage",
        "version": 2,
        "system": "S",
        "prompt": "P ${input}",
        "model": "anthropic:claude",
        "output": "json",
        "output_schema": {"type": "object"},
        "temperature": 0.5,
        "max_tokens": 99,
    }
    pinned = {"id": "s", "kind": "recipe", "recipe": "triage", "recipe_version": 2}
    assert recipe_of_step(pinned, STORED)["temperature"] == 0.5


def test_an_inline_step_is_its_own_recipe() -> None:
    step = {
        "id": "s",
        "kind": "recipe",
        "prompt": "Hi ${input.x}",
        "temperature": 1,
        "context": {"kb": "k"},
    }
    assert recipe_of_step(step, None) == {
        "prompt": "Hi ${input.x}",
        "output": "text",
        "temperature": 1,
        "max_tokens": DEFAULT_MAX_TOKENS,
    }


@pytest.mark.parametrize(
    ("step", "stored", "field", "words"),
    [
        ({"recipe": "triage", "prompt": "p"}, STORED, "steps[1].prompt", "not both"),
        ({}, STORED, "steps[1]", "exactly one of"),
        ({"recipe": "triage", "system": "x"}, STORED, "steps[1].system", "override only"),
        ({"recipe": "triage", "output": "text"}, STORED, "steps[1].output", "override only"),
        ({"recipe": "triage"}, None, "steps[1].recipe", "unknown recipe 'triage'"),
        ({"recipe": "other"}, STORED, "steps[1].recipe", "unknown recipe 'other'"),
        (
            {"recipe": "triage", "recipe_version": 1},
            STORED,
            "steps[1].recipe_version",
            "no version 1",
        ),
        ({"recipe": "triage", "temperature": 3}, STORED, "steps[1].temperature", "from 0 to 2"),
        ({"prompt": "p", "recipe_version": 1}, None, "steps[1].recipe_version", "only for a step"),
        ({"prompt": "${steps.a.output}"}, None, "steps[1].prompt", "reads 'steps'"),
        (
            {"prompt": "p", "output_schema": {"type": "object"}},
            None,
            "steps[1].output_schema",
            "only for",
        ),
        ({"prompt": "p", "max_tokens": 0}, None, "steps[1].max_tokens", "from 1 to"),
    ],
)
def test_a_step_whose_recipe_cannot_run_is_refused_naming_its_field(
    step: dict[str, Any], stored: dict[str, Any] | None, field: str, words: str
) -> None:
    with pytest.raises(InvalidDocument) as exc:
        recipe_of_step({"id": "s", "kind": "recipe", **step}, stored, where="steps[1]")
    found = fields_of(exc)
    assert field in found, found
    assert words in found[field]


def test_without_where_the_fields_are_the_steps_own() -> None:
    with pytest.raises(InvalidDocument) as exc:
        recipe_of_step({"recipe": "triage", "prompt": "p"}, STORED)
    assert set(fields_of(exc)) == {"prompt"}
    with pytest.raises(InvalidDocument) as exc:
        recipe_of_step({}, STORED)
    assert set(fields_of(exc)) == {None}


# --- the step in a workflow document, at save -------------------------------------------------


def document(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"id": "flow", "steps": [{"id": "first", "kind": "task"}, *steps]}


def errors_of(doc: dict[str, Any]) -> dict[str | None, str]:
    """Every message, by field (several on one field joined)."""
    found: dict[str | None, str] = {}
    for error in validate_document(doc):
        found[error.field] = f"{found.get(error.field, '')} | {error.message}"
    return found


def test_recipe_steps_that_save() -> None:
    named = {
        "id": "ask",
        "kind": "recipe",
        "recipe": "not_saved_yet",
        "recipe_version": 3,
        "model": "openai:gpt-4o",
        "temperature": 0.1,
        "max_tokens": 10,
        "context": {"kb": "docs"},
    }
    inline = {
        "id": "draft",
        "kind": "recipe",
        "input": {"q": "${steps.first.output}"},
        "system": "About ${input.q}",
        "prompt": "${input} ${context}",
        "output": "json",
        "output_schema": {
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/a"}},
            "$defs": {"a": {}},
        },
    }
    assert validate_document(document(named, inline)) == []


@pytest.mark.parametrize(
    ("step", "field", "words"),
    [
        ({"recipe": "r", "prompt": "p"}, "steps[1].prompt", "not both"),
        ({"model": "openai:x"}, "steps[1]", "exactly one of"),
        ({"recipe": "r", "system": "s"}, "steps[1].system", "override only"),
        ({"recipe": "r", "output_schema": {}}, "steps[1].output_schema", "override only"),
        ({"prompt": "p", "recipe_version": 2}, "steps[1].recipe_version", "only for a step"),
        ({"recipe": "r", "recipe_version": 0}, "steps[1].recipe_version", "at least 1"),
        ({"recipe": "Bad"}, "steps[1].recipe", "must match"),
        ({"prompt": "${steps.first.output}"}, "steps[1].prompt", "reads 'steps'"),
        ({"prompt": "p", "system": "${run.id}"}, "steps[1].system", "reads 'run'"),
        ({"prompt": "${input"}, "steps[1].prompt", "unclosed"),
        (
            {"prompt": "p", "output_schema": {"type": "object"}},
            "steps[1].output_schema",
            "only for output",
        ),
        (
            {"prompt": "p", "output": "json", "output_schema": {"type": 5}},
            "steps[1].output_schema.type",
            "not a valid JSON Schema",
        ),
        (
            {"prompt": "p", "output": "json", "output_schema": {"$ref": "https://e.x/s.json"}},
            "steps[1].output_schema.$ref",
            "not a local reference",
        ),
        ({"prompt": "p", "output_schema": "s"}, "steps[1].output_schema", "must be object"),
        ({"prompt": "p", "temperature": 2.1}, "steps[1].temperature", "at most 2"),
        ({"prompt": "p", "max_tokens": 200_001}, "steps[1].max_tokens", "at most 200000"),
        ({"prompt": "p", "model": "gpt-4o"}, "steps[1].model", "must match"),
        ({"prompt": "p", "sistem": "s"}, "steps[1].sistem", "did you mean 'system'"),
    ],
)
def test_recipe_step_errors_at_save_name_the_field(
    step: dict[str, Any], field: str, words: str
) -> None:
    found = errors_of(document({"id": "ask", "kind": "recipe", **step}))
    assert field in found, found
    assert words in found[field]


def test_inline_templates_read_the_step_input_not_the_run_input() -> None:
    # A closed input_schema bounds the run input's fields; a recipe's ${input.x} reads the
    # step's input, so it is not held to it.
    doc = document({"id": "ask", "kind": "recipe", "prompt": "${input.anything}"})
    doc["input_schema"] = {"type": "object", "additionalProperties": False, "properties": {}}
    assert validate_document(doc) == []
