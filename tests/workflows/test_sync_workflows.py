"""``manage.py sync_workflows`` and ``workflows.sync.sync_modules``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from workflows import registry
from workflows.models import WorkflowVersion
from workflows.sync import SyncError, sync_modules

SAMPLES = "tests.workflows.sample_modules"
GOOD = f"{SAMPLES}.good"
MORE = f"{SAMPLES}.more"
BROKEN = f"{SAMPLES}.broken_import"
INVALID = f"{SAMPLES}.invalid"

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def isolated_registry() -> Iterator[None]:
    """An empty registry and freshly imported sample modules for each test."""
    state = registry.snapshot()
    registry.clear()
    _forget_samples()
    yield
    _forget_samples()
    registry.restore(state)


def _forget_samples() -> None:
    for name in list(sys.modules):
        if name.startswith(f"{SAMPLES}."):
            del sys.modules[name]


def _sync(*args: str, **options: object) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("sync_workflows", *args, stdout=out, stderr=err, **options)
    return out.getvalue(), err.getvalue()


def _numbers(workflow_id: str) -> list[int]:
    return list(
        WorkflowVersion.objects.filter(workflow_id=workflow_id)
        .order_by("number")
        .values_list("number", flat=True)
    )


def test_sync_saves_every_builder_and_prints_one_line_each() -> None:
    out, err = _sync("--module", GOOD, "--module", MORE)

    # Creation order; the parent is saved after its child but reported where it was defined.
    assert out.splitlines() == [
        "sample_parent v1 created",
        "sample_child v1 created",
        "sample_more v1 created",
    ]
    assert err == ""
    stored = WorkflowVersion.objects.get(workflow_id="sample_more").document
    assert stored["steps"] == [
        {
            "id": "ping",
            "kind": "wait_event",
            "event": "ping",
            "key": "${input.id}",
            "timeout_ms": 60_000,
        }
    ]


def test_sync_twice_says_unchanged() -> None:
    _sync("--module", GOOD)
    _forget_samples()
    registry.clear()

    out, _ = _sync("--module", GOOD)

    assert out.splitlines() == ["sample_parent v1 unchanged", "sample_child v1 unchanged"]
    assert _numbers("sample_parent") == [1]
    assert _numbers("sample_child") == [1]


def test_sync_reads_the_setting_and_the_option_overrides_it(settings: Any) -> None:
    settings.WORKFLOW_MODULES = [MORE]

    out, _ = _sync()
    assert out.splitlines() == ["sample_more v1 created"]
    assert not WorkflowVersion.objects.filter(workflow_id="sample_parent").exists()

    out, _ = _sync(module=[GOOD])
    assert "sample_parent v1 created" in out.splitlines()


def test_sync_with_nothing_configured_says_so(settings: Any) -> None:
    settings.WORKFLOW_MODULES = []

    out, err = _sync()

    assert out == ""
    assert "WORKFLOW_MODULES" in err


def test_a_module_that_fails_to_import_is_an_error_and_nothing_is_saved() -> None:
    with pytest.raises(CommandError) as caught:
        _sync("--module", GOOD, "--module", BROKEN)

    message = str(caught.value)
    assert BROKEN in message
    assert "ModuleNotFoundError" in message
    assert "no_such_module" in message
    assert not WorkflowVersion.objects.exists()


def test_a_missing_module_is_an_error() -> None:
    with pytest.raises(CommandError, match=f"{SAMPLES}.nope"):
        _sync("--module", f"{SAMPLES}.nope")


def test_an_invalid_document_is_an_error_naming_the_workflow_and_its_errors() -> None:
    out = StringIO()

    with pytest.raises(CommandError) as caught:
        call_command("sync_workflows", "--module", INVALID, stdout=out, stderr=StringIO())

    message = str(caught.value)
    assert "sample_invalid" in message
    assert INVALID in message
    assert "steps[0].ms" in message
    assert "315360000000" in message
    assert not WorkflowVersion.objects.filter(workflow_id="sample_invalid").exists()
    # The valid workflow beside it is saved and reported.
    assert out.getvalue().splitlines() == ["sample_fine v1 created"]
    assert _numbers("sample_fine") == [1]


def test_the_command_exits_non_zero_on_error() -> None:
    from django.core.management import ManagementUtility

    utility = ManagementUtility(["manage.py", "sync_workflows", "--module", BROKEN])

    with pytest.raises(SystemExit) as caught:
        utility.execute()

    assert caught.value.code != 0


def test_sync_modules_returns_the_results() -> None:
    results = sync_modules([GOOD])
    again = sync_modules([GOOD])

    assert [(wid, r.version.number, r.created) for wid, r in results] == [
        ("sample_parent", 1, True),
        ("sample_child", 1, True),
    ]
    assert [(wid, r.created) for wid, r in again] == [
        ("sample_parent", False),
        ("sample_child", False),
    ]


def test_sync_modules_reports_what_it_saved_beside_a_failure() -> None:
    with pytest.raises(SyncError) as caught:
        sync_modules([INVALID, MORE])

    assert [wid for wid, _ in caught.value.saved] == ["sample_fine", "sample_more"]
    assert len(caught.value.problems) == 1
    assert caught.value.problems[0].startswith("workflow 'sample_invalid'")


def test_a_subworkflow_of_an_unknown_workflow_is_reported() -> None:
    from workflows.sdk import workflow

    orphan = workflow("sample_orphan")
    orphan.subworkflow("call", workflow="sample_nowhere")

    with pytest.raises(SyncError, match="unknown workflow 'sample_nowhere'"):
        sync_modules([])
    assert not WorkflowVersion.objects.filter(workflow_id="sample_orphan").exists()
