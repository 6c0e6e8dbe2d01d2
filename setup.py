"""Maps the top-level folders onto the `specrl` import package.

`operator/` becomes `specrl.operator` and `runtime/` becomes `specrl.runtime`. `operator/` has no
`__init__.py` on purpose, so `import operator` from the repository root still gives the standard
library; it is shipped as a namespace package. Everything else lives in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {"specrl.operator": "operator", "specrl.runtime": "runtime"}
SKIP = {"__pycache__"}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for name, folder in ROOTS.items():
        for path in sorted([Path(folder), *Path(folder).rglob("*")]):
            if path.is_dir() and not SKIP & set(path.parts):
                dotted = ".".join((name, *path.relative_to(folder).parts))
                packages.append(dotted)
                package_dir[dotted] = str(path)
    return packages, package_dir


_pkgs, _dirs = _packages()
setup(packages=_pkgs, package_dir=_dirs, package_data={"": ["*.json", "*.yaml", "*.txt"]}, include_package_data=True)
