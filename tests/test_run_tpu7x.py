"""`tpuctl run` of the BERT template on JAX on a TPU7x VM that Google takes away: a Spot VM preempted (recreated,
resumed from the bucket's checkpoint) and a flex-start VM ended at its max run duration (the run stops)."""

from __future__ import annotations

import json
import re

import pytest

from test_run import _text, _tpuctl, _zero, project, run_preempted_at, tpc  # noqa: F401 (fixtures)
from test_run_jax import _tpu7x_spec
from tpuctl import spec as spec_mod
from tpuctl.jobs.pipeline import Pipeline, RunOptions

pytest.importorskip("jax")


def _instance_path(p: Pipeline) -> str:
    return f"projects/{p.project}/zones/{p.zone}/instances/{p.node}"


@pytest.mark.slow
@pytest.mark.tf
@pytest.mark.timeout(600)
def test_spot_tpu7x_preempted_by_compute_is_recreated_and_resumes_from_the_checkpoint(tpc, cloud, project):
    """Compute preempts the Spot TPU7x VM mid-run (its termination action is DELETE: Spot TPUs are recreated,
    never restarted); tpuctl makes it again from the run's plan and the job resumes from the bucket's checkpoint.

    Also the TPU7x run itself (one run of JAX on 2 cores costs a minute): TPU7x is a Compute Engine instance, not
    a TPU API node; the same pipeline reaches its one SSH worker, whose guest learns the slice from its metadata
    server (machine type tpu7x-standard-4t: 8 JAX devices), and the run leaves nothing but its bucket."""
    from tpuctl.ledger import Ledger

    spec = spec_mod.from_mapping(_tpu7x_spec("spot-7x", max_steps=20, provisioning="spot"))
    p = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=0.5))
    o = run_preempted_at(p, cloud, 10, path=_instance_path)  # after a checkpoint
    assert (p.plan.accelerator.api, p.plan.framework) == ("compute", "jax")
    assert o.state == "succeeded" and o.recoveries == 1 and o.step == 20, o
    log = _text(tpc, o.bucket, "runs/spot-7x/logs/worker-0.log")  # the second incarnation's log
    start = next(line for line in log.splitlines() if line.startswith("start "))
    assert start.startswith("start backend=jax strategy=cpu processes=1 hosts=1 devices=8 per_replica_batch=8 "
                            "global_batch=64 step="), log[-2000:]
    resumed = int(re.search(r" step=(\d+) ", start)[1])
    # Step 10 was seen, so checkpoint 5 was whole and 10 may have been: at most one checkpoint interval is lost.
    # The pipeline sees the step through the log, a poll behind the job, so the VM may die after checkpoint 15 too.
    assert resumed in (5, 10, 15), start
    assert f"step={resumed + 5} " in log and "done step=20 " in log, log[-2000:]
    assert "checkpoint step=20 " in log, log[-2000:]
    assert {"checkpoints/ckpt-20.npz", "checkpoints/checkpoint"} <= set(o.artifacts)
    # Google deleted the first VM itself (termination action DELETE): both lifetimes are costed, one after the other.
    first, second = sorted((e for e in Ledger().entries() if e.kind == "tpu" and e.run == "spot-7x"),
                           key=lambda e: e.created)
    assert first.deleted is not None and second.deleted is not None and first.deleted <= second.created
    assert _zero(cloud, project)


@pytest.mark.slow
@pytest.mark.tf
@pytest.mark.timeout(600)
def test_flex_start_tpu7x_ended_at_its_max_run_duration_stops_the_run_without_asking_again(tpc, cloud, project,
                                                                                            tmp_path):
    """Compute deletes a flex-start TPU7x VM at its max run duration (24 h, 86 s of wall clock at the tests'
    speed) while the job trains: the run ends with exit code 4 and a resume hint, and no second TPU is asked for."""
    from tpuctl.errors import RunDurationEnded
    from tpuctl.ledger import Ledger

    spec = spec_mod.from_mapping(_tpu7x_spec("flex-7x", max_steps=100000, provisioning="flex-start",
                                             max_run_duration="24h"))
    p = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=0.5))
    with pytest.raises(RunDurationEnded) as e:
        p.run()
    assert e.value.exit_code == 4 and "max run duration (1d)" in e.value.message, e.value.message
    assert "--name flex-7x" in e.value.hint and "gs://" in e.value.hint
    assert p.outcome.recoveries == 0 and (p.outcome.step or 0) >= 5, p.outcome
    assert [e.kind for e in Ledger().entries() if e.kind == "tpu" and e.run == "flex-7x"] == ["tpu"]
    status = json.loads(_text(tpc, p.outcome.bucket, "runs/flex-7x/status.json"))
    assert status["state"] == "failed" and status["ended"] == "max_run_duration"
    shown = _tpuctl(cloud, tmp_path, project, "job", "status", "flex-7x")
    assert shown.returncode == 0 and shown.stderr.startswith(
        "run flex-7x: failed, step ") and "(Google ended the flex-start TPU at its max run duration)" in shown.stderr, \
        shown.stderr
    assert _zero(cloud, project)
