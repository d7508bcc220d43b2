"""System checks (``manage.py check``, ``migrate``, ``runserver``): configuration that
cannot work as set is said before a run meets it."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks
from django.db import DatabaseError, connections

from . import kb_vectors


def embeddings_storage(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """``DJFLOW_EMBEDDINGS_MODEL`` is set but the database cannot store vectors: retrieval
    stays full-text (a warning, not an error: everything else works). SQLite is known
    without a query; whether PostgreSQL has pgvector is asked only when the check may use
    the database (``migrate``, ``check --database default``)."""
    model = str(settings.DJFLOW.get("EMBEDDINGS_MODEL") or "").strip()
    if not model:
        return []
    connection = connections["default"]
    if connection.vendor != "postgresql":
        why = kb_vectors.unavailable(connection)
    elif not databases or "default" not in databases:
        return []
    else:
        try:
            why = kb_vectors.unavailable(connection)
        except DatabaseError as error:
            why = f"could not ask the database whether it has pgvector: {error}"
    if why is None:
        return []
    return [
        checks.Warning(
            f"DJFLOW_EMBEDDINGS_MODEL is {model!r}, but {why}.",
            hint="Unset DJFLOW_EMBEDDINGS_MODEL, or use PostgreSQL with pgvector (README,"
            " 'Embeddings and hybrid search').",
            id="djflow.W001",
        )
    ]
