"""Where tpuctl keeps its own files on the user's machine: one root, overridable with TPUCTL_HOME.

Layout under the root: `config.yaml` (user config), `localcloud/` (the embedded cloud's state and
daemon file), `ssh/` (the per-user key pair, 0600), `ledger.json` (a cache of runs; labels decide),
`catalog-cache.json` (prices pulled by `tpuctl catalog refresh`), `gc.lock`, `logs/`.
"""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    root = Path(os.environ.get("TPUCTL_HOME") or Path.home() / ".tpuctl")
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return root


def localcloud_dir() -> Path:
    return home() / "localcloud"


def ssh_dir() -> Path:
    d = home() / "ssh"
    d.mkdir(exist_ok=True, mode=0o700)
    return d


def user_config() -> Path:
    return home() / "config.yaml"


def ledger() -> Path:
    return home() / "ledger.json"


def catalog_cache() -> Path:
    return home() / "catalog-cache.json"


def gc_lock() -> Path:
    return home() / "gc.lock"


def logs_dir() -> Path:
    d = home() / "logs"
    d.mkdir(exist_ok=True)
    return d
