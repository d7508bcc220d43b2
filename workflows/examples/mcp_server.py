"""A small MCP server to try ``mcp_tool`` steps with (the official SDK's ``MCPServer``).

Two tools about a support ticket's text:

- ``ticket_stats(text)``: structured content ``{"words", "characters", "lines", "questions",
  "urgent"}``, what an ``mcp_tool`` step answers as its output;
- ``slugify(text, max_length=60)``: text only (``export-crashes-on-large-files``), the step's
  output then being that text.

Run it over stdio (what ``DJFLOW_MCP_SERVERS`` starts with ``"command"``)::

    python -m workflows.examples.mcp_server

or over streamable HTTP on loopback (``"url": "http://127.0.0.1:8765/mcp"``)::

    python -m workflows.examples.mcp_server --http --port 8765

``workflows.examples.ticket_tools`` is a workflow that calls both.
"""

from __future__ import annotations

import argparse
import re
import unicodedata

from mcp.server.mcpserver import MCPServer
from pydantic import BaseModel, Field

server = MCPServer("djflow-examples", instructions="Tools about support tickets' text.")

# Words that make a ticket urgent (a toy rule: the point is the structured answer).
URGENT_WORDS = frozenset({"urgent", "asap", "down", "outage", "crash", "crashes", "immediately"})


class TicketStats(BaseModel):
    words: int = Field(description="how many words the text has")
    characters: int = Field(description="how many characters")
    lines: int = Field(description="how many lines")
    questions: int = Field(description="how many sentences end with a question mark")
    urgent: bool = Field(description="whether the text uses a word that asks for haste")


@server.tool()
def ticket_stats(text: str) -> TicketStats:
    """Count a ticket's words, characters, lines and questions, and say whether it reads
    urgent."""
    words = re.findall(r"[\w']+", text.lower())
    return TicketStats(
        words=len(words),
        characters=len(text),
        lines=len(text.splitlines()) or (1 if text else 0),
        questions=text.count("?"),
        urgent=any(word in URGENT_WORDS for word in words),
    )


@server.tool(structured_output=False)
def slugify(text: str, max_length: int = 60) -> str:
    """A short lower-case slug of the text (ASCII letters, digits and hyphens), e.g. for a
    branch or a file name."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")
    return slug[: max(1, min(max_length, 200))].rstrip("-")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="djflow's example MCP server")
    parser.add_argument("--http", action="store_true", help="streamable HTTP instead of stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args(argv)
    if args.http:
        server.run("streamable-http", host=args.host, port=args.port)
    else:
        server.run()


if __name__ == "__main__":
    main()
