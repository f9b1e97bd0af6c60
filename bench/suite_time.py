"""Test suite time: the fast tier and the whole suite, each timed as a developer and CI run them.

    .venv/bin/python bench/suite_time.py [--only fast|suite] [--limit SECONDS] [--slowest N]

The fast tier is `pytest -m "not slow"`, what a developer runs on every change (goal: under 5 minutes on 2
cores); the suite is the README's test command, what `.ci/run` runs (goal: under 25 minutes). Wall time is the
machine's, so each line starts with its load average (`uptime`'s three figures) and core count: a machine
shared with other work makes every figure larger. A run past `--limit` is interrupted as Ctrl-C would (pytest
then prints what passed so far) and marked `INTERRUPTED`. `--slowest N` also prints pytest's N slowest test
phases (`--durations`): what to mark slow, or cut, next.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
TIERS = {"fast": (PYTEST + ["-m", "not slow"], 5 * 60), "suite": (PYTEST, 25 * 60)}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"


def timed(name: str, limit_s: float, slowest: int = 0) -> str:
    cmd, goal_s = TIERS[name]
    cmd = cmd + ([f"--durations={slowest}"] if slowest else [])
    before = load()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=limit_s)
        interrupted = ""
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # pytest stops and prints what passed so far
        out, _ = proc.communicate(timeout=120)
        interrupted = f" INTERRUPTED at the {limit_s:.0f} s limit"
    wall = time.monotonic() - t0
    summary = next((l.strip("= ") for l in reversed(out.splitlines()) if " in " in l and "passed" in l), "?")
    durations = [l for l in out.splitlines() if re.match(r"^\d+\.\d+s (call|setup|teardown) ", l)][:slowest]
    failed = [l for l in out.splitlines() if l.startswith(("FAILED ", "ERROR "))]  # which, not only how many
    return "\n".join([f"{name}: {wall:.0f} s (goal <= {goal_s} s){interrupted}; load before {before}, after {load()}; "
                      f"`{shlex.join(['python'] + cmd[1:])}`; {summary}", *failed, *durations])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=sorted(TIERS))
    ap.add_argument("--limit", type=float, default=3600.0, help="seconds per run before it is interrupted")
    ap.add_argument("--slowest", type=int, default=0, metavar="N", help="also print the N slowest test phases")
    a = ap.parse_args(argv)
    for name in [a.only] if a.only else list(TIERS):
        print(timed(name, a.limit, a.slowest), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
