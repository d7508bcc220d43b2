"""The documentation site (docs/, mkdocs.yml) and the README as its front page.

The site builds with ``mkdocs build --strict`` (a broken link, a page left out of the
navigation or a missing image fails it); the configuration reference describes exactly the
variables the code reads, with the defaults the code gives; the README stays a front page.
The blocks of the pages run in tests/test_readme.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BASE_DIR = Path(__file__).resolve().parent.parent
DOCS = BASE_DIR / "docs"
README_MAX_LINES = 300


def _hook(name: str) -> ModuleType:
    """A module of docs/hooks/, which is not a package (MkDocs loads it by path)."""
    spec = importlib.util.spec_from_file_location(
        f"docs_hooks_{name}", DOCS / "hooks" / f"{name}.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


configuration = _hook("configuration")


def _documented() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for s in configuration.descriptions() for v in s["variables"]}


def test_the_readme_is_a_front_page() -> None:
    lines = (BASE_DIR / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_the_settings_are_read_as_the_generator_expects() -> None:
    # Guards the parser: finding nothing would make the checks below vacuous.
    read = configuration.variables_read()
    assert {"DATABASE_URL", "CELERY_BROKER_URL", "SECRET_KEY", "DJFLOW_LEASE_SECONDS"} <= set(read)
    assert read["DJFLOW_LEASE_SECONDS"].read_as == "number"
    assert read["DJFLOW_MAX_RUN_BYTES"].default == 64 * 1_048_576
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in read and "DJFLOW_ADDR" in read


def test_every_variable_read_is_documented_and_nothing_documented_is_unread() -> None:
    read, documented = set(configuration.variables_read()), set(_documented())
    assert read - documented == set(), "read by the code, not in docs/hooks/configuration.yml"
    assert documented - read == set(), "in docs/hooks/configuration.yml, read by nothing"
    names = [v["name"] for s in configuration.descriptions() for v in s["variables"]]
    assert len(names) == len(set(names)), "a variable described twice"


def _same_default(code: Any, documented: str) -> bool:
    """Whether the documented default says the code's literal default: its first code span
    (`30`, `true`, `a,b`), or for an empty one, words."""
    span = re.match(r"\s*`([^`]*)`", documented)
    if code in ("", [], {}):
        # Words (`empty`, `unset`, or how the code makes one when none is given), or `{}`.
        return span is None or span.group(1) in ("{}", "")
    if span is None:
        return False
    text = span.group(1)
    if isinstance(code, bool):
        return text == str(code).lower()
    if isinstance(code, int | float):
        try:
            return float(text) == float(code)
        except ValueError:
            return False
    if isinstance(code, list):
        return text == ",".join(code)
    return bool(text == str(code))


def test_every_documented_default_is_the_codes() -> None:
    """Where the code's default is a plain value, the page says that value (the settings'
    ``default=30.0`` is documented `30`); a computed default (``var/``, a URL of another
    setting) is described in words."""
    documented = _documented()
    drift = {
        name: (read.default, documented[name]["default"])
        for name, read in configuration.variables_read().items()
        if read.default is not None and not _same_default(read.default, documented[name]["default"])
    }
    assert drift == {}


def test_the_configuration_page_is_generated() -> None:
    page = (DOCS / "reference" / "configuration.md").read_text()
    assert page.index(configuration.MARKER) < page.index(configuration.END_MARKER)
    tables = configuration.render()
    for name in configuration.variables_read():
        assert f"| `{name}` |" in tables


def _images() -> list[tuple[Path, str]]:
    """Every image a page of the docs (or the README) shows: (page, target)."""
    return [
        (page, target)
        for page in [BASE_DIR / "README.md", *DOCS.rglob("*.md")]
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)", page.read_text())
        if not re.match(r"[a-z]+://", target)
    ]


def test_the_docs_reference_only_images_that_exist() -> None:
    missing = [
        f"{p.relative_to(BASE_DIR)}: {t}" for p, t in _images() if not (p.parent / t).is_file()
    ]
    assert missing == []
    assert len(_images()) >= 4, "the screenshots of the pages are shown"


def test_every_screenshot_is_shown() -> None:
    """docs/img/ holds only pictures a page shows (the browser tests write them:
    tests/browser.py, docs_screenshot)."""
    shown = {(page.parent / target).resolve() for page, target in _images()}
    unshown = sorted(p.name for p in (DOCS / "img").iterdir() if p.resolve() not in shown)
    assert unshown == []


def test_the_screenshots_are_taken_by_the_browser_tests() -> None:
    """Each picture of docs/img/ is written by a browser test (``docs_screenshot(page,
    "<name>")``), so ``DJFLOW_DOCS_SCREENSHOTS=1 pytest -m browser`` takes them all afresh."""
    calls = {
        name
        for test in (BASE_DIR / "tests").rglob("test_*.py")
        for name in re.findall(r'docs_screenshot\(page, "([^"]+)"\)', test.read_text())
    }
    assert {p.stem for p in (DOCS / "img").glob("*.png")} <= calls


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path: Path) -> None:
    """``mkdocs build --strict``, as the docs extra installs it: every page in the
    navigation, every link and anchor found, the configuration tables and the OpenAPI
    document generated, and Swagger UI and Mermaid on the pages that use them."""
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("mkdocs is not installed: pip install -e '.[test]' brings the docs extra")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=BASE_DIR,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    config = (site / "reference" / "configuration" / "index.html").read_text()
    assert "DJFLOW_LEASE_SECONDS" in config and "Reading this page's source" not in config
    assert '"openapi"' in (site / "reference" / "openapi.json").read_text()[:200]
    assert "iframe" in (site / "reference" / "api" / "index.html").read_text()
    assert 'class="mermaid"' in (site / "explanation" / "architecture" / "index.html").read_text()
