"""`python -m tpuctl_agent prepare|run` (the bootstrap's two calls)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .install import prepare
from .supervisor import Agent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpuctl_agent")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--cache", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("--bundle", type=Path, required=True)
    r.add_argument("--worker", type=int, required=True)
    a = parser.parse_args(argv)
    if a.cmd == "prepare":
        return prepare(a.bundle, a.cache)
    return Agent(a.bundle, a.worker).run()


if __name__ == "__main__":
    sys.exit(main())
