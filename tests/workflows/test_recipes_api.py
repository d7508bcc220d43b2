"""The recipes API (CONTRACT section 10: the version rules of section 4) over HTTP, against
Postgres, and who may use it (workflows.access, "recipes")."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import connection
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from workflows.models import Recipe
from workflows.services import recipe_save

pytestmark = pytest.mark.django_db

TRIAGE: dict[str, Any] = {
    "name": "triage",
    "description": "Sort a ticket.",
    "system": "You sort support tickets.",
    "prompt": "Ticket: ${input.text}\n\nKnown answers:\n${context}",
    "model": "openai:gpt-4o-mini",
    "output": "json",
    "output_schema": {
        "type": "object",
        "required": ["kind"],
        "properties": {"kind": {"enum": ["bug", "question"]}},
    },
    "temperature": 0.2,
}


def client_for(*codenames: str, username: str = "bob") -> APIClient:
    """An API client of a new user holding exactly these workflows permissions."""
    person = get_user_model().objects.create_user(username=username, password="a-long-pass-1")
    person.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="workflows", codename__in=codenames)
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=person).key}")
    return client


@pytest.fixture
def cook() -> APIClient:
    """May read, create and change recipes."""
    return client_for("add_recipe", "change_recipe", username="cook")


def post(client: APIClient, body: Any) -> Any:
    return client.post("/api/v1/recipes", body, format="json")


# --- the version rules ------------------------------------------------------------------------


def test_save_then_same_body_then_conflict_then_next(cook: APIClient) -> None:
    first = post(cook, {**TRIAGE, "version": 1})
    assert first.status_code == 201, first.json()
    assert first.json()["name"] == "triage"
    assert (first.json()["version"], first.json()["created"]) == (1, True)

    again = post(cook, {**TRIAGE, "version": 1})
    assert (again.status_code, again.json()["version"], again.json()["created"]) == (200, 1, False)
    # Leaving out the version finds the version holding the same body too.
    unversioned = post(cook, TRIAGE)
    assert (unversioned.status_code, unversioned.json()["version"]) == (200, 1)
    # Spelling out the defaults is the same body.
    spelled = post(cook, {**TRIAGE, "max_tokens": 1024})
    assert (spelled.status_code, spelled.json()["version"]) == (200, 1)

    conflict = post(cook, {**TRIAGE, "version": 1, "temperature": 0.9})
    assert conflict.status_code == 409
    assert conflict.json()["errors"][0]["field"] == "version"

    following = post(cook, {**TRIAGE, "temperature": 0.9})
    assert (following.status_code, following.json()["version"]) == (201, 2)
    assert Recipe.objects.filter(name="triage").count() == 2
    stored = Recipe.objects.get(name="triage", version=1).document
    assert stored == {"name": "triage", "version": 1, **TRIAGE, "max_tokens": 1024}


def test_read_the_newest_a_version_and_the_list(cook: APIClient) -> None:
    post(cook, TRIAGE)
    post(cook, {**TRIAGE, "prompt": "Ticket: ${input}"})
    post(cook, {"name": "answer", "prompt": "Answer ${input.question}"})

    newest = cook.get("/api/v1/recipes/triage")
    assert newest.status_code == 200
    assert newest.json()["version"] == 2
    assert newest.json()["versions"] == [2, 1]
    assert newest.json()["versions_total"] == 2
    assert newest.json()["document"]["prompt"] == "Ticket: ${input}"
    assert newest.json()["created_by"] == "cook"
    assert newest.json()["model"] == "openai:gpt-4o-mini"

    first = cook.get("/api/v1/recipes/triage/versions/1")
    assert first.status_code == 200
    assert first.json()["document"]["prompt"] == TRIAGE["prompt"]

    listed = cook.get("/api/v1/recipes").json()
    assert [(r["name"], r["version"]) for r in listed["results"]] == [("answer", 1), ("triage", 2)]
    assert listed["results"][0]["output"] == "text"
    assert listed["next"] is None


def test_the_list_is_cursor_paginated(cook: APIClient) -> None:
    for n in range(5):
        recipe_save(document={"name": f"r{n}", "prompt": "p"})
        recipe_save(document={"name": f"r{n}", "prompt": "p2"})
    seen: list[tuple[str, int]] = []
    cursor: str | None = None
    while True:
        query = "?limit=2" + (f"&cursor={cursor}" if cursor else "")
        page = cook.get(f"/api/v1/recipes{query}").json()
        seen += [(r["name"], r["version"]) for r in page["results"]]
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == [(f"r{n}", 2) for n in range(5)]
    assert cook.get("/api/v1/recipes?cursor=bogus").status_code == 400


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/api/v1/recipes/nope", "name"),
        ("/api/v1/recipes/triage/versions/7", "version"),
        ("/api/v1/recipes/triage/versions/x", "version"),
        ("/api/v1/recipes/triage/versions/0", "version"),
        ("/api/v1/recipes/triage/versions/" + "9" * 5000, "version"),
    ],
)
def test_unknown_recipes_and_versions_are_404_naming_the_field(
    cook: APIClient, path: str, field: str
) -> None:
    post(cook, TRIAGE)
    response = cook.get(path)
    assert response.status_code == 404
    assert response.json()["errors"][0]["field"] == field


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([1, 2], "body"),
        ("a recipe", "body"),
        ({"prompt": "p"}, "name"),
        ({"name": 5, "prompt": "p"}, "name"),
        ({"name": "Bad-Name", "prompt": "p"}, "name"),
        ({"name": "x" * 101, "prompt": "p"}, "name"),
        ({"name": "r"}, "prompt"),
        ({"name": "r", "prompt": ""}, "prompt"),
        ({"name": "r", "prompt": ["p"]}, "prompt"),
        ({"name": "r", "prompt": "p", "version": "1"}, "version"),
        ({"name": "r", "prompt": "p", "version": 0}, "version"),
        ({"name": "r", "prompt": "p", "version": True}, "version"),
        ({"name": "r", "prompt": "p", "system": {"a": 1}}, "system"),
        ({"name": "r", "prompt": "p", "model": "gpt-4o"}, "model"),
        ({"name": "r", "prompt": "p", "model": 4}, "model"),
        ({"name": "r", "prompt": "p", "output": "xml"}, "output"),
        ({"name": "r", "prompt": "p", "output_schema": {"type": "object"}}, "output_schema"),
        ({"name": "r", "prompt": "p", "output": "json", "output_schema": []}, "output_schema"),
        (
            {"name": "r", "prompt": "p", "output": "json", "output_schema": {"type": "nope"}},
            "output_schema.type",
        ),
        ({"name": "r", "prompt": "p", "temperature": "hot"}, "temperature"),
        ({"name": "r", "prompt": "p", "temperature": 2.5}, "temperature"),
        ({"name": "r", "prompt": "p", "max_tokens": 1.5}, "max_tokens"),
        ({"name": "r", "prompt": "p", "max_tokens": 200_001}, "max_tokens"),
        ({"name": "r", "prompt": "p", "description": ["d"]}, "description"),
        ({"name": "r", "prompt": "p", "colour": "red"}, "colour"),
        ({"name": "r", "prompt": "Hi ${steps.a.output}"}, "prompt"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(cook: APIClient, body: Any, field: str) -> None:
    response = post(cook, body)
    assert response.status_code == 400, response.content
    assert field in [e.get("field") for e in response.json()["errors"]]
    assert not Recipe.objects.exists()


def test_malformed_json_is_a_400(cook: APIClient) -> None:
    response = cook.generic("POST", "/api/v1/recipes", "{", content_type="application/json")
    assert response.status_code == 400


# --- who may --------------------------------------------------------------------------------


def test_a_user_without_recipe_permissions_gets_403_on_the_list_and_404_on_items(
    cook: APIClient,
) -> None:
    post(cook, TRIAGE)
    stranger = client_for(username="stranger")
    assert stranger.get("/api/v1/recipes").status_code == 403
    for path in ("/api/v1/recipes/triage", "/api/v1/recipes/triage/versions/1"):
        response = stranger.get(path)
        assert response.status_code == 404
        # The answer a name that does not exist gets.
        assert response.json() == {
            "errors": [{"field": "name", "message": "unknown recipe 'triage'"}]
        }
    refused = post(stranger, {"name": "mine", "prompt": "p"})
    assert refused.status_code == 403
    # The same body as an existing version tells such a user nothing either.
    assert post(stranger, TRIAGE).status_code == 403
    assert Recipe.objects.count() == 1


def test_the_anonymous_are_refused(anon_api: APIClient) -> None:
    assert anon_api.get("/api/v1/recipes").status_code in (401, 403)
    assert anon_api.post("/api/v1/recipes", TRIAGE, format="json").status_code in (401, 403)


def test_view_recipe_reads_but_does_not_save(cook: APIClient) -> None:
    post(cook, TRIAGE)
    reader = client_for("view_recipe", username="reader")
    assert reader.get("/api/v1/recipes").json()["results"][0]["name"] == "triage"
    assert reader.get("/api/v1/recipes/triage").status_code == 200
    assert post(reader, {"name": "mine", "prompt": "p"}).status_code == 403


def test_add_recipe_creates_names_but_not_new_versions_of_existing_ones(cook: APIClient) -> None:
    post(cook, TRIAGE)
    adder = client_for("add_recipe", username="adder")
    mine = post(adder, {"name": "mine", "prompt": "p"})
    assert (mine.status_code, mine.json()["version"]) == (201, 1)
    assert adder.get("/api/v1/recipes/mine").status_code == 200

    theirs = post(adder, {**TRIAGE, "prompt": "Changed ${input}"})
    assert theirs.status_code == 403
    assert theirs.json()["errors"][0]["field"] == "name"
    assert "change_recipe" in theirs.json()["errors"][0]["message"]
    # Their own name too: a new version is change_recipe's, whoever saved the first.
    assert post(adder, {"name": "mine", "prompt": "p2"}).status_code == 403
    # Re-posting a stored body writes nothing and is answered.
    assert post(adder, TRIAGE).status_code == 200
    assert Recipe.objects.count() == 2


def test_change_recipe_saves_new_versions_but_not_new_names(cook: APIClient) -> None:
    post(cook, TRIAGE)
    changer = client_for("change_recipe", username="changer")
    assert post(changer, {**TRIAGE, "temperature": 1}).json()["version"] == 2
    new_name = post(changer, {"name": "fresh", "prompt": "p"})
    assert new_name.status_code == 403
    assert "add_recipe" in new_name.json()["errors"][0]["message"]


def test_superusers_may_do_everything(admin_user) -> None:
    client = APIClient()
    client.force_authenticate(admin_user)
    assert post(client, TRIAGE).status_code == 201
    assert post(client, {**TRIAGE, "temperature": 1}).status_code == 201
    assert client.get("/api/v1/recipes/triage").json()["versions"] == [2, 1]


# --- races ----------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_concurrent_saves_of_the_next_version_never_share_a_number() -> None:
    """Eight threads, each on its own Postgres connection, save different bodies at once."""
    assert connection.vendor == "postgresql"
    recipe_save(document={"name": "race", "prompt": "p"})
    barrier = threading.Barrier(8)
    results: list[int] = []
    failures: list[BaseException] = []

    def save(n: int) -> None:
        try:
            barrier.wait()
            recipe, _ = recipe_save(document={"name": "race", "prompt": f"body {n}"})
            results.append(recipe.version)
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=save, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert sorted(results) == list(range(2, 10))


@pytest.mark.django_db(transaction=True)
def test_concurrent_saves_of_a_new_name_and_the_same_explicit_version() -> None:
    barrier = threading.Barrier(6)
    created: list[bool] = []
    failures: list[BaseException] = []

    def save() -> None:
        try:
            barrier.wait()
            created.append(recipe_save(document={"name": "fresh", "version": 1, "prompt": "p"})[1])
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=save) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert sorted(created) == [False] * 5 + [True]
    assert Recipe.objects.filter(name="fresh").count() == 1


def test_resolve_is_the_newest_or_the_pinned_version() -> None:
    recipe_save(document={"name": "r", "prompt": "one"})
    recipe_save(document={"name": "r", "prompt": "two"})
    newest = Recipe.objects.resolve("r")
    assert newest is not None and newest.version == 2
    pinned = Recipe.objects.resolve("r", 1)
    assert pinned is not None and pinned.document["prompt"] == "one"
    assert Recipe.objects.resolve("r", 3) is None
    assert Recipe.objects.resolve("other") is None


def test_an_item_lists_the_newest_100_versions_and_counts_them_all(cook: APIClient) -> None:
    # 150 versions in one insert (past the service, which would take a save each); the
    # service saves the next one, so the newest is a real save.
    Recipe.objects.bulk_create(
        Recipe(
            name="triage",
            version=number,
            document={"name": "triage", "version": number, "prompt": f"v{number}"},
            content_hash=f"{number:064x}",
        )
        for number in range(1, 151)
    )
    saved = post(cook, {**TRIAGE, "prompt": "the newest"})
    assert saved.json()["version"] == 151
    item = cook.get("/api/v1/recipes/triage").json()
    assert item["version"] == 151
    assert item["versions"] == list(range(151, 51, -1))
    assert item["versions_total"] == 151
    # Any version is still read by number.
    old = cook.get("/api/v1/recipes/triage/versions/1")
    assert (old.status_code, old.json()["document"]["prompt"]) == (200, "v1")


def test_the_schema_documents_the_cap(cook: APIClient) -> None:
    schema = cook.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    read = schema["paths"]["/api/v1/recipes/{name}"]["get"]
    assert "newest 100" in read["description"]
    detail = schema["components"]["schemas"]["RecipeDetail"]["properties"]
    assert "newest 100" in detail["versions"]["description"]
    assert detail["versions_total"]["type"] == "integer"
