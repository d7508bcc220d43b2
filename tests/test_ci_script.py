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
