"""A loopback port that proves the server made no request to it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def never_contacted() -> Iterator[str]:
    """The URL of a listening loopback port; on leaving, asserts nothing connected to it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/x.json"
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
