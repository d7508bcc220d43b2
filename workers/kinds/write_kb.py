"""``write_kb``: a worker writes one document to a knowledge base and answers
``{kb, key, version}`` (CONTRACT sections 1 and 10).

Invariants:

- The attempt's stored input is what is written: :func:`prepare` (the planner, pure)
  resolves the step's ``kb``, ``key``, ``title`` and ``content`` templates afresh for every
  attempt into ``{"kb", "key", "title", "content"}``. ``kb`` and ``key`` must resolve to
  non-empty text (``kb`` a knowledge base's name), ``title`` to text or null (none),
  ``content`` to anything but null: text as it is, another JSON value as its compact JSON. A
  value that cannot be written fails the attempt with class ``invalid_input``, naming the
  field; so does content over ``DJFLOW_KB_MAX_CONTENT_BYTES`` (checked by the body, which
  reads the settings).
- The body upserts through ``workflows.knowledge.kb_write``: the knowledge base is created by
  its first write; the same title and content as the current version write nothing and
  answer that version, so an ``at_least_once`` retry after a write that landed makes no second
  version. The engine's write is trusted: the saving user's rights were checked at save
  (``workflows.services.kb_name_errors``).
- A run's secrets are never written: a knowledge base is shared with people who may not read
  the run, and it stores what it is given as it is (the API and the admin show it so). The
  body gets the attempt's input revealed, like any; what it writes has each secret's text
  replaced by ``••••`` (``workflows.secrets``), in the key and title as in the content.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from workflows import knowledge, secrets
from workflows.errors import InvalidInput
from workflows.failures import KindFailure
from workflows.kb_names import KEY_MAX_LENGTH, TITLE_MAX_LENGTH, name_problem
from workflows.kinds import Kind, Refused, Role, Scope, register

FIELDS = ("kb", "key", "title", "content")


def prepare(step: Mapping[str, Any], scope: Scope) -> dict[str, Any]:
    """The attempt's input: the document with the step's templates resolved (Refused, so
    class invalid_input naming the field, when one resolves to what cannot be written)."""
    kb = scope.resolve(step["kb"], "kb")
    problem = name_problem(kb)
    if problem:
        raise Refused(f"kb: resolved to {_shown(kb)}: {problem}")
    key = scope.resolve(step["key"], "key")
    if not isinstance(key, str) or not key:
        raise Refused(f"key: resolved to {_shown(key)}, not a non-empty string")
    if len(key) > KEY_MAX_LENGTH:
        raise Refused(f"key: is {len(key)} characters; at most {KEY_MAX_LENGTH} are allowed")
    title = scope.resolve(step["title"], "title") if step.get("title") is not None else None
    if title is None:
        title = ""
    if not isinstance(title, str):
        raise Refused(f"title: resolved to {_shown(title)}, not a string")
    if len(title) > TITLE_MAX_LENGTH:
        raise Refused(f"title: is {len(title)} characters; at most {TITLE_MAX_LENGTH} are allowed")
    content = scope.resolve(step["content"], "content")
    if content is None:
        raise Refused("content: resolved to null: there is nothing to write")
    if not isinstance(content, str):
        content = json.dumps(content, separators=(",", ":"), ensure_ascii=False)
    if not content:
        raise Refused("content: resolved to empty text: there is nothing to write")
    return {"kb": kb, "key": key, "title": title, "content": content}


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value[:40])
    names = {bool: "a boolean", dict: "an object", list: "an array"}
    return names.get(type(value), "a number")


def write_kb_body(step: Mapping[str, Any], workflow_id: str) -> Callable[..., Any]:
    """Every worker can write (no handler to have)."""
    return write


def write(ctx: Any, given: Any, prior: Any = None) -> dict[str, Any]:
    if not isinstance(given, Mapping) or any(
        not isinstance(given.get(name), str) for name in FIELDS
    ):
        raise KindFailure("write_kb: the attempt's input is not a prepared document", "fatal")
    given = secrets.shown(ctx.conceal({name: given[name] for name in FIELDS}))
    with ctx.span("kb_write", kb=given["kb"], key=given["key"]) as span:
        try:
            written = knowledge.kb_write(
                kb=given["kb"],
                key=given["key"],
                title=given["title"],
                content=given["content"],
                run_id=ctx.run_id,
                step_run_id=ctx.step_run_id or None,
            )
        except InvalidInput as invalid:
            problems = "; ".join(f"{e.field}: {e.message}" for e in invalid.errors)
            raise KindFailure(f"write_kb: {problems}", "invalid_input") from None
        version = written.document.version
        span.set_attribute("version", version)
        span.set_attribute("created", written.created)
    return {"kb": given["kb"], "key": given["key"], "version": version}


WRITE_KB = register(
    Kind("write_kb", Role.WORKER, max_attempts=3, prepare=prepare, body=write_kb_body)
)
