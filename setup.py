"""Package discovery; everything else about the build is in pyproject.toml.

The repository root is the package `cadence` (pyproject's `package-dir`), so its top-level folders are
`cadence.server`, `cadence.engine`, ... find_packages() names them `server`, `engine`, ..., and setuptools'
declarative `packages.find` has no way to put `cadence.` in front; this file does that. Finding the
packages, instead of listing them, means a new folder (with its `__init__.py`) ships without anyone
remembering to add it. A folder without `__init__.py` is skipped, subfolders and all: .ci/wheel_check
fails CI when a source file is missing from the wheel.
"""

from __future__ import annotations

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

# Folders of the repository that are not part of the package: they stay in the checkout.
NOT_SHIPPED = ("tests", "bench", "deploy", "docs", "build", "dist")


class BuildPy(build_py):
    """Leaves this file out of the wheel.

    Every *.py in the root folder is a module of `cadence`, and this file is one of them. distutils skips
    the setup script by its name in sys.argv[0], but under a PEP 517 build (pip, `python -m build`) that
    is the build frontend's script, so without this the wheel would carry `cadence/setup.py`.
    """

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        modules: list[tuple[str, str, str]] = super().find_package_modules(package, package_dir)
        return [module for module in modules if module[:2] != ("cadence", "setup")]


setup(
    packages=["cadence"]
    + ["cadence." + name for name in find_packages(exclude=[*NOT_SHIPPED, *(f"{d}.*" for d in NOT_SHIPPED)])],
    cmdclass={"build_py": BuildPy},
)
