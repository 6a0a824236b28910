"""Packages discovered from the ``package-dir`` mapping: every package under the three library
folders installs under its ``shardwise.*`` name, so a new subpackage can never be left out of
the wheel. Metadata is in pyproject.toml."""

from setuptools import find_packages, setup

ROOTS = {"shardwise.composable": "composable", "shardwise.mesh": "mesh", "shardwise.checkpoint": "checkpoint"}
PACKAGES = [name for top, folder in ROOTS.items() for name in [top] + [f"{top}.{p}" for p in find_packages(folder)]]

setup(package_dir=ROOTS, packages=PACKAGES)
