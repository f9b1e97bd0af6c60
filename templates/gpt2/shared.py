"""lmkit (templates/lmkit), the code the language-model templates share, imported the way this package itself was:
the top-level `lmkit` that ships beside the template in a job bundle (template.json `uses`), else the installed
`tpuctl.templates.lmkit`. A copy of this package outside tpuctl (a user's template begun as a copy of a built-in,
loaded on the laptop) has no top-level `lmkit` there: it gets the installed one. Every template built on lmkit
carries this same file (templates/README.md)."""

from __future__ import annotations

import importlib
import importlib.util

_LMKIT = ("lmkit" if not __package__.startswith("tpuctl.") and importlib.util.find_spec("lmkit") is not None
          else "tpuctl.templates.lmkit")


def lmkit(module: str):
    """lmkit's `module` (e.g. "trainer")."""
    return importlib.import_module(f"{_LMKIT}.{module}")
