"""The recipes admin with Django's test client: saving makes versions (never edits one), errors
show on their field, the preview renders a sample, and who may see it (workflows.access)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils.html import escape

from workflows.models import Recipe
from workflows.services import recipe_save

pytestmark = pytest.mark.django_db

ADD = "/admin/workflows/recipe/add/"

FORM: dict[str, Any] = {
    "name": "greet",
    "description": "Say hello.",
    "system": "You are polite.",
    "prompt": "Greet ${input.who} in ${input.lang}.\n${context}",
    "model": "openai:gpt-4o-mini",
    "output": "text",
    "output_schema": "",
    "temperature": "0.3",
    "max_tokens": "",
}


def change_url(recipe: Recipe) -> str:
    return reverse("admin:workflows_recipe_change", args=[recipe.pk])


def preview_url(recipe: Recipe) -> str:
    return reverse("admin:workflows_recipe_preview", args=[recipe.pk])


@pytest.fixture
def root(admin_user) -> Client:
    client = Client()
    client.force_login(admin_user)
    return client


def staff(*codenames: str, username: str = "staffer") -> Client:
    person = get_user_model().objects.create_user(
        username=username, password="a-long-pass-1", is_staff=True
    )
    person.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="workflows", codename__in=codenames)
    )
    client = Client()
    client.force_login(person)
    return client


def test_the_add_form_saves_version_1_and_a_change_saves_version_2(root: Client) -> None:
    response = root.post(ADD, FORM)
    assert response.status_code == 302, response.content.decode()[:3000]
    first = Recipe.objects.get(name="greet")
    assert response["Location"] == change_url(first)
    assert first.version == 1
    assert first.document == {
        "name": "greet",
        "version": 1,
        "description": "Say hello.",
        "system": "You are polite.",
        "prompt": "Greet ${input.who} in ${input.lang}.\n${context}",
        "model": "openai:gpt-4o-mini",
        "output": "text",
        "temperature": 0.3,
        "max_tokens": 1024,
    }
    stored_before = dict(first.document)

    page = root.get(change_url(first))
    assert page.status_code == 200
    assert escape(FORM["prompt"]) in page.content.decode()

    changed = {**FORM, "prompt": "Say hi to ${input.who}.", "output": "json"}
    changed["output_schema"] = json.dumps({"type": "object"})
    response = root.post(change_url(first), changed)
    assert response.status_code == 302
    second = Recipe.objects.get(name="greet", version=2)
    assert response["Location"] == change_url(second)
    assert second.document["prompt"] == "Say hi to ${input.who}."
    assert second.document["output_schema"] == {"type": "object"}
    first.refresh_from_db()
    assert first.document == stored_before
    assert second.created_by is not None and second.created_by.username == "root"

    # Saving a page unchanged stores nothing and says which version it is.
    again = root.post(change_url(second), changed, follow=True)
    shown = [str(m) for m in again.context["messages"]]
    assert shown[-1] == "unchanged: this is already version 2 of greet"
    assert Recipe.objects.filter(name="greet").count() == 2


def test_a_version_page_cannot_rename_its_recipe(root: Client) -> None:
    recipe, _ = recipe_save(document={"name": "greet", "prompt": "p"})
    root.post(change_url(recipe), {**FORM, "name": "other"})
    assert set(Recipe.objects.values_list("name", flat=True)) == {"greet"}


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"name": "Bad Name"}, "name", "must match"),
        ({"prompt": "Hi ${steps.a.output}"}, "prompt", "reads &#x27;steps&#x27;"),
        ({"model": "gpt-4o"}, "model", "&lt;provider&gt;:&lt;model&gt;"),
        ({"temperature": "7"}, "temperature", "from 0 to 2"),
        ({"output_schema": "{not json"}, "output_schema", "Malformed JSON"),
        ({"output_schema": '{"type": "object"}'}, "output_schema", "only for output"),
        (
            {"output": "json", "output_schema": '{"type": 3}'},
            "output_schema",
            "type: is not a valid JSON Schema",
        ),
    ],
)
def test_errors_show_on_their_field_and_nothing_is_saved(
    root: Client, changes: dict[str, str], field: str, words: str
) -> None:
    response = root.post(ADD, {**FORM, **changes})
    assert response.status_code == 200
    html = response.content.decode()
    assert "The recipe was not saved" in html
    row = html.split(f'class="form-row field-{field} errors"', 1)
    assert len(row) == 2, f"no error on {field}"
    assert words in row[1].split('class="form-row', 1)[0]
    assert not Recipe.objects.exists()


def test_the_preview_renders_a_sample(root: Client) -> None:
    recipe, _ = recipe_save(document={k: v for k, v in FORM.items() if v and k != "temperature"})
    page = root.get(preview_url(recipe))
    assert page.status_code == 200
    response = root.post(
        preview_url(recipe),
        {
            "sample_input": '{"who": {"name": "Zoë"}, "lang": "Welsh"}',
            "sample_context": "Be brief.",
        },
    )
    html = response.content.decode()
    assert 'id="rendered-system">You are polite.</pre>' in html
    expected = escape('Greet {"name":"Zoë"} in Welsh.\nBe brief.')
    assert f'id="rendered-prompt">{expected}</pre>' in html
    # Nothing was saved.
    assert Recipe.objects.count() == 1


def test_the_preview_shows_bad_json_as_an_error(root: Client) -> None:
    recipe, _ = recipe_save(document={"name": "greet", "prompt": "Hi ${input}"})
    response = root.post(preview_url(recipe), {"sample_input": "{'who': 1}", "sample_context": ""})
    html = response.content.decode()
    assert response.status_code == 200
    assert 'id="preview-error"' in html
    assert "Malformed JSON" in html
    assert 'id="rendered-prompt"' not in html


def test_the_preview_shows_a_failing_render_as_an_error(root: Client) -> None:
    recipe, _ = recipe_save(document={"name": "big", "prompt": "${input}" * 200})
    sample = json.dumps("x" * 10_000)
    response = root.post(preview_url(recipe), {"sample_input": sample, "sample_context": ""})
    html = response.content.decode()
    assert "Cannot render: the rendered prompt is over 1048576 bytes" in html
    assert 'id="rendered-prompt"' not in html


def test_staff_without_recipe_permissions_cannot_see_the_admin_pages(root: Client) -> None:
    recipe, _ = recipe_save(document={"name": "greet", "prompt": "p"})
    outsider = staff()
    for path in (
        "/admin/workflows/recipe/",
        ADD,
        change_url(recipe),
        preview_url(recipe),
    ):
        assert outsider.get(path).status_code == 403, path
    assert outsider.post(preview_url(recipe), {"sample_input": "{}"}).status_code == 403
    assert outsider.post(ADD, FORM).status_code == 403
    assert "workflows/recipe/" not in outsider.get("/admin/").content.decode()


def test_a_reader_sees_and_previews_but_saves_nothing(root: Client) -> None:
    recipe, _ = recipe_save(document={"name": "greet", "prompt": "Hi ${input.who}"})
    reader = staff("view_recipe", username="reader")
    assert reader.get("/admin/workflows/recipe/").status_code == 200
    page = reader.get(change_url(recipe)).content.decode()
    assert 'id="save-recipe"' not in page
    assert reader.post(change_url(recipe), {**FORM, "name": "greet"}).status_code == 403
    assert reader.get(ADD).status_code == 403
    rendered = reader.post(preview_url(recipe), {"sample_input": '{"who": "Al"}'})
    assert 'id="rendered-prompt">Hi Al</pre>' in rendered.content.decode()
    assert Recipe.objects.count() == 1


def test_an_adder_may_add_names_but_not_versions(root: Client) -> None:
    recipe, _ = recipe_save(document={"name": "greet", "prompt": "p"})
    adder = staff("add_recipe", username="adder")
    assert adder.post(ADD, {**FORM, "name": "mine"}).status_code == 302
    assert adder.post(change_url(recipe), FORM).status_code == 403
    # The add page with an existing name would be a new version: refused on the name.
    response = adder.post(ADD, {**FORM, "prompt": "changed"})
    html = response.content.decode()
    row = html.split('class="form-row field-name errors"', 1)
    assert len(row) == 2 and "change_recipe" in row[1]
    assert Recipe.objects.filter(name="greet").count() == 1


# JSON that parses (or nests too deep to) but that nothing after the form could handle: the
# API's limits (workflows.json_limits). Each is a field error, never a 500 (the test client
# raises what the view raises).
UNHANDLEABLE_JSON = [
    pytest.param("[" * 150 + "]" * 150, "nested more than 100 levels deep", id="deep"),
    pytest.param("[" * 100_000 + "]" * 100_000, "nested more than 100 levels deep", id="deeper"),
    pytest.param('{"a": "\\ud800"}', "a: a string may not contain a lone surrogate", id="lone"),
    pytest.param('{"\\u0000": 1}', "the value: a key may not contain the character", id="nul"),
    pytest.param("9" * 5000, "a number has more than 4300 digits", id="digits"),
]


def field_errors(response: Any, field: str) -> list[str]:
    return [str(e) for e in response.context["form"].errors.get(field, [])]


@pytest.mark.parametrize(("text", "words"), UNHANDLEABLE_JSON)
def test_an_output_schema_past_the_apis_limits_is_a_field_error(
    root: Client, text: str, words: str
) -> None:
    response = root.post(ADD, {**FORM, "output": "json", "output_schema": text})
    assert response.status_code == 200
    (error,) = field_errors(response, "output_schema")
    assert words in error
    assert escape(error) in response.content.decode()
    assert not Recipe.objects.exists()


@pytest.mark.parametrize(("text", "words"), UNHANDLEABLE_JSON)
def test_a_sample_input_past_the_apis_limits_is_a_field_error(
    root: Client, text: str, words: str
) -> None:
    recipe, _ = recipe_save(document={"name": "greet", "prompt": "Hi ${input}"})
    response = root.post(preview_url(recipe), {"sample_input": text, "sample_context": ""})
    assert response.status_code == 200
    html = response.content.decode()
    (error,) = field_errors(response, "sample_input")
    assert words in error
    assert 'id="preview-error"' in html and escape(error) in html
    assert 'id="rendered-prompt"' not in html


def test_a_deep_but_allowed_sample_renders(root: Client) -> None:
    recipe, _ = recipe_save(document={"name": "greet", "prompt": "Hi ${input}"})
    sample = "[" * 100 + "]" * 100
    response = root.post(preview_url(recipe), {"sample_input": sample, "sample_context": ""})
    assert f'id="rendered-prompt">Hi {sample}</pre>' in response.content.decode()


# --- the version list -------------------------------------------------------------------------


def many_versions(name: str, count: int) -> list[Recipe]:
    """``count`` versions of ``name``, written in one insert (a test's shortcut past the
    service: each body must differ only for the service's sake)."""
    return Recipe.objects.bulk_create(
        Recipe(
            name=name,
            version=number,
            document={"name": name, "version": number, "prompt": f"v{number}", "output": "text"},
            content_hash=f"{number:064x}",
        )
        for number in range(1, count + 1)
    )


def test_the_page_lists_the_newest_100_versions_and_says_how_many(root: Client) -> None:
    many_versions("greet", 130)
    newest = Recipe.objects.get(name="greet", version=130)
    response = root.get(change_url(newest))
    assert response.status_code == 200
    assert [number for _, number, _ in response.context["versions"]] == list(range(130, 30, -1))
    listed = response.content.decode().split('id="recipe-versions"', 1)[1].split("</p>", 1)[0]
    assert "the newest 100 of 130" in listed
    assert ">31</a>" in listed and ">30</a>" not in listed
    # An old version's page works too (its own number is simply not among the newest).
    assert root.get(change_url(Recipe.objects.get(name="greet", version=2))).status_code == 200


def test_a_short_version_list_says_nothing_of_a_cap(root: Client) -> None:
    many_versions("greet", 3)
    response = root.get(change_url(Recipe.objects.get(name="greet", version=3)))
    listed = response.content.decode().split('id="recipe-versions"', 1)[1].split("</p>", 1)[0]
    assert "the newest" not in listed
    assert [number for _, number, _ in response.context["versions"]] == [3, 2, 1]
