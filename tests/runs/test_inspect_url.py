"""The run resource's ``inspect_url`` (CONTRACT section 11): the absolute address of the run's
inspector page, on ``SITE_URL``, in every run the API answers and in its OpenAPI schema; the
admin's run pages and the home page link to the same page."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from rest_framework.test import APIClient

from .factories import RunFactory

pytestmark = pytest.mark.django_db


def test_every_run_the_api_answers_has_its_inspect_url_on_site_url(
    api: APIClient, settings
) -> None:
    settings.SITE_URL = "https://flows.example.com/"
    run = RunFactory()
    expected = f"https://flows.example.com/runs/{run.id}/"
    assert api.get(f"/api/v1/runs/{run.id}").json()["inspect_url"] == expected
    assert api.get("/api/v1/runs").json()["results"][0]["inspect_url"] == expected
    body = {"workflow": run.workflow_id, "input": {"ticket": "Q: where?"}}
    started = api.post("/api/v1/runs", body, format="json")
    assert started.status_code == 201, started.json()
    assert (
        started.json()["inspect_url"] == f"https://flows.example.com/runs/{started.json()['id']}/"
    )


def test_the_inspect_url_is_the_same_whatever_host_the_request_named(
    api: APIClient, settings
) -> None:
    """Built from SITE_URL, never from a Host header a client chose."""
    settings.SITE_URL = "http://127.0.0.1:8000"
    settings.ALLOWED_HOSTS = ["*"]
    run = RunFactory()
    answer = api.get(f"/api/v1/runs/{run.id}", HTTP_HOST="evil.example.net").json()
    assert answer["inspect_url"] == f"http://127.0.0.1:8000/runs/{run.id}/"


def test_the_inspect_url_leads_to_the_runs_page_for_whoever_may_read_it(
    api: APIClient, user
) -> None:
    run = RunFactory()
    url = api.get(f"/api/v1/runs/{run.id}").json()["inspect_url"]
    path = url.removeprefix("http://127.0.0.1:8000")
    reader = Client()
    reader.force_login(user)
    page = reader.get(path)
    assert page.status_code == 200
    assert str(run.id) in page.content.decode()
    stranger = get_user_model().objects.create_user("mallory", password="a-long-password-1")
    other = Client()
    other.force_login(stranger)
    assert other.get(path).status_code == 404


def test_the_openapi_schema_describes_the_inspect_url(api: APIClient) -> None:
    schema = api.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    for shape in ("Run", "RunList"):
        field = schema["components"]["schemas"][shape]["properties"]["inspect_url"]
        assert field["type"] == "string"
        assert field["format"] == "uri"
        assert field["readOnly"] is True
        assert "inspector" in field["description"]


# --- the admin ---------------------------------------------------------------------------


def _staff_viewer() -> Client:
    user = get_user_model().objects.create_user(
        username="sam", password="a-long-password-1", is_staff=True
    )
    user.user_permissions.set(Permission.objects.filter(codename="view_run"))
    client = Client()
    client.force_login(user)
    return client


def test_the_admins_run_list_and_run_page_link_to_the_inspector() -> None:
    runs = [RunFactory(), RunFactory()]
    client = _staff_viewer()
    listing = client.get("/admin/runs/run/")
    assert listing.status_code == 200
    html = listing.content.decode()
    for run in runs:
        assert f'<a href="/runs/{run.id}/" class="djflow-inspect">Inspect</a>' in html
    page = client.get(f"/admin/runs/run/{runs[0].id}/change/")
    assert page.status_code == 200
    assert f'<a href="/runs/{runs[0].id}/" class="djflow-inspect">Inspect</a>' in (
        page.content.decode()
    )
