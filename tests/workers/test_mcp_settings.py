"""DJFLOW_MCP_SERVERS is checked when the settings load: a bad entry refuses to start, naming
the entry and what is wrong with it, and never quoting a header's or an env variable's value
(they hold credentials)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from config.settings import _mcp_servers

from ..settings_probe import probe_settings

SECRET = "Bearer hush-hush-42"

BAD = {
    "not-json": ("{nope", "DJFLOW_MCP_SERVERS is not JSON"),
    "not-an-object": ("[1, 2]", "DJFLOW_MCP_SERVERS must be a JSON object"),
    "entry-not-object": ('{"a": "http://x"}', "DJFLOW_MCP_SERVERS['a']: must be an object"),
    "neither": ('{"a": {}}', "DJFLOW_MCP_SERVERS['a']: give either \"url\""),
    "both": ('{"a": {"url": "http://x", "command": ["x"]}}', "not both or none"),
    "bad-scheme": ('{"a": {"url": "file:///etc/passwd"}}', "must be an http:// or https:// URL"),
    "unknown-field": ('{"a": {"url": "http://x", "header": {}}}', "unknown field 'header'"),
    "empty-command": ('{"s": {"command": []}}', "DJFLOW_MCP_SERVERS['s']: \"command\" must be"),
    "command-not-list": ('{"s": {"command": "python -m x"}}', '"command" must be a non-empty'),
    "env-not-strings": ('{"s": {"command": ["x"], "env": {"A": 1}}}', "'env' must map names"),
    "header-line-break": (
        json.dumps({"h": {"url": "http://x", "headers": {"Authorization": SECRET + "\r\nX: y"}}}),
        "DJFLOW_MCP_SERVERS['h']: 'headers' must map names to strings",
    ),
    "empty-name": ('{"": {"url": "http://x"}}', "1 to 200 printable characters"),
}


@pytest.mark.parametrize("raw, expected", list(BAD.values()), ids=list(BAD))
def test_a_bad_entry_is_refused_naming_it(raw: str, expected: str) -> None:
    with pytest.raises(ImproperlyConfigured) as refused:
        _mcp_servers(raw)
    assert expected in str(refused.value)
    assert "hush-hush" not in str(refused.value)


def test_good_entries_are_kept_normalised() -> None:
    raw = json.dumps(
        {
            "docs": {"url": "https://mcp.example.com/mcp", "headers": {"Authorization": SECRET}},
            "local": {"command": ["python", "-m", "tools"]},
        }
    )
    assert _mcp_servers(raw) == {
        "docs": {"url": "https://mcp.example.com/mcp", "headers": {"Authorization": SECRET}},
        "local": {"command": ["python", "-m", "tools"], "env": {}},
    }
    assert _mcp_servers("") == {}


def test_a_process_with_a_bad_entry_does_not_start(tmp_path: Path) -> None:
    servers = json.dumps({"docs": {"url": "ftp://x", "headers": {"A": SECRET}}})
    done = probe_settings(tmp_path, unset=["DATABASE_URL"], DJFLOW_MCP_SERVERS=servers)
    assert done.returncode != 0
    assert "ImproperlyConfigured: DJFLOW_MCP_SERVERS['docs']" in done.stderr
    assert "hush-hush" not in done.stderr


def test_sentry_events_mask_the_configured_header_values(settings) -> None:
    import sentry_sdk

    from config.sentry import init_sentry
    from tests.runs.test_secrets import Captured

    settings.DJFLOW = {
        **settings.DJFLOW,
        "MCP_SERVERS": {
            "docs": {"url": "http://127.0.0.1:9/mcp", "headers": {"X-Key": SECRET}},
            "keyed": {"url": "http://bot:pass-word-9@127.0.0.1:9/mcp?token=tok-en-77"},
            "local": {"command": ["prog"], "env": {"API_KEY": "envsecret-42", "DEBUG": "1"}},
        },
    }
    transport = Captured()
    init_sentry(
        dsn="https://public@127.0.0.1/1",
        environment="test",
        traces_sample_rate=0.0,
        transport=transport,
    )
    try:
        headers = {"X-Key": SECRET}  # a frame's local, as the pool's would be
        try:
            raise RuntimeError(
                f"the server refused {headers['X-Key']} envsecret-42 pass-word-9 "
                "http://bot:pass-word-9@127.0.0.1:9/mcp?token=tok-en-77 tok-en-77 debug=1"
            )
        except RuntimeError:
            sentry_sdk.capture_exception()
        sentry_sdk.flush()
    finally:
        sentry_sdk.get_client().close()
        sentry_sdk.init(trace_propagation_targets=[])
    sent = "\n".join(transport.sent)
    assert len(transport.sent) == 1 and "the server refused" in sent
    assert "hush-hush" not in sent
    # A stdio env's long values and a URL's credentials are masked; a short value ("1") is
    # not, or every "1" of every event would be.
    for secret in ("envsecret-42", "pass-word-9", "tok-en-77"):
        assert secret not in sent
    assert "debug=1" in sent
