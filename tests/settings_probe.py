"""Load the settings afresh in a subprocess with a given environment: how the tests of what
the settings read (and refuse) see them as a new process would, without this process's
settings, which pytest-django has already configured."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
# What the probe runs when the caller has nothing to print: only that the settings load.
SETUP = "import django; django.setup()"


def probe_settings(
    var_dir: Path, code: str = SETUP, *, unset: Iterable[str] = (), **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new Python process whose settings are ``config.settings`` with this
    process's environment, less the variables ``unset``, plus ``env``, and
    ``DJFLOW_VAR_DIR`` at ``var_dir`` (never the checkout's own var/)."""
    dropped = set(unset)
    environ = {k: v for k, v in os.environ.items() if k not in dropped}
    environ.update(DJANGO_SETTINGS_MODULE="config.settings", DJFLOW_VAR_DIR=str(var_dir), **env)
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=BASE_DIR,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )


def last_line(done: subprocess.CompletedProcess[str]) -> str:
    """What a probe printed last, once it is known to have loaded the settings."""
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]
