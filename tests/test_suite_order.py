"""The suite's --order option (conftest.py): the same tests in another order, to show that none depends on what
ran before it (issue 33: a GPT-2 test failed only after a BERT test had left Keras' dtype policy changed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FILES = ["tests/test_bert_config.py", "tests/test_catalog.py", "tests/test_config.py"]  # files that import and collect fast


def collect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def collected(*options: str) -> list[str]:
    proc = collect(*options, *FILES)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


@pytest.mark.slow  # fast tier: --order: test_an_unknown_order_is_a_usage_error
def test_reverse_and_seeded_random_orders_run_every_test_once_in_another_order():
    default = collected()
    assert [test.split("::")[0] for test in default][::len(default) - 1] == [FILES[0], FILES[-1]]
    assert collected("--order=reverse") == default[::-1]
    shuffled = collected("--order=random:4")
    assert collected("--order=random:4") == shuffled  # the seed reproduces its order
    # The files move, each as one block with its tests in their usual order (a module fixture is set up once).
    files = list(dict.fromkeys(test.split("::")[0] for test in shuffled))
    assert sorted(files) == FILES and files != FILES
    assert shuffled == [test for f in files for test in default if test.split("::")[0] == f]


def test_an_unknown_order_is_a_usage_error():
    proc = collect("--order=shuffle", FILES[0])
    assert proc.returncode == 4 and "--order: 'shuffle' is not reverse or random:SEED" in proc.stderr
