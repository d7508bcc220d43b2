"""Fixtures of the worker tests: ``model_server``, a local server speaking OpenAI's and
Anthropic's wire formats (tests/model_server.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.model_server import ModelServer


@pytest.fixture
def model_server() -> Iterator[ModelServer]:
    with ModelServer() as server:
        yield server
