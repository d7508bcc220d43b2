"""The recipe preview in a real browser (Debian's Chromium, driven by Playwright): type a sample
input, render, read the prompt; the page runs under the site's Content-Security-Policy."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.urls import reverse

from tests.browser import ARTIFACTS, chromium_page
from workflows.services import recipe_save

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "a-long-password-1"


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    yield from chromium_page(monkeypatch)


def test_preview_a_recipe_with_a_typed_sample(page, live_server, django_user_model) -> None:
    recipe, _ = recipe_save(
        document={
            "name": "greet",
            "system": "You write for ${input.audience}.",
            "prompt": "Greet ${input.who.name} warmly.\nNotes: ${context}",
        }
    )
    preview = reverse("admin:workflows_recipe_preview", args=[recipe.pk])
    django_user_model.objects.create_superuser("root", "root@example.com", PASSWORD)
    violations: list[str] = []
    page.on(
        "console", lambda m: violations.append(m.text) if "Content Security" in m.text else None
    )

    page.goto(f"{live_server.url}/admin/login/?next={preview}")
    page.fill("#id_username", "root")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"**{preview}")

    page.fill("#id_sample_input", '{"who": {"name": "Zoë"}, "audience": "children"}')
    page.fill("#id_sample_context", "She likes owls.")
    page.click("#render-recipe")
    page.wait_for_selector("#rendered-prompt")
    page.screenshot(path=str(ARTIFACTS / "recipe_preview.png"), full_page=True)
    assert page.inner_text("#rendered-prompt") == "Greet Zoë warmly.\nNotes: She likes owls."
    assert page.inner_text("#rendered-system") == "You write for children."
    # What was typed stays in the form, to edit and render again.
    assert "Zoë" in page.input_value("#id_sample_input")

    page.fill("#id_sample_input", "{not json")
    page.click("#render-recipe")
    page.wait_for_selector("#preview-error")
    assert "Malformed JSON" in page.inner_text(".field-sample_input .errorlist")
    assert page.locator("#rendered-prompt").count() == 0
    assert violations == []
