"""``python -m bench.regex_format``: how long ``POST /api/v1/runs`` takes when its body is
full of ``format: "regex"`` values (issue 36, deliver 1).

Each request goes through Django's test client in this process: the whole of Django's and
DRF's request path (middleware, the JSON parser, token authentication, the start's checks
against the version's ``input_schema``, the run's insert), but no gunicorn and no socket, so
the figure is the server's work alone. The workflow's ``input_schema`` declares
``{"type": "string", "format": "regex"}`` fields; its one step is a 1 ms ``sleep`` (no worker
is needed to start it). It runs on the bench's Postgres database and Redis (``bench.common``;
``DJFLOW_BENCH_DATABASE_URL`` and ``DJFLOW_BENCH_REDIS_URL`` point elsewhere), and leaves the
runs it started there.

Shapes of body, each about ``--bytes`` of JSON (1 MiB by default, under the default
``DJFLOW_MAX_BODY_BYTES``):

- ``classes``: an array of short case-insensitive character classes over wide ranges,
  ``(?i)[\u0100-\uffff]1f`` and the like, each a pattern of its own (Python's ``re`` took 7 to
  20 ms to compile each);
- ``one``: one field holding one pattern of such classes, the whole body long;
- ``nested``: one pattern of parentheses nested 10,000 deep, padded with classes;
- ``alternation``: one pattern ``w0|w1|w2|...``, the whole body long;
- ``backref``: an array of ``(a)\\1``, which RE2 refuses (a 400 naming each field).

Prints ``shape | body bytes | status | median seconds`` over ``--repeat`` requests. Run it on
a quiet machine::

    .venv/bin/python -m bench.regex_format            # --bytes 1048576 --repeat 3
    .venv/bin/python -m bench.regex_format --bytes 32768 --shapes classes

Before issue 36 (jsonschema's own checker, Python's ``re``) use small ``--bytes``: a 32 KB
body of classes held a web worker 22.8 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench import common

WORKFLOW = "bench_regex_format"
USERNAME = "bench_regex"
# Case-insensitive classes over wide ranges: Python's re folds the case of every character in
# them, 7 to 20 ms each (measured here); each value ends in its own number, so no engine's
# cache of compiled patterns helps.
CLASSES = ("(?i)[\u0100-\uffff]", "(?i)[\\w\u0100-\u9fff]", "(?i)[^\u0100-\uffff]")


def _class(n: int) -> str:
    return f"{CLASSES[n % len(CLASSES)]}{n:x}"


def _fill(unit: Callable[[int], str], size: int) -> list[str]:
    """Values ``unit(0), unit(1), ...`` until their JSON array is about ``size`` bytes."""
    values: list[str] = []
    used = 2
    while True:
        value = unit(len(values))
        cost = len(json.dumps(value, ensure_ascii=False).encode()) + 1  # and a comma
        if used + cost > size:
            return values
        values.append(value)
        used += cost


def _pattern(size: int, start: str = "", end: str = "") -> str:
    """One pattern of classes between ``start`` and ``end`` whose JSON is about ``size``."""
    body = "".join(_fill(_class, size - len(start) - len(end)))
    return start + body + end


def bodies(size: int) -> dict[str, dict[str, Any]]:
    """The input of each shape, each about ``size`` bytes of JSON once wrapped in a start."""
    room = size - 200  # the start's other fields and the wrapping
    depth = 10_000
    return {
        "classes": {"patterns": _fill(_class, room)},
        "one": {"pattern": _pattern(room)},
        "nested": {"pattern": _pattern(room, "(" * depth, ")" * depth)},
        "alternation": {"pattern": "|".join(f"w{n}" for n in range(room // 8))[:room]},
        "backref": {"patterns": _fill(lambda n: f"(a{n % 10})\\1", room)},
    }


SCHEMA = {
    "type": "object",
    "properties": {
        "pattern": {"type": "string", "format": "regex"},
        "patterns": {"type": "array", "items": {"type": "string", "format": "regex"}},
    },
}


def _prepare() -> Any:
    """The workflow and a superuser's token; returns a client that sends it."""
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    from workflows.services import definition_save

    definition_save(
        document={
            "id": WORKFLOW,
            "input_schema": SCHEMA,
            "steps": [{"id": "nap", "kind": "sleep", "ms": 1}],
        }
    )
    user, _ = get_user_model().objects.get_or_create(
        username=USERNAME, defaults={"is_superuser": True, "is_staff": True}
    )
    token, _ = Token.objects.get_or_create(user=user)
    # A 500 is a figure too (before issue 36, deep nesting raised RecursionError).
    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


def measure(client: Any, raw: bytes, repeat: int) -> tuple[int, float]:
    """The status and the median seconds of ``repeat`` starts with body ``raw``."""
    seconds, status = [], 0
    for _ in range(repeat):
        started = time.perf_counter()
        response = client.generic("POST", "/api/v1/runs", raw, content_type="application/json")
        seconds.append(time.perf_counter() - started)
        status = response.status_code
    return status, statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=1_048_576, help="body size, in bytes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--shapes", default=",".join(bodies(1000)), help="comma-separated")
    args = parser.parse_args()
    common.configure()
    client = _prepare()
    print(f"{'shape':<12} | {'body bytes':>10} | status | median s (of {args.repeat})")
    for shape, value in bodies(args.bytes).items():
        if shape not in args.shapes.split(","):
            continue
        start = {"workflow": WORKFLOW, "input": value}
        raw = json.dumps(start, ensure_ascii=False, separators=(",", ":")).encode()
        status, median = measure(client, raw, args.repeat)
        print(f"{shape:<12} | {len(raw):>10} | {status:>6} | {median:.3f}", flush=True)


if __name__ == "__main__":
    main()
