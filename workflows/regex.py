"""Regular expressions on a linear-time engine (RE2), for ``matches`` guards and the
``pattern``s of ``input_schema`` (contract section 9).

Python's ``re`` backtracks: ``^(a+)+$`` against 29 ``a`` and a ``!`` froze a web process for
9 s, and each extra character doubles it. RE2 matches in time linear in the text, so it has no
backreferences and no lookarounds; a pattern that needs them is refused at save.

Pure Python, no Django. Never raises on a string pattern.
"""

from __future__ import annotations

import functools
from typing import Any

import re2

__all__ = ["compile_linear", "linear_pattern_error"]

_OPTIONS = re2.Options()
# RE2 logs every refused pattern to stderr; the refusal is reported to the author instead.
_OPTIONS.log_errors = False


def linear_pattern_error(pattern: str) -> str | None:
    """Why RE2 cannot compile ``pattern`` (backreferences and lookarounds among the reasons), or
    ``None`` when it can."""
    try:
        re2.compile(pattern, _OPTIONS)
    except re2.error as exc:
        reason = exc.args[0] if exc.args else exc
        text = reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)
        return f"{text} (patterns run on RE2, which has no backreferences or lookarounds)"
    except (OverflowError, RecursionError, ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@functools.lru_cache(maxsize=256)
def compile_linear(pattern: str) -> Any | None:
    """The compiled RE2 pattern (with ``search``), or ``None`` when RE2 cannot compile it."""
    if not isinstance(pattern, str) or linear_pattern_error(pattern) is not None:
        return None
    return re2.compile(pattern, _OPTIONS)
