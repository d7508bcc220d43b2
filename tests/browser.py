"""Headless Chromium for the tests of pages people click: Debian's ``chromium`` package,
driven by Playwright (never a browser Playwright downloads itself). Screenshots go to
``test-artifacts/``; those the docs show go through :func:`docs_screenshot`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
DOCS_IMAGES = Path(__file__).resolve().parents[1] / "docs" / "img"
# Set, the browser tests write the docs' pictures (docs/img/) afresh:
# DJFLOW_DOCS_SCREENSHOTS=1 pytest -m browser, then commit what changed.
DOCS_SCREENSHOTS = "DJFLOW_DOCS_SCREENSHOTS"


def chromium_page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A fresh page in a fresh browser; skips the test when Chromium is not installed."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium")
    # Playwright's sync API runs an event loop in this thread; the ORM calls the test makes
    # between browser steps are still plain synchronous calls.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    from django.db import connections
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 1000})
            context.set_default_timeout(15_000)
            yield context.new_page()
        finally:
            # ORM calls made while Playwright's loop runs get their own connection (Django
            # keys connections by context); close it, or it outlives the test database.
            connections.close_all()
            browser.close()


def docs_screenshot(page: Any, name: str) -> Path:
    """A screenshot of what ``page`` shows, for the docs: ``docs/img/<name>.png`` when
    ``DJFLOW_DOCS_SCREENSHOTS`` is set, else ``test-artifacts/docs-<name>.png`` (a test run
    leaves the docs as they are). The viewport only, not the whole page: a picture of what a
    reader first sees, of a size the repository keeps."""
    path = (
        DOCS_IMAGES / f"{name}.png"
        if os.environ.get(DOCS_SCREENSHOTS)
        else ARTIFACTS / f"docs-{name}.png"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path))
    return path
