"""Knowledge bases on the embedded default (``manage.py standalone``: SQLite, its file-system
broker, real web, worker and beat processes), searched with FTS5: the examples
(workflows/examples/kb_support.py) write a resolved ticket's answer and answer a new ticket
with it as context, over real HTTP; the local model server (tests/model_server.py) records
the prompt. (Postgres: tests/workers/test_kb_e2e.py.)"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.model_server import ModelServer
from tests.test_standalone import (
    RUN_TERMINAL,
    _api,
    _embedded_env,
    _free_port,
    _standalone,
    _start_run,
    _token,
    _wait_for_http,
    _wait_for_run,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")]

FIRST = "Clear the export cache, then export again."
SECOND = "Update to version 2.1: it no longer crashes on large exports."


def _remember(base: str, key: str, answer: str, log: Path) -> dict[str, Any]:
    body = {"ticket_id": "T-1", "ticket": "Export crashes", "answer": answer}
    status, run = _start_run(base, key, body, "kb_remember_answer")
    assert status == 201, run
    run = _wait_for_run(base, key, run, RUN_TERMINAL, log)
    assert run["status"] == "completed", (run, log.read_text())
    return run


def _answer(base: str, key: str, ticket: str, log: Path, workflow: str = "kb_answer_ticket") -> Any:
    status, run = _start_run(base, key, {"ticket": ticket}, workflow)
    assert status == 201, run
    run = _wait_for_run(base, key, run, RUN_TERMINAL, log)
    assert run["status"] == "completed", (run, log.read_text())
    return run


def test_the_knowledge_base_examples_on_sqlite_with_fts5(tmp_path: Path) -> None:
    env = _embedded_env(tmp_path / "var")
    env.update(DJANGO_SUPERUSER_USERNAME="admin", DJANGO_SUPERUSER_PASSWORD="a-long-password-1")
    env.setdefault("DJANGO_SUPERUSER_EMAIL", "admin@example.com")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with ModelServer() as model_server:
        env.update(model_server.openai_env(), DJFLOW_DEFAULT_MODEL="openai:gpt-4o-mini")
        args = (f"--addr=127.0.0.1:{port}", "--create-superuser")
        with _standalone(tmp_path, *args, env=env) as (proc, log):
            _wait_for_http(f"{base}/admin/login/", proc, log, timeout=45)
            assert "workflows.examples.kb_support" in log.read_text()
            key = _token(env)

            # The deployment's sync reserved the knowledge base its write_kb step names (issue
            # 36: nobody may take the name first): before any write it exists, empty, so a
            # start is accepted and its recipe's prompt holds no passage.
            before = len(model_server.requests)
            _answer(base, key, "x", log)
            [sent] = model_server.requests[before:]
            assert FIRST not in sent.last_user_message()

            # 1. The write: version 1, in SQLite, found by FTS5.
            run = _remember(base, key, FIRST, log)
            assert run["output"] == {"kb": "support-answers", "key": "T-1", "version": 1}
            status, found = _api(
                "GET", f"{base}/api/v1/kbs/support-answers/documents?q=export%20cache", key
            )
            assert status == 200, found
            [hit] = found["results"]
            assert (hit["key"], hit["version"], hit["content"]) == ("T-1", 1, FIRST)
            assert hit["score"] > 0
            # FTS5 syntax typed into q is words, not a 500.
            for q in ("%22", "NEAR(a", "col%3Ax", "*", "a%20OR%20(b"):
                status, _ = _api("GET", f"{base}/api/v1/kbs/support-answers/documents?q={q}", key)
                assert status == 200, q

            # 2. The recipe's prompt, as the model server got it, holds the passage.
            before = len(model_server.requests)
            run = _answer(base, key, "The export crashes again", log)
            [sent] = model_server.requests[before:]
            assert f"[Export crashes] {FIRST}" in sent.last_user_message()
            [call] = run["steps"][0]["model_calls"]
            assert call["retrieved"]["kb"] == "support-answers"
            assert [(h["key"], h["version"]) for h in call["retrieved"]["hits"]] == [("T-1", 1)]

            # 3. A second write makes version 2; the search finds the new text, not the old.
            run = _remember(base, key, SECOND, log)
            assert run["output"]["version"] == 2
            url = f"{base}/api/v1/kbs/support-answers/documents"
            status, new = _api("GET", f"{url}?q=large%20exports", key)
            assert [(d["key"], d["version"]) for d in new["results"]] == [("T-1", 2)]
            status, old = _api("GET", f"{url}?q=cache", key)
            assert (status, old["results"]) == (200, [])
            status, versions = _api("GET", f"{url}?key=T-1", key)
            assert [(d["version"], d["current"]) for d in versions["results"]] == [
                (2, True),
                (1, False),
            ]
            before = len(model_server.requests)
            _answer(base, key, "The export crashes again", log)
            [sent] = model_server.requests[before:]
            assert SECOND in sent.last_user_message() and FIRST not in sent.last_user_message()

            # 4. The offline stand-in echoes the start of its prompt: the passage.
            standin = {
                "id": "kb_standin",
                "limits": {"run_timeout_ms": 120_000},
                "steps": [
                    {
                        "id": "answer",
                        "kind": "recipe",
                        "model": "standin:echo",
                        "prompt": "${context}\n\nTicket: ${input.ticket}",
                        "context": {"kb": "support-answers"},
                    }
                ],
            }
            status, saved = _api("POST", f"{base}/api/v1/definitions", key, standin)
            assert status == 201, saved
            run = _answer(base, key, "exports crash", log, "kb_standin")
            assert "[Export crashes] Update to version 2.1" in run["steps"][0]["output"]

            proc.terminate()
            proc.wait(timeout=30)
    # The documents live in SQLite, with the FTS5 table migration 0005 made for them.
    with sqlite3.connect(tmp_path / "var" / "db.sqlite3") as db:
        [(sql,)] = db.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'workflows_knowledgedocument_fts'"
        ).fetchall()
        assert "fts5" in sql.lower()
        rows = db.execute(
            "SELECT rowid FROM workflows_knowledgedocument_fts WHERE "
            "workflows_knowledgedocument_fts MATCH '\"large\"'"
        ).fetchall()
        assert len(rows) == 1
