"""The outbound address guard (workers/netguard.py), without the database: which addresses
are refused and why, what DJFLOW_HTTP_ALLOW lets through, and that a connection goes to the
address that was checked.

No DNS server answers in the test environment, so the tests that need a name with a chosen
answer (several addresses, an answer that changes) replace ``socket.getaddrinfo`` for that
one name and pass every other lookup to the real resolver. Numeric spellings (``127.1``,
``2130706433``) and ``localhost`` go through the real resolver.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.workers.http_servers import certificate, reply, serving
from workers import netguard
from workers.netguard import AddressRefused, Allow
from workflows.failures import StepFailure

NOBODY = Allow()


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "a loopback address"),
        ("127.255.0.9", "a loopback address"),
        ("::1", "a loopback address"),
        ("10.1.2.3", "a private address"),
        ("172.16.0.1", "a private address"),
        ("192.168.1.1", "a private address"),
        ("fc00::1", "a private address"),
        ("169.254.1.1", "a link-local address"),
        ("fe80::1", "a link-local address"),
        ("224.0.0.1", "a multicast address"),
        ("ff02::1", "a multicast address"),
        ("240.0.0.1", "a reserved address"),
        ("255.255.255.255", "a reserved address"),
        ("0.0.0.0", "an unspecified address"),
        ("::", "an unspecified address"),
        ("100.64.0.1", "a shared (carrier-grade NAT) address"),
        ("100.127.255.254", "a shared (carrier-grade NAT) address"),
        ("169.254.169.254", "a cloud metadata address"),
        ("fd00:ec2::254", "a cloud metadata address"),
        ("192.0.2.10", "a documentation address"),  # TEST-NET-1
        ("::7f00:1", "a reserved address"),  # IPv4-compatible, deprecated
        # IPv6 outside global unicast, or special inside it (Python 3.11's ipaddress calls
        # fec0::/10 and 3fff::/20 global).
        ("fec0::1", "a site-local address"),
        ("feff:ffff::1", "a site-local address"),
        ("2001:db8::1", "a documentation address"),
        ("3fff::1", "a documentation address"),
        ("100::1", "a reserved address"),  # discard-only 100::/64
        ("5f00::1", "a reserved address"),  # SRv6 SIDs
        ("2001::1", "a private address"),  # Teredo
        ("64:ff9b:1::a00:1", "a reserved address"),  # local-use NAT64, not unwrapped
        # IPv6 forms carrying an IPv4 address are judged by what they carry.
        ("::ffff:127.0.0.1", "a loopback address (it carries 127.0.0.1)"),
        ("::ffff:169.254.169.254", "a cloud metadata address (it carries 169.254.169.254)"),
        ("64:ff9b::a00:1", "a private address (it carries 10.0.0.1)"),
        ("2002:7f00:1::", "a loopback address (it carries 127.0.0.1)"),
    ],
)
def test_each_class_of_non_public_address_is_refused_with_its_reason(
    address: str, reason: str
) -> None:
    assert netguard.refusal(ipaddress.ip_address(address)) == reason


@pytest.mark.parametrize(
    "address",
    [
        "93.184.215.14",
        "8.8.8.8",
        "2606:4700::1111",
        "2a00:1450:4001:81c::200e",
        "::ffff:8.8.8.8",
        "64:ff9b::808:808",
        "2002:808:808::1",  # 6to4 carrying a public address, whatever Python's tables say
    ],
)
def test_public_addresses_pass(address: str) -> None:
    assert netguard.refusal(ipaddress.ip_address(address)) is None


def test_no_ipv6_address_outside_global_unicast_passes() -> None:
    """Every /10 of IPv6 outside 2000::/3 (except the prefixes carrying an IPv4 address,
    judged by it): an address at its start, middle and end is refused."""
    carriers = [ipaddress.ip_network("::ffff:0:0/96"), ipaddress.ip_network("64:ff9b::/96")]
    passed = []
    for prefix in range(1024):
        if prefix >> 7 == 0b001:
            continue  # 2000::/3
        base = prefix << 118
        for offset in (1, 1 << 117, (1 << 118) - 1):
            address = ipaddress.IPv6Address(base + offset)
            if any(address in net for net in carriers):
                continue
            if netguard.refusal(address) is None:
                passed.append(str(address))
    assert passed == []


@pytest.mark.parametrize(
    ("host", "address"),
    [
        ("localhost", "127.0.0.1"),
        ("127.0.0.1", "127.0.0.1"),
        ("127.1", "127.0.0.1"),
        ("2130706433", "127.0.0.1"),
        ("0x7f.1", "127.0.0.1"),
        ("0177.0.0.1", "127.0.0.1"),
        ("[::1]", "::1"),
        ("::ffff:127.0.0.1", "::ffff:127.0.0.1"),
    ],
)
def test_odd_spellings_are_judged_by_the_address_they_resolve_to(host: str, address: str) -> None:
    with pytest.raises(AddressRefused) as refused:
        netguard.resolve_checked(host, 80, NOBODY)
    assert refused.value.error_class == "fatal"
    message = refused.value.message
    assert message.startswith(f"http: {address}")
    assert "loopback address" in message and message.endswith("DJFLOW_HTTP_ALLOW does not list it")
    if host.strip("[]") != address:
        assert f"({'from ' + host.strip('[]')})" in message


def test_the_message_names_host_and_address() -> None:
    with pytest.raises(AddressRefused) as refused:
        netguard.resolve_checked("localhost", 80, NOBODY)
    assert refused.value.message == (
        "http: 127.0.0.1 (from localhost) is a loopback address; DJFLOW_HTTP_ALLOW does not list it"
    )


def test_a_host_listed_by_name_passes_whatever_case_and_trailing_dot() -> None:
    allow = Allow.parse(["LocalHost."])
    assert netguard.resolve_checked("localhost", 80, allow) == ["127.0.0.1"]
    assert netguard.resolve_checked("LOCALHOST", 80, allow) == ["127.0.0.1"]
    # The name, not the address: another spelling of the same address is still refused.
    with pytest.raises(AddressRefused):
        netguard.resolve_checked("127.0.0.1", 80, allow)


def test_addresses_listed_by_network_pass_whatever_name_led_to_them() -> None:
    allow = Allow.parse(["10.0.0.0/8", " 127.0.0.0/30 "])
    assert netguard.resolve_checked("127.1", 80, allow) == ["127.0.0.1"]
    assert netguard.resolve_checked("localhost", 80, allow) == ["127.0.0.1"]
    # The IPv4 network covers the IPv4-mapped form of its addresses.
    assert netguard.resolve_checked("::ffff:127.0.0.2", 80, allow) == ["::ffff:127.0.0.2"]
    with pytest.raises(AddressRefused, match=r"127\.0\.0\.9 is a loopback"):
        netguard.resolve_checked("127.0.0.9", 80, allow)
    with pytest.raises(AddressRefused, match=r"::1 is a loopback"):
        netguard.resolve_checked("::1", 80, allow)


def test_a_single_address_entry_is_a_network_of_one() -> None:
    allow = Allow.parse(["127.0.0.1", "::1"])
    assert allow.hosts == frozenset()
    assert netguard.resolve_checked("::1", 80, allow) == ["::1"]


def test_a_malformed_network_is_an_error_not_a_host_name() -> None:
    with pytest.raises(ValueError, match=r"'10\.0\.0\.0/33' is not a network"):
        Allow.parse(["10.0.0.0/33"])


Answers = Callable[[], list[str]]


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, Answers], list[str]]:
    """``resolver(name, answers)`` makes ``name`` resolve to what ``answers()`` returns at each
    lookup (the real resolver answers every other name); returns the list of looked-up names."""
    real = socket.getaddrinfo
    names: dict[str, Answers] = {}
    looked_up: list[str] = []

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        looked_up.append(str(host))
        if host not in names:
            return real(host, port, *args, **kwargs)
        return [
            (
                socket.AF_INET6 if ":" in address else socket.AF_INET,
                socket.SOCK_STREAM,
                6,
                "",
                (address, port),
            )
            for address in names[host]()
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    def define(name: str, answers: Answers) -> list[str]:
        names[name] = answers
        return looked_up

    return define


def test_one_private_address_among_public_ones_refuses_the_host(resolver) -> None:
    resolver("mixed.test", lambda: ["93.184.215.14", "2606:4700::1111", "10.0.0.5"])
    with pytest.raises(AddressRefused) as refused:
        netguard.resolve_checked("mixed.test", 443, NOBODY)
    assert refused.value.message == (
        "http: 10.0.0.5 (from mixed.test) is a private address; DJFLOW_HTTP_ALLOW does not list it"
    )


def test_public_answers_are_returned_in_the_resolvers_order(resolver) -> None:
    resolver("public.test", lambda: ["2606:4700::1111", "93.184.215.14", "93.184.215.14"])
    assert netguard.resolve_checked("public.test", 443, NOBODY) == [
        "2606:4700::1111",
        "93.184.215.14",
    ]


def test_resolving_longer_than_the_time_left_fails_retryable(resolver) -> None:
    """A resolver that does not answer (DNS cannot run here: the lookup is replaced by one
    that waits) costs the caller its time-out, not more; the lookup's thread is released
    when the test ends."""
    release = threading.Event()

    def hangs() -> list[str]:
        release.wait(5)
        return ["93.184.215.14"]

    resolver("slow.test", hangs)
    started = time.monotonic()
    try:
        with pytest.raises(StepFailure) as slow:
            netguard.resolve_checked("slow.test", 443, NOBODY, timeout=0.2)
    finally:
        release.set()
    elapsed = time.monotonic() - started
    assert (slow.value.error_class, slow.value.message) == (
        "retryable",
        "http: resolving slow.test took longer than 200 ms",
    )
    assert 0.2 <= elapsed < 0.4
    # An answer inside the time is checked as ever.
    resolver("quick.test", lambda: ["10.0.0.5"])
    with pytest.raises(AddressRefused, match=r"10\.0\.0\.5 \(from quick\.test\) is a private"):
        netguard.resolve_checked("quick.test", 443, NOBODY, timeout=2)


def test_a_forked_child_resolves_through_threads_of_its_own() -> None:
    """A worker process forked after its parent resolved (Celery's prefork pool) must not
    hand lookups to the parent's threads, which did not come along."""
    allow = Allow.parse(["localhost"])
    assert netguard.resolve_checked("localhost", 80, allow, timeout=2) == ["127.0.0.1"]
    pid = os.fork()
    if pid == 0:  # the child: its exit status is the verdict
        code = 1
        try:
            code = 0 if netguard.resolve_checked("localhost", 80, allow, timeout=2) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _answer_once_then(first: str, later: str) -> Answers:
    answers = iter([[first]])
    return lambda: next(answers, [later])


@pytest.fixture
def two_servers() -> Iterator[tuple[Any, Any]]:
    """A server on 127.0.0.2 and another on 127.0.0.3, on the same port (Linux routes all of
    127/8 to loopback)."""
    with serving({"/": lambda h: reply(h, 200, "checked")}, host="127.0.0.2") as checked:
        routes = {"/": lambda h: reply(h, 200, "rebound")}
        with serving(routes, host="127.0.0.3", port=checked.port) as rebound:
            yield checked, rebound


def test_the_connection_goes_to_the_checked_address_not_a_second_answer(
    resolver, two_servers
) -> None:
    """DNS rebinding: the name answers an allowed address, then a refused one. The guard
    resolves once per connection and connects to what it checked, so the request reaches the
    checked server, and the name is looked up once."""
    checked, rebound = two_servers
    looked_up = resolver("rebind.test", _answer_once_then("127.0.0.2", "127.0.0.3"))
    allow = Allow.parse(["127.0.0.2/32"])
    with netguard.client(timeout=5, allow=allow) as client:
        response = client.get(f"http://rebind.test:{checked.port}/")
    assert (response.status_code, response.text) == (200, "checked")
    assert looked_up.count("rebind.test") == 1
    assert checked.seen[0].headers["Host"] == f"rebind.test:{checked.port}"
    assert rebound.seen == []
    # A new connection looks the name up again, and the new answer is checked in its turn.
    with netguard.client(timeout=5, allow=allow) as client, pytest.raises(AddressRefused) as no:
        client.get(f"http://rebind.test:{checked.port}/")
    assert "127.0.0.3 (from rebind.test) is a loopback address" in no.value.message
    assert rebound.seen == []


def test_tls_to_a_pinned_address_still_checks_the_certificate_for_the_host_name(
    resolver, tmp_path: Path
) -> None:
    """Connecting to the checked IP must not cost TLS its name: the server is asked for
    the URL's host (SNI) and its certificate is checked against that name."""
    cert_path, key_path = certificate(tmp_path, "pinned.test")
    resolver("pinned.test", lambda: ["127.0.0.2"])
    resolver("other.test", lambda: ["127.0.0.2"])
    names_asked: list[str | None] = []
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_path, key_path)
    context.sni_callback = lambda sock, name, ctx: names_asked.append(name)
    routes = {"/": lambda h: reply(h, 200, "over tls")}
    with serving(routes, host="127.0.0.2", tls=context) as server:
        trusted = ssl.create_default_context(cafile=str(cert_path))
        allow = Allow.parse(["127.0.0.2"])
        with netguard.client(timeout=5, allow=allow, verify=trusted) as client:
            response = client.get(f"https://pinned.test:{server.port}/")
            assert (response.status_code, response.text) == (200, "over tls")
            # The same address under a name the certificate does not carry is refused by TLS.
            with pytest.raises(httpx2.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                client.get(f"https://other.test:{server.port}/")
    assert names_asked[0] == "pinned.test"
    assert "other.test" in names_asked


def test_only_http_and_https_are_called() -> None:
    netguard.check_scheme(httpx2.URL("https://example.com/"))
    with pytest.raises(netguard.StepFailure, match=r"only http and https URLs .* not ftp:"):
        netguard.check_scheme(httpx2.URL("ftp://example.com/"))


def test_a_url_is_shown_without_credentials_query_or_fragment() -> None:
    url = "https://user:secret@api.example.com:8443/v1/items?token=abc#frag"
    assert netguard.shown(url) == "https://api.example.com:8443/v1/items"
    assert netguard.shown("http://[::1]/x?y=1") == "http://[::1]/x"


def _settings_with(allow: str) -> subprocess.CompletedProcess[str]:
    probe = "from django.conf import settings; print(settings.DJFLOW['HTTP_ALLOW'])"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "DJFLOW_HTTP_ALLOW": allow}
    return subprocess.run(
        [sys.executable, "-c", probe],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_settings_read_the_allow_list_and_refuse_a_malformed_network() -> None:
    read = _settings_with(" api.internal, 10.0.0.0/8 ,,127.0.0.1")
    assert read.returncode == 0, read.stderr
    assert read.stdout.strip() == "['api.internal', '10.0.0.0/8', '127.0.0.1']"
    refused = _settings_with("api.internal,10.0.0.0/33")
    assert refused.returncode != 0
    assert "DJFLOW_HTTP_ALLOW: '10.0.0.0/33' is not a network" in refused.stderr
