"""Regular expressions on a linear-time engine (RE2), for ``matches`` guards, the
``pattern``s of ``input_schema`` and every ``format: "regex"`` value a client or a model sends
(contract section 9).

Python's ``re`` backtracks: ``^(a+)+$`` against 29 ``a`` and a ``!`` froze a web process for
9 s, and each extra character doubles it. Compiling is no safer: ``re.compile`` of a
case-insensitive character class took about 6 ms, so a 32 KB input of such values held a web
worker 22.8 s, and 10,000 nested parentheses raised RecursionError (a 500). RE2 parses and
compiles in time linear in the pattern, on heap stacks (10,000 nested parentheses compile),
refuses any program larger than ``max_mem`` allows, and matches in time linear in the text; so
it has no backreferences and no lookarounds, and a pattern that needs them is refused.

``max_mem`` is :data:`MAX_MEM` (1.25 MiB), not RE2's default 8 MiB: compile time and memory
are proportional to it. At 8 MiB a counted repetition of a wide class, ``[\\pL\\pN]{400}``,
compiled to 536,804 instructions in about 190 ms and each compiled pattern could keep up to
8 MiB; at 1.25 MiB a program has at most about 85,000 instructions (about 30 ms at worst,
``[\\pL\\pN]{63}``) and a larger one is refused after a few ms. 1.25 MiB is what the largest
legitimate patterns measured need: 65,536 literal characters (65,540 instructions) or a
thousand case-insensitive Unicode classes (59,004). :func:`linear_pattern_cost` says what one
compile cost, in instructions, so that a validation can bound the total.

Where the two engines disagree, RE2's verdict wins: a value is a regular expression here when
RE2 can compile it, because RE2 is what the engine would run it on (``(a)\\1`` and ``(?=a)``
are refused though Python's ``re`` takes them; ``\\pL`` and ``\\z`` pass though it does not).

Pure Python, no Django. Never raises on a string pattern.
"""

from __future__ import annotations

import functools
from typing import Any

import re2

__all__ = [
    "MAX_MEM",
    "TOO_LARGE_COST",
    "compile_linear",
    "linear_pattern_cost",
    "linear_pattern_error",
]

# RE2's memory bound for every pattern judged or compiled here (program and DFA cache).
MAX_MEM = 1_280 * 1024
# What a pattern refused for its size is charged, in instructions: more than any program
# MAX_MEM admits (about 85,000), since RE2 built up to that much before giving up.
TOO_LARGE_COST = 131_072

_OPTIONS = re2.Options()
_OPTIONS.max_mem = MAX_MEM
# RE2 logs every refused pattern to stderr; the refusal is reported to the author instead.
_OPTIONS.log_errors = False
# RE2 quotes the offending part of a pattern in its message: a client's 1 MiB pattern must
# not come back as a 1 MiB message.
_MAX_REASON_CHARS = 200


def _compiled(pattern: str) -> tuple[Any | None, str | None, int]:
    """RE2's program for ``pattern`` or ``None``, why not, and what compiling cost."""
    try:
        compiled = re2._Regexp(pattern, _OPTIONS)
    except re2.error as exc:
        reason = exc.args[0] if exc.args else exc
        text = reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)
        cost = TOO_LARGE_COST if "pattern too large" in text else 0
        if len(text) > _MAX_REASON_CHARS:
            text = text[: _MAX_REASON_CHARS - 3] + "..."
        reason = f"{text} (patterns run on RE2, which has no backreferences or lookarounds)"
        return None, reason, cost
    except (OverflowError, RecursionError, ValueError, TypeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"[:_MAX_REASON_CHARS], 0
    return compiled, None, int(compiled.programsize)


def linear_pattern_cost(pattern: str) -> tuple[str | None, int]:
    """Why RE2 cannot compile ``pattern`` (or ``None`` when it can), and what compiling it
    cost in program instructions: its program's size, :data:`TOO_LARGE_COST` when it was
    refused as too large, 0 when refused while parsing (time linear in its characters). Keeps
    nothing: the compiled program is dropped at once (``re2.compile`` would keep the last 128
    in its own cache, for patterns a client chose)."""
    _, reason, cost = _compiled(pattern)
    return reason, cost


def linear_pattern_error(pattern: str) -> str | None:
    """Why RE2 cannot compile ``pattern`` (backreferences and lookarounds among the reasons), or
    ``None`` when it can. Costs time linear in the pattern, bounded by :data:`MAX_MEM`, and
    keeps nothing."""
    return linear_pattern_cost(pattern)[0]


# Each cached program keeps up to MAX_MEM (its DFA cache grows with the texts it searches):
# 64 of them at most 80 MiB (256 programs of up to 8 MiB each took a process from 169 MB to
# 776 MB of RSS).
@functools.lru_cache(maxsize=64)
def compile_linear(pattern: str) -> Any | None:
    """The compiled RE2 pattern (with ``search``), or ``None`` when RE2 cannot compile it."""
    if not isinstance(pattern, str):
        return None
    # Not re2.compile: its own cache would keep 128 more programs beside these.
    return _compiled(pattern)[0]
