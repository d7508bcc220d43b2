"""Local HTTP servers for the http step's tests: real sockets, real HTTP/1.1 on loopback
(``http.server.ThreadingHTTPServer`` in a thread), each route a function of the request.

A route gets the handler and answers through :func:`reply` (or writes to it itself, for a
body that trickles). Every request is recorded in :attr:`Server.seen`.
"""

from __future__ import annotations

import ipaddress
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

Route = Callable[[BaseHTTPRequestHandler], None]


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Server:
    host: str
    port: int
    routes: dict[str, Route]
    seen: list[Seen] = field(default_factory=list)
    # path -> how many requests it has had (routes that answer differently the second time).
    counts: dict[str, int] = field(default_factory=dict)

    def url(self, path: str = "/") -> str:
        return f"http://{self.host}:{self.port}{path}"


def reply(
    handler: BaseHTTPRequestHandler,
    status: int,
    body: bytes | str = b"",
    headers: dict[str, str] | None = None,
) -> None:
    data = body.encode("utf-8") if isinstance(body, str) else body
    handler.send_response(status)
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(data)


def _handler_for(server: Server) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        body = b""

        def _any(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            path = self.path.split("?", 1)[0]
            # The body is read here: a route finds it as ``handler.body``, not on rfile.
            self.body = body
            server.seen.append(Seen(self.command, self.path, dict(self.headers.items()), body))
            server.counts[path] = server.counts.get(path, 0) + 1
            route = server.routes.get(path)
            try:
                if route is None:
                    reply(self, 404, "no such route")
                else:
                    route(self)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a time-out or a cap under test)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _any

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that refused the certificate, or hung up: the test asserts on that


@contextmanager
def serving(
    routes: dict[str, Route],
    host: str = "127.0.0.1",
    port: int = 0,
    tls: ssl.SSLContext | None = None,
) -> Iterator[Server]:
    """A server on ``host`` (any free port unless given) for the block's duration; HTTPS
    with ``tls`` (a server-side context)."""
    server = Server(host, port, routes)
    httpd = _QuietServer((host, port), _handler_for(server))
    httpd.daemon_threads = True
    if tls is not None:
        # The handshake in the request's thread, not in the accepting loop.
        httpd.socket = tls.wrap_socket(
            httpd.socket, server_side=True, do_handshake_on_connect=False
        )
    server.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    try:
        yield server
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def certificate(tmp_path: Path, name: str, *addresses: str) -> tuple[Path, Path]:
    """A self-signed certificate (its own CA) for ``name`` and the IP ``addresses``, valid for
    an hour: the paths of its PEM and of its key's."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    alt_names: list[x509.GeneralName] = [x509.DNSName(name)]
    alt_names += [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path
