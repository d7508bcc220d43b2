"""How a call's prompt, reply, tool arguments and result are stored (:class:`~runs.models.Content`):
once each by the SHA-256 of its canonical JSON, a prompt in parts (CONTRACT section 17).

A prompt ``{"system": text or None, "messages": [...]}`` is stored as its system text (a row
of its own), one row per message, and a row of its own that refers to both. A message's row
stands for the list of messages up to it, keyed by that list's digest, and refers to the list
before it: every prompt of a conversation that grows by a message per call shares the rows of
the messages it repeats, so a thread of n messages stores each once and one small row per
prompt, where storing each prompt whole stored every earlier message again with every call
(n calls of a thread of 2 messages per turn: n(n+1) messages instead of 2n).

Invariants:

- A row's digest is the SHA-256 of the canonical JSON of the value it stands for, whole or
  in parts; ``size`` is that JSON's length. So a prompt's digest and size are those of the
  whole prompt, as they were when prompts were stored whole, and a row stored whole before
  (or by a replay) and one stored in parts answer the same value: readers take either.
- A row's parts are stored in the same statement as the row, or before it, and are deleted
  only once no row refers to them (``runs.retention``).
- Only the exact prompt shape is stored in parts: anything else (a reply, a tool's values, a
  prompt with another key) is stored whole.

Reading a prompt in parts costs one more query, for every prompt read together: its rows and
its parts' rows in one recursive query over ``rest`` (which Postgres and SQLite both run).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

from django.db.models.expressions import RawSQL

from ..models import Content

Shape = Content.Shape


def canonical(body: Any) -> bytes:
    """``body``'s canonical JSON: sorted keys, no spaces, UTF-8."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def digest(body: Any) -> str:
    """The SHA-256 of ``body``'s canonical JSON."""
    return hashlib.sha256(canonical(body)).hexdigest()


# --- writing ------------------------------------------------------------------------------


def rows_of(body: Any) -> list[Content]:
    """The rows that store ``body``, its own row last (a prompt's parts before it)."""
    raw = canonical(body)
    key = hashlib.sha256(raw).hexdigest()
    if not _in_parts(body):
        return [Content(digest=key, body=body, size=len(raw))]
    rows: list[Content] = []
    system = body["system"]
    if system is not None:
        [text] = rows_of(system)
        rows.append(text)
    rows.extend(_lists(body["messages"]))
    rows.append(
        Content(
            digest=key,
            body={},
            size=len(raw),
            shape=Shape.PROMPT,
            head_id=rows[0].digest if system is not None else None,
            rest_id=rows[-1].digest if body["messages"] else None,
        )
    )
    return rows


def store(bodies: Sequence[Any]) -> dict[int, str]:
    """Store each body (None skipped) once by its digest, in one statement; answers each
    body's digest by the body's ``id()``. The same content again is the row already stored:
    nothing is written twice. Rows go in digest order, so two writers storing the same
    contents wait for each other in the same order, never both at once. A row's parts go in
    the same statement (the foreign keys are checked at commit)."""
    rows: dict[str, Content] = {}
    digests: dict[int, str] = {}
    for body in bodies:
        if body is None:
            continue
        made = rows_of(body)
        for row in made:
            rows.setdefault(row.digest, row)
        digests[id(body)] = made[-1].digest
    Content.objects.bulk_create([rows[key] for key in sorted(rows)], ignore_conflicts=True)
    return digests


def _in_parts(body: Any) -> bool:
    return (
        isinstance(body, dict)
        and body.keys() == {"system", "messages"}
        and isinstance(body["messages"], list)
        and (body["system"] is None or isinstance(body["system"], str))
    )


def _lists(messages: list[Any]) -> list[Content]:
    """A row per message, each keyed by the digest of the list up to it. The lists' canonical
    JSON is ``[m1,m2,...]``: hashed as it grows, so n messages cost n hashes of one message
    each, not of every prefix."""
    rows: list[Content] = []
    running = hashlib.sha256(b"[")
    size = 1
    for index, message in enumerate(messages):
        raw = canonical(message)
        if index:
            running.update(b",")
            size += 1
        running.update(raw)
        size += len(raw)
        closed = running.copy()
        closed.update(b"]")
        rows.append(
            Content(
                digest=closed.hexdigest(),
                body=message,
                size=size + 1,
                shape=Shape.LIST,
                rest_id=rows[-1].digest if rows else None,
            )
        )
    return rows


# --- reading ------------------------------------------------------------------------------


def bodies(digests: Iterable[str | None]) -> dict[str, Any]:
    """The value each stored content among ``digests`` stands for, whole: two queries at
    most (the rows, then the parts of those stored in parts)."""
    wanted = {digest for digest in digests if digest is not None}
    found = {row.digest: row for row in Content.objects.filter(digest__in=wanted)}
    assemble(found.values())
    return {key: row.body for key, row in found.items()}


def assemble(rows: Iterable[Content | None]) -> None:
    """Put in each row stored in parts (read with its call, ``select_related``) the whole
    value it stands for, in its ``body``: one query for all of them. Such a row is only read:
    it is never saved again (were it, it would hold the same value, whole)."""
    parted = {row.digest: row for row in rows if row is not None and row.shape != Shape.WHOLE}
    if not parted:
        return
    parts = _closure(parted)
    for row in parted.values():
        row.body = _whole(row.digest, parts)


def body(row: Content | None) -> Any:
    """The whole value ``row`` stands for (None for none)."""
    assemble([row])
    return None if row is None else row.body


def closure(digests: Iterable[str]) -> dict[str, tuple[str | None, str | None]]:
    """Each of ``digests`` and every part below it, as ``(head, rest)``: what retention needs
    to know of them, without their bodies."""
    return {
        key: (head, rest)
        for key, head, rest in _reached(list(digests)).values_list("digest", "head_id", "rest_id")
    }


def _closure(digests: Iterable[str]) -> dict[str, Content]:
    return {
        row.digest: row
        for row in _reached(list(digests)).only("digest", "body", "shape", "head", "rest")
    }


def _reached(digests: list[str]) -> Any:
    """The rows of ``digests`` and of every part below them, in one recursive query: a
    prompt's system text (``head``, always whole) and the chain of its messages (``rest``)."""
    table = Content._meta.db_table
    marks = ", ".join(["%s"] * len(digests))
    sql = (
        f"WITH RECURSIVE parts(digest) AS ("
        f"SELECT digest FROM {table} WHERE digest IN ({marks})"
        f" UNION SELECT head_id FROM {table} WHERE digest IN ({marks}) AND head_id IS NOT NULL"
        f" UNION SELECT c.rest_id FROM {table} c JOIN parts p ON c.digest = p.digest"
        " WHERE c.rest_id IS NOT NULL"
        ") SELECT digest FROM parts"
    )
    return Content.objects.filter(digest__in=RawSQL(sql, (*digests, *digests)))


def _whole(key: str, parts: dict[str, Content]) -> Any:
    row = parts[key]
    if row.shape == Shape.PROMPT:
        system = parts[row.head_id].body if row.head_id is not None else None
        messages = _messages(row.rest_id, parts) if row.rest_id is not None else []
        return {"system": system, "messages": messages}
    if row.shape == Shape.LIST:
        return _messages(key, parts)
    return row.body


def _messages(key: str | None, parts: dict[str, Content]) -> list[Any]:
    """The list a messages row stands for, walked back from its last message (a loop, not
    recursion: a thread may be longer than Python's recursion limit)."""
    backwards: list[Any] = []
    while key is not None:
        row = parts[key]
        backwards.append(row.body)
        key = row.rest_id
    backwards.reverse()
    return backwards
