"""A production install starts: ``pip install .`` (no extras) in a fresh venv runs a worker on
Redis and Postgres, gunicorn serves the API and static files, and ``check --deploy`` is clean.

The test extras bring packages the base install lacked (``packaging``, which kombu's Redis
transport imports), so only a venv without them shows a missing runtime dependency.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import image_files
from tests.processes import database_url, own_redis_url, wait_for
from tests.test_settings import CONFIG_VARS

BASE_DIR = Path(__file__).resolve().parent.parent
# Variables of this process the installed venv's processes must not see: the services, the
# test key and the checkout on the path.
_DROPPED = (*CONFIG_VARS, "SECRET_KEY", "PYTHONPATH", "DJANGO_SETTINGS_MODULE", "VIRTUAL_ENV")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED and not k.startswith("DJFLOW")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def test_settings_refuse_an_insecure_secret_key_outside_the_embedded_default(
    tmp_path: Path,
) -> None:
    setup = [sys.executable, "-c", "import django; django.setup()"]
    base = _clean_env(DJANGO_SETTINGS_MODULE="config.settings", DJFLOW_VAR_DIR=str(tmp_path))
    postgres = "postgres://flows:secret@db.example:5432/flows"
    for key in (
        None,
        "django-insecure-embedded-default-change-me",
        "short",
        "a" * 60,
        "django-insecure-" + secrets.token_urlsafe(50),
    ):
        env = {**base, "DATABASE_URL": postgres, **({"SECRET_KEY": key} if key else {})}
        done = subprocess.run(setup, cwd=BASE_DIR, env=env, capture_output=True, text=True)
        assert done.returncode != 0, key
        assert "ImproperlyConfigured" in done.stderr, done.stderr
        assert "secrets.token_urlsafe(50)" in done.stderr
    # A Redis broker alone leaves the embedded default too.
    env = {**base, "CELERY_BROKER_URL": "redis://127.0.0.1:6379/0"}
    done = subprocess.run(setup, cwd=BASE_DIR, env=env, capture_output=True, text=True)
    assert "ImproperlyConfigured" in done.stderr

    # Nothing set: the embedded default runs on a key of its own, made in its var folder
    # (tests/test_secret_key.py).
    done = subprocess.run(setup, cwd=BASE_DIR, env=base, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "secret_key").is_file()
    # A real key on Postgres is accepted.
    env = {**base, "DATABASE_URL": postgres, "SECRET_KEY": secrets.token_urlsafe(50)}
    done = subprocess.run(setup, cwd=BASE_DIR, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# --- The installed package -----------------------------------------------------------------


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a fresh venv with the project installed as the image installs it: not
    editable, no extras, from the files the image holds (tests/image_files.py), so that a
    file .dockerignore left out that the install needs fails here.

    CI has made one already (.ci/run exports DJFLOW_PLAIN_VENV, where .ci/plain_install_worker
    installed the same file set before the tests): that one, rather than another minute or
    two of pip on the same install.
    """
    made = os.environ.get("DJFLOW_PLAIN_VENV")
    if made:
        python = Path(made) / "bin" / "python"
        assert python.is_file(), f"DJFLOW_PLAIN_VENV={made} holds no venv"
        return python
    root = tmp_path_factory.mktemp("prod-venv")
    venv.create(root / "venv", with_pip=True)
    python = root / "venv" / "bin" / "python"
    image = image_files.build(root / "image")
    started = time.monotonic()
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", str(image)],
        cwd=root,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"pip install . took {time.monotonic() - started:.1f}s")
    return python


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except OSError:
        return 0, b""


@pytest.fixture
def production_env(transactional_db: None, tmp_path: Path) -> dict[str, str]:
    from django.db import connection

    return _clean_env(
        DJANGO_SETTINGS_MODULE="config.settings",
        DATABASE_URL=database_url(connection.settings_dict),
        # The suite's Redis, as configured (no worker of another test runs meanwhile).
        CELERY_BROKER_URL=own_redis_url(),
        CELERY_RESULT_BACKEND=own_redis_url(1),
        SECRET_KEY=secrets.token_urlsafe(50),
        SITE_URL="https://flows.example.com",
        ALLOWED_HOSTS="flows.example.com,127.0.0.1",
        DEBUG="false",
        DJFLOW_PROXY_SSL_HEADER="HTTP_X_FORWARDED_PROTO",
        DJFLOW_VAR_DIR=str(tmp_path / "var"),
    )


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    """Start a process in a session of its own, in a directory that is not the checkout."""
    started: list[subprocess.Popen[bytes]] = []
    workdir = tmp_path / "cwd"
    workdir.mkdir()

    def start(argv: list[str], env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            argv,
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in started:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _run(python: Path, env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_a_plain_install_runs_worker_and_gunicorn_with_a_clean_deploy_check(
    installed: Path, production_env: dict[str, str], spawn, tmp_path: Path
) -> None:
    cwd = tmp_path / "cwd"
    env = production_env

    # The installed package, not the checkout, answers.
    where = _run(installed, env, cwd, "-c", "import config; print(config.__file__)")
    assert where.returncode == 0, where.stderr
    assert not Path(where.stdout.strip()).is_relative_to(BASE_DIR)

    # mcp_tool steps: the SDK and the example server are in the plain install, and a call
    # over stdio goes through the worker's pool.
    servers = json.dumps(
        {"tickets": {"command": [str(installed), "-m", "workflows.examples.mcp_server"]}}
    )
    probe = (
        "import django; django.setup(); from workers.mcp.pool import pool; "
        "print(pool().call_tool('tickets', 'slugify', {'text': 'Plain install!'}, 30).texts)"
    )
    mcp = _run(installed, {**env, "DJFLOW_MCP_SERVERS": servers}, cwd, "-c", probe)
    assert mcp.returncode == 0, mcp.stderr
    assert mcp.stdout.strip().splitlines()[-1] == "['plain-install']"

    # Traces: the SDK, the OTLP exporter and the instrumentations are in the plain install
    # (set up for a web process, with an endpoint; nothing is sent until a span ends).
    probe = (
        "import django; django.setup(); from config import tracing; "
        "print(tracing.setup('web', django=True))"
    )
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    traces = _run(installed, {**env, **endpoint}, cwd, "-c", probe)
    assert traces.returncode == 0, traces.stderr
    assert traces.stdout.strip().splitlines()[-1] == "True", traces.stderr

    check = _run(installed, env, cwd, "-m", "django", "check", "--deploy")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "System check identified no issues" in check.stdout + check.stderr, check.stderr
    assert "WARNINGS" not in check.stdout + check.stderr

    worker = spawn(
        [
            str(installed),
            "-m",
            "celery",
            "-A",
            "config",
            "worker",
            "-l",
            "info",
            "-c",
            "1",
            "-n",
            f"prod-{os.getpid()}@%h",
        ],
        env,
        "worker",
    )
    ping = [
        str(installed),
        "-m",
        "celery",
        "-A",
        "config",
        "inspect",
        "ping",
        "-d",
        f"prod-{os.getpid()}@{socket.gethostname()}",
        "--timeout",
        "2",
    ]

    def answers() -> bool:
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()
        done = subprocess.run(ping, cwd=cwd, env=env, capture_output=True, text=True)
        return done.returncode == 0 and "pong" in done.stdout

    wait_for(answers, timeout=90, interval=1, message=lambda: (tmp_path / "worker.log").read_text())

    collect = _run(installed, env, cwd, "-m", "django", "collectstatic", "--noinput")
    assert collect.returncode == 0, collect.stderr
    port = _free_port()
    gunicorn = installed.parent / "gunicorn"
    web = spawn(
        [str(gunicorn), "config.wsgi:application", "--bind", f"127.0.0.1:{port}", "--workers", "1"],
        # Plain HTTP on loopback: the proxy that ends TLS is not here.
        {**env, "DJFLOW_SSL_REDIRECT": "false"},
        "gunicorn",
    )
    base = f"http://127.0.0.1:{port}"

    def schema() -> tuple[int, bytes] | None:
        assert web.poll() is None, (tmp_path / "gunicorn.log").read_text()
        status, body = _get(f"{base}/api/v1/definition.schema.json")
        return (status, body) if status else None

    status, body = wait_for(schema, timeout=60, interval=0.5)
    assert status == 200, body[:500]
    status, css = _get(f"{base}/static/admin/css/base.css")
    assert status == 200
    assert b"body" in css
    # The project's own pages and e-mails: their templates ship in the package.
    status, page = _get(f"{base}/accounts/login/")
    assert status == 200, page[:500]
    assert b'name="password"' in page


# --- The templates ---------------------------------------------------------------------------

# Run by the installed python: every file of the templates folder the settings use, looked up
# by its name through the template engine and rendered with a small context: what the pages'
# URLs need (a run's id, the admin's model and its change-form flags), nothing else. Prints the
# folder, where each template was found and what failed.
_RENDER_EVERY_TEMPLATE = """
import json, uuid
from pathlib import Path
import django
django.setup()
from django.apps import apps
from django.conf import settings
from django.template.loader import get_template
import config

folder = Path(settings.TEMPLATES[0]["DIRS"][0])
run = {"id": uuid.uuid4()}
flags = ("has_add_permission", "has_change_permission", "has_delete_permission",
         "has_view_permission", "change")
context = {"run": run, "page": {"run": run}, "cmp": {"a": run, "b": run}, "add": False,
           "is_popup": False,
           "save_as": False, "has_editable_inline_admin_formsets": False,
           **dict.fromkeys(flags, True)}
found, failed = {}, {}
for path in sorted(p for p in folder.rglob("*") if p.is_file()):
    name = path.relative_to(folder).as_posix()
    parts = name.split("/")
    opts = {}
    if parts[0] == "admin":
        try:
            opts["opts"] = apps.get_model(parts[1], parts[2])._meta
        except (LookupError, IndexError):
            opts["opts"] = apps.get_model("workflows", "workflow")._meta
    try:
        template = get_template(name)
        text = template.render({**context, **opts})
    except Exception as error:
        failed[name] = f"{type(error).__name__}: {error}"
    else:
        found[name] = {"origin": template.origin.name, "has_run_id": str(run["id"]) in text}
print(json.dumps({"config": config.__file__, "folder": str(folder), "found": found,
                  "failed": failed}))
"""


def _checkout_templates() -> set[str]:
    folder = BASE_DIR / "templates"
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_every_template_is_under_the_top_level_templates_folder() -> None:
    """CONTRACT section 14: no package of the project keeps templates of its own, and a source
    tree's config/ has no templates/, which the settings would take for a wheel's copy."""
    packages = ("config", "workflows", "runs", "approvals", "workers", "schedules")
    elsewhere = [
        str(folder.relative_to(BASE_DIR))
        for package in packages
        for folder in (BASE_DIR / package).rglob("templates")
        if folder.is_dir()
    ]
    assert elsewhere == []
    assert {"base.html", "runs/inspect.html", "emails/request.txt"} <= _checkout_templates()

    from django.conf import settings

    assert settings.TEMPLATES[0]["DIRS"] == [BASE_DIR / "templates"]


@pytest.mark.parametrize("source_tree", [True, False])
def test_the_templates_folder_follows_the_tree_the_settings_came_from(
    tmp_path: Path, source_tree: bool
) -> None:
    """A source tree (manage.py beside config/) reads its top-level templates/, even with a
    stray config/templates/ an older version left untracked; an install (no manage.py) reads
    the wheel's config/templates/, never a templates/ beside it in site-packages."""
    tree = tmp_path / "tree"
    shutil.copytree(
        BASE_DIR / "config", tree / "config", ignore=shutil.ignore_patterns("__pycache__")
    )
    (tree / "config" / "templates").mkdir()
    (tree / "templates").mkdir()
    if source_tree:
        shutil.copy(BASE_DIR / "manage.py", tree / "manage.py")
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL")},
        "PYTHONPATH": str(tree),
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "DJFLOW_VAR_DIR": str(tmp_path / "var"),
    }
    read = subprocess.run(
        [sys.executable, "-c", "from django.conf import settings; print(settings.TEMPLATES_DIR)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    expected = tree / "templates" if source_tree else tree / "config" / "templates"
    assert Path(read.stdout.strip()) == expected


@pytest.mark.slow
def test_a_plain_install_renders_every_template_of_the_checkout(
    installed: Path, tmp_path: Path
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    # The embedded default (nothing set): rendering needs no database or broker.
    env = _clean_env(DJANGO_SETTINGS_MODULE="config.settings", DJFLOW_VAR_DIR=str(tmp_path))
    done = _run(installed, env, cwd, "-c", _RENDER_EVERY_TEMPLATE)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])

    config = Path(answer["config"]).parent
    folder = Path(answer["folder"])
    assert not config.is_relative_to(BASE_DIR), answer["config"]
    # The wheel's own copy, beside the installed settings (setup.py maps it there).
    assert folder == config / "templates"
    assert answer["failed"] == {}
    assert set(answer["found"]) == _checkout_templates()
    for name, found in answer["found"].items():
        assert Path(found["origin"]) == folder / name
    assert answer["found"]["runs/inspect.html"]["has_run_id"]
