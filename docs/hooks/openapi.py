"""The REST API's OpenAPI document, generated when the site is built (an MkDocs hook).

``manage.py spectacular`` writes the schema the running API serves at ``/api/v1/schema/``;
the hook adds it to the site as ``reference/openapi.json``, which ``reference/api.md``
renders with Swagger UI (the ``swagger-ui-tag`` plugin, its assets served from the site).
The command runs on the embedded default in a folder of its own, so a build needs no
database, broker or ``SECRET_KEY``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

BASE_DIR = Path(__file__).resolve().parents[2]
SCHEMA_PATH = "reference/openapi.json"
# What would point the command at services: it needs none.
SERVICE_VARS = ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "SECRET_KEY")


def schema() -> str:
    """The OpenAPI document, as JSON text."""
    with tempfile.TemporaryDirectory(prefix="djflow-docs-") as var:
        env = {k: v for k, v in os.environ.items() if k not in SERVICE_VARS}
        env.update(DJFLOW_VAR_DIR=var, DJANGO_SETTINGS_MODULE="config.settings")
        done = subprocess.run(
            [sys.executable, "manage.py", "spectacular", "--format", "openapi-json"],
            cwd=BASE_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    if done.returncode != 0:
        raise RuntimeError(f"manage.py spectacular failed:\n{done.stderr}")
    return done.stdout


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    """MkDocs' hook: the schema joins the site's files."""
    files.append(File.generated(config, SCHEMA_PATH, content=schema()))
    return files
