"""NUL (``%00``) in a path or a query is a 400 on every route (contract section 9;
``config.middleware.NulRefusalMiddleware``; issue 36, lower findings).

Before, a name holding NUL reached Postgres, whose driver refuses it: a 500 on the
definitions, their versions, recipes, knowledge-base documents and admin pages.
"""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db

API_PATHS = [
    "/api/v1/definitions/a%00b",
    "/api/v1/definitions/%00",
    "/api/v1/definitions/a%00b/versions/1",
    "/api/v1/definitions/support_ticket/versions/1%00",
    "/api/v1/recipes/a%00b",
    "/api/v1/recipes/a%00b/versions/1",
    "/api/v1/kbs/a%00b/documents",
    "/api/v1/schedules/a%00b",
    "/api/v1/runs/%00",
    "/api/v1/runs/%00/trace",
]
ADMIN_PATHS = [
    "/admin/workflows/workflow/a%00b/change/",
    "/admin/workflows/workflow/a%00b/new-version/",
    "/admin/workflows/workflow/a%00b/diff/",
    "/admin/workflows/workflow/a%00b/roles/",
    "/admin/workflows/recipe/a%00b/change/",
    "/admin/workflows/recipe/a%00b/preview/",
    "/admin/workflows/knowledgebase/a%00b/change/",
    "/approvals/link/a%00b/",
]


@pytest.mark.parametrize("path", API_PATHS)
def test_nul_in_an_api_path_is_a_400_naming_the_path(api: APIClient, path: str) -> None:
    response = api.get(path)
    assert response.status_code == 400, response.content
    assert response.json() == {
        "errors": [{"field": "path", "message": "may not hold NUL characters (%00)"}]
    }


@pytest.mark.parametrize("path", ADMIN_PATHS)
def test_nul_in_a_page_path_is_a_400(admin_client, path: str) -> None:
    response = admin_client.get(path)
    assert response.status_code == 400, response.content
    assert b"NUL" in response.content


@pytest.mark.parametrize(
    ("url", "field"),
    [
        ("/api/v1/definitions?cursor=a%00b", "cursor"),
        ("/api/v1/kbs?x=%00", "x"),
        ("/api/v1/runs?workflow=a%00b", "workflow"),
        ("/api/v1/runs?a%00b=1", "query"),
    ],
)
def test_nul_in_a_query_is_a_400_naming_the_parameter(api: APIClient, url: str, field: str) -> None:
    response = api.get(url)
    assert response.status_code == 400, response.content
    assert [error["field"] for error in response.json()["errors"]] == [field]


def test_nul_is_refused_before_authentication(anon_api: APIClient) -> None:
    """Nothing can exist under a name holding NUL: a 400 says so without a lookup."""
    assert anon_api.get("/api/v1/definitions/a%00b").status_code == 400
    assert anon_api.get("/api/v1/definitions/ab").status_code in (401, 403)


def test_other_paths_pass_through(api: APIClient) -> None:
    assert api.get("/api/v1/definitions/missing").status_code == 404
    assert api.get("/api/v1/definitions?limit=2").status_code == 200
