"""The embedded default's ``SECRET_KEY``: generated once per installation, kept in a file under
its var folder (``VAR_DIR/secret_key``, mode 0600), so that no key a reader of this repository
knows ever signs a session or an approval link.

Invariants:

- The file is written whole or not at all: a key goes to a temporary file of its own first,
  and is then hard-linked to the final name, which fails if the name exists. Two processes
  that start at once on a fresh var folder (the standalone and its children, two standalones)
  each make a candidate, one link wins, and both read back the winner's key.
- A key once written is never replaced: deleting the file is how an operator rotates it (every
  session and approval link signed with the old one stops working).
- Nothing here is read outside the embedded default: the settings ask for it only when
  ``SECRET_KEY`` is unset there, and refuse to start without one anywhere else.

Imports only the standard library: the settings import it before Django is set up.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import time
from pathlib import Path

# token_urlsafe(50) is 67 characters: past Django's check --deploy (50, with 5 distinct).
_KEY_BYTES = 50
_MIN_LENGTH = 50
# A file still being written by a process without hard links (see _publish) reads short;
# how long another start waits for it to be whole before it calls the file broken.
_WAIT_SECONDS = 2.0


class SecretKeyFileError(Exception):
    """The key file exists but holds no usable key."""


def installation_key(path: Path) -> str:
    """The key kept at ``path``, made first if there is none."""
    if not path.exists():
        _publish(path, secrets.token_urlsafe(_KEY_BYTES))
    return _read(path)


def _publish(path: Path, key: str) -> None:
    """Put ``key`` at ``path`` unless a key is there already; never overwrite one."""
    candidate = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(key + "\n")
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(candidate, path)
        except FileExistsError:
            pass  # another start won the race; its key is the installation's
        except OSError as error:
            if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            # A file system without hard links (some network and host-shared mounts):
            # O_EXCL on the final name still lets only one start write it, and _read waits
            # out the moment it is empty.
            _write_exclusive(path, key)
    finally:
        candidate.unlink(missing_ok=True)


def _write_exclusive(path: Path, key: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
        out.flush()
        os.fsync(out.fileno())


def _read(path: Path) -> str:
    """The key in ``path``, which must be a regular file (not a link: a link planted in a
    shared var folder would make any file the key), owned by this user and closed to group
    and others (a key others can read signs for them). Refused by name otherwise."""
    deadline = time.monotonic() + _WAIT_SECONDS
    while True:
        key = _read_own(path).strip()
        if _usable(key):
            return key
        if time.monotonic() >= deadline:
            raise SecretKeyFileError(
                f"{path} holds no usable SECRET_KEY (fewer than {_MIN_LENGTH} characters, "
                "fewer than 5 distinct, or starting with 'django-insecure-'): delete it to "
                "have a new one generated (sessions and approval links signed with the old "
                "one stop working), or set SECRET_KEY"
            )
        time.sleep(0.05)


def _read_own(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise SecretKeyFileError(f"{path} is a symbolic link; the key must be a file") from None
        raise
    with os.fdopen(fd) as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise SecretKeyFileError(f"{path} is not a regular file")
        if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
            raise SecretKeyFileError(
                f"{path} is owned by another user (uid {info.st_uid}): a key someone else "
                "wrote is not this installation's; delete it, or set SECRET_KEY"
            )
        if info.st_mode & 0o077:
            raise SecretKeyFileError(
                f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):04o}): "
                f"run chmod 600 {path}, or delete it to have a new key generated"
            )
        return file.read()


def _usable(key: str) -> bool:
    """What the settings ask of any key (Django's check --deploy, security.W009)."""
    return len(key) >= _MIN_LENGTH and len(set(key)) >= 5 and not key.startswith("django-insecure-")
