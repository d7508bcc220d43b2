from typing import Any

from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "runs"
    verbose_name = "Runs"

    def ready(self) -> None:
        from celery.signals import task_prerun

        from workflows.secrets import forget, install_log_scrubber

        # Every process that runs the engine (web, worker, beat) masks secrets in its logs.
        install_log_scrubber()

        # A task that started a run held its secrets for its logs; the next task holds none.
        def _forget(**_: Any) -> None:
            forget()

        task_prerun.connect(_forget, weak=False, dispatch_uid="djflow-forget-secrets")
