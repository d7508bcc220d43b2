"""The embedded default's SECRET_KEY is its installation's own (config.secret_key): each
case loads the settings afresh in subprocesses, as a start of the standalone would."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from config import secret_key
from tests.test_settings import CONFIG_VARS

BASE_DIR = Path(__file__).resolve().parent.parent
PROBE = "from django.conf import settings; print(settings.SECRET_KEY)"


def _embedded_env(var_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (*CONFIG_VARS, "SECRET_KEY")}
    env.update(DJANGO_SETTINGS_MODULE="config.settings", DJFLOW_VAR_DIR=str(var_dir))
    return env


def _start(var_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", PROBE],
        cwd=BASE_DIR,
        env=_embedded_env(var_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _key(var_dir: Path) -> str:
    proc = _start(var_dir)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out.strip().splitlines()[-1]


def test_each_installation_gets_its_own_key_and_keeps_it(tmp_path: Path) -> None:
    first, second = tmp_path / "one", tmp_path / "two"

    key = _key(first)
    assert key != _key(second)
    assert _key(first) == key
    assert len(key) >= 50 and not key.startswith("django-insecure-")
    kept = first / "secret_key"
    assert kept.read_text().strip() == key
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    # Nothing else is left in the var folder by the making of it.
    assert not [p for p in first.iterdir() if p.name.startswith(".secret_key")]


def test_starts_racing_on_a_fresh_installation_agree_on_one_key(tmp_path: Path) -> None:
    var_dir = tmp_path / "var"
    # The settings make VAR_DIR; made here so that no start has that head start on the rest.
    var_dir.mkdir()
    procs = [_start(var_dir) for _ in range(6)]
    keys = set()
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        keys.add(out.strip().splitlines()[-1])
    assert keys == {(var_dir / "secret_key").read_text().strip()}


def test_a_set_secret_key_wins_and_no_file_is_made(tmp_path: Path) -> None:
    env = {**_embedded_env(tmp_path), "SECRET_KEY": "mine-" + "k" * 60}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=BASE_DIR, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "mine-" + "k" * 60
    assert not (tmp_path / "secret_key").exists()


def test_a_key_once_kept_is_never_replaced(tmp_path: Path) -> None:
    path = tmp_path / "secret_key"
    first = secret_key.installation_key(path)
    secret_key._publish(path, "another" * 10)
    assert secret_key.installation_key(path) == first


def test_a_file_without_a_usable_key_is_refused_by_name(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(secret_key, "_WAIT_SECONDS", 0.1)
    path = tmp_path / "secret_key"
    path.write_text("short\n")
    path.chmod(0o600)
    with pytest.raises(secret_key.SecretKeyFileError, match=str(path)):
        secret_key.installation_key(path)
    # The settings say so as ImproperlyConfigured, naming the variable to set.
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=BASE_DIR,
        env=_embedded_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "ImproperlyConfigured" in done.stderr and "DJFLOW_VAR_DIR" in done.stderr


def test_without_hard_links_one_start_still_writes_it(tmp_path: Path, monkeypatch) -> None:
    def no_links(src: object, dst: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    path = tmp_path / "secret_key"
    first = secret_key.installation_key(path)
    secret_key._publish(path, "another" * 10)
    assert secret_key.installation_key(path) == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["secret_key"]


def _own_file(path: Path, text: str, mode: int = 0o600) -> None:
    path.write_text(text)
    path.chmod(mode)


@pytest.mark.parametrize(
    ("plant", "why"),
    [
        # A key everyone reads is no secret: a pre-existing world-readable file.
        (lambda p: _own_file(p, "known-to-everyone-" + "0123456789" * 6, 0o644), "open to other"),
        (lambda p: _own_file(p, "known-to-everyone-" + "0123456789" * 6, 0o640), "open to other"),
        # A link planted in a shared var folder would make any file the key.
        (lambda p: p.symlink_to("/etc/hostname"), "symbolic link"),
        # Long enough, but what check --deploy calls insecure.
        (lambda p: _own_file(p, "django-insecure-" + "a" * 40), "no usable SECRET_KEY"),
        (lambda p: _own_file(p, "ab" * 40), "no usable SECRET_KEY"),
        (lambda p: p.mkdir(), "not a regular file|Is a directory"),
    ],
)
def test_a_key_file_others_could_know_is_refused(tmp_path: Path, monkeypatch, plant, why) -> None:
    monkeypatch.setattr(secret_key, "_WAIT_SECONDS", 0.1)
    path = tmp_path / "secret_key"
    plant(path)
    with pytest.raises((secret_key.SecretKeyFileError, OSError), match=why):
        secret_key.installation_key(path)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_a_key_file_of_another_user_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "secret_key"
    _own_file(path, "theirs-" + "0123456789" * 6)
    os.chown(path, 4242, -1)
    with pytest.raises(secret_key.SecretKeyFileError, match="another user"):
        secret_key.installation_key(path)


def test_the_key_goes_beside_the_database_and_var_is_private(tmp_path: Path) -> None:
    """A database kept on a volume apart from var/ keeps its key with it: a new container
    (a new var/) finds the same key. A var folder the settings make is this user's alone."""
    data = tmp_path / "data"
    data.mkdir()
    env = {**_embedded_env(tmp_path / "var-1"), "DATABASE_URL": f"sqlite:///{data / 'db.sqlite3'}"}

    def key(env: dict[str, str]) -> str:
        done = subprocess.run(
            [sys.executable, "-c", PROBE], cwd=BASE_DIR, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().splitlines()[-1]

    first = key(env)
    assert (data / "secret_key").read_text().strip() == first
    assert not (tmp_path / "var-1" / "secret_key").exists()
    assert key({**env, "DJFLOW_VAR_DIR": str(tmp_path / "var-2")}) == first
    assert stat.S_IMODE((tmp_path / "var-2").stat().st_mode) & 0o077 == 0
