"""The outbound address guard of ``http`` steps: a step may reach only public addresses,
unless its host is listed in ``DJFLOW_HTTP_ALLOW`` (contract section 10, "HTTP").

Invariants:

- A host is resolved once per connection (``socket.getaddrinfo``) and every address it
  resolves to is checked; one refused address refuses the host, so a name that answers a
  public and a private address cannot be used to reach the private one.
- Resolving is bounded by the connection's time-out (the request's time left): it runs in a
  thread of a small per-process pool and the caller waits no longer than that, then fails
  ``retryable`` (``getaddrinfo`` itself takes no time-out, and the worker's alarm would end
  the attempt as ``timeout`` instead).
- The connection goes to a checked address, never to the name again: the check happens in
  the network backend's ``connect_tcp`` (:class:`GuardedBackend`), which connects to the
  address it checked. A name whose answer changes between check and connect (DNS
  rebinding) reaches only the address that was checked. TLS still names the original host
  (SNI and the certificate's name check are httpcore's, from the URL).
- Addresses are judged by what they are, not by how they were spelt: the resolver turns
  ``127.1``, ``2130706433`` and ``0x7f.1`` into 127.0.0.1 before the check, and an IPv6
  address carrying an IPv4 one (``::ffff:127.0.0.1``, NAT64 ``64:ff9b::/96``, 6to4
  ``2002::/16``) is judged by the IPv4 address it carries. Any other IPv6 address must be
  global unicast (``2000::/3``), public (``is_global``) and not documentation (``2001:db8::/32``,
  ``3fff::/20``): site-local ``fec0::/10``, which ``ipaddress`` calls neither private nor
  reserved, is refused with the rest.
- The client never reads the environment (``trust_env=False``): an ``HTTP(S)_PROXY``
  variable would otherwise send the request through a proxy, past the guard.
- A refused address raises :class:`AddressRefused`, a ``StepFailure`` of class ``fatal``
  whose message names the host and the address, never a header or the URL's query.
"""

from __future__ import annotations

import concurrent.futures
import functools
import ipaddress
import os
import socket
import ssl
import threading
import time
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
# The only IPv6 addresses that may be public (RFC 4291): the rest is refused whatever name
# ipaddress gives it, so a range its tables miss (fec0::/10 on Python 3.11) cannot pass.
_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")
# Documentation (RFC 5737, 3849, 9637): never a real server; 3fff::/20 is newer than
# ipaddress's tables.
_DOCUMENTATION = tuple(
    ipaddress.ip_network(n)
    for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32", "3fff::/20")
)
# Threads resolving host names (getaddrinfo blocks and takes no time-out): one pool per
# process, built on first use and again in a forked child (the parent's threads are not
# there). A few threads: a worker process runs one step at a time, and a lookup that hangs
# past its caller's time-out keeps its thread until the resolver gives up.
_RESOLVER_THREADS = 4
_resolver: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_resolver_lock = threading.Lock()


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
    carries (its IPv6 form sits in ranges ipaddress calls reserved or not global)."""
    if isinstance(address, ipaddress.IPv4Address):
        return [address]
    if address.ipv4_mapped is not None:
        return [address.ipv4_mapped]
    if address in _NAT64:
        return [ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)]
    if address.sixtofour is not None:
        # Not 2002::/16 itself: newer Pythons call all of it non-global, 3.11 all of it global.
        return [address.sixtofour]
    return [address]


def _class_of(address: IPAddress) -> str | None:
    # Most specific first: the metadata address is link-local too, 240/4 private too.
    checks = (
        (address in _METADATA, "a cloud metadata address"),
        (address.is_unspecified, "an unspecified address"),
        (address.is_loopback, "a loopback address"),
        (address.is_link_local, "a link-local address"),
        (address.version == 6 and address.is_site_local, "a site-local address"),
        (address.is_multicast, "a multicast address"),
        (address.version == 4 and address in _SHARED, "a shared (carrier-grade NAT) address"),
        (_in_any(address, _DOCUMENTATION), "a documentation address"),
        (address.is_reserved, "a reserved address"),
        (address.is_private, "a private address"),
        (address.version == 6 and address not in _GLOBAL_UNICAST, "not a global unicast address"),
        # The rest of the special-purpose ranges (IANA's registry), whatever their name.
        (not address.is_global, "not a public address"),
    )
    return next((reason for refused, reason in checks if refused), None)


def _in_any(address: IPAddress, networks: Iterable[IPNetwork]) -> bool:
    return any(address in network for network in networks if network.version == address.version)


def resolve_checked(host: str, port: int, allow: Allow, timeout: float | None = None) -> list[str]:
    """The addresses of ``host`` to connect to, each checked, in the resolver's order;
    raises :class:`AddressRefused` naming the first refused one, and a ``retryable``
    ``StepFailure`` when resolving takes longer than ``timeout`` seconds."""
    name = host.strip("[]")
    try:
        answers = _getaddrinfo(name, port, timeout)
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


def _getaddrinfo(name: str, port: int, timeout: float | None) -> list[Any]:
    if timeout is None:
        return socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    lookup = _resolver_pool().submit(socket.getaddrinfo, name, port, type=socket.SOCK_STREAM)
    try:
        return lookup.result(timeout=max(0.0, timeout))
    except concurrent.futures.TimeoutError:
        # A lookup still queued never runs; one running keeps its thread until it returns.
        lookup.cancel()
        raise StepFailure(
            f"http: resolving {name} took longer than {round(timeout * 1000)} ms", "retryable"
        ) from None


def _resolver_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _resolver
    pid = os.getpid()
    with _resolver_lock:
        if _resolver is None or _resolver[0] != pid:
            # A pool inherited through fork is dropped, not shut down: its threads did not
            # come along, and its queue's lock may have been held at the fork.
            pool = concurrent.futures.ThreadPoolExecutor(
                _RESOLVER_THREADS, thread_name_prefix="djflow-resolve"
            )
            _resolver = (pid, pool)
        return _resolver[1]


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
        deadline = None if timeout is None else time.monotonic() + timeout
        # Each checked address in turn, as socket.create_connection would try the resolver's
        # answers (an unreachable IPv6 answer must not fail a host that has an IPv4 one).
        for address in resolve_checked(host, port, self.allow, timeout):
            # What resolving left of the time-out (a spent one fails the connect at once).
            left = None if deadline is None else max(0.001, deadline - time.monotonic())
            try:
                return self._inner.connect_tcp(address, port, left, local_address, options)
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
