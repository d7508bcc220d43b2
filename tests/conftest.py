"""Shared fixtures. Tests run against the real Postgres and Redis on loopback."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient


@pytest.fixture
def user(db):
    return get_user_model().objects.create_user(
        username="ada", email="ada@example.com", password="a-long-password-1"
    )


@pytest.fixture
def admin_user(db):
    return get_user_model().objects.create_superuser(
        username="root", email="root@example.com", password="a-long-password-1"
    )


@pytest.fixture
def api(user) -> APIClient:
    """An API client authenticated with the user's token."""
    client = APIClient()
    token, _ = Token.objects.get_or_create(user=user)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


@pytest.fixture
def anon_api() -> APIClient:
    return APIClient()
