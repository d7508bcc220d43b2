"""The application image starts, checked without a Docker engine (none runs here, in CI
either): its files are rebuilt from ``config/docker/Dockerfile``'s ``COPY`` lines and
``.dockerignore`` (tests/image_files.py), copied to a folder of their own, and the project is
checked and imported from there, with nothing of the checkout on the path. Before this test,
an image that left ``schedules/`` out (an installed app) would have died at its first
``manage.py``, and nothing in CI could see it.

That a non-editable ``pip install`` of the same files makes a working install is
tests/test_production_install.py's (and .ci/plain_install_worker's): both install from this
file set, not from the checkout.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path, PurePosixPath

import pytest
import yaml

from tests import image_files
from tests.test_production_install import _clean_env

BASE_DIR = Path(__file__).resolve().parent.parent
IMAGE = image_files.parse(image_files.DOCKERFILE.read_text())
# What a developer's checkout holds besides the project; none of it may reach the image.
NOT_THE_PROJECT = {".venv", ".git", "var", ".env", "build", ".pytest_cache", "test-artifacts"}
# The dependencies' folders: the only things the probe may import from outside the image.
SITE_PACKAGES = sorted({sysconfig.get_paths()[key] for key in ("purelib", "platlib")})

# Imports every installed app and every package of the project, then says where each module
# of the process came from.
PROBE = """
import importlib, json, sys
import django
django.setup()
from django.conf import settings
for name in [*settings.INSTALLED_APPS, *json.loads(sys.argv[1])]:
    importlib.import_module(name)
print(json.dumps({
    name: [module.__file__] if getattr(module, "__file__", None)
    else list(getattr(module, "__path__", []))
    for name, module in list(sys.modules.items())
}))
"""


# What setuptools would ship, asked of setuptools itself: the packages and where each one's
# folder is (package_dir), from pyproject.toml and setup.py as `pip install .` reads them.
SETUP_PROBE = """
import json, sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")
import setuptools
from distutils.core import run_setup
dist = run_setup("setup.py" if Path("setup.py").exists() else sys.argv[1], stop_after="config")
print(json.dumps({"packages": sorted(dist.packages or []), "package_dir": dist.package_dir or {}}))
"""


@functools.cache
def project_packages() -> dict[str, PurePosixPath]:
    """Every package ``pip install .`` ships -> its folder in the project."""
    with tempfile.TemporaryDirectory() as scratch:
        # With no setup.py, setup() alone: setuptools then reads pyproject.toml only.
        standin = Path(scratch) / "setup.py"
        standin.write_text("from setuptools import setup\nsetup()\n")
        done = subprocess.run(
            [sys.executable, "-c", SETUP_PROBE, str(standin)],
            cwd=BASE_DIR,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    mapped = found["package_dir"]
    folders = {}
    for package in found["packages"]:
        # The longest package_dir entry that is the package or one it is inside ("" is all).
        keys = [k for k in mapped if k in ("", package) or package.startswith(k + ".")]
        key = max(keys, key=len, default="")
        rest = package[len(key) :].lstrip(".").split(".") if package != key else []
        folders[package] = PurePosixPath(mapped.get(key, ""), *[part for part in rest if part])
    return folders


def in_image(path: str) -> PurePosixPath:
    return PurePosixPath(path).relative_to(IMAGE.workdir)


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return image_files.build(tmp_path_factory.mktemp("image") / "app")


def _run_in_image(image_dir: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """``python ARGS`` in the image's WORKDIR, seeing the dependencies but not the checkout:
    -S skips site-packages' .pth files, among them the editable install's finder, which
    would hand out the checkout's copy of any package the image lacks."""
    env = {**env, "PYTHONPATH": os.pathsep.join(SITE_PACKAGES)}
    return subprocess.run(
        [sys.executable, "-S", *args],
        cwd=image_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_compose_builds_this_dockerfile_from_the_root() -> None:
    """What this file checks is what `docker compose up --build` builds: the same Dockerfile,
    with the repository's root (where .dockerignore is) as the context."""
    compose = yaml.safe_load((BASE_DIR / "docker-compose.yml").read_text())
    build = compose["x-app"]["build"]
    assert (BASE_DIR / build["context"]).resolve() == BASE_DIR
    assert (BASE_DIR / build["dockerfile"]).resolve() == image_files.DOCKERFILE
    assert (BASE_DIR / ".dockerignore").is_file()


def test_the_image_holds_every_package_and_nothing_else_of_the_checkout() -> None:
    held = {in_image(path) for path in image_files.files()}
    tops = {path.parts[0] for path in held}
    assert not tops & NOT_THE_PROJECT
    assert not [p for p in held if "__pycache__" in p.parts or p.suffix in (".pyc", ".pyo")]
    assert not [p for p in held if any(part.endswith(".egg-info") for part in p.parts)]
    assert not [p for p in held if p.name == "secret_key"]
    for package, folder in project_packages().items():
        assert any(path.is_relative_to(folder) for path in held), f"the image lacks {package}"
    for needed in ("manage.py", "pyproject.toml", "README.md"):
        assert PurePosixPath(needed) in held


def test_every_file_of_the_repository_is_in_the_image() -> None:
    """COPY . . is the whole project: .dockerignore leaves out only what git does not track
    either (a pattern that caught a file of the project would show here)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=BASE_DIR, capture_output=True, check=True
    ).stdout.decode()
    tracked = {path for path in listed.split("\0") if path and (BASE_DIR / path).is_file()}
    held = {str(in_image(path)) for path in image_files.files()}
    assert sorted(tracked - held) == []


def test_nothing_git_ignores_reaches_the_image() -> None:
    """What git ignores in this checkout (var/, .venv, .env, caches, at any depth) is not sent:
    .dockerignore's patterns are anchored at the root where .gitignore's are not."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory"],
        cwd=BASE_DIR,
        capture_output=True,
        check=True,
    ).stdout.decode()
    ignored = [path.rstrip("/") for path in listed.split("\0") if path]
    sent = image_files.context(BASE_DIR)
    leaked = sorted(
        path for path in sent for gone in ignored if path == gone or path.startswith(f"{gone}/")
    )
    assert leaked == []


@pytest.mark.parametrize(
    "planted",
    [
        "deploy/.env",
        "deploy/grafana/.env.local",
        ".envrc",
        "bench/.envrc",
        "bench/var/secret_key",
        "bench/var/db.sqlite3",
        "tests/.venv/lib/x.py",
        "data/secret_key",
    ],
)
def test_secrets_and_data_in_a_subfolder_stay_out_of_the_image(
    tmp_path: Path, planted: str
) -> None:
    (tmp_path / ".dockerignore").write_text((BASE_DIR / ".dockerignore").read_text())
    (tmp_path / "Dockerfile").write_text("FROM scratch\nCOPY . .\n")
    (tmp_path / "kept.py").write_text("")
    path = tmp_path / planted
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("secret")
    sent = image_files.context(tmp_path, tmp_path / "Dockerfile")
    assert "kept.py" in sent
    assert planted not in sent


def test_the_image_installs_the_project_and_bakes_no_key_in() -> None:
    runs = [shlex.split(run.replace("&&", " && ")) for run in IMAGE.runs]
    installs = [words for words in runs if "pip" in words and "install" in words]
    assert installs, IMAGE.runs
    for words in installs:
        # Not editable: the image's install is the one CONTRACT section 12 calls complete.
        assert "-e" not in words and "--editable" not in words, words
    # Nothing at build time loads the settings: on the embedded default that would make a
    # SECRET_KEY in a layer of the image, the same in every container and readable by all
    # who pull it. The key is made at the first start, in the container's var folder.
    for words in runs:
        assert "manage.py" not in words and "django" not in words, words
    # Nor does it set one: a key in ENV or ARG would be every container's, and in the image's
    # history for all to read.
    for name, args in image_files.instructions(image_files.DOCKERFILE.read_text()):
        assert "SECRET_KEY" not in args, (name, args)
    assert IMAGE.cmd[:3] == ("python", "manage.py", "standalone"), IMAGE.cmd
    assert "var" not in {path.parts[0] for path in map(in_image, image_files.files())}


def test_manage_py_check_and_every_import_from_the_image_alone(
    image_dir: Path, tmp_path: Path
) -> None:
    # Imported where they are: a package whose folder is elsewhere (package_dir) is one only
    # once installed, and its folder was checked above.
    packages = [
        package
        for package, folder in project_packages().items()
        if folder == PurePosixPath(*package.split("."))
    ]
    assert {"config", "workflows", "runs", "approvals", "workers", "schedules"} <= set(packages)
    # The image's default command: the embedded default, which makes its own key.
    embedded = _clean_env(DJANGO_SETTINGS_MODULE="config.settings", DJFLOW_VAR_DIR=str(tmp_path))
    check = _run_in_image(image_dir, embedded, "manage.py", "check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert (tmp_path / "secret_key").is_file()

    probe = _run_in_image(image_dir, embedded, "-c", PROBE, json.dumps(packages))
    assert probe.returncode == 0, probe.stderr
    modules = json.loads(probe.stdout.strip().splitlines()[-1])
    for package in packages:
        assert modules[package], package
        for place in modules[package]:
            assert Path(place).is_relative_to(image_dir), (package, place)
    # Nothing came from the checkout, except the dependencies where the venv is inside it.
    for name, places in modules.items():
        for place in places:
            path = Path(place)
            if path.is_relative_to(BASE_DIR):
                assert any(path.is_relative_to(site) for site in SITE_PACKAGES), (name, place)


def test_compose_services_check_from_the_image(image_dir: Path, tmp_path: Path) -> None:
    """As docker-compose.yml runs it: Postgres, Redis and a SECRET_KEY of the operator's,
    and web's collectstatic (addresses from this environment, as the tests' own)."""
    env = _clean_env(
        DJANGO_SETTINGS_MODULE="config.settings",
        DJFLOW_VAR_DIR=str(tmp_path),
        DATABASE_URL=os.environ["DATABASE_URL"],
        CELERY_BROKER_URL=os.environ["CELERY_BROKER_URL"],
        CELERY_RESULT_BACKEND=os.environ["CELERY_RESULT_BACKEND"],
        SECRET_KEY=secrets.token_urlsafe(50),
    )
    check = _run_in_image(image_dir, env, "manage.py", "check")
    assert check.returncode == 0, check.stdout + check.stderr
    collect = _run_in_image(image_dir, env, "manage.py", "collectstatic", "--noinput", "-v0")
    assert collect.returncode == 0, collect.stdout + collect.stderr
    assert (tmp_path / "static" / "admin" / "css" / "base.css").is_file()
    assert not (tmp_path / "secret_key").exists()


def test_dockerignore_is_read_with_dockers_semantics_not_gitignores(tmp_path: Path) -> None:
    """Each case here is one where a .gitignore matcher would answer otherwise."""
    for path in ("a.pyc", "sub/b.pyc", "var", "data/var/x", "keep/skip", "keep/important"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x")
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    (tmp_path / ".dockerignore").write_text("# a comment\n*.pyc\nvar/\n/keep\n!keep/important\n")
    sent = image_files.context(tmp_path, tmp_path / "Dockerfile")
    # Anchored at the root: sub/b.pyc and data/var stay (.gitignore: left out at any depth).
    assert "a.pyc" not in sent and "sub/b.pyc" in sent and "data/var/x" in sent
    # A trailing slash is dropped: the file named var goes (.gitignore: folders only).
    assert "var" not in sent
    # A file is taken back from a left-out folder (.gitignore cannot).
    assert "keep/important" in sent and "keep/skip" not in sent
    (tmp_path / ".dockerignore").write_text("**/*.pyc\n")
    assert not {"a.pyc", "sub/b.pyc"} & image_files.context(tmp_path, tmp_path / "Dockerfile")
