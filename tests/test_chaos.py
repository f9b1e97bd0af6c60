"""The CI slice of the chaos runner: 20 seeded scenarios against one local cloud must end 0 / 0 / 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(540)
def test_chaos_slice_leaks_nothing_loses_no_checkpoint_and_exits_as_the_fault_says():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "chaos.py"), "--scenarios", "20", "--seed", "3",
                           # a detached run takes ~85 s here; test_supervisor covers it
                           "--without", "detached"],
                          capture_output=True, text=True, cwd=REPO, timeout=520)
    tail = proc.stdout.strip().splitlines()[-4:]
    assert tail == ["leaked: 0", "lost checkpoints: 0", "wrong exit codes: 0", "scenarios: 20"], (
        proc.stdout[-4000:] + proc.stderr[-2000:])
    assert proc.returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_draws_unexpected_answers_and_up_rolls_back_what_they_break():
    # Seed 3 draws both shapes of localcloud's `odd-response`: a node whose endpoints are an empty list (up
    # finishes) and a queued resource's create answered without its operation's name (the client raises
    # ValueError: up must roll back and exit 1 with one `error: unexpected ...` line, nothing left behind).
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "chaos.py"), "--scenarios", "2", "--seed", "3",
                           "--faults", "odd-response"], capture_output=True, text=True, cwd=REPO, timeout=280)
    lines = proc.stdout.strip().splitlines()
    assert [" exit=0 " in lines[0], " exit=1 " in lines[1]] == [True, True], proc.stdout[-4000:] + proc.stderr[-2000:]
    assert lines[-4:] == ["leaked: 0", "lost checkpoints: 0", "wrong exit codes: 0", "scenarios: 2"], (
        proc.stdout[-4000:] + proc.stderr[-2000:])
