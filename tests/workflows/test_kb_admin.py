"""The knowledge-base admin: browse, search (kb_search, ranked), add, and edit, which saves a
new version and never changes a stored row; everything through workflows.access."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client

from workflows import access, knowledge
from workflows.models import KnowledgeBase, KnowledgeDocument

pytestmark = pytest.mark.django_db

DOCS = "/admin/workflows/knowledgedocument/"
KBS = "/admin/workflows/knowledgebase/"


def staff(name: str, *codenames: str) -> tuple[Any, Client]:
    user = get_user_model().objects.create_user(
        name, f"{name}@example.com", "a-long-password-1", is_staff=True
    )
    for codename in codenames:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="workflows", codename=codename)
        )
    client = Client()
    client.force_login(user)
    return user, client


@pytest.fixture
def answers() -> KnowledgeBase:
    knowledge.kb_write(kb="answers", key="crash", title="Export crashes", content="Clear cache.")
    knowledge.kb_write(kb="answers", key="login", title="Sign-in", content="Reset the password.")
    knowledge.kb_write(kb="secret-plans", key="plan", title="The plan", content="Cache it all.")
    return KnowledgeBase.objects.get(name="answers")


def test_staff_without_rights_sees_nothing(answers: KnowledgeBase) -> None:
    _, client = staff("plain")
    index = client.get("/admin/")
    assert b"Knowledge base" not in index.content and b"knowledge" not in index.content.lower()
    assert client.get(DOCS).status_code == 403
    assert client.get(KBS).status_code == 403
    document = KnowledgeDocument.objects.get(key="crash")
    page = client.get(f"{DOCS}{document.pk}/change/")
    assert page.status_code in (302, 403, 404) and b"Clear cache" not in page.content
    assert (
        client.post(f"{DOCS}add/", {"kb": answers.pk, "key": "x", "content": "y"}).status_code
        == 403
    )
    assert KnowledgeDocument.objects.count() == 3


def test_a_reader_browses_and_searches_only_their_knowledge_base(answers: KnowledgeBase) -> None:
    reader, client = staff("reader")
    access.grant_kb(access.KB_READ, answers, user=reader)
    listed = client.get(DOCS)
    assert listed.status_code == 200
    assert b"Export crashes" in listed.content and b"The plan" not in listed.content
    assert b"secret-plans" not in listed.content  # not even in the filter
    found = client.get(DOCS, {"q": "cache"})
    assert b"Export crashes" in found.content and b"Sign-in" not in found.content
    assert b"The plan" not in found.content  # it says cache too, in a base they may not read
    assert client.get(DOCS, {"q": '" ( NOT *'}).status_code == 200
    # Reading is not writing: the page shows no save.
    page = client.get(f"{DOCS}{KnowledgeDocument.objects.get(key='crash').pk}/change/")
    assert page.status_code == 200 and b'name="_save"' not in page.content


def test_search_results_come_best_first(answers: KnowledgeBase) -> None:
    _, client = staff("auditor", "view_knowledgebase")
    knowledge.kb_write(kb="answers", key="cache", title="Cache", content="The cache explained.")
    body = client.get(DOCS, {"q": "cache"}).content.decode()
    titles = [body.index(f'<td class="field-title">{t}</td>') for t in ("Cache", "Export crashes")]
    assert titles == sorted(titles)


def test_an_edit_saves_a_new_version_and_keeps_the_old_row(answers: KnowledgeBase) -> None:
    writer, client = staff("writer")
    access.grant_kb(access.KB_WRITE, answers, user=writer)
    old = KnowledgeDocument.objects.get(key="crash")
    response = client.post(
        f"{DOCS}{old.pk}/change/",
        {"title": "Export crashes", "content": "Update to 2.1.", "_continue": "1"},
    )
    assert response.status_code == 302, response.content
    old.refresh_from_db()
    assert (old.version, old.current, old.content) == (1, False, "Clear cache.")
    new = KnowledgeDocument.objects.get(key="crash", current=True)
    assert (new.version, new.content, new.created_by) == (2, "Update to 2.1.", writer)
    assert response["Location"].endswith(f"{new.pk}/change/")
    # The same text again writes nothing.
    client.post(f"{DOCS}{new.pk}/change/", {"title": "Export crashes", "content": "Update to 2.1."})
    assert KnowledgeDocument.objects.filter(key="crash").count() == 2
    # A bound is a form error, not a 500.
    big = client.post(f"{DOCS}{new.pk}/change/", {"title": "t", "content": "x" * 200_000})
    assert big.status_code == 200 and b"DJFLOW_KB_MAX_CONTENT_BYTES" in big.content


def test_adding_a_document_writes_version_1_to_a_writable_base_only(answers) -> None:
    writer, client = staff("writer")
    access.grant_kb(access.KB_WRITE, answers, user=writer)
    other = KnowledgeBase.objects.get(name="secret-plans")
    refused = client.post(f"{DOCS}add/", {"kb": other.pk, "key": "k", "content": "c"})
    assert refused.status_code == 200 and not KnowledgeDocument.objects.filter(key="k").exists()
    added = client.post(f"{DOCS}add/", {"kb": answers.pk, "key": "k", "content": "c"})
    assert added.status_code == 302
    assert KnowledgeDocument.objects.get(key="k").version == 1


def test_adding_a_knowledge_base_makes_its_creator_reader_and_writer() -> None:
    creator, client = staff("creator", "add_knowledgebase")
    assert client.post(f"{KBS}add/", {"name": "team-notes"}).status_code == 302
    kb = KnowledgeBase.objects.get(name="team-notes")
    assert kb.created_by == creator
    assert access.may_read_kb(creator, kb) and access.may_write_kb(creator, kb)
    assert client.post(f"{KBS}add/", {"name": "Bad Name"}).status_code == 200
    _, plain = staff("plain")
    assert plain.post(f"{KBS}add/", {"name": "mine"}).status_code == 403
