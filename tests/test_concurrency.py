"""20 `tpuctl up`/`tpuctl run` processes at once against one local cloud, four owners: all succeed or fail
cleanly, every resource carries its own run's and owner's labels, and one owner's gc leaves the other owners'
runs alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import cloud_stack

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


OWNERS = ("ana", "bo", "cy", "dee")
SHAPES = (("v2-8", "us-central1-b"), ("v3-8", "us-central1-a"), ("v5litepod-16", "us-east5-a"))
N = 20


def _tpuctl(stack, owner: str, *args: str) -> subprocess.Popen:
    # The owner label comes from the login name.
    env = {**os.environ, **stack.env, "USER": owner, "LOGNAME": owner, "TPUCTL_OWNER": owner}
    return subprocess.Popen([sys.executable, "-m", "tpuctl", *args], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """Exit code and stderr; the pipes are drained while waiting, so a chatty child cannot block on them."""
    _out, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def _labelled(stack) -> list[tuple[str, str, dict]]:
    res = stack.status()["resources"]
    return [(kind, r["name"], r.get("labels") or {}) for kind in ("nodes", "queued_resources", "instances", "buckets")
            for r in res.get(kind, []) if "tpuctl-run" in (r.get("labels") or {})]


def test_twenty_parallel_ups_and_runs_four_owners_then_one_owners_gc(tmp_path):
    with cloud_stack.Stack() as stack:
        runs = {}
        procs = {}
        jobs: set[str] = set()
        for i in range(N):
            owner = OWNERS[i % len(OWNERS)]
            accelerator, zone = SHAPES[i % len(SHAPES)]
            run = f"par-{owner}-{i:02d}"
            runs[run] = owner
            # A short TTL: by the time gc runs every run has expired, so only the owner rule protects others.
            if i % 5 == 4:  # every fifth is a whole `tpuctl run` of the stand-in job
                spec = cloud_stack.write_spec(stack, run, accelerator, (zone,), "spot", ttl="20s", extra={"job": {
                    "template": str(cloud_stack.STANDIN),
                    "config": {"trainer": {"max_steps": 5, "checkpoint_every": 5, "step_seconds": 0.02}}}})
                jobs.add(run)
                procs[run] = _tpuctl(stack, owner, "run", str(spec), "--yes", "--poll", "0.5")
            else:
                procs[run] = _tpuctl(stack, owner, "up", "--name", run, "--accelerator", accelerator, "--zone", zone,
                                     "--provisioning", ("on-demand", "spot", "queued")[i % 3], "--ttl", "20s",
                                     "--yes")
        results = {run: _finish(p, 400) for run, p in procs.items()}
        codes = Counter(code for code, _ in results.values())
        assert set(codes) <= {0, 1, 3}, {run: r for run, r in results.items() if r[0] not in (0, 1, 3)}
        for run, (code, err) in results.items():
            if code != 0:  # a clean failure leaves nothing of its run behind
                assert stack.live(run) == [], (run, err)
                assert len([l for l in err.splitlines() if l.startswith("error:")]) == 1, err
        assert codes[0] >= N - 2, results

        # No cross-talk: every resource's run label is a run we started, its owner label that run's owner,
        # and each TPU node / bucket name belongs to the run its label names.
        labelled = _labelled(stack)
        for kind, name, labels in labelled:
            run = labels["tpuctl-run"]
            assert run in runs, (kind, name, labels)
            assert labels["tpuctl-owner"] == runs[run], (kind, name, labels)
            short = name.rsplit("/", 1)[-1]
            assert short == run or short.startswith(f"tpuctl-{run}-"), (kind, name, labels)
        ok = {run for run, (code, _) in results.items() if code == 0}
        # `up` leaves its TPU; `run` tears its TPU down and keeps the bucket with the checkpoints.
        assert {labels["tpuctl-run"] for kind, _, labels in labelled if kind in ("nodes", "queued_resources")} == ok - jobs
        assert {labels["tpuctl-run"] for kind, _, labels in labelled if kind == "buckets"} == ok
        for run in ok & jobs:
            model = [b.name for b in stack.clients.storage.list_blobs(next(
                n for k, n, l in labelled if k == "buckets" and l["tpuctl-run"] == run), prefix=f"runs/{run}/model/")]
            assert any(n.endswith("ckpt-5.json") for n in model), (run, model)
        buckets = {b["name"]: b for b in stack.status()["resources"]["buckets"]}
        for b in buckets.values():  # one grant each, beside the project convenience bindings a new bucket has
            granted = [x for x in b["iam_policy"].get("bindings", [])
                       if any(m.startswith("serviceAccount:") for m in x["members"])]
            assert len(granted) == 1, b["iam_policy"]

        time.sleep(21)  # every TTL has now passed
        gc = _tpuctl(stack, OWNERS[0], "gc", "--yes", "--buckets", "--lock-wait", "30")
        code, err = _finish(gc, 300)
        assert code == 0, err
        left = {labels["tpuctl-run"] for _, _, labels in _labelled(stack)}
        mine = {r for r in ok if runs[r] == OWNERS[0]}
        others = {r for r in ok if runs[r] != OWNERS[0]}
        assert not (left & mine), f"gc left {sorted(left & mine)} of its own owner"
        assert others <= left, f"gc removed other owners' runs {sorted(others - left)}"

        for run in sorted(others):
            cloud_stack.cleanup(stack, run, "down")
        assert stack.live() == []
