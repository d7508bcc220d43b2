"""The admin's document editor in a real browser: type, save, see the errors, keep the text.

Needs Debian's Chromium (``apt-get install -y chromium``); Playwright drives it, never a
browser it downloads itself. Screenshots go to ``test-artifacts/``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from django.contrib.admin.utils import quote
from django.urls import reverse

from tests.browser import ARTIFACTS, chromium_page
from workflows.models import WorkflowVersion

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "a-long-password-1"
EDITOR = "window.id_document_editor"

DOCUMENT = {
    "id": "browser_flow",
    "description": "Typed in a browser.",
    "steps": [
        {"id": "fetch", "kind": "task"},
        {"id": "notify", "kind": "task", "input": {"text": "${steps.fetch.output}"}},
    ],
}
INVALID = {
    "id": "browser_flow",
    "description": "Two mistakes.",
    "steps": [
        {"id": "a", "kind": "task", "colour": "red"},
        {"id": "Bad-Id", "kind": "task"},
    ],
}


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    yield from chromium_page(monkeypatch)


def log_in(page, live_server, django_user_model, next_path: str) -> None:
    django_user_model.objects.create_superuser("root", "root@example.com", PASSWORD)
    page.goto(f"{live_server.url}/admin/login/?next={next_path}")
    page.fill("#id_username", "root")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"**{next_path}")


def wait_for_editor(page) -> None:
    # A function, not an expression string: Playwright evaluates a string with eval, which
    # the Content-Security-Policy refuses.
    page.wait_for_function(f"() => {EDITOR} !== undefined && {EDITOR}.aceEditor !== undefined")


def type_into_editor(page, text: str) -> None:
    """Replace the editor's content the way a user does: focus, select all, type."""
    page.click("#id_document .ace_content")
    page.keyboard.press("Control+A")
    page.keyboard.press("Delete")
    # insert_text sends the characters as typed input; it skips Ace's bracket auto-closing,
    # which would otherwise double every brace and quote of the pasted document.
    page.keyboard.insert_text(text)


def editor_text(page) -> str:
    return page.evaluate(f"{EDITOR}.getText()")


def test_author_a_workflow_in_the_json_editor(page, live_server, django_user_model):
    add_path = "/admin/workflows/workflow/add/"
    log_in(page, live_server, django_user_model, add_path)
    wait_for_editor(page)
    # The plain textarea gives way to the editor once it has started.
    assert page.is_hidden("#id_document_textarea")
    assert json.loads(editor_text(page))["id"] == ""

    # 1. Type a document and save it.
    text = json.dumps(DOCUMENT, indent=2)
    type_into_editor(page, text)
    assert json.loads(editor_text(page)) == DOCUMENT
    page.screenshot(path=str(ARTIFACTS / "admin-add-typed.png"), full_page=True)
    page.click("#save-document")
    change_path = reverse("admin:workflows_workflow_change", args=[quote("browser_flow")])
    page.wait_for_url(f"**{change_path}")
    success = page.locator(".messagelist .success")
    assert "Saved browser_flow version 1." in success.inner_text()
    assert page.locator(".field-hash_prefix code").first.inner_text()
    page.screenshot(path=str(ARTIFACTS / "admin-saved.png"), full_page=True)
    assert WorkflowVersion.objects.get(workflow_id="browser_flow").document == {
        "version": 1,
        **DOCUMENT,
    }

    # The version's own page is for reading: the pretty document, nothing to save or delete.
    page.click("#versions-group a:text-is('view')")
    page.locator("pre.djflow-document").wait_for()
    assert json.loads(page.locator("pre.djflow-document").inner_text()) == {
        "version": 1,
        **DOCUMENT,
    }
    assert page.locator("input[name=_save]").count() == 0
    assert page.locator("a.deletelink").count() == 0
    page.screenshot(path=str(ARTIFACTS / "admin-version.png"), full_page=True)
    page.go_back()

    # 2. Open "New version", put in an invalid document, and see every error by its field.
    page.click("#new-version-link")
    wait_for_editor(page)
    assert json.loads(editor_text(page)) == DOCUMENT
    # Set through the widget's API this time: no change event fires, so this also proves the
    # form takes the editor's text on submit.
    page.evaluate(f"document => {EDITOR}.set(document)", INVALID)
    page.click("#save-document")
    errors = page.locator("#document-errors li")
    errors.first.wait_for()
    listed = errors.all_inner_texts()
    fields = page.locator("#document-errors code.djflow-field").all_inner_texts()
    pairs = zip(fields, listed, strict=True)
    assert any(f.startswith("steps[0]") and "colour" in line for f, line in pairs)
    assert "steps[1].id" in fields
    assert page.locator(".errornote").is_visible()
    wait_for_editor(page)
    assert json.loads(editor_text(page)) == INVALID  # what the user wrote is still there
    page.screenshot(path=str(ARTIFACTS / "admin-invalid.png"), full_page=True)
    assert WorkflowVersion.objects.filter(workflow_id="browser_flow").count() == 1

    # 3. Malformed JSON comes back exactly as typed, with the line and column of the slip.
    broken = '{\n  "id": "browser_flow",\n  "steps": [\n'
    type_into_editor(page, broken)
    page.click("#save-document")
    page.locator(".field-document .errorlist").wait_for()
    assert "Malformed JSON" in page.locator(".field-document .errorlist").inner_text()
    wait_for_editor(page)
    assert editor_text(page) == broken
    page.screenshot(path=str(ARTIFACTS / "admin-malformed.png"), full_page=True)
    assert WorkflowVersion.objects.filter(workflow_id="browser_flow").count() == 1

    # 4. A valid second version, then its diff against the first, coloured by line.
    second = {**DOCUMENT, "description": "Typed twice."}
    type_into_editor(page, json.dumps(second, indent=2))
    page.click("#save-document")
    page.locator(".messagelist .success").wait_for()
    assert "Saved browser_flow version 2." in page.locator(".messagelist .success").inner_text()
    page.click("#diff-link")
    page.locator("#diff").wait_for()
    assert page.locator("#diff-from").input_value() == "1"
    assert page.locator("#diff-to").input_value() == "2"
    removed = page.locator("tr.diff-removed").all_inner_texts()
    added = page.locator("tr.diff-added").all_inner_texts()
    assert removed == ['-  "description": "Typed in a browser.",']
    assert added == ['+  "description": "Typed twice.",']
    colour = page.locator("tr.diff-added td").evaluate("td => getComputedStyle(td).backgroundColor")
    assert colour == "rgb(230, 255, 236)"
    page.screenshot(path=str(ARTIFACTS / "admin-diff.png"), full_page=True)
