"""The API docs (Swagger UI) work offline: their files come from the installed
drf-spectacular-sidecar package, never from a CDN."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from tests.browser import chromium_page


@pytest.fixture
def page(monkeypatch):
    yield from chromium_page(monkeypatch)


def test_the_docs_page_loads_nothing_from_another_host() -> None:
    page = Client().get("/api/v1/docs/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js" in html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), html
    assert "cdn.jsdelivr.net" not in html


@pytest.mark.browser
@pytest.mark.django_db
def test_swagger_ui_renders_the_schema_with_no_network(page, live_server) -> None:
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(f"{live_server.url}/api/v1/docs/")
    page.wait_for_selector(".swagger-ui .info .title")
    assert "djflow API" in page.inner_text(".swagger-ui .info .title")
    # The operations of the schema are listed (the schema itself was fetched and parsed).
    page.wait_for_selector("#operations-runs-runs_start")
    page.wait_for_selector("#operations-runs-runs_trace")
    foreign = [url for url in requested if not url.startswith(live_server.url)]
    assert foreign == []


@pytest.mark.django_db
def test_the_schema_documents_the_trace_and_the_retry(api) -> None:
    """The trace's span and the retry's body are in the OpenAPI schema (CONTRACT section 11)."""
    schema = api.get("/api/v1/schema/?format=json").json()
    traced_op = schema["paths"]["/api/v1/runs/{run_id}/trace"]["get"]
    assert traced_op["operationId"] == "runs_trace"
    span = schema["components"]["schemas"]["TraceSpan"]
    assert set(span["properties"]) >= {
        "id",
        "parent",
        "name",
        "kind",
        "step_id",
        "attempt",
        "start",
        "end",
        "status",
        "attributes",
        "usage",
        "cost_usd",
    }
    retry = schema["paths"]["/api/v1/runs/{run_id}/retry"]["post"]
    body = retry["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert set(schema["components"]["schemas"][body.rsplit("/", 1)[1]]["properties"]) == {
        "from_step",
        "input",
        "dry_run",
    }
