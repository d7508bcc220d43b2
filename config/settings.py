"""Settings for the engine. Every value comes from the environment, with a safe default.

With nothing set the project runs on the *embedded default*: SQLite and kombu's
file-system broker under ``var/``, so ``manage.py standalone`` works on a laptop with nothing
installed. ``DATABASE_URL``, ``CELERY_BROKER_URL`` and ``CELERY_RESULT_BACKEND`` switch to
Postgres and Redis, the production and test path.
"""

import ipaddress
import json
import re
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import environ
from csp.constants import NONCE, NONE, SELF, UNSAFE_INLINE
from django.core.exceptions import ImproperlyConfigured
from kombu import Queue

from config import metrics_files, secret_key
from config.logging import CELERY_TASK_LOGGERS

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
VAR_DIR = Path(env("DJFLOW_VAR_DIR", default=str(BASE_DIR / "var")))
# The embedded default keeps its database, broker and mail under var/; make sure it exists,
# open to this user only when it makes it (its database holds sessions and API tokens).
VAR_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)

# Metrics (prometheus-client's multiprocess mode, config.metrics_files): every process of
# this host writes its values under DJFLOW_METRICS_DIR/<host name>/, and GET /metrics adds up
# every host's folder. Exported here, in the environment, before anything imports the client
# (it picks how it stores values at its first import) and so that every child inherits it.
# DJFLOW_METRICS=false counts nothing and serves no /metrics (a read-only file system, or
# measuring what counting costs).
# `manage.py run_replay` counts nothing either: what a replay runs is no run of the
# deployment's, and its counters would be summed with the deployment's at the next scrape
# (the choice has to be made here, before the client is imported; config.replay).
DJFLOW_METRICS_ENABLED = env.bool("DJFLOW_METRICS", default=True) and sys.argv[1:2] != [
    "run_replay"
]
DJFLOW_METRICS_DIR = Path(env("DJFLOW_METRICS_DIR", default=str(VAR_DIR / "metrics")))
METRICS_HOST_DIR = (
    metrics_files.export(DJFLOW_METRICS_DIR) if DJFLOW_METRICS_ENABLED else metrics_files.unexport()
)

DEBUG = env.bool("DEBUG", default=False)
# The embedded default: SQLite and the file-system broker, both under VAR_DIR.
EMBEDDED = env("DATABASE_URL", default="sqlite:").startswith("sqlite:") and env(
    "CELERY_BROKER_URL", default="filesystem://"
).startswith("filesystem://")
SECRET_KEY = env("SECRET_KEY", default="")


def _embedded_key_path() -> Path:
    """Where the embedded default keeps its key: beside its SQLite database, so that the key
    goes wherever the data goes (a database on a volume and var/ in a container's layer
    would otherwise get a new key with each new container); in VAR_DIR for an in-memory one."""
    name = env.db_url("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'db.sqlite3'}")["NAME"]
    if not name or name == ":memory:" or str(name).startswith("file:"):
        return VAR_DIR / "secret_key"
    return Path(name).resolve().parent / "secret_key"


if not SECRET_KEY and EMBEDDED:
    # No key anyone else knows, and the same one at every start of this installation (its
    # sessions and approval links outlive a restart): generated once, kept beside its data.
    try:
        SECRET_KEY = secret_key.installation_key(_embedded_key_path())
    except (OSError, secret_key.SecretKeyFileError) as error:
        raise ImproperlyConfigured(
            f"SECRET_KEY is not set, and the embedded default's own key could not be kept "
            f"at {_embedded_key_path()} (beside its database, by default in DJFLOW_VAR_DIR): "
            f"{error}"
        ) from error


def _insecure_key(key: str) -> bool:
    """What Django's `check --deploy` (security.W009) calls insecure: anyone who knows or
    guesses a key can forge sessions and approval links."""
    return len(key) < 50 or len(set(key)) < 5 or key.startswith("django-insecure-")


if not EMBEDDED and _insecure_key(SECRET_KEY):
    raise ImproperlyConfigured(
        "SECRET_KEY is missing or insecure (it must be at least 50 characters, 5 of them "
        "different, and not start with 'django-insecure-'), and DATABASE_URL or "
        "CELERY_BROKER_URL is not the embedded default. Generate one with: python3 -c "
        "'import secrets; print(secrets.token_urlsafe(50))'"
    )
# Secrets of run inputs (writeOnly fields) are encrypted at rest with a key derived from
# this (comma-separated: the first encrypts, each decrypts, for rotation), else from
# SECRET_KEY. Set it so that rotating SECRET_KEY (sessions, links) leaves them readable.
DJFLOW_FIELD_KEY = env.list("DJFLOW_FIELD_KEY", default=[])
if any(len(key) < 32 for key in DJFLOW_FIELD_KEY):
    raise ImproperlyConfigured(
        "DJFLOW_FIELD_KEY: each comma-separated key must be at least 32 characters. Generate "
        "one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
    )
# GET /metrics asks for this as a bearer token when it is set (at least 16 characters). Unset,
# it answers only on the embedded default, to a client on this machine with no proxy in front
# (config.metrics): its labels name workflows and accounts.
DJFLOW_METRICS_TOKEN = env.str("DJFLOW_METRICS_TOKEN", default="")
if DJFLOW_METRICS_TOKEN and len(DJFLOW_METRICS_TOKEN) < 16:
    raise ImproperlyConfigured(
        "DJFLOW_METRICS_TOKEN must be at least 16 characters. Generate one with: python3 -c "
        "'import secrets; print(secrets.token_urlsafe(32))'"
    )
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])
SITE_URL = env("SITE_URL", default="http://127.0.0.1:8000")

# Served over HTTPS (SITE_URL says so): cookies only over HTTPS, HSTS and the redirect to
# HTTPS on, so `manage.py check --deploy` is clean. Behind a proxy that ends TLS, name the
# header it sets (DJFLOW_PROXY_SSL_HEADER=HTTP_X_FORWARDED_PROTO) so Django sees the request
# as secure, and only set it when the proxy overwrites that header from clients.
_HTTPS = SITE_URL.startswith("https://")
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = _HTTPS
SECURE_SSL_REDIRECT = env.bool("DJFLOW_SSL_REDIRECT", default=_HTTPS)
SECURE_HSTS_SECONDS = env.int("DJFLOW_HSTS_SECONDS", default=31_536_000 if _HTTPS else 0)
# check --deploy asks for both with HSTS on; DJFLOW_HSTS_SECONDS=0 turns all three off.
SECURE_HSTS_INCLUDE_SUBDOMAINS = SECURE_HSTS_PRELOAD = SECURE_HSTS_SECONDS > 0
if _proxy_header := env("DJFLOW_PROXY_SSL_HEADER", default=""):
    SECURE_PROXY_SSL_HEADER = (_proxy_header, "https")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    # Swagger UI's files, served from the package: the docs work offline (the default
    # loads swagger-ui-dist from a CDN, a blank page without the network).
    "drf_spectacular_sidecar",
    "django_celery_beat",
    "django_json_widget",
    # Object permissions: the per-workflow roles of CONTRACT section 8 (workflows/access.py).
    "guardian",
    "csp",
    "axes",
    "workflows",
    "runs",
    "approvals",
    "workers",
    "schedules",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # NUL in the path or the query: a 400 before any view sends it to Postgres (a 500 there).
    "config.middleware.NulRefusalMiddleware",
    # The Content-Security-Policy header (CONTENT_SECURITY_POLICY below) on every response.
    "csp.middleware.CSPMiddleware",
    # Static files (the admin's, Swagger UI's) from STATIC_ROOT, filled by `collectstatic`:
    # gunicorn serves none itself. Files it has not collected fall through to the next
    # handler, so `runserver --insecure` (the standalone) still serves them from the apps.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    # After WhiteNoise (static files are never masked), before everything that renders.
    "config.middleware.SecretMaskMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Answers a locked-out sign-in (django-axes) with the locked-out page, 429. Last, as
    # django-axes asks.
    "axes.middleware.AxesMiddleware",
]

# Error pages and mails to ADMINS show frames' variables: secrets in them are masked.
DEFAULT_EXCEPTION_REPORTER = "config.reporting.SecretScrubbingReporter"
# Content-Security-Policy for every page (home, sign-in, approvals, notifications, the admin,
# the API docs): everything from this origin only, no plugins, no <base>, no framing, forms
# post only here. Scripts come from files on this origin; an inline script runs only with
# this response's nonce ({{ request.csp_nonce }}, which django-csp then adds to the header).
# Styles may be inline: the admin's JSON editor (Ace) and Swagger UI insert <style> elements
# at run time and neither can carry a nonce; CSS cannot run script, and every value a page
# shows is escaped by the templates. A nonce beside 'unsafe-inline' would disable the
# latter, so style-src has none. Images may be data: URLs (Swagger UI's and the admin's icons).
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF, NONCE],
        "style-src": [SELF, UNSAFE_INLINE],
        "img-src": [SELF, "data:"],
        "object-src": [NONE],
        "base-uri": [NONE],
        "frame-ancestors": [NONE],
        "form-action": [SELF],
    },
}

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

# Every template of the pages and e-mails is in the top-level templates/ of a source tree (the
# checkout, an editable install, the image's COPY). A wheel has no top level of its own, so
# setup.py maps the folder into this package as config/templates/: a top-level `templates` in
# site-packages would share its folder, and names like base.html, with any other distribution
# that ships one. One rule, on the tree this module was loaded from: a source tree (manage.py
# beside config/) reads its top-level templates/, an install reads the wheel's copy beside this
# module. Never a copy installed elsewhere (an old plain install beside a checkout), never a
# stray config/templates/ in a source tree (an older version's, left untracked by a pull), and
# never a site-packages/templates/ that another distribution shipped.
_SOURCE_TREE = (BASE_DIR / "manage.py").is_file()
TEMPLATES_DIR = (
    BASE_DIR / "templates" if _SOURCE_TREE else Path(__file__).resolve().parent / "templates"
)

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [TEMPLATES_DIR],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "approvals.context_processors.header",
            ],
        },
    },
]

DATABASES = {
    "default": env.db_url("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'db.sqlite3'}"),
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several processes (web, worker, beat) share one file: wait for the write lock instead
    # of failing at once, and let readers run beside a writer.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": 20, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"}
    )
else:
    # Persistent connections. No health check before each task (a round trip per step):
    # the engine's claim and record reconnect and try again when a connection is broken
    # (workers.execution), and Django drops a connection that errored before the next task.
    DATABASES["default"]["CONN_MAX_AGE"] = env.int("CONN_MAX_AGE", default=300)
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = env.bool("CONN_HEALTH_CHECKS", default=False)
    # The statements every step sends (runs.engine.sql) are prepared on the server, once per
    # connection, from their second use: parsing and planning them was more of Postgres's
    # time than running them. Django's own queries stay unprepared (its client-side cursors
    # never prepare). Off (false) behind a pooler in transaction mode that does not keep
    # prepared statements (PgBouncer before 1.21, or with max_prepared_statements 0).
    # (A prepare_threshold given on DATABASE_URL's query string arrives as text.)
    _options = DATABASES["default"].setdefault("OPTIONS", {})
    if env.bool("DJFLOW_DB_PREPARED_STATEMENTS", default=True):
        _options["prepare_threshold"] = int(_options.get("prepare_threshold", 1))
    else:
        _options.pop("prepare_threshold", None)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
# WhiteNoise warns at every start about a STATIC_ROOT that does not exist.
STATIC_ROOT.mkdir(exist_ok=True)
# Files served at the site's root, as browsers ask for them: /favicon.ico (every page and the
# admin's; it was a 404 on each, issue 37). WhiteNoise serves this folder as it is, in every
# process that has the middleware (gunicorn, runserver, the tests' live server).
WHITENOISE_ROOT = Path(__file__).resolve().parent / "static" / "root"

# Sign-ins (the sign-in page and the admin's) go through django-axes first: failed attempts
# are counted per user name and per client address, in the database (shared by every
# process: a count per process would bound nothing). The DJFLOW_LOGIN_FAILURE_LIMIT-th
# failure of a user name or of an address within DJFLOW_LOGIN_COOLOFF_MINUTES locks it:
# sign-ins as that user, or from that address, answer 429 (the password is not tried) until
# that long after the last failure. A successful sign-in clears its user's count.
# Then Django's own global permissions, and django-guardian's per-object ones (a role on
# one workflow is an object permission on its Workflow row).
AUTHENTICATION_BACKENDS = [
    "config.security.LoginLockoutBackend",
    "django.contrib.auth.backends.ModelBackend",
    "guardian.backends.ObjectPermissionBackend",
]
AXES_FAILURE_LIMIT = env.int("DJFLOW_LOGIN_FAILURE_LIMIT", default=5)
AXES_COOLOFF_TIME = timedelta(minutes=env.float("DJFLOW_LOGIN_COOLOFF_MINUTES", default=15))
AXES_LOCKOUT_PARAMETERS = ["username", "ip_address"]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"
AXES_CLIENT_IP_CALLABLE = "config.security.client_ip"
# No row per successful sign-in (a table that only grows); failures and lockouts are kept
# and logged. No banner at every process start either.
AXES_DISABLE_ACCESS_LOG = True
AXES_VERBOSE = False
# How many proxies in front of the site append to X-Forwarded-For (0: clients connect
# directly, REMOTE_ADDR is theirs). Behind one, REMOTE_ADDR is the proxy's: set this, or every
# sign-in and anonymous API call counts against one address.
DJFLOW_TRUSTED_PROXIES = env.int("DJFLOW_TRUSTED_PROXIES", default=0)

# The cache the API's throttles count in, shared by every process (a per-process memory
# cache would let N processes allow N times the rate): the database by default (the table
# is made by a migration), or e.g. CACHE_URL=redis://127.0.0.1:6379/2. The embedded default,
# one host, keeps it in files under VAR_DIR instead: on SQLite a write per API request would
# queue behind the engine's own writes for the database's one write lock.
CACHES = {
    "default": env.cache_url(
        "CACHE_URL",
        default=f"filecache://{VAR_DIR / 'cache'}" if EMBEDDED else "dbcache://djflow_cache",
    )
}
# Django's database cache keeps 300 entries by default and, past them, deletes a third of
# its rows by key order, live throttle counts included: with more than about 300 clients
# counted within a throttle's window, some would be forgotten and could go past their rate.
# A throttle's count lives one window (a minute), so 10,000 entries hold that many clients a
# minute; expired rows are deleted first. The cost is the COUNT(*) the cache runs at every
# write: about 0.7 ms at 10,000 rows here. CACHE_URL=dbcache://table?MAX_ENTRIES=N wins.
if CACHES["default"]["BACKEND"] == "django.core.cache.backends.db.DatabaseCache":
    CACHES["default"].setdefault("OPTIONS", {}).setdefault("MAX_ENTRIES", 10_000)

# The pages people use (the approvals inbox, notifications) sign in here; an e-mailed
# approval link works without signing in.
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"

# --- E-mail -------------------------------------------------------------------------------
EMAIL_BACKEND = env("EMAIL_BACKEND", default="django.core.mail.backends.console.EmailBackend")
EMAIL_FILE_PATH = env("EMAIL_FILE_PATH", default=str(VAR_DIR / "mail"))
EMAIL_HOST = env("EMAIL_HOST", default="localhost")
EMAIL_PORT = env.int("EMAIL_PORT", default=25)
EMAIL_HOST_USER = env("EMAIL_HOST_USER", default="")
EMAIL_HOST_PASSWORD = env("EMAIL_HOST_PASSWORD", default="")
EMAIL_USE_TLS = env.bool("EMAIL_USE_TLS", default=False)
DEFAULT_FROM_EMAIL = env("DEFAULT_FROM_EMAIL", default="workflows@localhost")
# Seconds an SMTP connection may block a mail worker before the send fails (and is retried).
EMAIL_TIMEOUT = env.int("EMAIL_TIMEOUT", default=30)

# --- REST API -----------------------------------------------------------------------------
# No anonymous user row: the API and the pages require a signed-in user, and the approval
# links of e-mail approvers carry their own token.
ANONYMOUS_USER_NAME = None
GUARDIAN_MONKEY_PATCH_USER = False

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["config.parsers.JSONParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "config.api_errors.exception_handler",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
    # Requests per minute (or /s, /hour, /day) per signed-in user and per anonymous address;
    # past them the API answers 429 with Retry-After. Counted in CACHES["default"].
    "DEFAULT_THROTTLE_CLASSES": [
        "config.security.UserRateThrottle",
        "config.security.AnonRateThrottle",
    ],
    "DEFAULT_THROTTLE_RATES": {
        "user": env("DJFLOW_API_THROTTLE_USER", default="600/min"),
        "anon": env("DJFLOW_API_THROTTLE_ANON", default="60/min"),
    },
    # 0 (no proxy): the client is REMOTE_ADDR. DRF's None would take the whole
    # X-Forwarded-For, which any client writes: it could throttle another's address, or
    # itself never (a new header each request).
    "NUM_PROXIES": DJFLOW_TRUSTED_PROXIES,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "djflow API",
    "DESCRIPTION": "Durable workflows on Django and Celery: definitions, runs, events, approvals.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SCHEMA_PATH_PREFIX": "/api/v1",
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "RunStatusEnum": "runs.status.RunStatus",
        "StepStatusEnum": "runs.status.StepStatus",
    },
    # drf-spectacular's own, then the statuses every operation may answer (413, 414, 429, ...)
    # and the links from a created resource's id to the operations on it (config/openapi.py).
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "config.openapi.every_operation_answers",
    ],
}

# --- Celery -------------------------------------------------------------------------------
CELERY_BROKER_URL = env("CELERY_BROKER_URL", default="filesystem://")
CELERY_RESULT_BACKEND = env(
    "CELERY_RESULT_BACKEND", default=f"db+sqlite:///{VAR_DIR / 'celery-results.sqlite3'}"
)
# The engine reads no result; the result backend counts fan-outs' chords (runs.dispatch). A
# backend that is down must not hold the sender of a fan-out (a web request, a worker's pool
# process) for Celery's 20 retries (19 s measured): one more try, then the fan-out goes
# without its chord. The same bounds for a header task counting itself in the worker.
CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {
    "retry_policy": {
        "max_retries": 1,
        "interval_start": 0,
        "interval_step": 0.2,
        "interval_max": 0.2,
    }
}
CELERY_REDIS_SOCKET_CONNECT_TIMEOUT = 2.0
CELERY_REDIS_SOCKET_TIMEOUT = 5.0
# kombu's Redis transport (Sentinel's too): its priorities run the other way (see below).
_REDIS_BROKER = CELERY_BROKER_URL.startswith(
    ("redis://", "rediss://", "redis+socket://", "sentinel://")
)
if CELERY_BROKER_URL.startswith("filesystem://"):
    _broker_dir = VAR_DIR / "broker"
    # kombu's file-system transport does not create its folders; a bare `celery worker`
    # on the embedded default would fail without them.
    for _sub in ("out", "control", "processed"):
        (_broker_dir / _sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "out"),
        "data_folder_out": str(_broker_dir / "out"),
        "control_folder": str(_broker_dir / "control"),
        "processed_folder": str(_broker_dir / "processed"),
        "store_processed": False,
        # The file-system transport polls; a short interval keeps a step hop quick.
        "polling_interval": env.float("CELERY_BROKER_POLLING_INTERVAL", default=0.05),
    }
    # kombu's own file-system transport lets the worker read a message file its publisher has
    # created but not yet written (https://github.com/celery/kombu/issues/1551): the
    # standalone's worker died of it (JSONDecodeError in _get), and did so in 2 of 3 runs of
    # bench/standalone.py (1,000 runs from 4 clients). config.broker writes each message under
    # a temporary name and renames it into place. Chosen by measurement (figures in
    # bench/README.md) over kombu's SQLAlchemy transport on SQLite: neither crashed, runs/s
    # 15.6 against 17.8 (medians of 3 on a loaded machine; config.broker was the faster in 2
    # of the 3 rounds), and the SQLAlchemy transport keeps exchange bindings per process and
    # has no fanout, so `celery inspect`, remote control and Flower's events would not reach
    # the worker. An explicit filesystem:// gets it too.
    CELERY_BROKER_TRANSPORT = "config.broker:Transport"
elif _REDIS_BROKER:
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        # Redis redelivers an unacknowledged message after this long. Keep it above the
        # longest step time limit: leases in Postgres, not redelivery, recover lost work.
        "visibility_timeout": env.int("CELERY_VISIBILITY_TIMEOUT", default=43200),
        # One list per priority (kombu's default merges the ten into four): a run's priority
        # (POST /runs, 0-9) orders its messages on every queue. kombu pops the lowest number
        # first; runs.dispatch.broker_priority turns the run's scale over for it.
        "priority_steps": list(range(10)),
    }
else:
    # RabbitMQ (amqp://) redelivers an unacknowledged message only when its consumer's
    # channel closes, so there is no timeout to set here; its own consumer_timeout (30 min by
    # default) closes a channel holding a message that long: README, Running on RabbitMQ.
    CELERY_BROKER_TRANSPORT_OPTIONS = {}
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_RESULT_ACCEPT_CONTENT = ["json"]
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "default"
# Message priority (a run's priority, POST /runs): RabbitMQ orders a queue's messages only
# when the queue is declared with x-max-priority, which Celery does for every queue it
# declares when this is set. RabbitMQ refuses to declare an existing queue with other
# arguments: queues made by an older djflow must be deleted once (README, Running on RabbitMQ), or
# this set empty to keep them without priority.
_max_priority = env.str("CELERY_TASK_QUEUE_MAX_PRIORITY", default="10").strip()
CELERY_TASK_QUEUE_MAX_PRIORITY = int(_max_priority) if _max_priority else None
# Messages that belong to no one run (the clock's, the reconciler's, batches of fired
# timers) go at the middle of the scale, as a run of the default priority 5 does; unset, they
# would be the lowest on RabbitMQ and the highest on Redis.
CELERY_TASK_DEFAULT_PRIORITY = 4 if _REDIS_BROKER else 5
# The engine's own tasks (advance, the timer tick, the reconciler) have a queue of their own
# so a backlog of step bodies never delays planning. `celery -A config worker` with no -Q
# consumes every queue below.
# The clock (the timer tick and the reconciler) has a queue of its own too: a tick that fires
# thousands of timers sends thousands of advance messages to `engine`, and the next tick must
# not wait behind them (measured: 10,000 timers due at once fired in 93 s with the tick on
# `engine`, 6.4 s on a queue of its own).
# Approval and hand-off e-mails have a queue of their own: a slow or failing SMTP server
# delays mail only, never planning or step bodies.
CELERY_TASK_QUEUES = [Queue("default"), Queue("engine"), Queue("timers"), Queue("mail")]
CELERY_TASK_ROUTES = {
    "approvals.send_mail": {"queue": "mail"},
    "runs.fire_timers": {"queue": "timers"},
    "runs.wake_timers": {"queue": "timers"},
    "runs.reconcile": {"queue": "timers"},
    # Run-end webhooks go out beside the mail: a slow receiver delays only outbound messages.
    "workers.deliver_notification": {"queue": "mail"},
    # Fired timers' runs, advanced in batches (and their next steps run) by a worker.
    "workers.advance_runs": {"queue": "engine"},
    "runs.*": {"queue": "engine"},
}
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Celery's consumer, made to survive a broker restart with tasks unacknowledged (see there).
CELERY_WORKER_CONSUMER = "config.worker_consumer:Consumer"
CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT = env.float("CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT", default=10)
# Task events (what Flower shows) cost about 0.4 ms per step on Redis (workers.task_events)
# and are for a monitor to ask for: Flower turns them on at run time (enable_events every
# 5 s), `-E` or this at start. Off by default, like Celery's.
CELERY_WORKER_SEND_TASK_EVENTS = env.bool("CELERY_WORKER_SEND_TASK_EVENTS", default=False)
CELERY_TIMEZONE = TIME_ZONE
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
# Celery's Django fix-up closes the database connection around every task unless this is
# set; a new connection per step costs more than the step. Connections are instead
# recycled by Django's own rules (CONN_MAX_AGE, health checks), applied before each task
# by config.celery.
CELERY_DB_REUSE_MAX = env.int("CELERY_DB_REUSE_MAX", default=1000)


def _is_redis(url: str) -> bool:
    """A URL redis-py can connect to (a broker URL like sentinel:// is not one)."""
    return url.startswith(("redis://", "rediss://"))


# --- The engine ---------------------------------------------------------------------------
# Dotted module paths whose builders' documents are saved at worker start-up and by
# ``manage.py sync_workflows``.
WORKFLOW_MODULES = env.list("WORKFLOW_MODULES", default=[])


def _http_allow(entries: list[str]) -> list[str]:
    """DJFLOW_HTTP_ALLOW's entries, stripped; an entry with a slash must be a network (a
    misspelt CIDR refuses to start rather than allowing nothing, or a host of that name)."""
    allowed = [entry.strip() for entry in entries if entry.strip()]
    for entry in allowed:
        if "/" in entry:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ImproperlyConfigured(
                    f"DJFLOW_HTTP_ALLOW: {entry!r} is not a network (an IP address/prefix)"
                ) from None
    return allowed


def _mcp_servers(raw: str) -> dict[str, dict[str, Any]]:
    """DJFLOW_MCP_SERVERS, checked: ``{"name": {"url": "http(s)://...", "headers": {...}}}``
    (streamable HTTP) or ``{"name": {"command": ["prog", "arg"], "env": {...}}}`` (stdio). A
    bad entry refuses to start, naming it and the field; a header's or an env variable's value
    is never quoted (they hold credentials)."""
    try:
        parsed = json.loads(raw or "{}")
    except ValueError as error:
        raise ImproperlyConfigured(f"DJFLOW_MCP_SERVERS is not JSON ({error})") from None
    if not isinstance(parsed, dict):
        raise ImproperlyConfigured("DJFLOW_MCP_SERVERS must be a JSON object of servers by name")
    return {name: _mcp_server(name, entry) for name, entry in parsed.items()}


def _mcp_server(name: str, entry: Any) -> dict[str, Any]:
    def refuse(problem: str) -> ImproperlyConfigured:
        return ImproperlyConfigured(f"DJFLOW_MCP_SERVERS[{name!r}]: {problem}")

    if not 1 <= len(name) <= 200 or not name.isprintable():
        raise refuse("a server's name is 1 to 200 printable characters")
    if not isinstance(entry, dict):
        raise refuse('must be an object: {"url": ...} or {"command": [...]}')
    if ("url" in entry) == ("command" in entry):
        raise refuse('give either "url" (streamable HTTP) or "command" (stdio), not both or none')
    transport, extra = ("url", "headers") if "url" in entry else ("command", "env")
    unknown = sorted(set(entry) - {transport, extra})
    if unknown:
        raise refuse(
            f"unknown field {unknown[0]!r} (a {transport} server takes {transport!r} and {extra!r})"
        )
    pairs = entry.get(extra) or {}
    if not isinstance(pairs, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) and not any(c in v for c in "\r\n\0")
        for k, v in pairs.items()
    ):
        raise refuse(f"{extra!r} must map names to strings without line breaks or NUL")
    if transport == "url":
        url = entry["url"]
        if not isinstance(url, str) or not re.match(r"^https?://[^/?#\s]+", url):
            raise refuse('"url" must be an http:// or https:// URL')
        return {"url": url, "headers": pairs}
    command = entry["command"]
    if (
        not isinstance(command, list)
        or not command
        or not all(isinstance(part, str) and part and "\0" not in part for part in command)
    ):
        raise refuse('"command" must be a non-empty list of strings: ["prog", "arg", ...]')
    return {"command": command, "env": pairs}


# pgvector indexes (HNSW, IVFFlat) take vectors of at most this many dimensions.
MAX_INDEXED_DIMENSIONS = 2000


def _embeddings_dimensions(value: str) -> int | None:
    """DJFLOW_EMBEDDINGS_DIMENSIONS: None when empty, else a whole number the vector index
    can hold; anything else refuses to start (a column of the wrong size would fail every
    write later instead)."""
    if not value.strip():
        return None
    try:
        dimensions = int(value)
    except ValueError:
        dimensions = 0
    if not 1 <= dimensions <= MAX_INDEXED_DIMENSIONS:
        raise ImproperlyConfigured(
            f"DJFLOW_EMBEDDINGS_DIMENSIONS must be a whole number from 1 to"
            f" {MAX_INDEXED_DIMENSIONS} (what a pgvector index holds), not {value!r}"
        )
    return dimensions


# The ended run statuses (runs.status.RUN_TERMINAL; tests/test_settings.py keeps them equal):
# what retention may delete.
_ENDED = ("completed", "failed", "cancelled", "timed_out")


def _retention_days(value: str) -> dict[str, int]:
    """DJFLOW_RETENTION_DAYS: empty (runs are kept forever), one number of days for every
    ended status, or ``status=days`` pairs (``completed=30,failed=90``; a status not named is
    kept forever). Anything else refuses to start, naming what is wrong."""
    text = value.strip()
    if not text:
        return {}

    def days(raw: str, what: str) -> int:
        try:
            number = int(raw.strip())
        except ValueError:
            number = 0
        if number < 1:
            raise ImproperlyConfigured(
                f"DJFLOW_RETENTION_DAYS: {what} must be a whole number of days, at least 1, "
                f"not {raw.strip()!r}"
            )
        return number

    if "=" not in text:
        return dict.fromkeys(_ENDED, days(text, "the age"))
    found: dict[str, int] = {}
    for pair in text.split(","):
        status, _, raw = pair.partition("=")
        status = status.strip()
        if status not in _ENDED:
            raise ImproperlyConfigured(
                f"DJFLOW_RETENTION_DAYS: {status!r} is not an ended status (one of "
                f"{', '.join(_ENDED)}): only ended runs are deleted"
            )
        found[status] = days(raw, status)
    return found


def _step_queues(names: list[str]) -> list[str]:
    """DJFLOW_STEP_QUEUES: the queues authors may name in a step's ``queue`` (workflows.queues;
    ``default`` is always among them). Naming one of the engine's own queues (those of
    CELERY_TASK_ROUTES) refuses to start: a step there waits behind the clock, the planner or
    the mail and holds them up, and a list the settings silently cut would surprise the
    operator who wrote it."""
    listed = sorted({name.strip() for name in names if name.strip()})
    engine = {route["queue"] for route in CELERY_TASK_ROUTES.values()} - {CELERY_TASK_DEFAULT_QUEUE}
    reserved = sorted(engine.intersection(listed))
    if reserved:
        raise ImproperlyConfigured(
            f"DJFLOW_STEP_QUEUES names {', '.join(reserved)}: the engine's own queues "
            f"({', '.join(sorted(engine))}) carry its planning, clock and mail, and steps may "
            "never run there"
        )
    return listed


DJFLOW = {
    # Largest accepted request body, in bytes: a larger one is a 413 naming ``body``
    # (DATA_UPLOAD_MAX_MEMORY_SIZE below). DJFLOW_MAX_BODY_BYTES is the contract's name;
    # DJFLOW_MAX_DOCUMENT_BYTES, its name before, is still read when the new one is unset.
    "MAX_BODY_BYTES": env.int(
        "DJFLOW_MAX_BODY_BYTES", default=env.int("DJFLOW_MAX_DOCUMENT_BYTES", default=1_048_576)
    ),
    # Most steps a workflow document may hold, nested ones included (checked at save).
    "MAX_DOCUMENT_STEPS": env.int("DJFLOW_MAX_DOCUMENT_STEPS", default=500),
    # Most bytes one run may store (compact JSON): its attempts' inputs, outputs, errors and
    # spans and its child runs' inputs, counted on the run's row as they are written. A
    # write that would pass it fails the run (class limit) and is not made.
    "MAX_RUN_BYTES": env.int("DJFLOW_MAX_RUN_BYTES", default=64 * 1_048_576),
    # Most bytes of values (inputs, outputs, errors) one answer of GET /runs or
    # GET /runs/{id} embeds (runs.answers); a value over DJFLOW_ANSWER_VALUE_BYTES, or past
    # the budget, is null there and listed in its object's ``truncated`` with its link.
    "MAX_ANSWER_BYTES": env.int("DJFLOW_MAX_ANSWER_BYTES", default=4 * 1_048_576),
    "ANSWER_VALUE_BYTES": env.int("DJFLOW_ANSWER_VALUE_BYTES", default=65_536),
    # Most attempts GET /runs/{id} embeds: the newest ones, oldest first; the whole journal
    # is GET /runs/{id}/steps, cursor-paginated (20,000 attempts answered ~10 MB of rows).
    "ANSWER_STEPS": env.int("DJFLOW_ANSWER_STEPS", default=1000),
    # The operator's cap on one tree of runs, which no document can raise (runs.engine.trees):
    # at most MAX_TREE_RUNS runs under one root (subworkflow children and body runs, every
    # depth; the start past it fails its step, class limit), started at most
    # MAX_TREE_RUNS_PER_MINUTE a minute after a first minute's worth at once (a start past
    # the pace waits for its turn, a timer, rather than fail: it will succeed). A document's
    # limits.max_steps counts at most MAX_STEPS_CEILING.
    "MAX_TREE_RUNS": env.int("DJFLOW_MAX_TREE_RUNS", default=10_000),
    "MAX_TREE_RUNS_PER_MINUTE": env.int("DJFLOW_MAX_TREE_RUNS_PER_MINUTE", default=6_000),
    "MAX_STEPS_CEILING": env.int("DJFLOW_MAX_STEPS_CEILING", default=100_000),
    # A cancel (or any end) ends the runs below the run in its own transaction when their
    # tree has started at most this many (about 10 ms each under load), each only if no one
    # holds it; a larger tree's, and a busy one, are ended by a runs.end_tree task in
    # batches, and POST /runs/{id}/cancel answers 202 instead of 200.
    "CANCEL_INLINE_RUNS": env.int("DJFLOW_CANCEL_INLINE_RUNS", default=50),
    # A running attempt's lease: its worker renews it every third of this while the body
    # runs; when it lapses the worker is taken as lost (at_least_once attempts are offered
    # again, at_most_once ones become in_doubt). Never renewed past the attempt's deadline
    # plus grace.
    "LEASE_SECONDS": env.float("DJFLOW_LEASE_SECONDS", default=30.0),
    # An in_doubt attempt (an at_most_once one whose worker was lost after it started) that
    # no operator resolves within this long fails (class in_doubt); a durable timer row.
    "IN_DOUBT_SECONDS": env.float("DJFLOW_IN_DOUBT_SECONDS", default=86_400.0),
    # How long past an attempt's timeout_ms the engine waits for the worker's own time-out
    # report (Celery's soft time limit) before it times the attempt out itself.
    "DEADLINE_GRACE_SECONDS": env.float("DJFLOW_DEADLINE_GRACE_SECONDS", default=5.0),
    # An attempt left scheduled this long counts as lost (its message gone) and is offered
    # again by the reconciler; a run with nothing in flight that has not moved for this long
    # is advanced by it.
    "LOST_MESSAGE_SECONDS": env.float("DJFLOW_LOST_MESSAGE_SECONDS", default=10.0),
    # The reconciler's period (a beat entry, set at each beat start) and its most rows of
    # each kind per tick.
    "RECONCILE_SECONDS": env.int("DJFLOW_RECONCILE_SECONDS", default=30),
    "RECONCILE_BATCH": env.int("DJFLOW_RECONCILE_BATCH", default=500),
    # A periodic pass (the reconciler, the clock, retention) that fails on one run goes on
    # with the others and leaves that run alone this long, doubling with each failure in a
    # row up to a day (runs.engine.isolation).
    "PASS_BACKOFF_SECONDS": env.float("DJFLOW_PASS_BACKOFF_SECONDS", default=300.0),
    # The timer tick (every second) claims due timers this many at a time, for at most
    # TIMER_TICK_SECONDS; it advances up to TIMER_INLINE_RUNS runs itself and hands more to
    # workers in messages of TIMER_ADVANCE_BATCH runs each (a worker advances them and runs
    # their next steps itself).
    "TIMER_BATCH": env.int("DJFLOW_TIMER_BATCH", default=1000),
    "TIMER_TICK_SECONDS": env.float("DJFLOW_TIMER_TICK_SECONDS", default=5.0),
    "TIMER_INLINE_RUNS": env.int("DJFLOW_TIMER_INLINE_RUNS", default=20),
    "TIMER_ADVANCE_BATCH": env.int("DJFLOW_TIMER_ADVANCE_BATCH", default=20),
    # Between two ticks the engine wakes at the next timer due before the next tick (an ETA
    # message, runs.wake_timers), no sooner than this many milliseconds after now: timers
    # fire within about this much of their instant, not up to a second late. 0: the tick
    # alone fires them. Measured (bench.timers precision, 100 timers a second): firing p99
    # 985 ms with 0, 111 ms with 100 for 0.09 core more, 61 ms with 50 for 0.23 core more.
    "TIMER_RESOLUTION_MS": env.int("DJFLOW_TIMER_RESOLUTION_MS", default=100),
    # Fired timers are kept this long (for inspection), then deleted by the reconciler.
    "TIMER_RETENTION_SECONDS": env.int("DJFLOW_TIMER_RETENTION_SECONDS", default=86400),
    # A worker without a step's handler hands the attempt back (class unservable) at most
    # this many times in a row at once; after that the reconciler offers it again.
    "MAX_QUICK_REFUSALS": env.int("DJFLOW_MAX_QUICK_REFUSALS", default=20),
    # How long a worker that handed an attempt back keeps its slot, so another takes it.
    "UNSERVABLE_PAUSE_SECONDS": env.float("DJFLOW_UNSERVABLE_PAUSE_SECONDS", default=0.25),
    # An attempt whose handler no live worker serves (on its queue) fails, class unservable,
    # when none has served it for this long (a worker lacking a handler another live worker
    # has just hands it back). The same window decides starts: a handler a worker served
    # within it (workers restarting) is accepted and the run waits; none in it is a 400.
    "UNSERVABLE_SECONDS": env.float("DJFLOW_UNSERVABLE_SECONDS", default=60.0),
    # Each worker writes a heartbeat (the handlers and queues it serves) this often; it counts
    # as live while its last one is at most WORKER_LIVE_BEATS beats old.
    "WORKER_HEARTBEAT_SECONDS": env.float("DJFLOW_WORKER_HEARTBEAT_SECONDS", default=5.0),
    "WORKER_LIVE_BEATS": env.int("DJFLOW_WORKER_LIVE_BEATS", default=3),
    # Starting a run whose task or agent handler no worker has served within
    # UNSERVABLE_SECONDS is refused (400); one a worker served in that window, but no live
    # worker serves now, is accepted and waits for a worker from its start. Turn off where
    # workers are started on demand (scaled from zero) or after the API.
    "START_CHECKS_WORKERS": env.bool("DJFLOW_START_CHECKS_WORKERS", default=True),
    # POST /runs plans the run's first step in the request up to this many times a second per
    # web process; past it the request inserts the run and a worker plans it (runs.services).
    "START_INLINE_PER_SECOND": env.float("DJFLOW_START_INLINE_PER_SECOND", default=1.0),
    # A worker that finished a step runs the run's next step itself (no broker hop) for at
    # most this many steps and seconds in one task, then offers it through the broker.
    "INLINE_MAX_STEPS": env.int("DJFLOW_INLINE_MAX_STEPS", default=50),
    "INLINE_SECONDS": env.float("DJFLOW_INLINE_SECONDS", default=2.0),
    # Attempts of a fan-out sent in one message (runs.dispatch.offer_fan_out_on_commit): run
    # one after another by the worker that takes it, the rest offered to other workers as
    # soon as one runs long (workers.batches). 1 sends a message per attempt.
    "FAN_OUT_PER_MESSAGE": env.int("DJFLOW_FAN_OUT_PER_MESSAGE", default=10),
    # A fan-out's messages go as one Celery chord whose body is runs.advance of the run (the
    # design card: "parallel and foreach map onto chords"); a notification only, the fan-in
    # is the journal's. false: the same messages without the chord (bench.fanout compares).
    "FAN_OUT_CHORDS": env.bool("DJFLOW_FAN_OUT_CHORDS", default=True),
    # On a result backend that counts no chord (the embedded default's database), Celery's
    # chord_unlock polls a fan-out's header results every second for at most this long.
    "FAN_OUT_CHORD_UNLOCK_SECONDS": env.float("DJFLOW_FAN_OUT_CHORD_UNLOCK_SECONDS", default=600.0),
    # For the engine's own tests: every plan made from a run's settled prefix (the rows after
    # it only) is made again from the whole journal, and a difference raises.
    "CHECK_PREFIX": env.bool("DJFLOW_CHECK_PREFIX", default=False),
    # How long a worker keeps trying to record a finished attempt while the database is
    # unreachable (a restart, a fail-over) before it gives up and leaves it to the lease.
    "RECORD_RETRY_SECONDS": env.float("DJFLOW_RECORD_RETRY_SECONDS", default=60.0),
    # Approval steps: reminders no more often than this (a document asking for less is
    # refused at save, and a stored one is held to it when its request opens), and the
    # e-mail domains anyone may name as approvers (exact domains, lower case); naming an
    # address elsewhere takes the permission approvals.mail_external. Empty: none.
    "MIN_REMIND_MS": env.int("DJFLOW_MIN_REMIND_MS", default=600_000),
    "APPROVER_EMAIL_DOMAINS": [
        domain.strip().lower().rstrip(".")
        for domain in env.list("DJFLOW_APPROVER_EMAIL_DOMAINS", default=[])
        if domain.strip()
    ],
    # Model calls in flight at once per account, across every worker process and machine
    # (workers.slots), counted in Redis: by default the broker's when it is Redis, else the
    # result backend's; with neither (the embedded default) calls are not counted, which
    # each worker says once at start. Set the URL empty to turn counting off.
    "MODEL_CONCURRENCY": env.int("DJFLOW_MODEL_CONCURRENCY", default=10),
    "MODEL_SLOTS_REDIS_URL": env(
        "DJFLOW_MODEL_SLOTS_REDIS_URL",
        default=next(
            (url for url in (CELERY_BROKER_URL, CELERY_RESULT_BACKEND) if _is_redis(url)), ""
        ),
    ),
    # How long a model call waits in its worker for one of its account's slots before its
    # attempt is handed back (to be offered again), so a full account does not hold workers.
    "MODEL_SLOT_WAIT_SECONDS": env.float("DJFLOW_MODEL_SLOT_WAIT_SECONDS", default=2.0),
    # How long a slot outlives its holder's last refresh (every quarter of it): a killed
    # worker's slots are free again within this.
    "MODEL_SLOT_TTL_SECONDS": env.float("DJFLOW_MODEL_SLOT_TTL_SECONDS", default=60.0),
    # http steps: the hosts they may reach besides public addresses (comma-separated host
    # names, exact and case-insensitive, or IP addresses and CIDRs matched against the
    # address a name resolves to; see workers/netguard.py), and the largest response body
    # they read, in bytes (past it the step fails, class fatal).
    "HTTP_ALLOW": _http_allow(env.list("DJFLOW_HTTP_ALLOW", default=[])),
    "HTTP_MAX_RESPONSE_BYTES": env.int("DJFLOW_HTTP_MAX_RESPONSE_BYTES", default=1_048_576),
    # The queues a step's ``queue`` may name in a document a person saves, besides
    # ``default`` (comma-separated; workflows.queues). The engine's own never: see there.
    "STEP_QUEUES": _step_queues(env.list("DJFLOW_STEP_QUEUES", default=["default"])),
    # Run-end webhooks (a document's notify; workers/notify.py): attempts at most, the wait
    # after the first failed one (doubled after each, at most NOTIFY_BACKOFF_MAX_SECONDS),
    # each attempt's time-out, and the largest body (past it the run is sent without its
    # journal). Their addresses follow HTTP_ALLOW, as http steps' do.
    "NOTIFY_MAX_ATTEMPTS": env.int("DJFLOW_NOTIFY_MAX_ATTEMPTS", default=8),
    "NOTIFY_BACKOFF_SECONDS": env.float("DJFLOW_NOTIFY_BACKOFF_SECONDS", default=10.0),
    "NOTIFY_BACKOFF_MAX_SECONDS": env.float("DJFLOW_NOTIFY_BACKOFF_MAX_SECONDS", default=600.0),
    "NOTIFY_TIMEOUT_SECONDS": env.float("DJFLOW_NOTIFY_TIMEOUT_SECONDS", default=10.0),
    "NOTIFY_MAX_BODY_BYTES": env.int("DJFLOW_NOTIFY_MAX_BODY_BYTES", default=1_048_576),
    # Model prices come from genai-prices' bundled table (offline: it is never updated at run
    # time). DJFLOW_PRICES (JSON, USD per million tokens) wins over it, keyed
    # "provider:model" or "model": {"input": x, "output": y, "cached_input": z}; a model
    # neither knows is recorded but not priced.
    "PRICES": env.json("DJFLOW_PRICES", default={}),
    # The model of a recipe step that names none ("<provider>:<model>"); empty: none.
    "DEFAULT_MODEL": env.str("DJFLOW_DEFAULT_MODEL", default=""),
    # Providers beyond openai and anthropic, each speaking one of their wire formats:
    # {"ollama": {"adapter": "openai", "base_url": "http://127.0.0.1:11434/v1",
    # "api_key_env": "OLLAMA_API_KEY"}} (api_key_env only where the endpoint wants a key).
    "PROVIDERS": env.json("DJFLOW_PROVIDERS", default={}),
    # mcp_tool steps: the MCP servers by name (see _mcp_servers), and each process's pool of
    # clients to them: at most MCP_POOL_SIZE open, the least recently used closed first, one
    # idle for MCP_IDLE_SECONDS closed (workers/mcp/pool.py). Pre-flight at a start lists a
    # server's tools, waiting at most MCP_PREFLIGHT_TIMEOUT_SECONDS, and keeps the list for
    # MCP_PREFLIGHT_CACHE_SECONDS.
    "MCP_SERVERS": _mcp_servers(env.str("DJFLOW_MCP_SERVERS", default="")),
    "MCP_POOL_SIZE": env.int("DJFLOW_MCP_POOL_SIZE", default=20),
    "MCP_IDLE_SECONDS": env.float("DJFLOW_MCP_IDLE_SECONDS", default=60.0),
    "MCP_PREFLIGHT_TIMEOUT_SECONDS": env.float("DJFLOW_MCP_PREFLIGHT_TIMEOUT_SECONDS", default=3.0),
    "MCP_PREFLIGHT_CACHE_SECONDS": env.float("DJFLOW_MCP_PREFLIGHT_CACHE_SECONDS", default=30.0),
    # Knowledge-base retrieval fuses full-text search with vector search (pgvector) when this
    # names an embeddings model ("<provider>:<model>", OpenAI's format or standin); empty:
    # full text only. Its vectors' length is sent to the provider as `dimensions`; empty:
    # the model's own (the stand-in's 384).
    "EMBEDDINGS_MODEL": env.str("DJFLOW_EMBEDDINGS_MODEL", default=""),
    "EMBEDDINGS_DIMENSIONS": _embeddings_dimensions(
        env.str("DJFLOW_EMBEDDINGS_DIMENSIONS", default="")
    ),
    # Knowledge bases: the largest document content a write keeps (UTF-8 bytes; past it a
    # write_kb step fails with class invalid_input, naming content), and the most text a
    # recipe's context passes into ${context} (the best passages first, the rest cut).
    "KB_MAX_CONTENT_BYTES": env.int("DJFLOW_KB_MAX_CONTENT_BYTES", default=102_400),
    "KB_CONTEXT_MAX_BYTES": env.int("DJFLOW_KB_CONTEXT_MAX_BYTES", default=32_768),
    # Bulk cancel and retry (runs.bulk): the most runs one batch (one transaction of a worker)
    # acts on.
    "BULK_BATCH": env.int("DJFLOW_BULK_BATCH", default=100),
    # Retention (runs.retention): ended runs are deleted this many days after they ended, per
    # status (empty: kept forever); a beat entry purges every RETENTION_EVERY_SECONDS, for at
    # most RETENTION_TICK_SECONDS a pass (then it hands the rest to its next message),
    # RETENTION_BATCH run trees per transaction.
    "RETENTION_DAYS": _retention_days(env.str("DJFLOW_RETENTION_DAYS", default="")),
    "RETENTION_EVERY_SECONDS": env.int("DJFLOW_RETENTION_EVERY_SECONDS", default=3600),
    "RETENTION_TICK_SECONDS": env.float("DJFLOW_RETENTION_TICK_SECONDS", default=60.0),
    "RETENTION_BATCH": env.int("DJFLOW_RETENTION_BATCH", default=100),
    # Schedules (README "Schedules"): the shortest every_ms a schedule may have (a cron's
    # finest is a minute too), the most schedules one user may have of one workflow, what a
    # fire does with slots missed while beat or every worker was down ("one": one start for
    # all of them; "skip": none), and how late a fire may come and still count as on time.
    "SCHEDULE_MIN_INTERVAL_MS": env.int("DJFLOW_SCHEDULE_MIN_INTERVAL_MS", default=60_000),
    "SCHEDULES_PER_WORKFLOW": env.int("DJFLOW_SCHEDULES_PER_WORKFLOW", default=20),
    "SCHEDULE_CATCH_UP": env.str("DJFLOW_SCHEDULE_CATCH_UP", default="one"),
    "SCHEDULE_GRACE_SECONDS": env.float("DJFLOW_SCHEDULE_GRACE_SECONDS", default=60.0),
}
DATA_UPLOAD_MAX_MEMORY_SIZE = DJFLOW["MAX_BODY_BYTES"]
if DJFLOW["MODEL_CONCURRENCY"] < 1:
    raise ImproperlyConfigured(
        f"DJFLOW_MODEL_CONCURRENCY must be at least 1, not {DJFLOW['MODEL_CONCURRENCY']}"
    )
if DJFLOW["MODEL_SLOT_WAIT_SECONDS"] < 0:
    raise ImproperlyConfigured("DJFLOW_MODEL_SLOT_WAIT_SECONDS must not be negative")
if DJFLOW["SCHEDULE_CATCH_UP"] not in ("skip", "one"):
    raise ImproperlyConfigured(
        f"DJFLOW_SCHEDULE_CATCH_UP must be skip or one, not {DJFLOW['SCHEDULE_CATCH_UP']!r}"
    )
if DJFLOW["SCHEDULE_MIN_INTERVAL_MS"] < 1000:
    raise ImproperlyConfigured("DJFLOW_SCHEDULE_MIN_INTERVAL_MS must be at least 1000")
if DJFLOW["MCP_POOL_SIZE"] < 1:
    raise ImproperlyConfigured(
        f"DJFLOW_MCP_POOL_SIZE must be at least 1, not {DJFLOW['MCP_POOL_SIZE']}"
    )
for _name in ("BULK_BATCH", "RETENTION_BATCH", "RETENTION_EVERY_SECONDS"):
    if DJFLOW[_name] < 1:
        raise ImproperlyConfigured(f"DJFLOW_{_name} must be at least 1, not {DJFLOW[_name]}")
for _name in ("MAX_TREE_RUNS", "MAX_TREE_RUNS_PER_MINUTE", "MAX_STEPS_CEILING", "ANSWER_STEPS"):
    if DJFLOW[_name] < 1:
        raise ImproperlyConfigured(f"DJFLOW_{_name} must be at least 1, not {DJFLOW[_name]}")
if DJFLOW["CANCEL_INLINE_RUNS"] < 0:
    raise ImproperlyConfigured("DJFLOW_CANCEL_INLINE_RUNS must not be negative")
for _name in ("MCP_IDLE_SECONDS", "MCP_PREFLIGHT_TIMEOUT_SECONDS", "RETENTION_TICK_SECONDS"):
    if DJFLOW[_name] <= 0:
        raise ImproperlyConfigured(f"DJFLOW_{_name} must be more than 0")
# Pre-flight waits inside a web request (POST /runs, the admin's definition page): a longer
# wait would hold a web worker past what a proxy or gunicorn gives a request.
if DJFLOW["MCP_PREFLIGHT_TIMEOUT_SECONDS"] > 10:
    raise ImproperlyConfigured("DJFLOW_MCP_PREFLIGHT_TIMEOUT_SECONDS must be at most 10")

# Log lines as text (the default) or as JSON objects carrying the run, step, attempt and
# trace ids (config.logging), for a log pipeline to index.
LOG_FORMAT = env.str("DJFLOW_LOG_FORMAT", default="text").strip().lower()
if LOG_FORMAT not in ("text", "json"):
    raise ImproperlyConfigured(f"DJFLOW_LOG_FORMAT must be text or json, not {LOG_FORMAT!r}")
_JSON_LOGS = LOG_FORMAT == "json"

# Celery's per-task lines about the engine's clock (the 1 s timer tick, the reconciler) are
# dropped at their loggers: 186 of an idle minute's 186 lines (config.logging says more).
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {
        "quiet_clock": {"()": "config.logging.QuietClock"},
        "run_ids": {"()": "config.logging.RunIds"},
    },
    "formatters": {"json": {"()": "config.logging.json_formatter"}},
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            **({"formatter": "json", "filters": ["run_ids"]} if _JSON_LOGS else {}),
        }
    },
    "root": {"handlers": ["console"], "level": env("LOG_LEVEL", default="INFO")},
    "loggers": {
        "django.db.backends": {"level": "INFO"},
        # httpx2 logs every request's full URL at INFO, query string included, and a query
        # may carry a credential (http steps, the model SDKs): only its warnings are kept.
        "httpx2": {"level": "WARNING"},
        "httpcore2": {"level": "WARNING"},
        # DJFLOW_LOG_CLOCK=true keeps Celery's routine lines about the clock's tasks (beat's
        # "Sending due task", the worker's received/succeeded): for a clock that seems stuck.
        **{
            name: {
                "filters": [] if env.bool("DJFLOW_LOG_CLOCK", default=False) else ["quiet_clock"]
            }
            for name in CELERY_TASK_LOGGERS
        },
    },
}

# --- Sentry -------------------------------------------------------------------------------
SENTRY_DSN = env("SENTRY_DSN", default="")
if SENTRY_DSN:
    from config.sentry import init_sentry

    init_sentry(
        dsn=SENTRY_DSN,
        environment=env("SENTRY_ENVIRONMENT", default="production"),
        traces_sample_rate=env.float("SENTRY_TRACES_SAMPLE_RATE", default=0.0),
    )
