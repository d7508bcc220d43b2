"""GET /runs/{id}, GET /runs and the run's inspector page answer within a size bound
(DJFLOW_MAX_ANSWER_BYTES, DJFLOW_ANSWER_VALUE_BYTES; issue 36): a value that does not fit is
null, listed in its object's ``truncated`` with a link that answers it whole to whoever may
read the run, and 404 to anyone else. The web process reads only what it shows."""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest

from runs import services
from runs.models import Run, StepRun
from workflows.services import definition_save

from . import flows_bounded as flows
from .test_run_bytes import _drive

KIB = 1024
pytestmark = pytest.mark.django_db


@pytest.fixture
def bounds(settings) -> tuple[int, int]:
    settings.DJFLOW = {
        **settings.DJFLOW,
        "MAX_ANSWER_BYTES": 512 * KIB,
        "ANSWER_VALUE_BYTES": 64 * KIB,
    }
    return 512 * KIB, 64 * KIB


def _big_run(user: Any, *, size: int = 300 * KIB, items: int = 3) -> Run:
    """A completed run of ``items`` outputs of ``size`` bytes, collected into the foreach's
    output and the run's (each at most 1 MiB), and a run input of 200 KiB."""
    for builder in flows.ALL:
        definition_save(document=builder.document())
    start = {"size": size, "items": list(range(items)), "pad": "p" * (200 * KIB)}
    run = services.run_start(workflow="bounded_echo_output", input=start, user=user).run
    return _drive(run)


def test_the_run_answer_stays_under_the_bound_with_links_to_each_value(api, user, bounds):
    total, _ = bounds
    run = _big_run(user)
    assert run.status == "completed", run.error
    # What the old answer carried: 3 outputs of 300 KiB, the foreach's and the run's.
    stored = sum(len(str(row.output or "")) for row in StepRun.objects.filter(run=run))
    assert stored > 1700 * KIB
    answer = api.get(f"/api/v1/runs/{run.id}")
    assert answer.status_code == 200
    assert len(answer.content) < total + 64 * KIB
    body = answer.json()
    items = [step for step in body["steps"] if step["step_id"] == "item"]
    assert len(items) == 3
    for step in items:
        assert step["output"] is None
        left_out = step["truncated"]["output"]
        assert left_out["bytes"] >= 300 * KIB
        # Small values are still shown.
        assert step["input"] == {"size": 300 * KIB, "index": step["input"]["index"]}
    # The run's input (200 KiB of padding) is over the value bound too.
    assert body["input"] is None and body["truncated"]["input"]["bytes"] > 200 * KIB
    url = items[0]["truncated"]["output"]["url"]
    assert url.startswith("http") and url.endswith(f"/steps/{items[0]['id']}/output")
    path = url[url.index("/api/v1/") :]
    whole = api.get(path)
    assert whole.status_code == 200
    assert whole.json()["value"] == "x" * (300 * KIB - 2)
    run_input = api.get(
        body["truncated"]["input"]["url"][body["truncated"]["input"]["url"].index("/api/v1/") :]
    )
    assert run_input.json()["value"]["pad"] == "p" * (200 * KIB)


def test_the_links_are_404_to_those_who_may_not_read_the_run(api, user, stranger, bounds):
    run = _big_run(user, items=2)
    step = StepRun.objects.filter(run=run, step_id="item").first()
    for path in (
        f"/api/v1/runs/{run.id}/steps/{step.id}/output",
        f"/api/v1/runs/{run.id}/input",
        f"/api/v1/runs/{run.id}/output",
    ):
        assert stranger.get(path).status_code == 404
        assert api.get(path).status_code == 200
    other = _big_run(user, items=1)
    # An attempt of another run, a field that is no value, an id that is no number.
    for path in (
        f"/api/v1/runs/{other.id}/steps/{step.id}/output",
        f"/api/v1/runs/{run.id}/steps/{step.id}/claim",
        f"/api/v1/runs/{run.id}/steps/x{step.id}/output",
        f"/api/v1/runs/{run.id}/steps/99999999999999999999999/output",
    ):
        answer = api.get(path)
        assert answer.status_code == 404, path
        assert answer.json()["errors"][0]["field"] in ("step", "field")


def test_the_answer_reads_only_what_it_shows(api, user, bounds):
    """The web process never holds the large values (3.2 MB of them here): the sizes come
    from the database, and only values that fit are read."""
    run = _big_run(user)
    api.get(f"/api/v1/runs/{run.id}")  # warm: imports, caches
    tracemalloc.start()
    try:
        assert api.get(f"/api/v1/runs/{run.id}").status_code == 200
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 1024 * KIB


def test_the_runs_list_stays_under_the_bound(api, user, bounds):
    for builder in flows.ALL:
        definition_save(document=builder.document())
    for _ in range(8):
        services.run_start(
            workflow="bounded_echo_output",
            input={"size": 10, "items": [], "pad": "p" * (100 * KIB)},
            user=user,
        )
    answer = api.get("/api/v1/runs?limit=500")
    assert answer.status_code == 200
    rows = answer.json()["results"]
    assert len(rows) == 8
    # 100 KiB inputs are over the value bound: none embedded, each linked.
    assert all(
        row["input"] is None and row["truncated"]["input"]["bytes"] > 100 * KIB for row in rows
    )
    assert len(answer.content) < 64 * KIB


def test_the_list_embeds_what_fits_and_links_the_rest(api, user, settings):
    settings.DJFLOW = {
        **settings.DJFLOW,
        "MAX_ANSWER_BYTES": 100 * KIB,
        "ANSWER_VALUE_BYTES": 64 * KIB,
    }
    for builder in flows.ALL:
        definition_save(document=builder.document())
    for _ in range(4):
        services.run_start(
            workflow="bounded_echo_output",
            input={"size": 10, "items": [], "pad": "p" * (40 * KIB)},
            user=user,
        )
    rows = api.get("/api/v1/runs").json()["results"]
    shown = [row for row in rows if row["input"] is not None]
    # Two inputs of 40 KiB fit 100 KiB; the others are links.
    assert len(shown) == 2 and all(row["truncated"] is None for row in shown)
    assert all(row["truncated"]["input"]["url"] for row in rows if row["input"] is None)


def test_the_inspector_page_shows_large_values_as_links(client, user, bounds):
    run = _big_run(user)
    client.force_login(user)
    page = client.get(f"/runs/{run.id}/")
    assert page.status_code == 200
    assert len(page.content) < 1024 * KIB
    step = StepRun.objects.filter(run=run, step_id="item").first()
    assert f"/api/v1/runs/{run.id}/steps/{step.id}/output".encode() in page.content


def test_the_openapi_document_describes_truncated_values_and_their_links(api):
    schema = api.get("/api/v1/schema/?format=json").json()
    paths = schema["paths"]
    assert "/api/v1/runs/{run_id}/steps/{step_run_id}/{field}" in paths
    assert "/api/v1/runs/{run_id}/input" in paths
    components = schema["components"]["schemas"]
    assert "truncated" in components["StepRun"]["properties"]
    assert "truncated" in components["RunList"]["properties"]
