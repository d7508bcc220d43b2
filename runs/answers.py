"""Answers within a size bound (issue 36): what ``GET /runs`` and ``GET /runs/{id}`` embed of
the values runs and attempts store.

A 934 KB start whose foreach echoed it made a 188 MB answer, read whole into the web worker
(1.27 GB). Now the rows are read without their values (``sized``: the values' sizes come
from the database, as octets of their JSON text), and ``bound`` then reads only the values
that fit: each at most ``DJFLOW_ANSWER_VALUE_BYTES``, all of one answer together at most
``DJFLOW_MAX_ANSWER_BYTES``, in the order they are shown (the runs first, then the journal,
oldest first). A value left out is ``null`` in the answer and listed in the object's
``truncated`` (``{field: {"bytes": n, "url": ...}}``), whose link answers the whole value
to whoever may read the run (``runs.views.RunInputView``, ``RunOutputView``).

Invariant: the web process holds at most the bound's bytes of values for one answer, however
large the journal (the sizes and ids of its rows aside).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from django.conf import settings
from django.db.models import BigIntegerField, Func, Model, QuerySet, TextField
from django.db.models.functions import Cast

from .models import Run, StepRun

RUN_VALUES = ("input", "output")
STEP_VALUES = ("input", "output", "error")


class _Octets(Func):
    """The byte length of a JSON column's text, computed where the value is."""

    function = "octet_length"
    output_field = BigIntegerField()

    def __init__(self, name: str) -> None:
        super().__init__(Cast(name, TextField()))

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        # SQLite's length() of a BLOB counts bytes (octet_length is 3.43+ only).
        return self.as_sql(
            compiler,
            connection,
            function="length",
            template="%(function)s(CAST(%(expressions)s AS BLOB))",
            **extra,
        )


def sized(queryset: QuerySet[Any], fields: Sequence[str]) -> QuerySet[Any]:
    """``queryset`` without the values of ``fields``, each with its size (``<field>_bytes``,
    None for SQL NULL) instead: what ``bound`` needs to choose."""
    return queryset.defer(*fields).annotate(**{f"{name}_bytes": _Octets(name) for name in fields})


def budget() -> tuple[int, int]:
    """(the bytes of values one answer embeds at most, the largest value it embeds)."""
    tunables = settings.DJFLOW
    return int(tunables["MAX_ANSWER_BYTES"]), int(tunables["ANSWER_VALUE_BYTES"])


def bound(
    runs: Iterable[Run], steps: Iterable[StepRun] = (), *, limits: tuple[int, int] | None = None
) -> None:
    """Read the values of ``runs`` and ``steps`` (from ``sized`` querysets) that fit the
    answer, in that order, and set them on the objects; each value left out is set to None
    and noted in the object's ``truncated`` ({field: bytes}). Reads one statement a field
    that has values to read. ``limits``: (all values, one value) instead of ``budget()``."""
    total, largest = limits or budget()
    spent = 0
    wanted: dict[tuple[type[Model], str], dict[Any, Any]] = defaultdict(dict)
    for objects, fields in ((runs, RUN_VALUES), (steps, STEP_VALUES)):
        for obj in objects:
            obj.truncated = {}
            for name in fields:
                size = getattr(obj, f"{name}_bytes", None)
                # Set now: a deferred field read later would load the whole value.
                setattr(obj, name, None)
                if size is None:
                    continue
                if size <= largest and spent + size <= total:
                    spent += size
                    wanted[(type(obj), name)][obj.pk] = obj
                else:
                    obj.truncated[name] = size
    for (model, name), objects in wanted.items():
        rows = model._default_manager.filter(pk__in=list(objects)).values_list("pk", name)
        for pk, value in rows:
            setattr(objects[pk], name, value)


def truncated(obj: Any, url_of: Callable[[str], str]) -> dict[str, Any] | None:
    """An object's ``truncated`` as the API shows it: {field: {"bytes", "url"}}, or None;
    ``url_of(field)`` is the address of the whole value."""
    left_out = getattr(obj, "truncated", None)
    if not left_out:
        return None
    return {name: {"bytes": size, "url": url_of(name)} for name, size in left_out.items()}
