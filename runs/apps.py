from typing import Any

from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "runs"
    verbose_name = "Runs"

    def ready(self) -> None:
        from celery.signals import task_prerun

        from workflows.secrets import forget, install_log_scrubber

        # The engine's own step kinds, in the registry before any document is checked.
        from . import kinds  # noqa: F401

        # Every process that runs the engine (web, worker, beat) masks secrets in its logs.
        install_log_scrubber()

        # A task that started a run held its secrets for its logs; the next task holds none.
        def _forget(**_: Any) -> None:
            forget()

        task_prerun.connect(_forget, weak=False, dispatch_uid="djflow-forget-secrets")

        from django.conf import settings
        from django.db.backends.signals import connection_created
        from django.db.models.signals import pre_delete

        from .engine.sql import generic_plans

        connection_created.connect(generic_plans, weak=False, dispatch_uid="djflow-generic-plans")

        from . import bulk
        from .engine import hooks
        from .models import Run

        # Bulk actions whose next batch message was lost are offered again (runs.bulk).
        hooks.repair("bulk_actions_reoffered", bulk.reoffer_idle)

        # Idempotency keys are per (workflow, caller). Deleting a user would set their runs'
        # created_by to NULL and move their keys into the no-user scope that trusted code
        # (the builder's start, commands) shares: there they would collide with each other
        # and answer trusted starts with the deleted user's runs. No one can call as a
        # deleted user again, so their keys are dropped with them (the runs stay).
        def _drop_keys(sender: Any, instance: Any, **_: Any) -> None:
            Run.objects.filter(created_by=instance, idempotency_key__isnull=False).update(
                idempotency_key=None
            )

        pre_delete.connect(
            _drop_keys,
            sender=settings.AUTH_USER_MODEL,
            weak=False,
            dispatch_uid="djflow-drop-idempotency-keys",
        )
