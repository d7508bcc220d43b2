"""Knowledge bases over the API (``GET /api/v1/kbs``, ``GET /api/v1/kbs/{kb}/documents``) and
who may do what with them (workflows.access, "knowledge bases"): reading, and naming them in a
saved workflow. A knowledge base one may not read is a 404, as one that does not exist."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from workflows import access, knowledge
from workflows.models import KnowledgeBase

pytestmark = pytest.mark.django_db


def person(name: str, *codenames: str) -> Any:
    """A user who may create workflows (and holds ``codenames`` of the workflows app)."""
    user = get_user_model().objects.create_user(name, f"{name}@example.com", "a-long-password-1")
    for codename in ("add_workflow", *codenames):
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="workflows", codename=codename)
        )
    return get_user_model().objects.get(pk=user.pk)


def api_for(user: Any) -> APIClient:
    api = APIClient()
    token, _ = Token.objects.get_or_create(user=user)
    api.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return api


@pytest.fixture
def answers() -> KnowledgeBase:
    knowledge.kb_write(kb="answers", key="crash", title="Export crashes", content="Clear cache.")
    knowledge.kb_write(kb="answers", key="crash", title="Export crashes", content="Update to 2.1.")
    knowledge.kb_write(kb="answers", key="login", title="Sign-in", content="Reset the password.")
    knowledge.kb_write(kb="secret-plans", key="x", content="the plan")
    return KnowledgeBase.objects.get(name="answers")


def errors(response: Any) -> list[tuple[str | None, str]]:
    return [(e.get("field"), e["message"]) for e in response.json()["errors"]]


# --- reading ------------------------------------------------------------------------------------


def test_the_list_holds_what_the_caller_may_read(answers: KnowledgeBase) -> None:
    reader = person("reader")
    access.grant_kb(access.KB_READ, answers, user=reader)
    listed = api_for(reader).get("/api/v1/kbs").json()
    assert [kb["name"] for kb in listed["results"]] == ["answers"]
    assert listed["results"][0]["documents"] == 2 and listed["next"] is None
    everyone = api_for(person("auditor", "view_knowledgebase")).get("/api/v1/kbs").json()
    assert [kb["name"] for kb in everyone["results"]] == ["answers", "secret-plans"]
    assert api_for(person("nobody")).get("/api/v1/kbs").json()["results"] == []


def test_an_ordinary_user_cannot_see_list_or_search_a_knowledge_base(
    answers: KnowledgeBase,
) -> None:
    api = api_for(person("nobody"))
    for url in (
        "/api/v1/kbs/answers/documents",
        "/api/v1/kbs/answers/documents?q=cache",
        "/api/v1/kbs/answers/documents?key=crash",
    ):
        forbidden, missing = api.get(url), api.get(url.replace("answers", "no-such"))
        assert forbidden.status_code == missing.status_code == 404
        assert errors(forbidden) == [("kb", "unknown knowledge base 'answers'")]
        assert errors(missing) == [("kb", "unknown knowledge base 'no-such'")]
    assert APIClient().get("/api/v1/kbs").status_code in (401, 403)


def test_a_group_grant_reads_one_knowledge_base_only(answers: KnowledgeBase) -> None:
    member = person("member")
    team = Group.objects.create(name="support")
    member.groups.add(team)
    access.grant_kb(access.KB_WRITE, answers, group=team)  # writing implies reading
    api = api_for(member)
    assert api.get("/api/v1/kbs/answers/documents").status_code == 200
    assert api.get("/api/v1/kbs/secret-plans/documents").status_code == 404


def test_documents_are_current_versions_newest_first_and_paginated(api, answers) -> None:
    page = api.get("/api/v1/kbs/answers/documents?limit=1").json()
    [first] = page["results"]
    assert (first["key"], first["version"], first["current"]) == ("login", 1, True)
    assert first["score"] is None and first["kb"] == "answers"
    rest = api.get(f"/api/v1/kbs/answers/documents?limit=1&cursor={page['next']}").json()
    assert [(d["key"], d["version"]) for d in rest["results"]] == [("crash", 2)]
    assert rest["results"][0]["content"] == "Update to 2.1."


def test_key_lists_every_version_of_one_document(api, answers) -> None:
    body = api.get("/api/v1/kbs/answers/documents?key=crash").json()
    assert [(d["version"], d["current"], d["content"]) for d in body["results"]] == [
        (2, True, "Update to 2.1."),
        (1, False, "Clear cache."),
    ]
    assert api.get("/api/v1/kbs/answers/documents?key=nope").json()["results"] == []


def test_q_answers_ranked_hits_of_current_versions_with_scores(api, answers) -> None:
    body = api.get("/api/v1/kbs/answers/documents", {"q": "update"}).json()
    assert [(d["key"], d["version"]) for d in body["results"]] == [("crash", 2)]
    assert body["results"][0]["score"] > 0 and body["next"] is None
    assert api.get("/api/v1/kbs/answers/documents", {"q": "cache"}).json()["results"] == []
    both = api.get("/api/v1/kbs/answers/documents", {"q": "update or password", "limit": 1})
    assert len(both.json()["results"]) == 1


def test_a_search_takes_the_lists_limits_and_answers_its_best_100(api, answers) -> None:
    """``limit`` is 1 to 500 for the list and the search alike, as the OpenAPI document
    says (one parameter, one range); a search asked for more than 100 answers its best 100."""
    wide = api.get("/api/v1/kbs/answers/documents", {"q": "update", "limit": 500})
    assert wide.status_code == 200, wide.content
    assert [d["key"] for d in wide.json()["results"]] == ["crash"]


@pytest.mark.parametrize(
    "q",
    ['"', "'", "(", ")", "*", "-", ":", "^", "NOT", "a AND OR", 'x" OR "y', "col:q", "&|!<->"],
)
def test_search_syntax_characters_in_q_are_never_a_500(api, answers, q: str) -> None:
    response = api.get("/api/v1/kbs/answers/documents", {"q": f"update {q}"})
    assert response.status_code == 200, response.content


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"q": "x" * 1001}, "q"),
        ({"q": ""}, "q"),
        ({"q": "  "}, "q"),
        ({"key": ""}, "key"),
        ({"key": "k" * 201}, "key"),
        ({"q": "a", "key": "b"}, "key"),
        ({"limit": "0"}, "limit"),
        ({"limit": "abc"}, "limit"),
        ({"q": "a", "limit": "501"}, "limit"),
        ({"q": "a", "limit": "-1"}, "limit"),
        ({"q": "a", "limit": "9" * 5000}, "limit"),
        ({"limit": "9" * 5000}, "limit"),
        ({"cursor": "not-a-cursor"}, "cursor"),
        ({"q": "a", "cursor": "x"}, "cursor"),
    ],
    ids=[
        "long-q",
        "empty-q",
        "blank-q",
        "empty-key",
        "long-key",
        "q-and-key",
        "zero",
        "nan",
        "big",
        "negative",
        "q-digits",
        "digits",
        "cursor",
        "q-cursor",
    ],
)
def test_every_bad_parameter_is_a_400_naming_it(api, answers, params, field) -> None:
    response = api.get("/api/v1/kbs/answers/documents", params)
    assert response.status_code == 400, response.content
    assert [f for f, _ in errors(response)] == [field]


def test_the_openapi_schema_describes_both_calls(api) -> None:
    schema = api.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    paths = json.loads(schema.content)["paths"]
    documents = paths["/api/v1/kbs/{kb}/documents"]["get"]
    assert {p["name"] for p in documents["parameters"]} >= {"kb", "q", "key", "cursor", "limit"}
    assert set(documents["responses"]) >= {"200", "400", "404"}
    assert "/api/v1/kbs" in paths


# --- naming knowledge bases in a saved workflow ------------------------------------------------


def reading(kb: str) -> dict[str, Any]:
    return {
        "id": "answers_with_context",
        "steps": [{"id": "ask", "kind": "recipe", "prompt": "${context}", "context": {"kb": kb}}],
    }


def writing(kb: str) -> dict[str, Any]:
    return {
        "id": "remember",
        "steps": [{"id": "keep", "kind": "write_kb", "kb": kb, "key": "k", "content": "c"}],
    }


def test_a_recipe_context_needs_read_on_its_knowledge_base(answers: KnowledgeBase) -> None:
    reader, stranger = person("reader"), person("stranger")
    access.grant_kb(access.KB_READ, answers, user=reader)
    assert (
        api_for(reader).post("/api/v1/definitions", reading("answers"), format="json").status_code
        == 201
    )
    refused = api_for(stranger).post("/api/v1/definitions", reading("answers"), format="json")
    missing = api_for(stranger).post("/api/v1/definitions", reading("no-such"), format="json")
    assert refused.status_code == missing.status_code == 400
    [(field, message)] = errors(refused)
    assert field == "steps[0].context.kb" and "needs the permission to read it" in message
    # The same words whether the name exists or not: trying names tells nothing.
    assert errors(missing)[0][1] == message.replace("'answers'", "'no-such'")


def test_a_write_kb_step_needs_write_on_its_knowledge_base_or_add_for_a_new_one(
    answers: KnowledgeBase,
) -> None:
    reader, creator, writer = person("reader"), person("creator", "add_knowledgebase"), person("w")
    access.grant_kb(access.KB_READ, answers, user=reader)
    access.grant_kb(access.KB_WRITE, answers, user=writer)
    refused = api_for(reader).post("/api/v1/definitions", writing("answers"), format="json")
    assert refused.status_code == 400
    [(field, message)] = errors(refused)
    assert field == "steps[0].kb" and "needs the permission to write it" in message
    new = api_for(reader).post("/api/v1/definitions", writing("brand-new"), format="json")
    assert errors(new)[0][1] == message.replace("'answers'", "'brand-new'")
    assert (
        api_for(creator)
        .post("/api/v1/definitions", writing("brand-new"), format="json")
        .status_code
        == 201
    )
    assert (
        api_for(creator)
        .post("/api/v1/definitions", {**writing("answers"), "id": "r2"}, format="json")
        .status_code
        == 400
    )
    assert (
        api_for(writer)
        .post("/api/v1/definitions", {**writing("answers"), "id": "r3"}, format="json")
        .status_code
        == 201
    )


def test_a_write_kb_step_naming_a_template_needs_the_global_right(answers) -> None:
    document = writing("${input.kb}")
    creator = person("creator", "add_knowledgebase")
    refused = api_for(creator).post("/api/v1/definitions", document, format="json")
    assert errors(refused) == [
        (
            "steps[0].kb",
            "a knowledge base named by a template may be any of them: writing it needs the "
            "permission workflows.change_knowledgebase",
        )
    ]
    editor = person("editor", "change_knowledgebase")
    assert api_for(editor).post("/api/v1/definitions", document, format="json").status_code == 201


@pytest.mark.parametrize(
    ("document", "field"),
    [
        (writing("Not A Name"), "steps[0].kb"),
        ({**writing("ok"), "steps": [{**writing("ok")["steps"][0], "key": ""}]}, "steps[0].key"),
        (reading("${input.kb}"), "steps[0].context.kb"),
        (
            {
                "id": "q",
                "steps": [
                    {
                        "id": "a",
                        "kind": "recipe",
                        "prompt": "p",
                        "context": {"kb": "answers", "query": "${run.id}"},
                    }
                ],
            },
            "steps[0].context.query",
        ),
        (
            {
                "id": "q",
                "steps": [
                    {
                        "id": "a",
                        "kind": "recipe",
                        "prompt": "p",
                        "context": {"kb": "answers", "top_k": 0},
                    }
                ],
            },
            "steps[0].context.top_k",
        ),
    ],
    ids=["kb-name", "empty-key", "context-template", "query-root", "top-k"],
)
def test_bad_knowledge_base_fields_are_400_at_save(api, document, field) -> None:
    response = api.post("/api/v1/definitions", document, format="json")
    assert response.status_code == 400
    assert field in [f for f, _ in errors(response)], errors(response)


def test_a_person_who_creates_a_knowledge_base_reads_and_writes_it() -> None:
    creator = person("creator", "add_knowledgebase")
    kb = knowledge.kb_get_or_create(name="mine", user=creator)
    assert access.may_read_kb(creator, kb) and access.may_write_kb(creator, kb)
    other = person("other", "add_knowledgebase")
    assert not access.may_read_kb(other, knowledge.kb_get_or_create(name="mine", user=other))


def test_a_new_name_a_write_kb_step_names_is_its_savers_from_the_save() -> None:
    """Rights are asked at save and runs are trusted later, so a new name allowed at save must
    be the saver's then: otherwise the knowledge base a run creates has no reader (its author
    could not see or read what the workflow wrote), and whoever creates the name first (a
    person with other readers) owns what this workflow writes into it."""
    creator = person("creator", "add_knowledgebase")
    saved = api_for(creator).post("/api/v1/definitions", writing("brand-new"), format="json")
    assert saved.status_code == 201, saved.json()
    kb = KnowledgeBase.objects.get(name="brand-new")
    assert kb.created_by == creator
    assert access.may_read_kb(creator, kb) and access.may_write_kb(creator, kb)
    assert api_for(creator).get("/api/v1/kbs/brand-new/documents").status_code == 200
    # Taken now: another creator may not write into it.
    other = person("other", "add_knowledgebase")
    taken = api_for(other).post(
        "/api/v1/definitions", {**writing("brand-new"), "id": "theirs"}, format="json"
    )
    assert taken.status_code == 400
    assert errors(taken)[0][0] == "steps[0].kb"


def test_a_refused_save_reserves_no_name() -> None:
    creator = person("creator", "add_knowledgebase")
    document = writing("fresh")
    document["steps"].append({"id": "keep", "kind": "write_kb", "kb": "fresh", "key": "k"})
    assert api_for(creator).post("/api/v1/definitions", document, format="json").status_code == 400
    assert not KnowledgeBase.objects.filter(name="fresh").exists()


def test_a_context_may_not_name_a_knowledge_base_that_does_not_exist_yet(
    answers: KnowledgeBase,
) -> None:
    """One who may create knowledge bases naming a future one in a context would read, in every
    run, whatever its eventual creator (with readers of their own) puts there."""
    creator = person("creator", "add_knowledgebase")
    future = api_for(creator).post("/api/v1/definitions", reading("hr-notes"), format="json")
    assert future.status_code == 400
    [(field, message)] = errors(future)
    assert field == "steps[0].context.kb" and "needs the permission to read it" in message
    # One this document's own write_kb creates is the saver's (above), so it may be read.
    both = {
        "id": "write_then_read",
        "steps": [
            writing("own-notes")["steps"][0],
            {**reading("own-notes")["steps"][0], "id": "ask"},
        ],
    }
    assert api_for(creator).post("/api/v1/definitions", both, format="json").status_code == 201
    # A reader of every knowledge base may name any name.
    auditor = person("auditor", "view_knowledgebase")
    assert (
        api_for(auditor).post("/api/v1/definitions", reading("later"), format="json").status_code
        == 201
    )
