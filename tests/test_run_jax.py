"""`tpuctl run` of the BERT template on JAX on the local cloud: across the 2 hosts of a v5e and of a TPU7x
slice, and a TPU7x VM preempted or ended.

A v5litepod-16 has 2 hosts of 8 chips. With `framework: jax` each worker runs its own process; they meet
through `jax.distributed` (coordinator: worker 0 from worker-network-endpoints; process ids from each worker's
metadata server), each forcing 8 CPU devices under the local cloud's LOCALCLOUD_TPU_REHEARSAL=cpu, and train
one DataParallel model over 16 devices with cross-process all-reduces. Resuming a JAX cluster after a lost node
is test_multislice's 2x2 run (requeued slice) and the spot TPU7x test below (recreated VM); this run is not
preempted.
"""

from __future__ import annotations

import json
import re

import pytest

from test_run import REPO, _text, _tpuctl, _zero, project, run_preempted_at, tpc  # noqa: F401 (fixtures)
from tpuctl import spec as spec_mod
from tpuctl.jobs.pipeline import Pipeline, RunOptions

pytest.importorskip("jax")


@pytest.mark.slow
@pytest.mark.tf
@pytest.mark.timeout(600)
def test_jax_on_a_2_host_v5e_slice_trains_on_both_hosts_with_one_checkpoint_writer(tpc, cloud, project):
    spec = spec_mod.from_mapping({
        "name": "bert-jax", "zone": "us-east5-a", "accelerator": "v5litepod-16", "provisioning": "spot",
        "job": {"template": "bert", "preset": "bert-tiny", "framework": "jax",
                "config": {"trainer": {"max_steps": 20, "checkpoint_every": 10, "log_every": 10,
                                       "steps_per_execution": 10, "warmup_steps": 5, "per_replica_batch_size": 8,
                                       "shuffle_buffer": 256}},
                "data": {"corpus": [str(REPO / "examples" / "data" / "corpus.txt")], "vocab_size": 2000}}})
    p = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=1.0))
    assert (p.spec.job.framework, p.spec.runtime_version) == ("jax", None)
    o = p.run()
    assert p.plan.runtime_version == "v2-alpha-tpuv5-lite" and p.plan.framework == "jax"
    assert o.state == "succeeded" and o.recoveries == 0 and o.step == 20, o
    logs = [_text(tpc, o.bucket, f"runs/bert-jax/logs/worker-{w}.log") for w in range(2)]
    for w, log in enumerate(logs):  # both hosts are processes of one JAX cluster over the slice's 16 devices
        start = next(line for line in log.splitlines() if line.startswith("start "))
        assert start.startswith("start backend=jax strategy=cpu processes=2 hosts=2 devices=16 per_replica_batch=8 "
                                "global_batch=128 step=0 "), (w, log[-2000:])
        assert "step=10 " in log and "done step=20 " in log, (w, log[-2000:])
    assert "checkpoint step=20 " in logs[0] and "checkpoint step=" not in logs[1]  # process 0 alone writes
    assert {"checkpoints/ckpt-20.npz", "checkpoints/checkpoint", "export/metrics.json"} <= set(o.artifacts)
    assert _zero(cloud, project)


def _tpu7x_spec(name: str, *, max_steps: int, **fields) -> dict:
    """bert-tiny on TPU7x (one VM unless `fields` names another accelerator), checkpointing every 5 steps."""
    return {"name": name, "zone": "us-central1-c", "accelerator": "tpu7x-8", **fields,
            "job": {"template": "bert", "preset": "bert-tiny",
                    "config": {"trainer": {"max_steps": max_steps, "checkpoint_every": 5, "log_every": 5,
                                           "steps_per_execution": 5, "warmup_steps": 2,
                                           "per_replica_batch_size": 8, "shuffle_buffer": 64}},
                    "data": {"corpus": [str(REPO / "examples" / "data" / "corpus.txt")], "vocab_size": 2000}}}


@pytest.mark.slow
@pytest.mark.tf
@pytest.mark.timeout(900)
def test_jax_on_a_2_host_tpu7x_mig_slice_trains_on_both_hosts_and_leaves_nothing(tpc, cloud, project):
    """tpu7x-16 is two Compute Engine VMs in a MIG with a workload policy: the pipeline reaches both as workers 0
    and 1 of one slice, their guests meet through `jax.distributed` (process ids from `agent-worker-number`,
    the coordinator from `worker-network-endpoints`), and down deletes the MIG, its template and its policy."""
    spec = spec_mod.from_mapping(_tpu7x_spec("bert-7x16", max_steps=10, accelerator="tpu7x-16"))
    p = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=1.0))
    o = p.run()
    assert (p.plan.accelerator.api, p.plan.accelerator.hosts, p.plan.framework) == ("compute", 2, "jax")
    assert o.state == "succeeded" and o.step == 10, o
    logs = [_text(tpc, o.bucket, f"runs/bert-7x16/logs/worker-{w}.log") for w in range(2)]
    for w, log in enumerate(logs):
        start = next(line for line in log.splitlines() if line.startswith("start "))
        assert start.startswith("start backend=jax strategy=cpu processes=2 hosts=2 devices=16 per_replica_batch=8 "
                                "global_batch=128 step=0"), (w, log[-2000:])
        assert "done step=10 " in log, (w, log[-2000:])
    assert "checkpoint step=10 " in logs[0] and "checkpoint step=" not in logs[1]  # process 0 alone writes
    assert {"checkpoints/ckpt-10.npz", "checkpoints/checkpoint"} <= set(o.artifacts)
    assert _zero(cloud, project)


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

    spec = spec_mod.from_mapping(_tpu7x_spec("spot-7x", max_steps=30, provisioning="spot"))
    p = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=0.5))
    o = run_preempted_at(p, cloud, 10, path=_instance_path)  # after a checkpoint
    assert (p.plan.accelerator.api, p.plan.framework) == ("compute", "jax")
    assert o.state == "succeeded" and o.recoveries == 1 and o.step == 30, o
    log = _text(tpc, o.bucket, "runs/spot-7x/logs/worker-0.log")  # the second incarnation's log
    start = next(line for line in log.splitlines() if line.startswith("start "))
    assert start.startswith("start backend=jax strategy=cpu processes=1 hosts=1 devices=8 per_replica_batch=8 "
                            "global_batch=64 step="), log[-2000:]
    resumed = int(re.search(r" step=(\d+) ", start)[1])
    assert resumed in (5, 10), start  # at most one checkpoint interval lost
    assert f"step={resumed + 5} " in log and "done step=30 " in log, log[-2000:]
    assert "checkpoint step=30 " in log, log[-2000:]
    assert {"checkpoints/ckpt-30.npz", "checkpoints/checkpoint"} <= set(o.artifacts)
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
