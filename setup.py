"""Package discovery (the rest of the build configuration is ``pyproject.toml``): setuptools
finds the packages under ``mla_backend/`` and under ``integrations/``, which ships as
``mla_backend_integrations`` (``package-dir`` in ``pyproject.toml``; a bare top-level
``integrations`` could collide with anything on a user's path). The engine tests' folders are not
shipped. pyproject.toml's ``packages.find`` cannot rename a folder, hence this file."""

from setuptools import find_packages, setup

TESTS = ["*.tests", "*.tests.*"]

setup(
    packages=find_packages(include=["mla_backend", "mla_backend.*"], exclude=TESTS)
    + [
        "mla_backend_integrations" + name.removeprefix("integrations")
        for name in find_packages(include=["integrations", "integrations.*"], exclude=TESTS)
    ]
)
