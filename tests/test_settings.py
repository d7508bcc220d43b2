"""The settings read the environment. Each case imports them afresh in a subprocess."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .settings_probe import last_line, probe_settings

BASE_DIR = Path(__file__).resolve().parent.parent
CONFIG_VARS = (
    "DATABASE_URL",
    "CELERY_BROKER_URL",
    "CELERY_RESULT_BACKEND",
    "CELERY_VISIBILITY_TIMEOUT",
    "SENTRY_DSN",
    "DJFLOW_MODEL_CONCURRENCY",
    "DJFLOW_MODEL_SLOTS_REDIS_URL",
    "DJFLOW_MODEL_SLOT_WAIT_SECONDS",
    "DJFLOW_EMBEDDINGS_MODEL",
    "DJFLOW_EMBEDDINGS_DIMENSIONS",
    "DJFLOW_DB_PREPARED_STATEMENTS",
)

# Prints what the tests look at, as JSON, from a process that imported the settings fresh.
PROBE = """
import json
import sentry_sdk
from django.conf import settings
from config.celery import app

db = settings.DATABASES["default"]
client = sentry_sdk.get_client()
print(json.dumps({
    "var_dir": str(settings.VAR_DIR),
    "db_engine": db["ENGINE"],
    "db_name": str(db["NAME"]),
    "db_host": db.get("HOST", ""),
    "db_options": db.get("OPTIONS", {}),
    "broker_url": app.conf.broker_url,
    "result_backend": app.conf.result_backend,
    "transport_options": app.conf.broker_transport_options,
    "accept_content": list(app.conf.accept_content),
    "result_accept_content": list(app.conf.result_accept_content or []),
    "task_serializer": app.conf.task_serializer,
    "result_serializer": app.conf.result_serializer,
    "acks_late": app.conf.task_acks_late,
    "reject_on_worker_lost": app.conf.task_reject_on_worker_lost,
    "prefetch_multiplier": app.conf.worker_prefetch_multiplier,
    "queue_max_priority": app.conf.task_queue_max_priority,
    "default_priority": app.conf.task_default_priority,
    "queue_arguments": {q.name: q.queue_arguments for q in app.amqp.queues.values()},
    "sentry_active": client.is_active(),
    "sentry_integrations": sorted(getattr(client, "integrations", {})),
    "model_slots": {
        key: settings.DJFLOW[key]
        for key in ("MODEL_CONCURRENCY", "MODEL_SLOTS_REDIS_URL", "MODEL_SLOT_WAIT_SECONDS")
    },
    "embeddings": [settings.DJFLOW[k] for k in ("EMBEDDINGS_MODEL", "EMBEDDINGS_DIMENSIONS")],
}))
# Nothing was captured; close without waiting so nothing could be sent.
client.close(timeout=0)
"""


def load_settings(tmp_path: Path, **env: str) -> dict[str, Any]:
    return json.loads(last_line(probe_settings(tmp_path, PROBE, unset=CONFIG_VARS, **env)))


def assert_durable_celery(conf: dict[str, Any]) -> None:
    assert conf["accept_content"] == ["json"]
    assert conf["result_accept_content"] == ["json"]
    assert conf["task_serializer"] == "json"
    assert conf["result_serializer"] == "json"
    assert conf["acks_late"] is True
    assert conf["reject_on_worker_lost"] is True
    assert conf["prefetch_multiplier"] == 1


def test_nothing_set_means_the_embedded_default_under_the_var_dir(tmp_path: Path) -> None:
    conf = load_settings(tmp_path)

    assert conf["var_dir"] == str(tmp_path)
    assert conf["db_engine"] == "django.db.backends.sqlite3"
    assert Path(conf["db_name"]).parent == tmp_path
    assert conf["broker_url"] == "filesystem://"
    assert conf["result_backend"].startswith("db+sqlite:///")
    assert conf["result_backend"].endswith(str(tmp_path / "celery-results.sqlite3"))
    for key in ("data_folder_in", "data_folder_out", "control_folder"):
        assert Path(conf["transport_options"][key]).is_relative_to(tmp_path)
    assert_durable_celery(conf)
    assert conf["sentry_active"] is False


def test_service_urls_switch_to_postgres_and_redis(tmp_path: Path) -> None:
    conf = load_settings(
        tmp_path,
        DATABASE_URL="postgres://flows:secret@db.example:5432/flows",
        CELERY_BROKER_URL="redis://cache.example:6379/0",
        CELERY_RESULT_BACKEND="redis://cache.example:6379/1",
    )

    assert conf["db_engine"] == "django.db.backends.postgresql"
    assert (conf["db_name"], conf["db_host"]) == ("flows", "db.example")
    assert conf["broker_url"] == "redis://cache.example:6379/0"
    assert conf["result_backend"] == "redis://cache.example:6379/1"
    # Above any step time limit: leases in the database recover lost work, not redelivery.
    # One list per priority: a run's priority (0-9) orders its messages; kombu pops the
    # lowest number first, so the default (5) is 4 there.
    assert conf["transport_options"] == {
        "visibility_timeout": 12 * 3600,
        "priority_steps": list(range(10)),
    }
    assert conf["default_priority"] == 4
    assert_durable_celery(conf)


def test_rabbitmq_queues_are_declared_with_a_max_priority_unless_told_not_to(
    tmp_path: Path,
) -> None:
    url = "amqp://guest:guest@mq.example:5672/djflow"
    conf = load_settings(tmp_path, CELERY_BROKER_URL=url)
    assert conf["queue_max_priority"] == 10
    assert conf["default_priority"] == 5
    for name in ("default", "engine", "timers", "mail"):
        assert conf["queue_arguments"][name] == {"x-max-priority": 10}
    # Queues an older djflow declared without it are kept so (RabbitMQ refuses a queue
    # declared again with other arguments).
    off = load_settings(tmp_path, CELERY_BROKER_URL=url, CELERY_TASK_QUEUE_MAX_PRIORITY="")
    assert off["queue_max_priority"] is None
    assert not any(off["queue_arguments"].values())


def test_postgres_prepares_the_step_statements_unless_told_not_to(tmp_path: Path) -> None:
    url = "postgres://flows:secret@db.example:5432/flows"
    assert load_settings(tmp_path, DATABASE_URL=url)["db_options"]["prepare_threshold"] == 1
    off = load_settings(tmp_path, DATABASE_URL=url, DJFLOW_DB_PREPARED_STATEMENTS="false")
    assert "prepare_threshold" not in off["db_options"]
    given = load_settings(tmp_path, DATABASE_URL=f"{url}?prepare_threshold=3")
    assert given["db_options"]["prepare_threshold"] == 3
    # SQLite has nothing to prepare: its options are its own.
    assert "prepare_threshold" not in load_settings(tmp_path)["db_options"]


def test_visibility_timeout_comes_from_the_environment(tmp_path: Path) -> None:
    conf = load_settings(
        tmp_path, CELERY_BROKER_URL="redis://127.0.0.1:6379/0", CELERY_VISIBILITY_TIMEOUT="90000"
    )
    assert conf["transport_options"]["visibility_timeout"] == 90000


def test_a_rabbitmq_broker_gets_no_redis_transport_options(tmp_path: Path) -> None:
    """RabbitMQ has no visibility timeout (it redelivers when a consumer's channel closes);
    Redis's options are not passed to it."""
    conf = load_settings(
        tmp_path,
        CELERY_BROKER_URL="amqp://guest:guest@127.0.0.1:5672//",
        CELERY_VISIBILITY_TIMEOUT="90000",
    )
    assert conf["broker_url"] == "amqp://guest:guest@127.0.0.1:5672//"
    assert conf["transport_options"] == {}
    assert_durable_celery(conf)


def test_sentry_dsn_turns_on_django_and_celery_integrations(tmp_path: Path) -> None:
    # A loopback DSN: even if something were captured, it could not leave the machine.
    conf = load_settings(tmp_path, SENTRY_DSN="https://public@127.0.0.1/1")

    assert conf["sentry_active"] is True
    assert {"django", "celery"} <= set(conf["sentry_integrations"])


def test_model_slots_are_counted_in_the_brokers_redis_else_the_result_backends(
    tmp_path: Path,
) -> None:
    embedded = load_settings(tmp_path)["model_slots"]
    assert embedded == {
        "MODEL_CONCURRENCY": 10,
        "MODEL_SLOTS_REDIS_URL": "",  # the embedded default has no Redis: not counted
        "MODEL_SLOT_WAIT_SECONDS": 2.0,
    }

    on_redis = load_settings(
        tmp_path,
        CELERY_BROKER_URL="redis://cache.example:6379/0",
        CELERY_RESULT_BACKEND="redis://cache.example:6379/1",
    )
    assert on_redis["model_slots"]["MODEL_SLOTS_REDIS_URL"] == "redis://cache.example:6379/0"

    on_rabbitmq = load_settings(
        tmp_path,
        CELERY_BROKER_URL="amqp://guest:guest@127.0.0.1:5672//",
        CELERY_RESULT_BACKEND="redis://cache.example:6379/1",
    )
    assert on_rabbitmq["model_slots"]["MODEL_SLOTS_REDIS_URL"] == "redis://cache.example:6379/1"

    chosen = load_settings(
        tmp_path,
        CELERY_BROKER_URL="redis://cache.example:6379/0",
        DJFLOW_MODEL_SLOTS_REDIS_URL="redis://slots.example:6379/3",
        DJFLOW_MODEL_CONCURRENCY="4",
        DJFLOW_MODEL_SLOT_WAIT_SECONDS="0.5",
    )["model_slots"]
    assert chosen == {
        "MODEL_CONCURRENCY": 4,
        "MODEL_SLOTS_REDIS_URL": "redis://slots.example:6379/3",
        "MODEL_SLOT_WAIT_SECONDS": 0.5,
    }


def test_embeddings_are_off_unless_a_model_is_named(tmp_path: Path) -> None:
    assert load_settings(tmp_path)["embeddings"] == ["", None]

    chosen = load_settings(
        tmp_path,
        DJFLOW_EMBEDDINGS_MODEL="openai:text-embedding-3-small",
        DJFLOW_EMBEDDINGS_DIMENSIONS="256",
    )
    assert chosen["embeddings"] == ["openai:text-embedding-3-small", 256]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("DJFLOW_MODEL_CONCURRENCY", "0"),
        ("DJFLOW_MODEL_SLOT_WAIT_SECONDS", "-1"),
        ("DJFLOW_EMBEDDINGS_DIMENSIONS", "0"),
        ("DJFLOW_EMBEDDINGS_DIMENSIONS", "2001"),
        ("DJFLOW_EMBEDDINGS_DIMENSIONS", "384.5"),
        ("DJFLOW_EMBEDDINGS_DIMENSIONS", "many"),
        ("DJFLOW_MCP_POOL_SIZE", "0"),
        ("DJFLOW_MCP_IDLE_SECONDS", "0"),
        ("DJFLOW_MCP_PREFLIGHT_TIMEOUT_SECONDS", "0"),
        ("DJFLOW_MCP_PREFLIGHT_TIMEOUT_SECONDS", "11"),
        ("DJFLOW_LOG_FORMAT", "xml"),
        ("DJFLOW_LOG_FORMAT", ""),
    ],
)
def test_a_model_slot_setting_out_of_range_is_refused_naming_it(
    tmp_path: Path, name: str, value: str
) -> None:
    done = probe_settings(tmp_path, unset=CONFIG_VARS, **{name: value})
    assert done.returncode != 0
    assert "ImproperlyConfigured" in done.stderr and name in done.stderr


# That every variable the settings read is documented: tests/test_docs.py (the generated
# configuration reference, docs/reference/configuration.md).
