"""Save on the preemption notice (templates/README.md "Save on notice"), on TensorFlow and JAX.

`python -m bert.train` as a worker starts it, with `checkpoint_every` far beyond the run: the save request file
(the agent writes it on the metadata server's notice) gets a checkpoint at the next step boundary and training
goes on;
SIGTERM (the guest's shutdown) writes one at the step reached and ends the process as SIGTERM would. No step is
lost: the last checkpoint is the last step the process trained.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from test_bert_backends import data_dir  # noqa: E402,F401 - the shared prepared corpus fixture (skips without jax)
from test_bert_train import _worker_env  # noqa: E402

from tpuctl.templates.lmkit import checkpoints  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.timeout(300)]

STEP = re.compile(r"^step=(\d+) ")
SAVED = re.compile(r"^checkpoint step=(\d+) path=(\S+)$")


def _lines_until(proc, pattern: re.Pattern, seen: list[str], deadline: float) -> re.Match:
    for line in proc.stdout:
        seen.append(line.rstrip("\n"))
        m = pattern.match(seen[-1])
        if m:
            return m
        assert time.monotonic() < deadline, seen[-20:]
    errors = Path(proc.args[proc.args.index("--config") + 1]).with_name("stderr.txt").read_text()[-2000:]
    raise AssertionError(f"the program ended before {pattern.pattern}: {seen[-20:]}\n{errors}")


@pytest.mark.parametrize("framework", ["tensorflow", pytest.param("jax", marks=pytest.mark.slow)])  # ~15 s each
def test_a_notice_saves_the_step_reached_and_sigterm_loses_none(data_dir, tmp_path, framework):  # noqa: F811
    model_dir = tmp_path / "model"
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({
        "preset": "bert-tiny",
        "trainer": {"max_steps": 100000, "checkpoint_every": 100000, "per_replica_batch_size": 8,
                    "steps_per_execution": 1, "log_every": 1, "warmup_steps": 5, "shuffle_buffer": 64},
        "runtime": {"data_dir": data_dir, "model_dir": str(model_dir), "framework": framework, "seed": 1}}))
    # Off Google Cloud: no metadata server address at all (the session's closed port reads as a broken one).
    request = tmp_path / "save-request"
    env = {**{k: v for k, v in _worker_env().items() if not k.startswith("GCE_METADATA")},
           "TPUCTL_SAVE_REQUEST": str(request)}
    errors = open(tmp_path / "stderr.txt", "w")  # a file: a pipe nobody reads could stall the program
    proc = subprocess.Popen([sys.executable, "-m", "bert.train", "--config", str(cfg), "--replicas", "2"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=errors, text=True)
    seen: list[str] = []
    deadline = time.monotonic() + 240
    try:
        noticed_at = int(_lines_until(proc, STEP, seen, deadline)[1])
        request.write_text("instance/preempted=TRUE\n")
        first = int(_lines_until(proc, SAVED, seen, deadline)[1])
        assert first >= noticed_at and not request.exists()  # taken
        # Training goes on after the save the agent asked for.
        reached = int(_lines_until(proc, re.compile(rf"^step=({first + 2}) "), seen, deadline)[1])
        proc.send_signal(signal.SIGTERM)
        last = int(_lines_until(proc, SAVED, seen, deadline)[1])
        rest = proc.stdout.read().splitlines()
        assert proc.wait(timeout=60) == -signal.SIGTERM, seen[-10:] + rest
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
        errors.close()
    trained = max(int(m[1]) for m in map(STEP.match, seen + rest) if m)
    assert last >= reached and last == trained  # steps lost: 0
    assert rest == [f"stopped step={last} reason=sigterm"]
    ckpt_dir = str(model_dir / "checkpoints")
    assert checkpoints.latest(ckpt_dir) == f"{ckpt_dir}/ckpt-{last}.npz"
    assert (model_dir / "checkpoints" / f"ckpt-{first}.npz").exists()
