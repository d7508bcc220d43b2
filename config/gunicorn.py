"""gunicorn's configuration for djflow: ``gunicorn -c python:config.gunicorn config.wsgi``.

Only the metrics' bookkeeping (prometheus-client's multiprocess mode, config.metrics_files);
every other setting comes from the command line. The master loads the settings, which export
``PROMETHEUS_MULTIPROC_DIR`` for the workers it forks.
"""

import os
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")


def on_starting(server: Any) -> None:
    """Before the first worker: remove the files of this host's processes that are gone."""
    from django.conf import settings

    from config import metrics_files

    metrics_files.remove_gone(settings.METRICS_HOST_DIR)


def child_exit(server: Any, worker: Any) -> None:
    """A worker ended (recycled, killed): its live gauges end with it."""
    from config import metrics_files

    metrics_files.process_ended(worker.pid)
