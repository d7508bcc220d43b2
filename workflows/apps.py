from typing import Any

from django.apps import AppConfig


class WorkflowsConfig(AppConfig):
    name = "workflows"
    verbose_name = "Workflows"

    def ready(self) -> None:
        from django.core import checks
        from django.db.models.signals import post_migrate

        from . import checks as djflow_checks

        checks.register(djflow_checks.embeddings_storage, checks.Tags.database)
        # After every migrate, not only migration 0006's: pgvector installed after that ran
        # gets its vector column from the next migrate.
        post_migrate.connect(_vector_column, sender=self, dispatch_uid="djflow-kb-vectors")


def _vector_column(using: str = "default", **_: Any) -> None:
    from django.db import connections

    from . import kb_vectors

    kb_vectors.install(connections[using])
