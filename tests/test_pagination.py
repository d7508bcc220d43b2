"""``?limit=`` on every cursor-paginated list: a bad value is a 400 naming it, never ignored."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

LISTS = ["/api/v1/definitions", "/api/v1/runs", "/api/v1/approvals"]


@pytest.mark.django_db
@pytest.mark.parametrize("url", LISTS)
@pytest.mark.parametrize("limit", ["abc", "0", "501", "-1", "1e3", "9" * 40])
def test_a_bad_limit_is_a_400_naming_it(api: APIClient, url: str, limit: str) -> None:
    response = api.get(url, {"limit": limit})
    assert response.status_code == 400, response.content
    [error] = response.json()["errors"]
    assert error["field"] == "limit"
    assert "from 1 to 500" in error["message"]
    # The value is echoed, but never more than a bounded prefix of it.
    assert len(error["message"]) < 120


@pytest.mark.django_db
@pytest.mark.parametrize("url", LISTS)
@pytest.mark.parametrize("limit", ["1", "500"])
def test_a_limit_in_range_is_taken(api: APIClient, url: str, limit: str) -> None:
    response = api.get(url, {"limit": limit})
    assert response.status_code == 200, response.content
    assert response.json()["next"] is None


@pytest.mark.django_db
@pytest.mark.parametrize("url", LISTS)
@pytest.mark.parametrize("cursor", ["AAAA", "!!!!", "", "bz0w", "cT1h"])
def test_a_cursor_this_api_did_not_give_out_is_a_400(api: APIClient, url: str, cursor: str) -> None:
    """``AAAA`` and ``bz0w`` (``o=0``) decode to no position, ``cT1h`` to ``q=a``: DRF would
    answer each with the first page."""
    response = api.get(url, {"cursor": cursor})
    assert response.status_code == 400, response.content
    assert [e["field"] for e in response.json()["errors"]] == ["cursor"]
