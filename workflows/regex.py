"""Regular expressions on a linear-time engine (RE2), for ``matches`` guards, the
``pattern``s of ``input_schema`` and every ``format: "regex"`` value a client or a model sends
(contract section 9).

Python's ``re`` backtracks: ``^(a+)+$`` against 29 ``a`` and a ``!`` froze a web process for
9 s, and each extra character doubles it. Compiling is no safer: ``re.compile`` of a
case-insensitive character class took about 6 ms, so a 32 KB input of such values held a web
worker 22.8 s, and 10,000 nested parentheses raised RecursionError (a 500). RE2 parses and
compiles in time linear in the pattern, on heap stacks (10,000 nested parentheses compile),
refuses any program larger than ``max_mem`` (8 MiB, RE2's default, kept), and matches in time
linear in the text; so it has no backreferences and no lookarounds, and a pattern that needs
them is refused.

Where the two engines disagree, RE2's verdict wins: a value is a regular expression here when
RE2 can compile it, because RE2 is what the engine would run it on (``(a)\\1`` and ``(?=a)``
are refused though Python's ``re`` takes them; ``\\pL`` and ``\\z`` pass though it does not).

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
# RE2 quotes the offending part of a pattern in its message: a client's 1 MiB pattern must
# not come back as a 1 MiB message.
_MAX_REASON_CHARS = 200


def linear_pattern_error(pattern: str) -> str | None:
    """Why RE2 cannot compile ``pattern`` (backreferences and lookarounds among the reasons), or
    ``None`` when it can. Costs time linear in the pattern and keeps nothing: the compiled
    program is dropped at once (``re2.compile`` would keep the last 128 in a cache, each up to
    8 MiB, for patterns a client chose)."""
    try:
        re2._Regexp(pattern, _OPTIONS)
    except re2.error as exc:
        reason = exc.args[0] if exc.args else exc
        text = reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)
        if len(text) > _MAX_REASON_CHARS:
            text = text[: _MAX_REASON_CHARS - 3] + "..."
        return f"{text} (patterns run on RE2, which has no backreferences or lookarounds)"
    except (OverflowError, RecursionError, ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"[:_MAX_REASON_CHARS]
    return None


@functools.lru_cache(maxsize=256)
def compile_linear(pattern: str) -> Any | None:
    """The compiled RE2 pattern (with ``search``), or ``None`` when RE2 cannot compile it."""
    if not isinstance(pattern, str) or linear_pattern_error(pattern) is not None:
        return None
    return re2.compile(pattern, _OPTIONS)
