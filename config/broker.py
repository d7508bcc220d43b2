"""kombu's file-system transport, made safe for several processes: the embedded default's broker.

kombu's own transport (``kombu.transport.filesystem``, kombu 5.7) creates a message file, then
locks and writes it; the consumer takes the oldest file without the lock, so it can read a
file that is still empty (https://github.com/celery/kombu/issues/1551). The standalone's worker
died of it with ``JSONDecodeError('Expecting value: line 1 column 1 (char 0)')`` in ``_get``,
twice in 20 minutes (issue 11). The same file holds two more races: a consumer moves the file it
takes to ``tempfile.gettempdir()``, which may be another file system, where ``shutil.move``
copies and then deletes (two consumers can both deliver it, or read a partial copy); and an
exchange's binding table is created by truncating its file before the lock is taken, so a
publisher can read an empty table and fail the same way.

Invariants kept here:

- A file bearing a queue's message name is complete: it is written under a temporary name the
  consumer ignores (a leading dot and a ``.tmp`` suffix), then renamed into place. A rename
  within one directory is atomic, so a reader sees the whole message or no file.
- A message is delivered once: a consumer claims it by renaming it into ``.claimed/`` under the
  same folder (same file system, so the rename is atomic); of two consumers the second's rename
  fails and it moves on to the next file.
- An exchange's table file is replaced by rename, never rewritten in place: readers take no
  lock and never see it half-written; writers serialise on a lock file beside it.
- A consumer never dies of one bad file: a claimed file that does not decode (left by another
  writer, or cut short by a power loss, since nothing here is fsynced) is moved to
  ``.corrupt/`` and logged. The message is lost, which the engine already survives: the
  reconciler re-offers work whose message never arrived.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from queue import Empty
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps, loads
from kombu.utils.objects import cached_property

logger = logging.getLogger(__name__)

# Names the consumer ignores: kombu's own consumer and ours match ``<stamp>_<uuid>.<queue>.msg``.
TEMPORARY_PREFIX = "."
TEMPORARY_SUFFIX = ".tmp"
CLAIMED_FOLDER = ".claimed"
CORRUPT_FOLDER = ".corrupt"


def _write_then_rename(path: Path, data: bytes) -> None:
    """Write ``data`` under a temporary name beside ``path``, then rename it to ``path``."""
    temporary = path.with_name(
        f"{TEMPORARY_PREFIX}{path.name}.{uuid.uuid4().hex}{TEMPORARY_SUFFIX}"
    )
    try:
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


class Channel(filesystem.Channel):
    """kombu's file-system channel with atomic publishing, claiming and binding."""

    def _put(self, queue: str, payload: dict[str, Any], **kwargs: Any) -> None:
        """Put ``payload`` onto ``queue``; the file appears complete or not at all."""
        # Zero-padded so that names sort by time across a change in the number of digits
        # (kombu's unpadded stamps put 100000_ before 99999_).
        name = f"{round(monotonic() * 1000):015d}_{uuid.uuid4()}.{queue}.msg"
        path = Path(self.data_folder_out) / name
        try:
            _write_then_rename(path, dumps(payload).encode())
        except OSError as exc:
            raise ChannelError(f"Cannot add file {str(path)!r} to directory") from exc

    def _get(self, queue: str) -> dict[str, Any]:
        """Take the oldest message of ``queue``: claim it by rename, read it, remove it."""
        suffix = f".{queue}.msg"
        folder = Path(self.data_folder_in)
        names = sorted(
            name
            for name in os.listdir(folder)
            if not name.startswith(TEMPORARY_PREFIX) and name.partition(".")[2] == suffix[1:]
        )
        for name in names:
            claimed = self._claimed_folder / name
            try:
                os.rename(folder / name, claimed)
            except OSError:
                continue  # another consumer took it (or purged it) first
            try:
                payload = claimed.read_bytes()
            except OSError as exc:
                raise ChannelError(f"Cannot read file {str(claimed)!r} from queue.") from exc
            try:
                message = loads(payload)
            except ValueError:
                self._set_aside(claimed, payload)
                continue
            self._dispose(claimed)
            return message
        raise Empty()

    def _dispose(self, claimed: Path) -> None:
        """A delivered message's file: kept in ``processed_folder`` if asked, else removed."""
        if self.store_processed:
            shutil.move(claimed, Path(self.processed_folder) / claimed.name)
        else:
            claimed.unlink()

    def _set_aside(self, claimed: Path, payload: bytes) -> None:
        corrupt = self._corrupt_folder / claimed.name
        os.replace(claimed, corrupt)
        logger.error(
            "Broker message %s (%d bytes) does not decode; moved to %s. Its work is re-offered "
            "by the reconciler.",
            claimed.name,
            len(payload),
            corrupt,
        )

    @cached_property
    def _claimed_folder(self) -> Path:
        return self._subfolder(CLAIMED_FOLDER)

    @cached_property
    def _corrupt_folder(self) -> Path:
        return self._subfolder(CORRUPT_FOLDER)

    def _subfolder(self, name: str) -> Path:
        # Under the folder messages are read from, so a rename into it never crosses
        # file systems.
        path = Path(self.data_folder_in) / name
        path.mkdir(exist_ok=True)
        return path

    # --- exchange tables (control_folder/<exchange>.exchange) -------------------------------

    def get_table(self, exchange: str) -> list[filesystem.exchange_queue_t]:
        """The bindings of ``exchange``; the file is only ever replaced whole, so no lock."""
        file = self._exchange_file(exchange)
        try:
            table = loads(file.read_bytes())
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}") from exc
        return [filesystem.exchange_queue_t(*binding) for binding in table]

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        binding = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        with self._table_lock(exchange):
            table = self.get_table(exchange)
            if binding not in table:
                table.insert(0, binding)
                self._save_table(exchange, table)

    def _delete(
        self, queue: str, exchange: str, routing_key: str, pattern: str, *args: Any, **kwargs: Any
    ) -> None:
        # The grandparent's: it drops the queue from this process's state. kombu's own
        # _delete then rewrites the table in place; ours replaces it.
        super(filesystem.Channel, self)._delete(
            queue, exchange, routing_key, pattern, *args, **kwargs
        )
        binding = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        with self._table_lock(exchange):
            table = self.get_table(exchange)
            if binding in table:
                table.remove(binding)
                self._save_table(exchange, table)

    @contextlib.contextmanager
    def _table_lock(self, exchange: str) -> Iterator[None]:
        """Serialise read-modify-write of one exchange's table across processes."""
        file = self._exchange_file(exchange)
        self.control_folder.mkdir(exist_ok=True)
        with open(file.with_name(f"{TEMPORARY_PREFIX}{file.name}.lock"), "ab") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            yield  # closing the file releases the lock

    def _save_table(self, exchange: str, table: list[filesystem.exchange_queue_t]) -> None:
        file = self._exchange_file(exchange)
        try:
            _write_then_rename(file, dumps(table).encode())
        except OSError as exc:
            raise ChannelError(f"Cannot write {file}") from exc


class Transport(filesystem.Transport):
    """kombu's file-system transport with :class:`Channel`; same URL, options and folders."""

    Channel = Channel

    @property
    def default_connection_params(self) -> dict[str, Any]:
        # A folder has no host. kombu's virtual transports default to 'localhost', and the
        # empty host of "filesystem://" made every process on the embedded default log "No
        # hostname was supplied. Reverting to default 'localhost'" at each connection (issue
        # 37). The file-system transport never reads the host.
        return {}
