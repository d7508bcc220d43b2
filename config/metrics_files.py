"""Where the processes' metric files live (prometheus-client's multiprocess mode), and keeping
that folder clean. Nothing here imports prometheus-client at import time: the settings
import this module to export ``PROMETHEUS_MULTIPROC_DIR``, and the client reads that variable
when it is first imported.

The layout: ``DJFLOW_METRICS_DIR/<host name>/<type>_<pid>.db``. Every process of one host
writes to its host's folder (a file per process and metric type, named by pid); a scrape
reads every host's folder under the root, so web and worker containers that share the root
(a volume) but not their process ids never write to the same file. Process ids are only
meaningful within a host, so only a host's own processes remove its files:

- a master at its start (gunicorn's ``on_starting``, the Celery worker's ``worker_init``,
  ``manage.py standalone``) removes the files of processes of its host that are gone, a
  crashed child's included; the counts those held are lost, which Prometheus reads as a
  counter reset, as the client's documentation asks ("wiped between runs");
- a child that ends (gunicorn's ``child_exit``, Celery's ``worker_process_shutdown``) has its
  live gauges' files removed (``mark_process_dead``): what it had in flight is no longer;
- a scrape skips, and removes, the live gauges' files of its host's processes that are gone
  (a pool child killed outright, which no hook saw);
- a scrape skips the live gauges of another host whose workers stopped beating: a Celery
  worker's main process touches ``alive`` in its host's folder at every heartbeat
  (``mark_host_alive``), and a folder whose mark is older than the heartbeats' live window
  (or has none) is a host that is gone (a container recreated under a new host name, a
  machine retired), whose in-flight calls ended with it. Its files are left in place, not
  removed: a host that was only slow counts again at its next beat, and its counters (which
  must never go down) are read as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import time
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "PROMETHEUS_MULTIPROC_DIR"
# prometheus-client's gauge modes whose values belong to live processes only.
_LIVE_PREFIX = "gauge_live"
# In a host's folder: touched by its workers' heartbeats (see the module's docstring).
ALIVE_MARK = "alive"


def host_folder(root: Path) -> Path:
    """This host's folder under the root: its host name, as a safe folder name."""
    name = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname()).strip(".") or "host"
    return root / name


def export(root: Path) -> Path:
    """Make this host's folder and point prometheus-client at it, for this process and the
    ones it starts (a gunicorn master's workers, a Celery worker's pool, the standalone's
    children inherit the variable)."""
    folder = host_folder(root)
    folder.mkdir(parents=True, exist_ok=True)
    os.environ[ENV] = str(folder)
    return folder


def unexport() -> None:
    """Metrics turned off: values stay in memory, even in a child of a process that had
    them on."""
    os.environ.pop(ENV, None)


def this_host() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def pid_of(path: Path) -> int | None:
    """The process a metric file belongs to (``counter_123.db``: 123), or None."""
    tail = path.stem.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def remove_gone(folder: Path | None) -> int:
    """Remove the files of this host's processes that are gone from its folder (None:
    metrics are off); returns how many. A master calls it before it starts its children."""
    if folder is None or not folder.is_dir():
        return 0
    removed = 0
    for path in folder.glob("*.db"):
        pid = pid_of(path)
        if pid is not None and pid != os.getpid() and not alive(pid):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
    return removed


def process_ended(pid: int) -> None:
    """A child of this host ended: its live gauges end with it. Never raises: a scrape may
    remove the same files at the same moment (``files_to_read``), and an exception out of
    gunicorn's ``child_exit`` leaves the arbiter's main loop, which stops the master."""
    folder = this_host()
    if folder is None:
        return
    from prometheus_client import multiprocess

    try:
        for _ in range(3):
            try:
                multiprocess.mark_process_dead(pid, str(folder))  # type: ignore[no-untyped-call]
                return
            except FileNotFoundError:
                continue  # one removed by a scrape meanwhile: look again for the others
    except OSError:
        logger.warning(
            "metrics: the live gauges of process %s were not removed", pid, exc_info=True
        )


def mark_host_alive() -> None:
    """This host's workers are beating (a Celery worker's heartbeat, in its main process).
    Never raises: a metric's bookkeeping must not cost a heartbeat."""
    folder = this_host()
    if folder is None:
        return
    try:
        (folder / ALIVE_MARK).touch()
    except OSError:
        logger.warning("metrics: could not mark %s alive", folder, exc_info=True)


def _host_gone(folder: Path, now: float, window: float) -> bool:
    try:
        return now - (folder / ALIVE_MARK).stat().st_mtime > window
    except FileNotFoundError:
        return True


def files_to_read(root: Path, *, live_window: float = 15.0) -> list[str]:
    """Every host's files under the root, less the live gauges of this host's processes that
    are gone (removed on the way) and those of other hosts whose workers have not beaten
    within ``live_window`` seconds (left in place)."""
    own = this_host()
    own = own.resolve() if own is not None else None
    now = time.time()
    gone_hosts: dict[Path, bool] = {}
    files = []
    for path in sorted(root.glob("*/*.db")):
        if path.name.startswith(_LIVE_PREFIX):
            folder = path.parent.resolve()
            if folder == own:
                pid = pid_of(path)
                if pid is not None and not alive(pid):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                    continue
            else:
                if folder not in gone_hosts:
                    gone_hosts[folder] = _host_gone(folder, now, live_window)
                if gone_hosts[folder]:
                    continue
        files.append(str(path))
    return files
