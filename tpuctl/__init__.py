"""tpuctl: from a laptop to a trained model on Cloud TPUs and back to a zero bill.

The Python API (see README, "From Python"): `tpuctl.up`, `tpuctl.run`, `tpuctl.down`, `tpuctl.status`,
`tpuctl.gc`, `tpuctl.fit`, `tpuctl.board`, `tpuctl.local.start()/stop()`; events in `tpuctl.events`, errors in `tpuctl.errors`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Loaded on first use (PEP 562): `import tpuctl` happens for every `tpuctl.*` module, the workers' guest
# code and the local cloud included, which must not pay for (or need) pydantic and the spec machinery.
_API = ("Run", "up", "run", "down", "status", "gc", "fit", "board")
__all__ = [*_API, "local", "events", "errors", "__version__"]

if TYPE_CHECKING:
    from tpuctl import errors, events, local
    from tpuctl.api import Run, board, down, fit, gc, run, status, up


def __getattr__(name: str) -> Any:
    import importlib

    if name in _API:
        return getattr(importlib.import_module("tpuctl.api"), name)
    if name in ("local", "events", "errors"):
        return importlib.import_module(f"tpuctl.{name}")
    raise AttributeError(f"module 'tpuctl' has no attribute {name!r}")
