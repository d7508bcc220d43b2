"""The project's settings with the broker ``bench.standalone`` puts under test.

``DJFLOW_BENCH_BROKER`` names the candidate; unset, the settings are the project's own (the
embedded default: ``config.broker`` on ``filesystem://``). The candidates other than the
default live here, not in ``config.settings``, so the project carries no plumbing for a
broker it did not choose.
"""

from __future__ import annotations

import os

from kombu.transport import sqlalchemy

from config.settings import *  # noqa: F403
from config.settings import VAR_DIR

CANDIDATE = os.environ.get("DJFLOW_BENCH_BROKER", "")


class SQLiteTransport(sqlalchemy.Transport):
    """kombu's SQLAlchemy transport polling as often as the file-system one (0.05 s).

    kombu passes every transport option it does not know to ``create_engine``, which refuses
    ``polling_interval``; its default of 1 s would make the comparison the polling interval's.
    A URL of the ``sqla+sqlite://`` form would pick kombu's class by the ``sqla`` prefix, so
    the candidate is a plain ``sqlite://`` URL with this class as ``broker_transport``.
    """

    polling_interval = 0.05


if CANDIDATE == "kombu-filesystem":
    # The broker before issue 11: kombu's own file-system transport (its alias), same folders.
    CELERY_BROKER_TRANSPORT = "filesystem"
elif CANDIDATE == "sqlalchemy":
    CELERY_BROKER_URL = f"sqlite:///{VAR_DIR / 'broker.sqlite3'}"
    CELERY_BROKER_TRANSPORT = "bench.standalone_settings:SQLiteTransport"
    # Wait for SQLite's write lock as the project's own database does (config.settings).
    CELERY_BROKER_TRANSPORT_OPTIONS = {"connect_args": {"timeout": 20}}
elif CANDIDATE:
    raise ValueError(f"DJFLOW_BENCH_BROKER: unknown candidate {CANDIDATE!r}")
