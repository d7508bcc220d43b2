"""The admin authors documents through ``definition_save`` and shows versions read-only."""

from __future__ import annotations

import copy
import json
import re

import pytest
from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.contrib.admin.utils import quote
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape

from workflows import heartbeats
from workflows.diff import reading_order
from workflows.errors import FieldError, InvalidDocument
from workflows.forms import listed_at
from workflows.models import Workflow, WorkflowVersion
from workflows.services import definition_save

from .documents import support_ticket_body

pytestmark = pytest.mark.django_db

ADD_URL = "admin:workflows_workflow_add"

# Contract section 1, without its "version".
SUPPORT_TICKET = support_ticket_body()

SIMPLE = {
    "id": "simple",
    "description": "One step.",
    "steps": [{"id": "only", "kind": "task"}],
}

# Two problems the contract rejects at save: an unknown step field and a bad step id.
INVALID = {
    "id": "broken",
    "description": "Two mistakes.",
    "steps": [
        {"id": "a", "kind": "task", "colour": "red"},
        {"id": "Bad-Id", "kind": "task"},
    ],
}


def url(name: str, *args: str, **query: object) -> str:
    out = reverse(f"admin:workflows_workflow_{name}", args=[quote(a) for a in args])
    if query:
        out += "?" + "&".join(f"{k}={v}" for k, v in query.items())
    return out


def post_document(client, target: str, document: object, **kwargs):
    """Post like the JSON editor does: the document's JSON text in the ``document`` field."""
    text = document if isinstance(document, str) else json.dumps(document, indent=2)
    return client.post(target, {"document": text}, **kwargs)


def page_messages(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def textarea_text(response) -> str:
    """What the page's form field holds: the text the user will see and post again."""
    return response.context["form"]["document"].value()


@pytest.fixture
def simple_v1(admin_user) -> WorkflowVersion:
    return definition_save(document=SIMPLE, user=admin_user).version


def expected_errors(document: dict) -> list[dict[str, str]]:
    """What the service itself says about ``document``; the page must show each of these."""
    with pytest.raises(InvalidDocument) as caught:
        definition_save(document=document)
    return [e.as_dict() for e in caught.value.errors]


# --- adding a workflow ---------------------------------------------------------------------------


def test_add_page_is_a_json_editor(admin_client):
    response = admin_client.get(reverse(ADD_URL))
    assert response.status_code == 200
    html = response.content.decode()
    assert "jsoneditor.min.js" in html
    assert 'name="document"' in html
    # The editor starts from a file (the admin runs under a Content-Security-Policy that
    # refuses inline scripts), configured by the container's data attributes.
    assert "/static/workflows/document_editor.js" in html
    assert 'class="djflow-document-editor-container" hidden' in html
    assert "data-options=" in html
    assert json.loads(textarea_text(response))["id"] == ""


def test_creating_a_workflow_through_the_add_form(admin_client, admin_user):
    response = post_document(admin_client, reverse(ADD_URL), SIMPLE, follow=True)

    assert response.redirect_chain[-1][0] == url("change", "simple")
    assert "Saved simple version 1." in page_messages(response)
    version = WorkflowVersion.objects.get(workflow_id="simple")
    assert version.number == 1
    assert version.document == {**SIMPLE, "version": 1}
    assert version.created_by == admin_user
    assert LogEntry.objects.filter(object_id="simple", action_flag=ADDITION).exists()


def test_add_page_needs_a_staff_login(client):
    response = client.get(reverse(ADD_URL))
    assert response.status_code == 302
    assert reverse("admin:login") in response["Location"]


def test_add_page_without_add_permission_is_refused(client, django_user_model):
    staff = django_user_model.objects.create_user("staff", password="a-long-password-1")
    staff.is_staff = True
    staff.save()
    client.force_login(staff)
    assert client.get(reverse(ADD_URL)).status_code == 403
    assert post_document(client, reverse(ADD_URL), SIMPLE).status_code == 403
    assert not Workflow.objects.exists()


# --- new versions --------------------------------------------------------------------------------


def test_new_version_page_is_prefilled_with_the_latest_document_without_version(
    admin_client, simple_v1
):
    newer = {**SIMPLE, "description": "Still one step."}
    definition_save(document=newer)

    response = admin_client.get(url("new_version", "simple"))

    assert response.status_code == 200
    assert json.loads(textarea_text(response)) == newer
    assert '"version"' not in textarea_text(response)
    # In the order people write it, not the database's.
    assert textarea_text(response) == json.dumps(newer, indent=2)


def test_new_version_page_can_start_from_an_older_version(admin_client, simple_v1):
    definition_save(document={**SIMPLE, "description": "Still one step."})
    response = admin_client.get(url("new_version", "simple", **{"from": 1}))
    assert json.loads(textarea_text(response)) == SIMPLE


def test_creating_a_new_version(admin_client, simple_v1, admin_user):
    changed = copy.deepcopy(SIMPLE)
    changed["steps"].append({"id": "second", "kind": "task"})

    response = post_document(admin_client, url("new_version", "simple"), changed, follow=True)

    assert "Saved simple version 2." in page_messages(response)
    latest = Workflow.objects.get(id="simple").latest_version
    assert latest.number == 2
    assert latest.document == {**changed, "version": 2}
    assert latest.created_by == admin_user
    assert LogEntry.objects.filter(object_id="simple", action_flag=CHANGE).exists()


def test_same_body_again_saves_no_new_version(admin_client, simple_v1):
    response = post_document(admin_client, url("new_version", "simple"), SIMPLE, follow=True)

    assert "unchanged: this is already version 1 of simple" in page_messages(response)
    assert WorkflowVersion.objects.filter(workflow_id="simple").count() == 1


def test_same_body_through_the_add_page_saves_no_new_version(admin_client, simple_v1):
    # Key order and formatting do not make a new body.
    reordered = json.dumps(dict(reversed(list(SIMPLE.items()))))
    response = post_document(admin_client, reverse(ADD_URL), reordered, follow=True)

    assert "unchanged: this is already version 1 of simple" in page_messages(response)
    assert WorkflowVersion.objects.count() == 1


def test_new_version_page_does_not_write_another_workflow(admin_client, simple_v1):
    other = {**SIMPLE, "id": "other"}
    response = post_document(admin_client, url("new_version", "simple"), other)

    assert response.status_code == 200
    html = response.content.decode()
    assert '<code class="djflow-field">id</code>' in html
    assert not Workflow.objects.filter(id="other").exists()
    assert textarea_text(response) == json.dumps(other, indent=2)


def test_new_version_of_a_missing_workflow_redirects_with_a_message(admin_client):
    response = admin_client.get(url("new_version", "nothing_here"), follow=True)
    assert any("nothing_here" in m and "exist" in m for m in page_messages(response))


# --- rejected documents --------------------------------------------------------------------------


def test_invalid_document_lists_every_field_error_and_saves_nothing(admin_client):
    errors = expected_errors(INVALID)
    text = json.dumps(INVALID, indent=2)

    response = post_document(admin_client, reverse(ADD_URL), text)

    assert response.status_code == 200
    html = response.content.decode()
    listed = html[
        html.index('id="document-errors"') : html.index("</ul>", html.index("document-errors"))
    ]
    for error in errors:
        where = listed_at(FieldError(error["field"], error["message"]))
        assert f'<code class="djflow-field">{escape(where)}</code>' in listed
        assert escape(error["message"]) in listed
    # The unknown field is named at the step, and the bad id at its field.
    assert any(
        e["field"].startswith("steps[0]") and "colour" in e["field"] + e["message"] for e in errors
    )
    assert any(e["field"] == "steps[1].id" for e in errors)
    # The list sits above the editor, and the editor still holds what the user typed.
    assert html.index('id="document-errors"') < html.index('name="document"')
    assert textarea_text(response) == text
    assert escape(text) in html
    assert not Workflow.objects.exists()
    assert not WorkflowVersion.objects.exists()


def test_an_error_names_its_field_once(admin_client, simple_v1):
    """Errors such as "steps[0].colour unknown field 'colour'" and "steps[0].approvers
    required field 'approvers' is missing" said the field's name twice (issue 37): each is
    listed at the step, its message whole."""
    document = {
        **SIMPLE,
        "steps": [{"id": "a", "kind": "task", "colour": "red"}, {"id": "b", "kind": "approval"}],
    }
    response = post_document(admin_client, url("new_version", "simple"), document)

    html = response.content.decode()
    listed = re.findall(
        r'<code class="djflow-field">([^<]*)</code> <span class="djflow-message">([^<]*)</span>',
        html,
    )
    assert any(
        where == "steps[0]" and message.startswith(escape("unknown field 'colour'"))
        for where, message in listed
    )
    assert ("steps[1]", escape("required field 'approvers' is missing")) in listed
    for where, message in listed:
        name = where.rsplit(".", 1)[-1]
        assert not (name and f"'{name}'" in message), (where, message)
    # The API's own field stays the full path.
    fields = [e.field for e in response.context["form"].document_errors]
    assert "steps[0].colour" in fields and "steps[1].approvers" in fields


@pytest.mark.parametrize(
    ("step", "field"),
    [
        ({"id": "a", "kind": "task", "colour": "red"}, "steps[0]"),
        ({"id": "Bad-Id", "kind": "task"}, "steps[0].id"),
    ],
)
def test_each_kind_of_mistake_is_named_at_its_field(admin_client, simple_v1, step, field):
    document = {**SIMPLE, "steps": [step]}
    response = post_document(admin_client, url("new_version", "simple"), document)

    assert response.status_code == 200
    fields = [e.field for e in response.context["form"].document_errors]
    assert any(f == field or f.startswith(field + ".") for f in fields), fields
    assert WorkflowVersion.objects.filter(workflow_id="simple").count() == 1


def test_malformed_json_is_a_clear_form_error_and_keeps_the_text(admin_client):
    text = '{"id": "simple",\n "steps": [ {"id": "only" "kind": "task"} ]}'

    response = post_document(admin_client, reverse(ADD_URL), text)

    assert response.status_code == 200
    errors = response.context["form"].errors["document"]
    assert len(errors) == 1
    assert re.fullmatch(r"Malformed JSON: .+ at line 2, column \d+\.", errors[0])
    assert escape(errors[0]) in response.content.decode()
    assert textarea_text(response) == text
    assert not Workflow.objects.exists()


def test_empty_document_is_a_form_error(admin_client):
    response = post_document(admin_client, reverse(ADD_URL), "")
    assert response.status_code == 200
    assert response.context["form"].errors["document"] == ["Enter the workflow document as JSON."]


def test_a_different_body_for_an_existing_version_is_shown_at_version(admin_client, simple_v1):
    clash = {**SIMPLE, "version": 1, "description": "Something else."}

    response = post_document(admin_client, url("new_version", "simple"), clash)

    assert response.status_code == 200
    fields = [e.field for e in response.context["form"].document_errors]
    assert fields == ["version"]
    assert '<code class="djflow-field">version</code>' in response.content.decode()
    assert WorkflowVersion.objects.get(workflow_id="simple").description == "One step."


# --- the same document whichever way it is saved -------------------------------------------------


def test_contract_document_saved_through_the_admin_is_stored_as_definition_save_stores_it(
    admin_client, admin_user
):
    response = post_document(admin_client, reverse(ADD_URL), SUPPORT_TICKET, follow=True)
    assert "Saved support_ticket version 1." in page_messages(response)
    through_admin = WorkflowVersion.objects.get(workflow_id="support_ticket")

    # The new-version page offers the document back as the contract writes it.
    page = admin_client.get(url("new_version", "support_ticket"))
    assert json.loads(textarea_text(page)) == reading_order(
        {k: v for k, v in through_admin.document.items() if k != "version"}
    )

    # The service recognises the admin's row as the same body...
    again = definition_save(document=copy.deepcopy(SUPPORT_TICKET), user=admin_user)
    assert not again.created
    assert again.version.pk == through_admin.pk

    # ...and saving it afresh without the admin stores the very same thing.
    stored = (through_admin.document, through_admin.content_hash, through_admin.description)
    WorkflowVersion.objects.all().delete()
    Workflow.objects.all().delete()
    direct = definition_save(document=copy.deepcopy(SUPPORT_TICKET), user=admin_user).version
    assert (direct.number, direct.document, direct.content_hash, direct.description) == (
        1,
        *stored,
    )


# --- reading -------------------------------------------------------------------------------------


def test_changelist_shows_latest_version_and_description(admin_client, simple_v1):
    definition_save(document={**SIMPLE, "description": "Now described better."})
    response = admin_client.get(reverse("admin:workflows_workflow_changelist"))
    assert response.status_code == 200
    html = response.content.decode()
    row = html[html.index(">simple</a>") :]
    row = row[: row.index("</tr>")]
    assert '<td class="field-latest_number">2</td>' in row
    assert "Now described better." in row
    assert "field-created_at" in row


def test_change_page_lists_versions_read_only_with_links(admin_client, simple_v1):
    v2 = definition_save(document={**SIMPLE, "description": "Two."}).version

    response = admin_client.get(url("change", "simple"))

    assert response.status_code == 200
    html = response.content.decode()
    for version in (simple_v1, v2):
        assert version.content_hash[:12] in html
        assert reverse("admin:workflows_workflowversion_change", args=[version.pk]) in html
    assert "root" in html  # created_by of version 1
    assert url("new_version", "simple") in html
    assert url("diff", "simple") in html
    assert 'name="_save"' not in html
    assert 'name="versions-0-number"' not in html  # no editable inline


def test_workflow_change_page_refuses_posts_and_workflows_are_not_deleted(admin_client, simple_v1):
    assert admin_client.post(url("change", "simple"), {}).status_code == 405
    assert admin_client.get(url("delete", "simple")).status_code == 403
    assert admin_client.post(url("delete", "simple"), {"post": "yes"}).status_code == 403
    assert WorkflowVersion.objects.filter(workflow_id="simple").count() == 1


def test_versions_are_read_only(admin_client, simple_v1, rf, admin_user):
    from django.contrib import admin as django_admin

    model_admin = django_admin.site._registry[WorkflowVersion]
    request = rf.get("/")
    request.user = admin_user
    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_change_permission(request, simple_v1)
    assert not model_admin.has_delete_permission(request, simple_v1)
    assert model_admin.has_view_permission(request, simple_v1)

    change = reverse("admin:workflows_workflowversion_change", args=[simple_v1.pk])
    page = admin_client.get(change)
    assert page.status_code == 200
    html = page.content.decode()
    assert 'name="_save"' not in html
    simple_v1.refresh_from_db()
    pretty = json.dumps({"id": "simple", "version": 1, **SIMPLE}, indent=2)
    assert escape(pretty) in html

    forged = {"number": 9, "description": "rewritten", "document": "{}"}
    assert admin_client.post(change, forged).status_code == 403
    assert admin_client.get(reverse("admin:workflows_workflowversion_add")).status_code == 403
    delete = reverse("admin:workflows_workflowversion_delete", args=[simple_v1.pk])
    assert admin_client.post(delete, {"post": "yes"}).status_code == 403
    simple_v1.refresh_from_db()
    assert (simple_v1.number, simple_v1.description) == (1, "One step.")


def test_version_changelist_has_no_add_button(admin_client, simple_v1):
    response = admin_client.get(reverse("admin:workflows_workflowversion_changelist"))
    assert response.status_code == 200
    assert reverse("admin:workflows_workflowversion_add") not in response.content.decode()


# --- diff ----------------------------------------------------------------------------------------


def test_diff_page_colours_added_and_removed_lines(admin_client, simple_v1):
    changed = copy.deepcopy(SIMPLE)
    changed["description"] = "Two steps."
    changed["steps"].append({"id": "second", "kind": "task"})
    definition_save(document=changed)

    response = admin_client.get(url("diff", "simple", **{"from": 1, "to": 2}))

    assert response.status_code == 200
    html = response.content.decode()
    removed = escape('-  "description": "One step.",')
    added = escape('+  "description": "Two steps.",')
    assert f'<tr class="diff-removed"><td>{removed}</td></tr>' in html
    assert f'<tr class="diff-added"><td>{added}</td></tr>' in html
    assert f'<tr class="diff-added"><td>{escape("+      " + chr(34) + "id" + chr(34))}' in html
    assert '<option value="1" selected>' in html
    assert '<option value="2" selected>' in html
    assert '"version"' not in "".join(r[0] for r in response.context["rows"])


def test_diff_defaults_to_the_latest_against_the_one_before(admin_client, simple_v1):
    definition_save(document={**SIMPLE, "description": "v2"})
    definition_save(document={**SIMPLE, "description": "v3"})
    response = admin_client.get(url("diff", "simple"))
    assert (response.context["from_number"], response.context["to_number"]) == (2, 3)
    assert any(kind == "added" and '"v3"' in line for line, kind in response.context["rows"])


def test_diff_of_a_version_with_itself_says_so(admin_client, simple_v1):
    response = admin_client.get(url("diff", "simple"))
    assert response.context["rows"] == []
    assert 'id="diff-identical"' in response.content.decode()


def test_diff_names_an_unknown_version_instead_of_failing(admin_client, simple_v1):
    response = admin_client.get(url("diff", "simple", **{"from": 7, "to": "x"}))
    assert response.status_code == 200
    assert response.context["rows"] is None
    html = response.content.decode()
    assert escape("simple has no version '7'") in html
    assert escape("simple has no version 'x'") in html


# --- permissions and odd input -------------------------------------------------------------------


def test_add_permission_alone_cannot_add_versions_to_an_existing_workflow(
    client, django_user_model, simple_v1
):
    from django.contrib.auth.models import Permission

    author = django_user_model.objects.create_user("author", password="a-long-password-1")
    author.is_staff = True
    author.save()
    author.user_permissions.add(
        Permission.objects.get(codename="add_workflow"),
        Permission.objects.get(codename="view_workflow"),
    )
    client.force_login(author)

    changed = {**SIMPLE, "description": "Sneaked in."}
    refused = post_document(client, reverse(ADD_URL), changed)
    assert refused.status_code == 200
    assert [e.field for e in refused.context["form"].document_errors] == ["id"]
    assert WorkflowVersion.objects.filter(workflow_id="simple").count() == 1
    assert client.get(url("new_version", "simple")).status_code == 403

    fresh = post_document(client, reverse(ADD_URL), {**SIMPLE, "id": "fresh"}, follow=True)
    assert "Saved fresh version 1." in page_messages(fresh)


def test_a_json_value_that_is_not_an_object_is_rejected_on_the_page(admin_client):
    response = post_document(admin_client, reverse(ADD_URL), "[1, 2]")
    assert response.status_code == 200
    assert response.context["form"].document_errors
    assert 'id="document-errors"' in response.content.decode()
    assert textarea_text(response) == "[1, 2]"
    assert not Workflow.objects.exists()


def test_starter_document_shows_the_shape_of_a_step(admin_client):
    starter = json.loads(textarea_text(admin_client.get(reverse(ADD_URL))))
    assert set(starter) == {"id", "description", "steps"}
    assert set(starter["steps"][0]) == {"id", "kind"}


# --- handlers no live worker serves ----------------------------------------------------------


def _worker_serving(*handlers: str) -> None:
    now = timezone.now()
    heartbeats.heartbeat_record(
        hostname="w1@test", handlers=handlers, queues=["default"], pid=1, started_at=now
    )


def test_saving_a_document_whose_handler_no_live_worker_serves_warns(admin_client):
    document = {
        **SIMPLE,
        "steps": [*SIMPLE["steps"], {"id": "mail", "kind": "task", "handler": "x"}],
    }
    _worker_serving("simple.only")
    response = post_document(admin_client, reverse(ADD_URL), document, follow=True)
    assert response.status_code == 200
    # Saved all the same: the worker that serves it may be deployed later.
    assert WorkflowVersion.objects.filter(workflow_id="simple").count() == 1
    warnings = [
        (m.level_tag, str(m)) for m in response.context["messages"] if "no live worker" in str(m)
    ]
    assert warnings == [
        (
            "warning",
            "no live worker serves handler 'x' (step 'mail'); start a worker that imports it "
            "(WORKFLOW_MODULES)",
        )
    ]


def test_saving_a_document_every_live_worker_handler_serves_does_not_warn(admin_client):
    _worker_serving("simple.only")
    response = post_document(admin_client, reverse(ADD_URL), SIMPLE, follow=True)
    assert page_messages(response) == ["Saved simple version 1."]


def test_the_workers_page_lists_heartbeats_read_only(admin_client):
    _worker_serving("simple.only", "mail.send")
    response = admin_client.get(reverse("admin:workflows_workerheartbeat_changelist"))
    assert response.status_code == 200
    assert b"w1@test" in response.content
    row = admin_client.get(reverse("admin:workflows_workerheartbeat_change", args=["w1@test"]))
    assert b"mail.send" in row.content and b"<form" in row.content
    assert b'name="_save"' not in row.content


@pytest.mark.parametrize(
    ("staff", "perms", "list_code"),
    [
        (False, (), 302),  # not staff: the admin's sign-in page
        (True, (), 403),  # staff without the view permission
        (True, ("view_workerheartbeat",), 200),
    ],
)
def test_the_workers_page_answers_only_to_who_may_view_it(
    client, django_user_model, staff, perms, list_code
):
    from django.contrib.auth.models import Permission

    _worker_serving("simple.only")
    person = django_user_model.objects.create_user("pat", password="a-long-password-1")
    person.is_staff = staff
    person.save()
    person.user_permissions.add(*Permission.objects.filter(codename__in=perms))
    client.force_login(person)
    listing = client.get(reverse("admin:workflows_workerheartbeat_changelist"))
    assert listing.status_code == list_code
    row = client.get(reverse("admin:workflows_workerheartbeat_change", args=["w1@test"]))
    assert row.status_code == list_code
    assert (b"simple.only" in row.content) == (list_code == 200)


# JSON that parses (or nests too deep to) but that nothing after the form could handle: the
# API's limits (workflows.json_limits), a form error each, never a 500.
UNHANDLEABLE_DOCUMENTS = [
    ('{"id": "x", "steps": [], "description": ' + "[" * 150 + "]" * 150 + "}", "100 levels"),
    (
        '{"id": "x", "steps": [], "description": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "100 levels",
    ),
    ('{"id": "x", "steps": [{"id": "a", "kind": "task", "input": "\\ud800"}]}', "\\ud800"),
    ('{"id": "x", "steps": [{"id": "a", "kind": "task", "input": {"k\\u0000": 1}}]}', "\\u0000"),
    ('{"id": "x", "steps": [], "description": ' + "9" * 5000 + "}", "4300 digits"),
]


@pytest.mark.parametrize(("text", "words"), UNHANDLEABLE_DOCUMENTS)
def test_json_past_the_apis_limits_is_a_form_error(admin_client, text: str, words: str):
    response = post_document(admin_client, reverse(ADD_URL), text)
    assert response.status_code == 200
    (error,) = response.context["form"].errors["document"]
    assert words in error
    assert escape(error) in response.content.decode()
    assert not Workflow.objects.exists()


def test_a_lone_surrogate_is_named_where_it_is(admin_client):
    text = '{"id": "x", "steps": [{"id": "a", "kind": "task", "input": ["ok", "\\udfff"]}]}'
    response = post_document(admin_client, reverse(ADD_URL), text)
    assert response.context["form"].errors["document"] == [
        "steps[0].input[1]: a string may not contain a lone surrogate (\\udfff)"
    ]


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_number_json_has_not_is_a_form_error_not_a_500(admin_client, number):
    # Python's parser takes them; Postgres' jsonb refuses the row, after validation.
    text = '{"id": "simple", "input_schema": {"maximum": ' + number + '}, "steps": []}'
    response = post_document(admin_client, reverse(ADD_URL), text)
    assert response.status_code == 200
    [error] = response.context["form"].errors["document"]
    assert error.startswith("Malformed JSON: ") and "number" in error, error
    assert not Workflow.objects.exists()
