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
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "chaos.py"), "--scenarios", "20", "--seed", "3"],
                          capture_output=True, text=True, cwd=REPO, timeout=520)
    tail = proc.stdout.strip().splitlines()[-4:]
    assert tail == ["leaked: 0", "lost checkpoints: 0", "wrong exit codes: 0", "scenarios: 20"], (
        proc.stdout[-4000:] + proc.stderr[-2000:])
    assert proc.returncode == 0
