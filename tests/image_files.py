"""The files the application image holds, rebuilt without a Docker engine (none runs here):
the build context as ``.dockerignore`` leaves it, then each ``COPY`` of
``config/docker/Dockerfile`` applied to it, into a folder that stands for the image's
``WORKDIR``.

``.dockerignore`` is read by the Docker SDK for Python's own implementation
(``docker.utils.build.exclude_paths``, a port of the Docker CLI's pattern matcher), not by a
``.gitignore`` matcher such as pathspec's gitwildmatch, whose semantics differ where it
matters: in ``.dockerignore`` a pattern is anchored at the context's root (``*.pyc`` is the
root's only; ``**/*.pyc`` is every folder's), where ``.gitignore`` matches a slash-free
pattern at any depth; a trailing ``/`` is dropped (``var/`` leaves out a file named ``var``
too), where ``.gitignore`` matches only folders; and ``!`` can take back a file inside a
left-out folder, which ``.gitignore`` cannot. Where the SDK and the Docker CLI differ it says
less is sent, never more: it matches case-insensitively (the CLI on Linux does not) and reads
``[!a]``, not Go's ``[^a]``, as a negated class; this project's ``.dockerignore`` uses neither.

Only the Dockerfile instructions the project's Dockerfile uses are understood (``FROM``,
``WORKDIR``, ``COPY`` of context paths, and the ones that add no files); anything else raises
``Unsupported``, so a Dockerfile this cannot read fails the test instead of passing it
unread.

``python -m tests.image_files DEST`` writes the file set to DEST: ``.ci/plain_install_worker``
installs the project from there with ``pip install``, as the image does.
"""

from __future__ import annotations

import json
import posixpath
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from docker.utils.build import exclude_paths

BASE_DIR = Path(__file__).resolve().parent.parent
DOCKERFILE = BASE_DIR / "config" / "docker" / "Dockerfile"
# Instructions that put no file of the context into the image.
_NO_FILES = {"ARG", "CMD", "ENTRYPOINT", "ENV", "EXPOSE", "HEALTHCHECK", "LABEL", "RUN"}
_NO_FILES |= {"SHELL", "STOPSIGNAL", "USER", "VOLUME", "ONBUILD"}
# COPY flags that change owners or modes, not which files land where.
_HARMLESS_FLAGS = ("--chown=", "--chmod=", "--link")


class Unsupported(Exception):
    """A Dockerfile or COPY form this module does not read."""


@dataclass(frozen=True)
class Copy:
    sources: tuple[str, ...]
    dest: str  # absolute, in the image


@dataclass(frozen=True)
class Image:
    workdir: str
    copies: tuple[Copy, ...]
    runs: tuple[str, ...]
    cmd: tuple[str, ...]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    found: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction is skipped by Docker too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        if whole:
            name, _, args = whole.partition(" ")
            found.append((name.upper(), args.strip()))
    if pending:
        raise Unsupported(f"the Dockerfile ends inside a continued line: {pending!r}")
    return found


def _words(args: str) -> list[str]:
    """The exec form (a JSON array) or the shell form's words."""
    if args.startswith("["):
        words = json.loads(args)
        if not all(isinstance(word, str) for word in words):
            raise Unsupported(f"not a list of strings: {args}")
        return words
    return shlex.split(args)


def parse(text: str) -> Image:
    workdir, copies, runs, cmd = "/", [], [], ()
    for name, args in instructions(text):
        if name == "FROM":
            if copies or workdir != "/":
                raise Unsupported("more than one stage")
        elif name == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, args))
        elif name == "COPY":
            copies.append(_copy(args, workdir))
        elif name == "RUN":
            runs.append(args)
        elif name == "CMD":
            cmd = tuple(_words(args))
        elif name not in _NO_FILES:
            raise Unsupported(f"{name} {args}")
    return Image(workdir, tuple(copies), tuple(runs), cmd)


def _copy(args: str, workdir: str) -> Copy:
    rest = args
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        if not flag.startswith(_HARMLESS_FLAGS):
            raise Unsupported(f"COPY {flag}: only context paths are read here")
        rest = rest.lstrip()
    paths = _words(rest)
    if len(paths) < 2:
        raise Unsupported(f"COPY {args}")
    *sources, dest = paths
    for source in sources:
        if any(char in source for char in "*?[") or source.startswith(("/", "..")):
            raise Unsupported(f"COPY source {source!r}: wildcards and paths out of the context")
    absolute = posixpath.join(workdir, dest)
    # "dest/" (or several sources) names a folder; a trailing slash survives join, not normpath.
    folder = dest.endswith("/") or len(sources) > 1
    return Copy(tuple(sources), posixpath.normpath(absolute) + ("/" if folder else ""))


def context(root: Path, dockerfile: Path = DOCKERFILE) -> set[str]:
    """The files (not folders) of the build context: relative POSIX paths."""
    ignore = root / ".dockerignore"
    patterns = []
    if ignore.exists():
        # As the SDK reads it (docker.api.build): stripped, blank lines and comments dropped.
        lines = (line.strip() for line in ignore.read_text().splitlines())
        patterns = [line for line in lines if line and not line.startswith("#")]
    kept = exclude_paths(str(root), patterns, dockerfile=dockerfile.relative_to(root).as_posix())
    return {path for path in kept if not (root / path).is_dir() or (root / path).is_symlink()}


def files(root: Path = BASE_DIR, dockerfile: Path = DOCKERFILE) -> dict[str, str]:
    """What the image holds from the context: its path in the image -> the context's path."""
    image = parse(dockerfile.read_text())
    sent = context(root, dockerfile)
    placed: dict[str, str] = {}
    for copy in image.copies:
        for source in copy.sources:
            source = posixpath.normpath(source)
            if source == ".":
                below = sorted(sent)
                prefix = ""
            else:
                prefix = source + "/"
                below = sorted(path for path in sent if path.startswith(prefix))
            if below and source not in sent:  # a folder: its contents go into dest
                for path in below:
                    placed[posixpath.join(copy.dest.rstrip("/"), path[len(prefix) :])] = path
            elif source in sent:  # a file: into dest/ or onto dest
                target = copy.dest
                if target.endswith("/"):
                    target = posixpath.join(target, posixpath.basename(source))
                placed[target] = source
            else:
                raise Unsupported(f"COPY source {source!r} is not in the build context")
    return placed


def build(target: Path, root: Path = BASE_DIR, dockerfile: Path = DOCKERFILE) -> Path:
    """Copy what the image holds under its WORKDIR into ``target`` (which stands for it)."""
    workdir = PurePosixPath(parse(dockerfile.read_text()).workdir)
    for in_image, source in files(root, dockerfile).items():
        path = PurePosixPath(in_image)
        if not path.is_relative_to(workdir):
            raise Unsupported(f"{in_image} is outside WORKDIR {workdir}")
        out = target / path.relative_to(workdir)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / source, out, follow_symlinks=False)
    return target


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.image_files DEST")
    build(Path(sys.argv[1]))
