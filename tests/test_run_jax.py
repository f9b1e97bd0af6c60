"""`tpuctl run` of the BERT template on JAX on the local cloud: across the 2 hosts of a v5e and of a TPU7x
slice (a TPU7x VM preempted or ended: test_run_tpu7x.py).

A v5litepod-16 has 2 hosts of 8 chips. With `framework: jax` each worker runs its own process; they meet
through `jax.distributed` (coordinator: worker 0 from worker-network-endpoints; process ids from each worker's
metadata server), each forcing 8 CPU devices under the local cloud's LOCALCLOUD_TPU_REHEARSAL=cpu, and train
one DataParallel model over 16 devices with cross-process all-reduces. Resuming a JAX cluster after a lost node
is test_multislice's 2x2 run (requeued slice) and test_run_tpu7x's spot VM (recreated); this run is not
preempted.
"""

from __future__ import annotations

import pytest

from test_run import REPO, _text, _zero, project, tpc  # noqa: F401 (fixtures)
from tpuctl import spec as spec_mod
from tpuctl.jobs.pipeline import Pipeline, RunOptions

pytest.importorskip("jax")

# bert-tiny at half its width: these tests are about the cluster, not the model, and two cores train every
# host's 8 devices (a step of the v5e's 16: 3.6 s at bert-tiny's own width, 2.1 s at half, on loaded cores).
SMALL = {"hidden_size": 64, "intermediate_size": 256}


@pytest.mark.slow
@pytest.mark.tf
@pytest.mark.timeout(600)
def test_jax_on_a_2_host_v5e_slice_trains_on_both_hosts_with_one_checkpoint_writer(tpc, cloud, project):
    spec = spec_mod.from_mapping({
        "name": "bert-jax", "zone": "us-east5-a", "accelerator": "v5litepod-16", "provisioning": "spot",
        "job": {"template": "bert", "preset": "bert-tiny", "framework": "jax",
                "config": {"task": SMALL, "trainer": {"max_steps": 10, "checkpoint_every": 5, "log_every": 5,
                                                      "steps_per_execution": 5, "warmup_steps": 2,
                                                      "per_replica_batch_size": 8, "shuffle_buffer": 256}},
                "data": {"corpus": [str(REPO / "examples" / "data" / "corpus.txt")], "vocab_size": 2000}}})
    p = Pipeline(tpc, spec, options=RunOptions(yes=True, poll_s=1.0))
    assert (p.spec.job.framework, p.spec.runtime_version) == ("jax", None)
    o = p.run()
    assert p.plan.runtime_version == "v2-alpha-tpuv5-lite" and p.plan.framework == "jax"
    assert o.state == "succeeded" and o.recoveries == 0 and o.step == 10, o
    logs = [_text(tpc, o.bucket, f"runs/bert-jax/logs/worker-{w}.log") for w in range(2)]
    for w, log in enumerate(logs):  # both hosts are processes of one JAX cluster over the slice's 16 devices
        start = next(line for line in log.splitlines() if line.startswith("start "))
        assert start.startswith("start backend=jax strategy=cpu processes=2 hosts=2 devices=16 per_replica_batch=8 "
                                "global_batch=128 step=0 "), (w, log[-2000:])
        assert "step=5 " in log and "done step=10 " in log, (w, log[-2000:])
    assert "checkpoint step=10 " in logs[0] and "checkpoint step=" not in logs[1]  # process 0 alone writes
    assert {"checkpoints/ckpt-10.npz", "checkpoints/checkpoint", "export/metrics.json"} <= set(o.artifacts)
    assert _zero(cloud, project)


def _tpu7x_spec(name: str, *, max_steps: int, **fields) -> dict:
    """bert-tiny (SMALL) on TPU7x (one VM unless `fields` names another accelerator), checkpointing every 5
    steps."""
    return {"name": name, "zone": "us-central1-c", "accelerator": "tpu7x-8", **fields,
            "job": {"template": "bert", "preset": "bert-tiny",
                    "config": {"task": SMALL,
                               "trainer": {"max_steps": max_steps, "checkpoint_every": 5, "log_every": 5,
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
