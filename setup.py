"""The packages `pip install .` ships, and where their templates come from.

Everything else about the distribution is in pyproject.toml. The project's templates live in
the top-level templates/ (the design card), which is no package: a wheel can carry it only
inside one. It is mapped into config as config.templates, the name the settings look for in an
install (config/settings.py, TEMPLATES_DIR). pyproject.toml cannot say this while it also finds
the packages (setuptools ignores a package-dir entry for a package its find did not discover),
and a list of every package by hand would let a new one go unshipped.
"""

from setuptools import find_namespace_packages, setup

APPS = ["config", "workflows", "runs", "approvals", "workers", "schedules"]

setup(
    packages=[*find_namespace_packages(include=[f"{app}*" for app in APPS]), "config.templates"],
    package_dir={"config.templates": "templates"},
)
