"""Per-account model-call slots (workers.slots) against real Redis servers: the shared one on
127.0.0.1:6379 (database 8) and, for outages, a private ``redis-server`` each test starts,
stops, freezes and starts again."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from celery.signals import worker_ready
from prometheus_client import REGISTRY

from tests.processes import own_redis_url
from workers import slots as slots_module
from workers.slots import KEY_PREFIX, AccountSlots, SlotsBusy, slots

# The suite's own Redis (tests.processes.own_redis_url): the keys' prefix keeps them apart.
REDIS_URL = own_redis_url()
FORK = multiprocessing.get_context("fork")
# Short slots so that lapsing and refreshing show within seconds.
TTL, REFRESH = 2.0, 0.5


@pytest.fixture
def shared_redis() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    for key in client.scan_iter(f"{KEY_PREFIX}test-*"):
        client.delete(key)
    for key in client.scan_iter("test-slots:*"):
        client.delete(key)
    client.close()


@pytest.fixture
def account(shared_redis: redis.Redis) -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_slots() -> Iterator[Callable[..., AccountSlots]]:
    made: list[AccountSlots] = []

    def make(
        limit: int, url: str | None = REDIS_URL, *, ttl: float = TTL, refresh: float = REFRESH
    ) -> AccountSlots:
        made.append(AccountSlots(url, limit, ttl_seconds=ttl, refresh_seconds=refresh))
        return made[-1]

    yield make
    for instance in made:
        instance.close()


def gauge(account: str) -> float:
    return REGISTRY.get_sample_value("djflow_model_calls_in_flight", {"account": account}) or 0.0


def fail_open_total() -> float:
    return REGISTRY.get_sample_value("djflow_model_slots_fail_open_total") or 0.0


# --- the limit ------------------------------------------------------------------------------


def test_threads_never_hold_more_than_the_limit(
    make_slots: Callable[..., AccountSlots], account: str, shared_redis: redis.Redis
) -> None:
    limit, callers = 3, 12
    account_slots = make_slots(limit)
    active = f"test-slots:{account}:active"
    seen: list[tuple[int, int]] = []  # (holders by our own count, live slots in Redis)

    def call() -> None:
        with account_slots.held(account, wait_seconds=10) as counted:
            assert counted is True
            holders = int(shared_redis.incr(active))
            seen.append((holders, account_slots.in_flight(account)))
            time.sleep(0.1)
            shared_redis.decr(active)

    threads = [threading.Thread(target=call) for _ in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert len(seen) == callers  # every call got its turn
    assert max(holders for holders, _ in seen) == limit
    assert max(live for _, live in seen) == limit
    assert account_slots.in_flight(account) == 0
    assert gauge(account) == 0


def hold_and_sample(
    account_slots: AccountSlots, account: str, hold: float, samples: str, active: str
) -> None:
    """A forked worker's model call: holds a slot for ``hold`` seconds and records how many
    calls (its own count) and live slots (Redis's) it saw meanwhile."""
    client = redis.Redis.from_url(REDIS_URL)
    with account_slots.held(account, wait_seconds=20) as counted:
        holders = int(client.incr(active))
        client.rpush(samples, f"{int(counted)}:{holders}:{account_slots.in_flight(account)}")
        time.sleep(hold)
        client.decr(active)


def test_worker_processes_never_hold_more_than_the_limit(
    make_slots: Callable[..., AccountSlots], account: str, shared_redis: redis.Redis
) -> None:
    """Forked after the parent used the instance (its refresh thread running, its Redis
    connections open), as Celery's prefork pool does: each child counts in the same set."""
    limit, processes = 2, 6
    account_slots = make_slots(limit)
    with account_slots.held(account, wait_seconds=0):
        pass
    samples, active = f"test-slots:{account}:samples", f"test-slots:{account}:active"

    children = [
        FORK.Process(target=hold_and_sample, args=(account_slots, account, 0.2, samples, active))
        for _ in range(processes)
    ]
    started = time.monotonic()
    for child in children:
        child.start()
    for child in children:
        child.join(30)
    took = time.monotonic() - started

    assert [child.exitcode for child in children] == [0] * processes
    rows = [tuple(map(int, row.split(b":"))) for row in shared_redis.lrange(samples, 0, -1)]
    assert len(rows) == processes
    assert all(counted == 1 for counted, _, _ in rows)
    assert max(holders for _, holders, _ in rows) == limit
    assert max(live for _, _, live in rows) == limit
    # Three rounds of two, not six at once nor one at a time.
    assert took >= 0.2 * processes / limit
    assert account_slots.in_flight(account) == 0


def test_a_full_account_raises_slots_busy_after_the_wait(
    make_slots: Callable[..., AccountSlots], account: str, shared_redis: redis.Redis
) -> None:
    account_slots = make_slots(1)
    with account_slots.held(account, wait_seconds=0):
        # The account's key lives no longer than its latest slot.
        assert 0 < shared_redis.pttl(KEY_PREFIX + account) <= TTL * 1000
        started = time.monotonic()
        with pytest.raises(SlotsBusy) as busy, account_slots.held(account, wait_seconds=0.3):
            pytest.fail("a second slot of a full account")
        waited = time.monotonic() - started
        assert 0.3 <= waited < 0.8
        assert busy.value.account == account and "DJFLOW_MODEL_CONCURRENCY" in str(busy.value)
        assert account_slots.in_flight(account) == 1  # the refused caller left nothing behind
    assert account_slots.in_flight(account) == 0
    assert not shared_redis.exists(KEY_PREFIX + account)


def test_a_waiting_call_gets_the_slot_freed_within_its_wait(
    make_slots: Callable[..., AccountSlots], account: str
) -> None:
    account_slots = make_slots(1)
    holding = threading.Event()

    def hold() -> None:
        with account_slots.held(account, wait_seconds=0):
            holding.set()
            time.sleep(0.3)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(5)
    started = time.monotonic()
    with account_slots.held(account, wait_seconds=3) as counted:
        waited = time.monotonic() - started
        assert counted is True
        assert account_slots.in_flight(account) == 1
    holder.join(5)
    # Polled with a back-off of at most 0.2 s: taken soon after the holder left.
    assert 0.1 < waited < 0.8


def test_accounts_are_counted_apart(make_slots: Callable[..., AccountSlots], account: str) -> None:
    account_slots = make_slots(1)
    other = f"{account}-other"
    with account_slots.held(account, wait_seconds=0), account_slots.held(other, wait_seconds=0):
        assert (account_slots.in_flight(account), account_slots.in_flight(other)) == (1, 1)
        with pytest.raises(SlotsBusy), account_slots.held(account, wait_seconds=0):
            pass


def test_the_slot_is_freed_when_the_block_raises(
    make_slots: Callable[..., AccountSlots], account: str
) -> None:
    account_slots = make_slots(1)
    with (
        pytest.raises(RuntimeError, match="the model failed"),
        account_slots.held(account, wait_seconds=0),
    ):
        assert gauge(account) == 1
        raise RuntimeError("the model failed")
    assert account_slots.in_flight(account) == 0
    assert gauge(account) == 0
    with account_slots.held(account, wait_seconds=0) as counted:
        assert counted is True


# --- dead and live holders ------------------------------------------------------------------


def hold_until_killed(account_slots: AccountSlots, account: str, holding: object) -> None:
    with account_slots.held(account, wait_seconds=5):
        holding.set()  # type: ignore[attr-defined]
        time.sleep(60)


def test_a_killed_holders_slot_is_free_after_the_ttl(
    make_slots: Callable[..., AccountSlots], account: str
) -> None:
    account_slots = make_slots(1)
    holding = FORK.Event()
    child = FORK.Process(target=hold_until_killed, args=(account_slots, account, holding))
    child.start()
    assert holding.wait(10)
    time.sleep(REFRESH * 1.5)  # killed after its refresh thread pushed the slot forward
    os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
    child.join(5)
    killed = time.monotonic()

    assert account_slots.in_flight(account) == 1
    with pytest.raises(SlotsBusy), account_slots.held(account, wait_seconds=0):
        pass
    with account_slots.held(account, wait_seconds=TTL + 2) as counted:
        freed_after = time.monotonic() - killed
        assert counted is True
    # Its last refresh was at most REFRESH before the kill: free between TTL - REFRESH and
    # TTL after it (plus a poll).
    assert TTL - REFRESH - 0.3 <= freed_after <= TTL + 0.5


def hold_for(account_slots: AccountSlots, account: str, seconds: float, holding: object) -> None:
    with account_slots.held(account, wait_seconds=5) as counted:
        assert counted is True
        holding.set()  # type: ignore[attr-defined]
        time.sleep(seconds)


def test_a_live_holder_keeps_its_slot_past_the_ttl_by_refreshing_it(
    make_slots: Callable[..., AccountSlots], account: str
) -> None:
    """In a forked child whose parent's refresh thread was already running: the child
    starts its own, which keeps the slot live for three and a half ttls."""
    ttl, refresh, hold = 1.0, 0.25, 3.5
    account_slots = make_slots(1, ttl=ttl, refresh=refresh)
    with account_slots.held(f"{account}-parent", wait_seconds=0):
        pass  # the parent's refresh thread is started
    other = make_slots(1, ttl=ttl, refresh=refresh)
    holding = FORK.Event()
    child = FORK.Process(target=hold_for, args=(account_slots, account, hold, holding))
    child.start()
    assert holding.wait(10)
    held_since = time.monotonic()

    checks = 0
    while time.monotonic() - held_since < hold - 0.5:
        assert other.in_flight(account) == 1
        with pytest.raises(SlotsBusy), other.held(account, wait_seconds=0):
            pass
        checks += 1
        time.sleep(0.3)
    child.join(10)

    assert child.exitcode == 0
    assert checks >= 8
    assert other.in_flight(account) == 0  # released on exit, not left to lapse


def hold_briefly(account_slots: AccountSlots, account: str, seconds: float) -> None:
    with account_slots.held(account, wait_seconds=5) as counted:
        assert counted is True
        time.sleep(seconds)


def test_a_child_forked_while_its_parent_holds_a_slot_leaves_that_slot_alone(
    make_slots: Callable[..., AccountSlots], account: str
) -> None:
    """The child's refresh thread pushes forward the child's slots only: the parent's slot,
    released meanwhile, is not put back."""
    account_slots = make_slots(2, ttl=1.0, refresh=0.2)
    with account_slots.held(account, wait_seconds=0):
        child = FORK.Process(target=hold_briefly, args=(account_slots, account, 1.5))
        child.start()
        time.sleep(0.3)
        assert account_slots.in_flight(account) == 2
    for _ in range(4):  # through several of the child's refreshes
        assert account_slots.in_flight(account) == 1
        time.sleep(0.2)
    child.join(10)
    assert child.exitcode == 0
    assert account_slots.in_flight(account) == 0


# --- no Redis, and Redis away -----------------------------------------------------------------


def test_without_a_redis_url_nothing_is_counted_and_nothing_connects(
    make_slots: Callable[..., AccountSlots], account: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("a connection was attempted")

    account_slots = make_slots(1, None)
    failed_open = fail_open_total()

    with monkeypatch.context() as offline:
        offline.setattr(socket, "create_connection", no_network)
        offline.setattr(socket.socket, "connect", no_network)
        with (
            account_slots.held(account, wait_seconds=0) as first,
            account_slots.held(account, wait_seconds=0) as second,
        ):
            assert (first, second) == (False, False)  # over the limit of 1: not counted
            assert gauge(account) == 2
        assert account_slots.in_flight(account) == 0
    assert fail_open_total() == failed_open  # not an outage


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRedis:
    """A redis-server of the test's own, on a free port, with nothing persisted."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [shutil.which("redis-server") or "redis-server", "--port", str(self.port)]
        command += ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        command += ["--daemonize", "no"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.02)
        client.close()

    def stop(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)
        self.process = None


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    server = PrivateRedis()
    server.start()
    yield server
    if server.process is not None:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


def test_redis_going_away_fails_open_logging_once_and_counting_every_call(
    make_slots: Callable[..., AccountSlots],
    account: str,
    private_redis: PrivateRedis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="workers.slots")
    account_slots = make_slots(1, private_redis.url)
    failed_open_before = fail_open_total()

    with account_slots.held(account, wait_seconds=0) as counted:
        assert counted is True
        private_redis.stop()
        started = time.monotonic()
    # Leaving the block freed nothing in Redis (gone) and raised nothing.

    calls = 50
    for _ in range(calls):
        with account_slots.held(account, wait_seconds=5) as counted:
            assert counted is False
    # No retries of a refused connection (redis-py's default would take seconds per call).
    assert time.monotonic() - started < 2

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    released = [line for line in warnings if "could not free" in line]
    failed_open = [line for line in warnings if "unreachable" in line]
    assert len(released) == 1, warnings  # the slot held when Redis went: it lapses there
    assert len(failed_open) == 1, warnings  # once, not once per call
    assert account in failed_open[0]
    assert "refused" in failed_open[0].lower()  # the Redis error itself
    assert fail_open_total() - failed_open_before == calls


def test_counting_resumes_when_redis_is_back(
    make_slots: Callable[..., AccountSlots],
    account: str,
    private_redis: PrivateRedis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Including for a call let through during the outage: the next refresh counts it."""
    caplog.set_level(logging.INFO, logger="workers.slots")
    account_slots = make_slots(1, private_redis.url)
    private_redis.stop()

    with account_slots.held(account, wait_seconds=0) as during_outage:
        assert during_outage is False
        private_redis.start()  # empty: nothing persisted, the scripts unloaded
        deadline = time.monotonic() + 5
        while account_slots.in_flight(account) != 1:
            assert time.monotonic() < deadline, "the uncounted call was never counted"
            time.sleep(0.1)
        with pytest.raises(SlotsBusy), account_slots.held(account, wait_seconds=0):
            pass
    assert account_slots.in_flight(account) == 0
    with account_slots.held(account, wait_seconds=0) as counted:
        assert counted is True
    assert any("answers again" in r.getMessage() for r in caplog.records)


def test_a_redis_that_hangs_fails_open_after_the_read_timeout(
    make_slots: Callable[..., AccountSlots], account: str, private_redis: PrivateRedis
) -> None:
    account_slots = make_slots(1, private_redis.url)
    with account_slots.held(account, wait_seconds=0) as counted:
        assert counted is True
    assert private_redis.process is not None
    os.kill(private_redis.process.pid, signal.SIGSTOP)  # accepts connections, answers nothing
    try:
        started = time.monotonic()
        with account_slots.held(account, wait_seconds=5) as counted:
            assert counted is False
        first = time.monotonic() - started
        started = time.monotonic()
        for _ in range(20):
            with account_slots.held(account, wait_seconds=5) as counted:
                assert counted is False
        then = time.monotonic() - started
    finally:
        os.kill(private_redis.process.pid, signal.SIGCONT)
    assert first < 1.5  # one read time-out (0.5 s), no retries
    assert then < 0.5  # within the retry pause no call waits on Redis again


# --- the process's instance -------------------------------------------------------------------


def report_instance(parent_id: int, results: object) -> None:
    results.put((id(slots()) != parent_id, slots() is slots()))  # type: ignore[attr-defined]


def test_the_process_instance_comes_from_settings_and_is_rebuilt_after_fork(settings) -> None:
    instance = slots()
    assert instance is slots()
    assert instance.limit == settings.DJFLOW["MODEL_CONCURRENCY"]
    assert instance.redis_url == settings.DJFLOW["MODEL_SLOTS_REDIS_URL"]

    results = FORK.Queue()
    child = FORK.Process(target=report_instance, args=(id(instance), results))
    child.start()
    rebuilt, kept = results.get(timeout=10)
    child.join(10)
    assert (rebuilt, kept) == (True, True)


def test_a_starting_worker_says_whether_model_calls_are_counted(
    settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="workers.slots")
    settings.DJFLOW = {
        **settings.DJFLOW,
        "MODEL_CONCURRENCY": 7,
        "MODEL_SLOTS_REDIS_URL": "redis://:hunter2@cache.example:6379/4",
    }
    worker_ready.send(sender=None)
    settings.DJFLOW = {**settings.DJFLOW, "MODEL_SLOTS_REDIS_URL": ""}
    worker_ready.send(sender=None)

    lines = [r for r in caplog.records if r.name == slots_module.__name__]
    assert len(lines) == 2
    counted, uncounted = lines
    assert "at most 7 in flight per account" in counted.getMessage()
    assert "cache.example" in counted.getMessage() and "hunter2" not in counted.getMessage()
    assert uncounted.levelno == logging.WARNING
    assert "not limited" in uncounted.getMessage()
    assert "DJFLOW_MODEL_SLOTS_REDIS_URL" in uncounted.getMessage()


@pytest.mark.parametrize("url", [REDIS_URL, None], ids=["counted", "no-redis"])
def test_a_gauge_that_fails_fails_no_model_call(
    make_slots: Callable[..., AccountSlots],
    account: str,
    url: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The in-flight gauge writes to a file of the metrics folder (multiprocess mode): a folder
    # gone or full must not fail the model call, let alone the step (runs.metrics' rule).
    def broken(**labels: str) -> None:
        raise OSError("the metric files are gone")

    monkeypatch.setattr(slots_module.MODEL_CALLS_IN_FLIGHT, "labels", broken)
    account_slots = make_slots(1, url)
    ran = []
    with account_slots.held(account, wait_seconds=0) as counted:
        ran.append(counted)
    assert ran == [url is not None]
    if url is not None:
        # The slot was freed: the next call gets it at once.
        assert account_slots.in_flight(account) == 0


def test_a_fail_open_count_that_fails_fails_no_model_call(
    make_slots: Callable[..., AccountSlots], account: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise OSError("the metric files are gone")

    monkeypatch.setattr(slots_module.MODEL_SLOTS_FAIL_OPEN, "inc", broken)
    # Nothing listens there: Redis is unreachable, the call goes ahead uncounted.
    account_slots = make_slots(1, f"redis://127.0.0.1:{_free_port()}/0")
    with account_slots.held(account, wait_seconds=0) as counted:
        assert counted is False
