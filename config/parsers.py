"""The API's JSON parser: DRF's, refusing as a 400 the JSON that is valid but cannot be
handled (``workflows.json_limits`` says which and why: nested past ``MAX_JSON_DEPTH``,
``\\u0000`` or a lone surrogate in a string or a key, each place named).
"""

from __future__ import annotations

import sys
from typing import Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError

from workflows.errors import InvalidInput
from workflows.json_limits import MAX_JSON_DEPTH, json_depth, text_problems


class JSONParser(parsers.JSONParser):
    def parse(self, stream: Any, media_type: Any = None, parser_context: Any = None) -> Any:
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError(f"JSON nested more than {MAX_JSON_DEPTH} levels deep") from None
        except ParseError as error:
            # Python refuses integers of more than 4,300 digits (CVE-2020-10735) and says so
            # with advice for Python programmers; a client needs only the limit.
            if "int_max_str_digits" in str(error.detail):
                raise ParseError(
                    f"JSON parse error: a number has more than {sys.get_int_max_str_digits()} "
                    "digits"
                ) from None
            raise
        if json_depth(data) > MAX_JSON_DEPTH:
            raise ParseError(f"JSON nested more than {MAX_JSON_DEPTH} levels deep")
        problems = text_problems(data)
        if problems:
            raise InvalidInput(errors=problems)
        return data
