"""The install ships every package of the tree: pyproject lists packages explicitly (find() would install
`provision`, `jobs`... as generic top-level modules), so a new subpackage that is not listed works in an editable
checkout and is missing from a wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_listed_in_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    tool = project["tool"]["setuptools"]
    listed, dirs = set(tool["packages"]), tool["package-dir"]
    found = set()
    for name, folder in dirs.items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            if "__pycache__" in rel.parts or any(p.startswith(".") for p in rel.parts):
                continue
            found.add(".".join([name, *rel.parts]))
    # A folder mapped under another's name (e.g. tpuctl.provision -> provision/) is found from its own entry.
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - found == set(), "pyproject lists packages that have no __init__.py"
