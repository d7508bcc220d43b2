"""The Content-Security-Policy of the project's own pages: the header on each, and each page
in a real browser loading with no violation and still working (the admin's JSON editor
starts, Swagger UI lists the operations)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from tests.approvals.builders import PASSWORD, approver, link_path, start_approval
from tests.browser import ARTIFACTS, chromium_page
from workflows.services import recipe_save

# The directives the policy must hold, whatever else it says.
REQUIRED = {
    "default-src": "'self'",
    "frame-ancestors": "'none'",
    "form-action": "'self'",
    "base-uri": "'none'",
    "object-src": "'none'",
}


def directives(header: str) -> dict[str, list[str]]:
    parsed: dict[str, list[str]] = {}
    for part in header.split(";"):
        name, *values = part.split()
        parsed[name] = values
    return parsed


def assert_strict(header: str) -> None:
    policy = directives(header)
    for name, value in REQUIRED.items():
        assert policy.get(name) == [value], (name, header)
    # Scripts: this origin, and inline ones only with the response's nonce.
    script = policy["script-src"]
    assert "'unsafe-inline'" not in script and "'unsafe-eval'" not in script, header
    assert set(script) - {"'self'"} <= {v for v in script if v.startswith("'nonce-")}, header


@pytest.fixture
def pages(db) -> dict[str, str]:
    """Each page of the project, by name: the path a signed-in superuser (root) opens."""
    get_user_model().objects.create_superuser("root", "root@example.com", PASSWORD)
    _, request = start_approval(users=["root"], emails=["ext@example.org"])
    recipe, _ = recipe_save(document={"name": "csp_check", "prompt": "Hi ${input}"})
    return {
        "home": "/",
        "runs list": "/runs/?status=failed",
        "inbox": "/approvals/",
        "approval": f"/approvals/{request.id}/",
        "run inspector": f"/runs/{request.run_id}/",
        "start form": f"/workflows/{request.run.workflow_id}/start",
        "approval link": link_path(approver(request, "ext@example.org")),
        "notifications": "/notifications/",
        "admin": "/admin/",
        "admin document editor": "/admin/workflows/workflow/add/",
        "admin changelist": "/admin/workflows/workflow/",
        "admin recipe editor": "/admin/workflows/recipe/add/",
        "admin recipe preview": f"/admin/workflows/recipe/{recipe.pk}/preview/",
        "api docs": "/api/v1/docs/",
    }


def test_every_page_sends_the_policy(pages: dict[str, str]) -> None:
    client = Client()
    for path in ("/accounts/login/", "/admin/login/"):
        response = client.get(path)
        assert response.status_code == 200, path
        assert_strict(response["Content-Security-Policy"])
    client.force_login(get_user_model().objects.get(username="root"))
    for name, path in pages.items():
        response = client.get(path)
        assert response.status_code == 200, (name, response.status_code)
        assert_strict(response["Content-Security-Policy"])


def test_the_api_docs_have_no_inline_script(db) -> None:
    page = Client().get("/api/v1/docs/")
    html = page.content.decode()
    # Swagger UI's start-up code is a file on this origin (the split view's ?script).
    assert '<script src="/api/v1/docs/?script=' in html
    assert "<script>" not in html
    script = Client().get("/api/v1/docs/?script=")
    assert script.status_code == 200
    assert script["Content-Type"].startswith("application/javascript")
    assert "SwaggerUIBundle" in script.content.decode()


def test_the_document_editor_has_no_inline_script(admin_client: Client) -> None:
    html = admin_client.get("/admin/workflows/workflow/add/").content.decode()
    assert "/static/workflows/document_editor.js" in html
    assert "<script>" not in html
    assert "style=" not in html.split('class="djflow-document-editor"')[1].split("</textarea>")[0]


def test_a_nonce_used_by_a_page_is_in_its_header(rf) -> None:
    """An inline script of a template runs only with the nonce django-csp puts in the header
    of that response (and no other)."""
    from csp.middleware import CSPMiddleware
    from django.http import HttpResponse
    from django.template import engines

    template = engines["django"].from_string('<script nonce="{{ request.csp_nonce }}"></script>')

    def view(request: Any) -> HttpResponse:
        return HttpResponse(template.render({}, request))

    answers = [CSPMiddleware(view)(rf.get("/")) for _ in range(2)]
    nonces = []
    for response in answers:
        nonce = response.content.decode().split('nonce="')[1].split('"')[0]
        assert f"'nonce-{nonce}'" in directives(response["Content-Security-Policy"])["script-src"]
        nonces.append(nonce)
    assert nonces[0] != nonces[1]


# --- In a real browser ----------------------------------------------------------------------

# Every violation the page reports (the event fires for blocked scripts, styles, frames...).
LISTEN = """
window.__cspViolations = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__cspViolations.push(
    `${e.violatedDirective} ${e.blockedURI} ${e.sourceFile}:${e.lineNumber}`);
});
"""


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from chromium_page(monkeypatch)


def check_works(page: Any, name: str) -> None:
    """What each page must still do under the policy."""
    if name == "admin document editor":
        # Functions, not expression strings: Playwright evaluates a string with eval, which
        # the policy refuses.
        page.wait_for_function(
            "() => window.id_document_editor !== undefined"
            " && window.id_document_editor.aceEditor !== undefined"
        )
        assert page.is_hidden("#id_document_textarea")
        assert page.is_visible("#id_document .ace_content")
    elif name == "admin recipe editor":
        # The output schema's JSON editor started from its file, as the document editor.
        page.wait_for_function(
            "() => window.id_output_schema_editor !== undefined"
            " && window.id_output_schema_editor.aceEditor !== undefined"
        )
        assert page.is_hidden("#id_output_schema_textarea")
    elif name == "api docs":
        page.wait_for_selector(".swagger-ui .info .title")
        page.wait_for_selector("#operations-runs-runs_start")
    elif name in ("approval", "approval link"):
        assert page.is_visible("button.approve")
    elif name == "admin changelist":
        # The admin's own scripts ran (actions bar wired up).
        page.wait_for_selector("#changelist-form")


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_every_page_loads_in_a_browser_with_no_violation(
    page: Any, live_server: Any, pages: dict[str, str]
) -> None:
    console: list[str] = []
    page.on("console", lambda message: console.append(message.text))
    page.add_init_script(LISTEN)

    def visit(name: str, path: str) -> list[str]:
        console.clear()
        page.goto(f"{live_server.url}{path}")
        page.wait_for_load_state("load")
        check_works(page, name)
        page.wait_for_timeout(200)  # late violations (styles inserted by scripts) arrive too
        violations = page.evaluate("window.__cspViolations")
        violations += [text for text in console if "Content Security Policy" in text]
        page.screenshot(path=str(ARTIFACTS / f"csp-{name.replace(' ', '-')}.png"))
        return violations

    found = {name: visit(name, path) for name, path in [("sign-in", "/accounts/login/")]}
    found["admin sign-in"] = visit("admin sign-in", "/admin/login/?next=/admin/")
    page.fill("#id_username", "root")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url("**/admin/")
    for name, path in pages.items():
        found[name] = visit(name, path)
    assert {name: v for name, v in found.items() if v} == {}
    # The listener itself works: an inline script without the nonce is reported.
    page.goto(f"{live_server.url}/accounts/login/")
    page.evaluate(
        "() => { const s = document.createElement('script');"
        " s.textContent = 'window.__ran = 1'; document.body.appendChild(s); }"
    )
    page.wait_for_function("() => window.__cspViolations.length > 0")
    assert page.evaluate("window.__ran") is None
