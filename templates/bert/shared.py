"""lmkit (templates/lmkit), the code the built-in templates share, imported the way this package itself was:
the top-level `lmkit` that ships beside `bert` in a job bundle (template.json `uses`), else the installed
`tpuctl.templates.lmkit`."""

from __future__ import annotations

import importlib


def lmkit(module: str):
    """lmkit's `module` (e.g. "checkpoints"). A copy of this package outside tpuctl (a user's template begun as
    a copy of bert, loaded on the laptop) has no top-level `lmkit` there: it gets the installed one."""
    if not __package__.startswith("tpuctl."):
        try:
            return importlib.import_module(f"lmkit.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != "lmkit":
                raise
    return importlib.import_module(f"tpuctl.templates.lmkit.{module}")
