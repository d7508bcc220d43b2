"""``DJFLOW_MAX_BODY_BYTES`` bounds every request body (contract section 9; issue 36, lower
findings): the contract and the README named it, the settings never read it (they read
``DJFLOW_MAX_DOCUMENT_BYTES``, still read when the new name is unset)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from runs.models import Run

from .settings_probe import last_line, probe_settings

PROBE = (
    "import django; django.setup(); from django.conf import settings; "
    "print(settings.DATA_UPLOAD_MAX_MEMORY_SIZE, settings.DJFLOW['MAX_BODY_BYTES'])"
)


def _limit(tmp_path: Path, **env: str) -> str:
    unset = ("DJFLOW_MAX_BODY_BYTES", "DJFLOW_MAX_DOCUMENT_BYTES")
    return last_line(probe_settings(tmp_path, PROBE, unset=unset, **env))


def test_the_body_limit_is_read_from_djflow_max_body_bytes(tmp_path: Path) -> None:
    assert _limit(tmp_path) == "1048576 1048576"
    assert _limit(tmp_path, DJFLOW_MAX_BODY_BYTES="2048") == "2048 2048"
    # The older name still counts when the contract's is unset, and loses to it when set.
    assert _limit(tmp_path, DJFLOW_MAX_DOCUMENT_BYTES="4096") == "4096 4096"
    both = {"DJFLOW_MAX_DOCUMENT_BYTES": "4096", "DJFLOW_MAX_BODY_BYTES": "8192"}
    assert _limit(tmp_path, **both) == "8192 8192"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "url", ["/api/v1/runs", "/api/v1/events", "/api/v1/definitions", "/api/v1/recipes"]
)
def test_a_body_over_the_limit_is_a_413_in_the_contracts_error_json(
    api: APIClient, settings, url: str
) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 2048
    body = json.dumps({"workflow": "support_ticket", "input": {"ticket": "x" * 4096}})
    response = api.generic("POST", url, body, content_type="application/json")
    assert response.status_code == 413, response.content
    assert response.json() == {
        "errors": [
            {"field": "body", "message": "is larger than 2048 bytes (DJFLOW_MAX_BODY_BYTES)"}
        ]
    }
    assert not Run.objects.exists()
