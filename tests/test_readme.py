"""The shell and Python blocks of the README and of the docs (docs/**/*.md), pasted as written,
on a fresh clone and a fresh database.

A page marks each ``sh`` block it promises works here with an HTML comment on the line
before it: ``<!-- readme-test: background -->`` for a command that keeps running (the first
one, which installs and starts the engine; the test waits for it to say it is up; a page
that repeats it repeats it exactly), and ``<!-- readme-test: run -->`` for a block pasted
into a second terminal afterwards (the blocks marked ``run`` run in order, the README's
first, then the docs' in the order of the site's navigation, in one shell, so a variable one
block sets is there for the next). An unmarked block must be one of :data:`NOT_RUN_HERE`,
each with its reason, so a new block forces a decision. Every ``python`` block runs on its
own, in a fresh interpreter with Django set up (:func:`test_every_python_block_runs`),
unless it too is one of :data:`NOT_RUN_HERE`.

The clone is the tracked files of this checkout copied to a temporary folder; it gets a new
``.venv`` exactly as the README says (about 15 s with pip's cache warm). The port is changed
through ``DJFLOW_ADDR``, which the README's commands honour.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

BASE_DIR = Path(__file__).resolve().parent.parent
README = BASE_DIR / "README.md"
DOCS = BASE_DIR / "docs"
BLOCK = re.compile(
    r"(?:<!-- readme-test: (?P<mark>\w+) -->\n)?^```(?P<lang>sh|python)\n(?P<body>.*?)^```",
    re.S | re.M,
)
# Blocks that cannot run on this machine, by their first line, and why.
NOT_RUN_HERE = {
    # The test command itself: this test is part of it.
    "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/pytest",
    # Production hosts (db.example.com, redis.example.com) that do not exist here.
    "export DATABASE_URL=postgres://djflow:secret@db.example.com:5432/djflow",
    # No Docker engine runs on this machine (its client does, but not `docker compose up`);
    # the block starts by writing the secrets docker-compose.yml requires to .env.
    "python3 -c 'import secrets; t = secrets.token_urlsafe; print(f\"SECRET_KEY={t(50)}\\n"
    "REDIS_PASSWORD={t(24)}\\nFLOWER_USER=admin\\nFLOWER_PASSWORD={t(24)}\")' > .env",
    # The same, for docker-compose.yml's observability profile.
    "python3 -c 'import secrets; t = secrets.token_urlsafe; print(f\""
    "DJFLOW_METRICS_TOKEN={t(32)}\\nGRAFANA_ADMIN_PASSWORD={t(24)}\")' >> .env",
    # The tutorial's restart of the first terminal with a module of the reader's own, which
    # this clone does not have.
    "WORKFLOW_MODULES=myflows.expense .venv/bin/python manage.py standalone",
    # Serving the docs keeps running; tests/test_docs.py builds the site itself.
    ".venv/bin/pip install -e '.[docs]' && .venv/bin/mkdocs serve",
    # docs/scale.md: benchmarks of many minutes on PostgreSQL and Redis (bench/README.md).
    ".venv/bin/python -m bench.run_all --json sitting.json   # the figures below, issue 17's table",
    # docs/CONTRACT.md, a verbatim copy of the contract: its example is
    # workflows/examples/support_ticket.py, which the tests run.
    "from workflows.sdk import workflow, when, RetryPolicy, StepFailure",
}
# A reader's shell has none of these; nor a SECRET_KEY, which the embedded default makes
# itself (config/secret_key.py), once for the standalone and the children it starts.
SERVICE_VARS = ("DATABASE_URL", "SENTRY_DSN", "WORKFLOW_MODULES", "DJFLOW_VAR_DIR", "SECRET_KEY")

pytestmark = pytest.mark.slow


def pages() -> list[Path]:
    """The README, then every page of the docs: those in the site's navigation in its
    order, then any other."""
    nav = re.findall(
        r"^\s*-\s*(?:[^\n]*:\s*)?(\S+\.md)\s*$", (BASE_DIR / "mkdocs.yml").read_text(), re.M
    )
    listed = [DOCS / name for name in nav]
    others = sorted(set(DOCS.rglob("*.md")) - set(listed))
    return [README, *listed, *others]


def blocks(lang: str = "sh") -> list[tuple[Path, str | None, str]]:
    """Every ``lang`` block of :func:`pages`, in order: (page, mark, body)."""
    return [
        (page, m["mark"], m["body"])
        for page in pages()
        for m in BLOCK.finditer(page.read_text())
        if m["lang"] == lang
    ]


def readme_blocks() -> list[tuple[str | None, str]]:
    return [(mark, body) for page, mark, body in blocks() if page == README]


def _first_line(body: str) -> str:
    return body.splitlines()[0].rstrip(" \\")


def test_every_block_is_run_or_says_why_not() -> None:
    readme = readme_blocks()
    assert readme[0][0] == "background", "the README starts with the command that runs it"
    unmarked = {_first_line(body) for _, mark, body in blocks() if mark is None}
    assert unmarked <= {line.rstrip(" \\") for line in NOT_RUN_HERE}, unmarked
    assert {mark for _, mark, _ in blocks()} <= {"background", "run", None}
    assert {mark for _, mark, _ in blocks("python")} == {None}
    # A page that shows the first command shows the README's, exactly.
    assert {body for _, mark, body in blocks() if mark == "background"} == {readme[0][1]}
    assert len(pages()) > 20, "the docs' pages are found"


@pytest.mark.parametrize(
    "page, body",
    [
        pytest.param(page, body, id=f"{page.relative_to(BASE_DIR)}-{i}")
        for i, (page, _, body) in enumerate(blocks("python"))
        if _first_line(body) not in NOT_RUN_HERE
    ],
)
def test_every_python_block_runs(page: Path, body: str) -> None:
    """Each Python block, pasted into a fresh interpreter with Django set up (as a module of
    the reader's project would be): it runs to its end, its own asserts included."""
    done = subprocess.run(
        [sys.executable, "-c", "import django\ndjango.setup()\n" + body],
        cwd=BASE_DIR,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{page}:\n{body}\n{done.stdout}{done.stderr}"


def _fresh_clone(target: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=BASE_DIR, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = BASE_DIR / name.decode()
        if source.is_file():
            (target / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            (target / name.decode()).write_bytes(source.read_bytes())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_line(log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = log.read_text(errors="replace")
        if text in content:
            return content
        if proc.poll() is not None:
            pytest.fail(f"the first command exited with {proc.returncode}:\n{content}")
        time.sleep(0.5)
    pytest.fail(f"no {text!r} within {timeout}s:\n{log.read_text(errors='replace')}")


def test_the_readme_works_pasted_as_written(tmp_path: Path) -> None:
    clone = tmp_path / "djflow"
    clone.mkdir()
    _fresh_clone(clone)
    port = _free_port()
    # A user's shell: none of the services pytest-env points the tests at (the README's
    # first hour is the embedded default), and the port moved by the README's own variable.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in SERVICE_VARS and not k.startswith("CELERY_") and k != "VIRTUAL_ENV"
    }
    env.update(DJFLOW_ADDR=f"127.0.0.1:{port}", PYTHONUNBUFFERED="1")
    # The example MCP server is a stdio child each process starts on first use; on this
    # 2-core machine under other test suites its start has outlasted the pre-flight's 3 s
    # (a 400 "unreachable" for ticket_tools). The longest wait the setting allows.
    env["DJFLOW_MCP_PREFLIGHT_TIMEOUT_SECONDS"] = "10"
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(BASE_DIR))
    )
    [first] = [body for mark, body in readme_blocks() if mark == "background"]
    pasted = "\n".join(body for _, mark, body in blocks() if mark == "run")

    log = tmp_path / "first-terminal.log"
    with log.open("wb") as out:
        first_terminal = subprocess.Popen(
            ["bash", "-c", first],
            cwd=clone,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for_line(log, "djflow is up", first_terminal, timeout=240)
        # The first start made a superuser and printed its password once: it signs in.
        started = _wait_for_line(log, "The password is shown this once", first_terminal, 10)
        password = re.search(r"^\s+password\s+(\S+)$", started, re.M)
        assert password, started
        session = _signed_in(f"http://127.0.0.1:{port}", "admin", password.group(1))
        assert session, "the printed password does not sign in"

        second_terminal = subprocess.run(
            ["bash", "-e", "-c", pasted],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            # The pages' blocks in one shell: the replay guide's run_replay commands are
            # processes of about 3 s each.
            timeout=240,
        )
        assert second_terminal.returncode == 0, second_terminal.stdout + second_terminal.stderr
        run_id = _started_run(second_terminal.stdout)
        # The README's hello: saved, then refused at start, naming the handler no worker has.
        assert '"created":true' in second_terminal.stdout.replace(" ", "")
        assert "steps[0].handler" in second_terminal.stdout
        assert "hello.greet" in second_terminal.stdout
        token = subprocess.run(
            [".venv/bin/python", "manage.py", "drf_create_token", "admin"],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()[2]
        run = _wait_for_run(f"http://127.0.0.1:{port}/api/v1/runs/{run_id}", token)
        assert run["status"] == "completed", run
        assert run["output"] == {"sent": True}
        # The tutorial's expense: saved, started, approved through the API, completed.
        expense_id = _started_run(second_terminal.stdout, "expense")
        expense = _wait_for_run(f"http://127.0.0.1:{port}/api/v1/runs/{expense_id}", token)
        assert expense["status"] == "completed", expense
        assert expense["output"] == {"approved_by": "admin"}
        # The MCP example: the bundled server, which standalone configured, answered.
        tools_id = _started_run(second_terminal.stdout, "ticket_tools")
        tools = _wait_for_run(f"http://127.0.0.1:{port}/api/v1/runs/{tools_id}", token)
        assert tools["status"] == "completed", tools
        assert tools["output"]["slug"] == "the-export-crashes-on-big-files-can-you"
        assert tools["output"]["stats"]["urgent"] is True
        # The knowledge-base examples: the answer's prompt held the passage the first wrote.
        answer_id = _started_run(second_terminal.stdout, "kb_answer_ticket")
        answer = _wait_for_run(f"http://127.0.0.1:{port}/api/v1/runs/{answer_id}", token)
        assert answer["status"] == "completed", answer
        [call] = [c for step in answer["steps"] for c in step["model_calls"]]
        assert [(h["key"], h["version"]) for h in call["retrieved"]["hits"]] == [("T-1", 1)]
        assert "Clear the export cache" in json.dumps(answer["output"])
        # The replay guide: the export replayed the same; the edited prompt is a call with no
        # recording, named with its difference; the fork's dry run reuses classify.
        said = second_terminal.stdout
        assert "(ticket_triage): completed before, completed now" in said, said
        assert "output: the same" in said
        assert "no recording: step ticket_triage.classify, model call to standin:echo" in said
        assert "Tell me whether this ticket is" in said
        assert "exit 2" in said
        assert '"reused":["classify"]' in said.replace(" ", "")
        fork_page = re.search(r"/runs/[0-9a-f-]{36}/compare/([0-9a-f-]{36})/", said)
        assert fork_page, said
        fork = _wait_for_run(f"http://127.0.0.1:{port}/api/v1/runs/{fork_page[1]}", token)
        assert fork["status"] == "completed" and fork["forked_from"]["step"] == "route", fork
    finally:
        os.killpg(first_terminal.pid, signal.SIGINT)
        try:
            first_terminal.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(first_terminal.pid, signal.SIGKILL)
            first_terminal.wait()
    assert first_terminal.returncode in (0, -signal.SIGINT), log.read_text()


def _signed_in(base: str, username: str, password: str) -> bool:
    """Sign in through the login form, as a person would."""
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
    form = opener.open(f"{base}/accounts/login/").read().decode()
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form)
    assert csrf, form
    body = urllib.parse.urlencode(
        {"username": username, "password": password, "csrfmiddlewaretoken": csrf.group(1)}
    ).encode()
    request = urllib.request.Request(
        f"{base}/accounts/login/", data=body, headers={"Referer": f"{base}/accounts/login/"}
    )
    with opener.open(request) as response:
        return response.url.rstrip("/") == base and "Log out" in response.read().decode()


def _started_run(output: str, workflow: str = "support_ticket") -> str:
    """The id of the ``workflow`` run the pasted blocks started: the first JSON object
    printed that is a run of it (curl prints bodies with no newline after them)."""
    decoder, position = json.JSONDecoder(), 0
    while (start := output.find("{", position)) != -1:
        try:
            body, position = decoder.raw_decode(output, start)
        except ValueError:
            position = start + 1
            continue
        if isinstance(body, dict) and body.get("workflow") == workflow and "id" in body:
            return body["id"]
    raise AssertionError(f"no run in the output:\n{output}")


def _wait_for_run(url: str, token: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"Authorization": f"Token {token}"})
    while True:
        with urllib.request.urlopen(request) as response:
            run = json.loads(response.read())
        if run["status"] in ("completed", "failed", "cancelled", "timed_out"):
            return run
        if time.monotonic() > deadline:
            return run
        time.sleep(0.5)
