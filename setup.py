"""The one part of the build that pyproject.toml cannot state: the package list.

The packages are every package under ``mxlib/`` (found, so a new subpackage needs no entry here) plus
``mxlib.notebooks``, which pyproject.toml's ``package-dir`` maps onto the top-level ``notebooks/`` folder
(the one copy of the notebooks; ``packages.find`` cannot see a package mapped from outside ``mxlib/``).
Everything else (metadata, dependencies, package data) is in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["mxlib", "mxlib.*"]) + ["mxlib.notebooks"])
