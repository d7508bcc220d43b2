"""Django's own error reports (the debug page, the mails to ``ADMINS``) with secrets masked.

A report shows the exception's message and every frame's local variables: a request that
started a run holds its input, secrets included (``workflows.secrets.expose``). The report is
scrubbed as rendered, like a Sentry event: the plaintexts this context holds, as the report
writes them (in a ``repr``, HTML-escaped), and every secret token show as ``••••``.
"""

from __future__ import annotations

from collections.abc import Callable

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe
from django.views.debug import ExceptionReporter

from workflows.secrets import exposed, exposing, scrub_text


def _scrubbed(text: str, form: Callable[[str], str]) -> str:
    with exposing([form(value) for value in exposed()]):
        return scrub_text(text)


def _quoted(value: str) -> str:
    return repr(value)[1:-1]


class SecretScrubbingReporter(ExceptionReporter):
    def get_traceback_html(self) -> SafeString:
        text = _scrubbed(str(super().get_traceback_html()), lambda value: escape(_quoted(value)))
        # What was escaped stays escaped; the mask is plain text.
        return mark_safe(_scrubbed(text, escape))

    def get_traceback_text(self) -> str:
        return _scrubbed(super().get_traceback_text(), _quoted)
