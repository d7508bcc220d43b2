"""`.ci/run` and the README agree: CI installs and tests exactly as a reader is told to."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
CI_RUN = BASE_DIR / ".ci" / "run"


def readme_commands() -> list[str]:
    """The fenced code blocks in README.md's first 40 lines."""
    head = "\n".join((BASE_DIR / "README.md").read_text().splitlines()[:40])
    return [block.strip() for block in re.findall(r"```\w*\n(.*?)```", head, flags=re.S)]


def test_readme_opens_with_the_run_and_the_test_command() -> None:
    run, test = readme_commands()[:2]
    assert run == (
        "python3 -m venv .venv && .venv/bin/pip install -e . "
        "&& .venv/bin/python manage.py standalone"
    )
    assert test == (
        "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/pytest"
    )


def test_ci_installs_and_tests_with_the_readme_command() -> None:
    script = CI_RUN.read_text()
    install, _, pytest_cmd = readme_commands()[1].rpartition(" && ")
    assert install in script.splitlines()
    assert re.search(rf"^{re.escape(pytest_cmd)}\b", script, flags=re.M)


def test_ci_script_is_strict_executable_bash() -> None:
    assert os.access(CI_RUN, os.X_OK)
    assert "set -euo pipefail" in CI_RUN.read_text()
    subprocess.run(["bash", "-n", str(CI_RUN)], check=True)


PLAIN_INSTALL = BASE_DIR / ".ci" / "plain_install_worker"


def _stage_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("stage ")]


def test_ci_starts_a_worker_from_a_plain_install_after_the_readme_install() -> None:
    """A missing runtime dependency cannot hide behind the test extras: after the README's
    install, CI makes a fresh venv with `pip install .` alone and pings a worker of it."""
    script = CI_RUN.read_text()
    lines = script.splitlines()
    install = readme_commands()[1].rpartition(" && ")[0]
    plain = lines.index("bash .ci/plain_install_worker")
    assert lines.index(install) < plain < lines.index(".venv/bin/pytest || rc=$?")
    assert os.access(PLAIN_INSTALL, os.X_OK)
    subprocess.run(["bash", "-n", str(PLAIN_INSTALL)], check=True)
    body = PLAIN_INSTALL.read_text()
    assert "set -euo pipefail" in body
    assert 'python3 -m venv "$venv_dir"' in body
    assert "venv_dir=${DJFLOW_PLAIN_VENV:-$work/venv}" in body
    # Kept for the README's test command, which uses it (tests/test_production_install.py).
    assert lines.index("export DJFLOW_PLAIN_VENV") < plain
    # The files the application image holds (tests/image_files.py), as the image installs
    # them: no extras, no editable install.
    assert re.search(r'-m tests\.image_files "\$work/image"$', body, re.M)
    assert re.search(r'pip" install -q --disable-pip-version-check "\$work/image"$', body, re.M)
    assert "[test]" not in body and " -e " not in body
    assert "--no-cache-dir" not in body  # pip's cache keeps the stage quick
    assert "celery -A config worker" in body
    assert "celery -A config inspect ping" in body
    assert 'ping_a_worker redis "${DJFLOW_PLAIN_BROKER:-redis://' in body
    # And on RabbitMQ with results in Postgres: no Redis at all.
    assert 'ping_a_worker rabbitmq "${DJFLOW_PLAIN_AMQP:-amqp://' in body
    assert '"db+postgresql+psycopg://' in body


def test_ci_runs_the_worker_end_to_end_tests_again_on_rabbitmq() -> None:
    script = CI_RUN.read_text()
    stages = _stage_lines(script)
    rabbit = next(i for i, s in enumerate(stages) if "RabbitMQ on 127.0.0.1:5672" in s)
    main = next(i for i, s in enumerate(stages) if "the README's test command" in s)
    again = next(i for i, s in enumerate(stages) if "again, on RabbitMQ" in s)
    assert rabbit < main < again
    assert "rabbitmq-server -detached" in script
    assert "wait_for RabbitMQ" in script
    assert re.search(
        r"CELERY_BROKER_URL=amqp://guest:guest@127\.0\.0\.1:5672/djflow_ci \\\n"
        r'\s+\.venv/bin/pytest -n 0 -m "worker_e2e and not soak"',
        script,
    )
    # Either run failing fails CI.
    assert 'exit "$amqp_rc"' in script and 'exit "$rc"' in script


def test_the_docs_say_rabbitmq_is_a_broker() -> None:
    deploy = (BASE_DIR / "docs" / "how-to" / "deploy.md").read_text()
    assert "## Running on RabbitMQ" in deploy
    assert "CELERY_BROKER_URL=amqp://" in deploy


def test_ci_checks_the_layers_and_the_types_with_the_lint_before_any_test() -> None:
    """The layering contracts (``[tool.importlinter]``) and mypy (``[tool.mypy]``, whose
    ``files`` say what it checks) fail CI in seconds, before the long test run; the docs
    say so where they say what CI runs (docs/how-to/develop.md)."""
    lines = CI_RUN.read_text().splitlines()
    ruff = lines.index(".venv/bin/ruff check .")
    tests = lines.index(".venv/bin/pytest || rc=$?")
    assert ruff < lines.index(".venv/bin/lint-imports") < tests
    assert ruff < lines.index(".venv/bin/mypy") < tests
    develop = " ".join((BASE_DIR / "docs" / "how-to" / "develop.md").read_text().split())
    assert "runs ruff, `lint-imports` (the layering contracts of `pyproject.toml`), mypy" in develop
