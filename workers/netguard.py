"""The outbound address guard of ``http`` steps: a step may reach only public addresses,
unless its host is listed in ``DJFLOW_HTTP_ALLOW`` (contract section 10, "HTTP").

Invariants:

- A host is resolved once per connection (``socket.getaddrinfo``) and every address it
  resolves to is checked; one refused address refuses the host, so a name that answers a
  public and a private address cannot be used to reach the private one.
- The connection goes to a checked address, never to the name again: the check happens in
  the network backend's ``connect_tcp`` (:class:`GuardedBackend`), which connects to the
  address it checked. A name whose answer changes between check and connect (DNS
  rebinding) reaches only the address that was checked. TLS still names the original host
  (SNI and the certificate's name check are httpcore's, from the URL).
- Addresses are judged by what they are, not by how they were spelt: the resolver turns
  ``127.1``, ``2130706433`` and ``0x7f.1`` into 127.0.0.1 before the check, and an IPv6
  address carrying an IPv4 one (``::ffff:127.0.0.1``, NAT64 ``64:ff9b::/96``, 6to4
  ``2002::/16``) is judged by the IPv4 address it carries.
- The client never reads the environment (``trust_env=False``): an ``HTTP(S)_PROXY``
  variable would otherwise send the request through a proxy, past the guard.
- A refused address raises :class:`AddressRefused`, a ``StepFailure`` of class ``fatal``
  whose message names the host and the address, never a header or the URL's query.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpcore2
import httpx2
from django.conf import settings

from workflows.failures import StepFailure

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

SCHEMES = ("http", "https")
# The instance metadata services of the clouds (AWS, GCP, Azure, ... on IPv4; AWS's on IPv6):
# the one address whose answer is credentials, so it is named as such.
_METADATA = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)
# Shared address space (RFC 6598, carrier-grade NAT): neither private nor global to ipaddress.
_SHARED = ipaddress.ip_network("100.64.0.0/10")
# IPv6 prefixes that carry an IPv4 address in their low 32 bits (RFC 6052 NAT64).
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class AddressRefused(StepFailure):
    """The step's host resolved to an address it may not reach (class ``fatal``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "fatal")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,))


@dataclass(frozen=True)
class Allow:
    """``DJFLOW_HTTP_ALLOW``: host names (exact, case-insensitive, without a trailing dot)
    whose addresses are not checked, and networks whose addresses are allowed whatever name
    led to them."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> Allow:
        hosts: set[str] = set()
        networks: list[IPNetwork] = []
        for entry in (e.strip() for e in entries):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                if "/" in entry:
                    raise ValueError(f"DJFLOW_HTTP_ALLOW: {entry!r} is not a network") from None
                hosts.add(_host_key(entry))
        return cls(frozenset(hosts), tuple(networks))

    @classmethod
    def from_settings(cls) -> Allow:
        return cls.parse(settings.DJFLOW.get("HTTP_ALLOW", []))

    def lists_host(self, host: str) -> bool:
        return _host_key(host) in self.hosts

    def lists_address(self, address: IPAddress) -> bool:
        return any(
            address in network for network in self.networks if network.version == address.version
        )


def _host_key(host: str) -> str:
    return host.strip("[]").rstrip(".").lower()


def refusal(address: IPAddress) -> str | None:
    """What makes ``address`` one a step may not reach ("a loopback address"), or None when
    it is public."""
    for judged in _judged(address):
        reason = _class_of(judged)
        if reason is not None:
            carried = f" (it carries {judged})" if judged != address else ""
            return reason + carried
    return None


def _judged(address: IPAddress) -> list[IPAddress]:
    """The addresses that decide: an IPv6 address that carries an IPv4 one is what it
    carries (its IPv6 form sits in ranges ipaddress calls reserved); 6to4 is both."""
    if isinstance(address, ipaddress.IPv4Address):
        return [address]
    if address.ipv4_mapped is not None:
        return [address.ipv4_mapped]
    if address in _NAT64:
        return [ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)]
    if address.sixtofour is not None:
        return [address, address.sixtofour]
    return [address]


def _class_of(address: IPAddress) -> str | None:
    # Most specific first: the metadata address is link-local too, 240/4 private too.
    checks = (
        (address in _METADATA, "a cloud metadata address"),
        (address.is_unspecified, "an unspecified address"),
        (address.is_loopback, "a loopback address"),
        (address.is_link_local, "a link-local address"),
        (address.is_multicast, "a multicast address"),
        (address.version == 4 and address in _SHARED, "a shared (carrier-grade NAT) address"),
        (address.is_reserved, "a reserved address"),
        (address.is_private, "a private address"),
        # The rest of the special-purpose ranges (IANA's registry), whatever their name.
        (not address.is_global, "not a public address"),
    )
    return next((reason for refused, reason in checks if refused), None)


def resolve_checked(host: str, port: int, allow: Allow) -> list[str]:
    """The addresses of ``host`` to connect to, each checked, in the resolver's order;
    raises :class:`AddressRefused` naming the first refused one."""
    name = host.strip("[]")
    try:
        answers = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise httpcore2.ConnectError(f"{name} does not resolve: {exc}") from exc
    addresses: list[str] = []
    for family, _type, _proto, _canon, sockaddr in answers:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        # A link-local IPv6 answer carries its zone ("fe80::1%eth0").
        text = str(sockaddr[0]).split("%", 1)[0]
        if text not in addresses:
            addresses.append(text)
    if not addresses:
        raise httpcore2.ConnectError(f"{name} resolves to no IP address")
    if not allow.lists_host(name):
        for text in addresses:
            _check(name, text, allow)
    return addresses


def _check(host: str, text: str, allow: Allow) -> None:
    address = ipaddress.ip_address(text)
    if any(allow.lists_address(judged) for judged in {address, *_judged(address)}):
        return
    reason = refusal(address)
    if reason is not None:
        # The address as the resolver gave it (ipaddress would spell ::ffff:127.0.0.1 in hex).
        source = "" if host == text else f" (from {host})"
        raise AddressRefused(
            f"http: {text}{source} is {reason}; DJFLOW_HTTP_ALLOW does not list it"
        )


class GuardedBackend(httpcore2.NetworkBackend):
    """httpcore's sync backend, connecting only to addresses the guard checked (see the
    module's invariants). The pool calls ``connect_tcp`` with the URL's host; TLS is started
    on the returned stream by the pool, with that host as the server name."""

    def __init__(self, allow: Allow, inner: httpcore2.NetworkBackend | None = None) -> None:
        self.allow = allow
        self._inner = inner or httpcore2.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.NetworkStream:
        options = list(socket_options or [])
        failure: httpcore2.ConnectError | None = None
        # Each checked address in turn, as socket.create_connection would try the resolver's
        # answers (an unreachable IPv6 answer must not fail a host that has an IPv4 one).
        for address in resolve_checked(host, port, self.allow):
            try:
                return self._inner.connect_tcp(address, port, timeout, local_address, options)
            except httpcore2.ConnectError as exc:
                failure = exc
        assert failure is not None  # resolve_checked returns at least one address
        raise failure

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore2.NetworkStream:
        raise AddressRefused("http: unix sockets are not reachable")

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class GuardedTransport(httpx2.HTTPTransport):
    """httpx2's transport over a pool whose connections go through :class:`GuardedBackend`.

    httpx2 2.16's ``HTTPTransport`` takes no network backend, and its ``__init__`` does
    nothing but build its pool (``_pool``, which ``handle_request`` and ``close`` use): so
    this one builds that pool itself, with the guarded backend, no proxy and no retries,
    instead of building one to throw away (its SSL context loads the CA bundle).
    """

    def __init__(self, allow: Allow, *, verify: ssl.SSLContext | bool = True) -> None:
        self._pool = httpcore2.ConnectionPool(
            ssl_context=_default_context() if verify is True else _context(verify),
            max_connections=4,
            network_backend=GuardedBackend(allow),
        )


@functools.cache
def _default_context() -> ssl.SSLContext:
    """The verifying context, built once per process: loading the CA bundle takes 17 ms,
    which was 90% of a request to a local server. A context is safe to share between
    threads; the pool sets the same ALPN protocols on it for each connection."""
    return _context(True)


def _context(verify: ssl.SSLContext | bool) -> ssl.SSLContext:
    return httpx2.create_ssl_context(verify=verify, trust_env=False)


def client(
    *, timeout: float, allow: Allow | None = None, verify: ssl.SSLContext | bool = True
) -> httpx2.Client:
    """A client whose every connection is guarded, that reads no proxy from the environment
    and follows no redirect (the caller follows them, each hop guarded again)."""
    transport = GuardedTransport(
        allow if allow is not None else Allow.from_settings(), verify=verify
    )
    return httpx2.Client(
        transport=transport, trust_env=False, follow_redirects=False, timeout=timeout
    )


def shown(url: httpx2.URL | str) -> str:
    """A URL as an error message may show it: scheme://host[:port]/path, no user info, no
    query, no fragment (they may carry credentials)."""
    parsed = httpx2.URL(url) if isinstance(url, str) else url
    host = f"[{parsed.host}]" if ":" in parsed.host else parsed.host
    port = f":{parsed.port}" if parsed.port is not None else ""
    return f"{parsed.scheme}://{host}{port}{parsed.path}"


def check_scheme(url: httpx2.URL) -> None:
    if url.scheme not in SCHEMES:
        raise StepFailure(
            f"http: only http and https URLs may be called, not {url.scheme or 'none'}:", "fatal"
        )
