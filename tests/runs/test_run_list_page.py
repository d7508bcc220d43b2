"""``/runs/``: the runs list page. Only the runs the user may read, newest first; each filter
narrows; search finds by exact id, correlation or idempotency key and never someone else's
run; pages follow the API's cursor; bad values are named on the page with a 400; a page is a
bounded number of queries whatever the number of runs."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from runs import selectors
from runs.status import RunStatus
from tests.moves import unchecked
from workflows import access
from workflows.services import definition_save

from .factories import RunFactory, WorkflowVersionFactory

pytestmark = pytest.mark.django_db

URL = "/runs/"
ROW = re.compile(r'data-run="([0-9a-f-]{36})"')


def _person(username: str, *codenames: str):
    user = get_user_model().objects.create_user(username=username, password="a-long-password-1")
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    return user


def _client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _listed(client: Client, **query) -> list[str]:
    response = client.get(URL, query)
    assert response.status_code == 200, response.content.decode()
    return ROW.findall(response.content.decode())


@pytest.fixture
def viewer() -> Client:
    """Vic holds the global viewer role: every run is his to read."""
    return _client(_person("vic", "view_run"))


@pytest.fixture
def two_workflows():
    return (
        WorkflowVersionFactory(),
        definition_save(document={"id": "nightly", "steps": [{"id": "a", "kind": "task"}]}).version,
    )


def test_a_visitor_who_is_not_signed_in_is_sent_to_sign_in() -> None:
    response = Client().get(URL)
    assert response.status_code == 302
    assert response["Location"] == f"/accounts/login/?next={URL}"


def test_runs_are_listed_newest_first_each_linking_into_the_inspector(viewer) -> None:
    now = timezone.now()
    old = RunFactory(created_at=now - timedelta(hours=2))
    new = RunFactory(created_at=now - timedelta(minutes=1), version=old.version)
    middle = RunFactory(created_at=now - timedelta(hours=1), version=old.version)
    response = viewer.get(URL)
    body = response.content.decode()
    assert ROW.findall(body) == [str(new.id), str(middle.id), str(old.id)]
    for run in (old, new, middle):
        assert f'href="{reverse("runs:inspect", args=[run.id])}"' in body
    assert 'href="/runs/"' in body  # the header's way back here, on every page


def test_each_filter_narrows_the_list(viewer, two_workflows) -> None:
    support, nightly = two_workflows
    now = timezone.now()
    a, b, c = (
        RunFactory(
            version=version,
            status=status,
            account=account,
            cost_usd=Decimal(cost),
            created_at=now - timedelta(days=days_ago),
        )
        for version, status, account, cost, days_ago in [
            (support, RunStatus.COMPLETED, "sales", "0.50", 3),
            (nightly, RunStatus.FAILED, "ops", "2.25", 2),
            (nightly, RunStatus.COMPLETED, "sales", "0", 1),
        ]
    )
    ids = {run: str(run.id) for run in (a, b, c)}
    assert _listed(viewer) == [ids[c], ids[b], ids[a]]
    assert _listed(viewer, workflow="nightly") == [ids[c], ids[b]]
    assert _listed(viewer, workflow="no_such_workflow") == []
    assert _listed(viewer, status="completed") == [ids[c], ids[a]]
    assert _listed(viewer, account="sales") == [ids[c], ids[a]]
    assert _listed(viewer, account="ops") == [ids[b]]
    # Created from (inclusive) and before (exclusive), in UTC, with or without the time.
    day = (now - timedelta(days=2)).date().isoformat()
    assert _listed(viewer, created_after=b.created_at.isoformat()) == [ids[c], ids[b]]
    assert _listed(viewer, created_before=b.created_at.isoformat()) == [ids[a]]
    assert _listed(viewer, created_after=day, created_before=c.created_at.isoformat()) == [ids[b]]
    # The browser's datetime-local control sends no zone and no seconds: UTC is meant.
    stamp = (now - timedelta(days=2, hours=1)).strftime("%Y-%m-%dT%H:%M")
    assert _listed(viewer, created_after=stamp) == [ids[c], ids[b]]
    assert _listed(viewer, cost_min="0.5") == [ids[b], ids[a]]
    assert _listed(viewer, cost_max="0.5") == [ids[c], ids[a]]
    assert _listed(viewer, cost_min="1", cost_max="3") == [ids[b]]
    assert _listed(viewer, workflow="nightly", status="completed", account="sales") == [ids[c]]


def test_search_finds_a_run_by_its_exact_id_correlation_or_idempotency_key(viewer) -> None:
    run = RunFactory(correlation="crm-7781", idempotency_key="order-55")
    other = RunFactory(version=run.version, correlation="crm-7782", idempotency_key="order-56")
    assert _listed(viewer, q=str(run.id)) == [str(run.id)]
    assert _listed(viewer, q=str(run.id).upper(), search_in="id") == [str(run.id)]
    assert _listed(viewer, q="crm-7781") == [str(run.id)]
    assert _listed(viewer, q="order-56") == [str(other.id)]
    # Exact: no prefix or substring matches.
    assert _listed(viewer, q="crm-778") == []
    assert _listed(viewer, q=str(run.id)[:8]) == []
    # Narrowed to where it is told to look.
    assert _listed(viewer, q="crm-7781", search_in="correlation") == [str(run.id)]
    assert _listed(viewer, q="crm-7781", search_in="idempotency_key") == []
    assert _listed(viewer, q="order-55", search_in="idempotency_key") == [str(run.id)]
    assert _listed(viewer, q="order-55", search_in="correlation") == []
    # Search and filters together.
    assert _listed(viewer, q="crm-7781", status="failed") == []


def test_a_stranger_sees_none_of_anothers_runs_not_even_by_searching() -> None:
    ada = _person("ada")
    mine = RunFactory(created_by=ada, correlation="crm-1", idempotency_key="key-1")
    access.grant(access.STARTER, mine.workflow_id, user=ada)
    stranger = _client(_person("mallory"))
    assert _listed(stranger) == []
    assert _listed(stranger, q=str(mine.id)) == []
    assert _listed(stranger, q=str(mine.id), search_in="id") == []
    assert _listed(stranger, q="crm-1") == []
    assert _listed(stranger, q="key-1") == []
    assert _listed(stranger, workflow=mine.workflow_id) == []
    # Answered as for an id nobody has: the search box keeps what was typed, nothing more.
    body = stranger.get(URL, {"q": str(mine.id)}).content.decode()
    assert "No run you may see matches these filters." in body
    assert body.count(str(mine.id)) == 1
    # Nor may they open it in the inspector.
    assert stranger.get(reverse("runs:inspect", args=[mine.id])).status_code == 404
    # Its starter sees it, and nobody else's run of the same workflow.
    theirs = RunFactory(version=mine.version, created_by=_person("bob"))
    assert _listed(_client(ada)) == [str(mine.id)]
    assert _listed(_client(ada), q=str(theirs.id)) == []


def test_a_viewer_of_one_workflow_sees_its_runs_only(two_workflows) -> None:
    support, nightly = two_workflows
    seen = RunFactory(version=nightly)
    unseen = RunFactory(version=support, correlation="secret-deal")
    vera = _person("vera")
    access.grant(access.VIEWER, "nightly", user=vera)
    client = _client(vera)
    assert _listed(client) == [str(seen.id)]
    assert _listed(client, q="secret-deal") == []
    assert _listed(client, q=str(unseen.id)) == []
    # The workflow filter offers only the workflows she may see.
    body = client.get(URL).content.decode()
    assert '<option value="nightly">' in body
    assert f'<option value="{support.workflow_id}">' not in body


def test_pages_follow_the_cursor_and_keep_the_filters(viewer, two_workflows) -> None:
    support, nightly = two_workflows
    now = timezone.now()
    runs = [RunFactory(version=nightly, created_at=now - timedelta(minutes=n)) for n in range(5)]
    RunFactory(version=support)  # filtered out on every page
    seen: list[str] = []
    url = f"{URL}?workflow=nightly&limit=2"
    pages = 0
    while url:
        response = viewer.get(url)
        assert response.status_code == 200
        body = response.content.decode()
        seen += ROW.findall(body)
        pages += 1
        found = re.search(r'href="([^"]+)" rel="next"', body)
        url = found.group(1).replace("&amp;", "&") if found else None
        if url:
            assert url.startswith(f"{URL}?") and "workflow=nightly" in url
    assert pages == 3
    assert seen == [str(run.id) for run in runs]
    # The last page leads back to newer runs.
    previous = re.search(r'href="([^"]+)" rel="prev"', body)
    assert previous is not None
    back = viewer.get(previous.group(1).replace("&amp;", "&")).content.decode()
    assert ROW.findall(back) == [str(runs[2].id), str(runs[3].id)]


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ({"created_after": "yesterday"}, "Created from: Enter a date and time: YYYY-MM-DD or"),
        ({"created_before": "2026-02-30"}, "Created before: Enter a date and time"),
        (
            {"created_after": "2026-12-02", "created_before": "2026-12-01"},
            "Created before: Must be later than “Created from”.",
        ),
        ({"cost_min": "-1"}, "Cost from (USD): Ensure this value is greater than or equal to 0"),
        ({"cost_max": "cheap"}, "Cost to (USD): Enter a number"),
        ({"cost_max": "NaN"}, "Cost to (USD): Enter a number"),
        ({"cost_min": "1e400"}, "Cost from (USD): "),
        ({"cost_min": "3", "cost_max": "1"}, "Cost to (USD): Must not be less than “Cost from”."),
        ({"status": "exploded"}, "Status: Select a valid choice"),
        ({"search_in": "input"}, "Search in: Select a valid choice"),
        ({"q": "0b7c25f2", "search_in": "id"}, "Search: A run id is a whole UUID"),
        ({"q": "x" * 256}, "Search: Ensure this value has at most 255 characters"),
        ({"account": "a" * 151}, "Account: Ensure this value has at most 150 characters"),
        ({"workflow": "w" * 101}, "Workflow: Ensure this value has at most 100 characters"),
        ({"cursor": "not-a-cursor"}, "cursor: is not a cursor this API gave out"),
        ({"limit": "0"}, "limit: must be a whole number from 1 to 500"),
    ],
)
def test_a_bad_filter_value_is_named_on_the_page_with_a_400(viewer, query, named) -> None:
    run = RunFactory()
    response = viewer.get(URL, query)
    assert response.status_code == 400
    body = response.content.decode()
    assert "These filters could not be used" in body
    assert named in body.replace("&#x27;", "'").replace("&quot;", '"'), body
    assert str(run.id) not in body  # nothing listed under filters that were not applied
    # The form keeps what was sent, so it can be corrected.
    assert 'name="created_after"' in body


def test_nul_in_a_filter_is_a_400_naming_it_before_the_page_runs(viewer) -> None:
    """NUL never reaches the form (config.middleware.NulRefusalMiddleware refuses it on every
    route, issue 36): a 400 naming the parameter, and no run listed."""
    run = RunFactory()
    response = viewer.get(URL, {"q": "crm\x00-1"})
    assert response.status_code == 400
    body = response.content.decode()
    assert "'q' may not hold NUL characters" in body
    assert str(run.id) not in body


# A page's queries: the session and the user; the user's global permissions (2); guardian's
# look-ups of the object permissions' content types (4: the workflow names offered, and the
# runs' permission filter); the workflow names; the page of runs; the header's unread count.
PAGE_QUERIES = 11


def test_a_page_is_a_bounded_number_of_queries(
    django_assert_max_num_queries, two_workflows
) -> None:
    """A viewer by object permission (the slowest path through the permission model) reads
    a full page of 50 runs of two workflows, filtered and searched, in as many queries as an
    empty one."""
    support, nightly = two_workflows
    vera = _person("vera")
    access.grant(access.VIEWER, "nightly", user=vera)
    access.grant(access.VIEWER, support.workflow_id, user=vera)
    client = _client(vera)
    with django_assert_max_num_queries(PAGE_QUERIES):
        client.get(URL)
    for n in range(60):
        RunFactory(version=nightly if n % 2 else support, account="sales", correlation=f"c{n}")
    for query in ({}, {"workflow": "nightly", "account": "sales"}, {"q": "c7"}):
        client = _client(vera)
        with django_assert_max_num_queries(PAGE_QUERIES):
            response = client.get(URL, query)
        assert response.status_code == 200
    assert len(_listed(client)) == 50


# --- the indexes that serve the page --------------------------------------------------------


@pytest.fixture
def many_runs() -> None:
    version = definition_save(document={"id": "w", "steps": [{"id": "a", "kind": "task"}]}).version
    # Rows straight into their statuses: a fixture, not the engine's moves (tests/moves.py).
    # One run in 50 has a correlation and an idempotency key; 20 accounts.
    with unchecked(), connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO runs_run (id, workflow_id, version_id, status, input, generation,"
            " attempts, cost_usd, body, account, correlation, idempotency_key, created_at,"
            " updated_at)"
            " SELECT gen_random_uuid(), %s, %s, 'completed', '{}'::jsonb, 1, 0, 0, '',"
            " 'acct' || (n %% 20),"
            " CASE WHEN n %% 50 = 0 THEN 'crm-' || n END,"
            " CASE WHEN n %% 50 = 0 THEN 'key-' || n END,"
            " now() - n * interval '1 second', now()"
            " FROM generate_series(1, 20000) AS n",
            [version.workflow_id, version.id],
        )
        cursor.execute("ANALYZE runs_run")


def _plan(queryset) -> str:
    sql, params = queryset.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {sql}", params)
        return "\n".join(row[0] for row in cursor.fetchall())


@pytest.mark.parametrize(
    ("filters", "indexes"),
    [
        ({"account": "acct7"}, ["run_account_newest"]),
        ({"search": "crm-100", "search_in": "correlation"}, ["run_correlation"]),
        ({"search": "key-100", "search_in": "idempotency_key"}, ["run_idempotency_key"]),
        ({"search": "key-100"}, ["run_correlation", "run_idempotency_key"]),
    ],
)
def test_the_account_filter_and_the_searches_read_an_index(many_runs, filters, indexes) -> None:
    plan = _plan(selectors.run_list(**filters)[:50])
    for index in indexes:
        assert index in plan, plan
    assert "Seq Scan on runs_run " not in plan, plan
