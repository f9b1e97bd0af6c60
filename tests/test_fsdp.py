"""runtime.sharding fsdp (issue 30, "Models bigger than a chip"): the weights, their gradients and the optimizer's
slots split over the devices with Keras' ModelParallel (lmkit strategy.shard_weights), checkpoints that hold
whole arrays whatever the mesh, and a rehearsal of 2 processes x 2 CPU devices that trains gpt2-tiny with fsdp,
resumes, and matches data parallelism's loss over the same steps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from conftest import on_jax
from test_data_prepare import write_corpus

pytestmark = pytest.mark.timeout(600)

VOCAB = 400


def test_fsdp_on_tensorflow_is_refused_naming_the_field():
    from tpuctl.templates.gpt2 import config
    from tpuctl.templates.lmkit.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        config.build({"preset": "gpt2-tiny", "runtime": {"sharding": "fsdp", "framework": "tensorflow"}})
    assert err.value.field == "runtime.sharding" and "jax" in err.value.rule
    with pytest.raises(ConfigError, match="must be data or fsdp"):
        config.build({"preset": "gpt2-tiny", "runtime": {"sharding": "zero3", "framework": "jax"}})
    assert config.build({"preset": "gpt2-tiny", "runtime": {"sharding": "fsdp", "framework": "jax"}}).runtime.sharding \
        == "fsdp"


def a_checkpoint_moves_between_meshes() -> str:
    """gpt2-tiny's weights and AdamW slots written under data parallelism on 1 device resume under fsdp on 2, split
    there, and written again from the split arrays resume whole on 1 device. Needs 2 JAX CPU devices."""
    import tempfile

    import jax
    import keras

    from tpuctl.templates.gpt2 import config, model as gpt2_model, train
    from tpuctl.templates.lmkit import checkpoints, strategy

    devices = jax.devices()
    assert len(devices) == 2, devices
    task = config.build({"preset": "gpt2-tiny"}).task

    def built(resolved: strategy.Resolved):
        keras.distribution.set_distribution(resolved.strategy)
        model = gpt2_model.build_model(task, vocab_size=VOCAB)
        optimizer = keras.optimizers.AdamW(learning_rate=1e-3)
        optimizer.build(model.trainable_variables)
        return model, optimizer

    def data_parallel(on) -> strategy.Resolved:
        return strategy.Resolved(keras.distribution.DataParallel(devices=on), "cpu", len(on), 1, backend="jax")

    rng = np.random.default_rng(0)
    model, optimizer = built(data_parallel(devices[:1]))
    for v in [*model.weights, *optimizer.variables]:  # every value distinct: a misplaced shard would show
        v.assign(rng.standard_normal(v.shape).astype(v.dtype) if v.dtype != "int64" else np.int64(7))
    first = tempfile.mkdtemp()
    checkpoints.save(first, 7, model, optimizer, keep=1, examples=56)

    sharded, sharded_optimizer = built(strategy.shard_weights(data_parallel(devices), train.CAUSAL_LM.fsdp_layout))
    assert checkpoints.restore(checkpoints.latest(first), sharded, sharded_optimizer) == 56
    kernel = sharded.get_layer("layer0_mlp_in").kernel  # [hidden 128, 512]: the hidden dimension split in two
    slot = next(v for v in sharded_optimizer.variables if v.path.endswith("layer0_mlp_in_kernel_momentum"))
    for split in (kernel, slot):
        assert split.value.sharding.shard_shape(split.shape) == (64, 512), split.path
    assert sharded.get_layer("final_norm").gamma.value.sharding.is_fully_replicated
    for a, b in zip([*model.weights, *optimizer.variables], [*sharded.weights, *sharded_optimizer.variables]):
        assert np.array_equal(checkpoints.host_value(a), checkpoints.host_value(b)), a.path

    second = tempfile.mkdtemp()
    checkpoints.save(second, 7, sharded, sharded_optimizer, keep=1, examples=56)
    back, back_optimizer = built(data_parallel(devices[:1]))
    checkpoints.restore(checkpoints.latest(second), back, back_optimizer)
    for a, b in zip([*model.weights, *optimizer.variables], [*back.weights, *back_optimizer.variables]):
        assert np.array_equal(checkpoints.host_value(a), checkpoints.host_value(b)), a.path
    return keras.backend.backend()


def test_a_checkpoint_written_under_one_mesh_resumes_under_another(monkeypatch):
    pytest.importorskip("jax")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert on_jax("test_fsdp", "a_checkpoint_moves_between_meshes", timeout=300) == "jax"


# The rehearsal: 2 hosts of a 4-device slice as their metadata servers describe them (localcloud's), each host a
# process with 2 CPU devices (LOCALCLOUD_TPU_REHEARSAL=cpu), meeting through jax.distributed.
SLICE = "v5litepod-4"
STEPS, HALF = 20, 10
TRAINER = {"max_steps": STEPS, "per_replica_batch_size": 8, "steps_per_execution": 5, "log_every": 5,
           "checkpoint_every": HALF, "keep_checkpoints": 5, "warmup_steps": 5, "learning_rate": 3e-3,
           # a constant rate after warm-up: a run told to stop at HALF trains its steps as a run to STEPS does
           "end_learning_rate_fraction": 1.0, "shuffle_buffer": 64}


def _two_hosts(data_dir: Path, model_dir: Path, *, sharding: str, max_steps: int) -> dict[int, float]:
    """Train gpt2-tiny on 2 processes x 2 CPU devices; the losses process 0 printed, by step."""
    from tpuctl.localcloud.metadata import MetadataServer

    config = model_dir.parent / f"{model_dir.name}-{max_steps}.json"
    config.write_text(json.dumps({
        "preset": "gpt2-tiny", "task": {"seq_len": 32},
        "trainer": {**TRAINER, "max_steps": max_steps},
        "runtime": {"data_dir": str(data_dir), "model_dir": str(model_dir), "seed": 7, "framework": "jax",
                    "sharding": sharding}}))
    node = f"fsdp-{uuid.uuid4().hex[:8]}"  # the rehearsal's coordinator port comes from the node's name
    endpoints = ",".join(f"{node}-w-{i}:{i}:127.0.0.1" for i in range(2))
    server = MetadataServer()
    try:
        hosts = server.attach(node, 2, lambda i: {"instance": {"attributes": {
            "accelerator-type": SLICE, "agent-worker-number": str(i), "worker-network-endpoints": endpoints,
            "tpu-env": f"NODE_ID: '{node}'\n"}}})
        procs = [subprocess.Popen(
            [sys.executable, "-m", "tpuctl.templates.gpt2.train", "--config", str(config)],
            env={**os.environ, "GCE_METADATA_HOST": host, "LOCALCLOUD_TPU_REHEARSAL": "cpu",
                 "TF_CPP_MIN_LOG_LEVEL": "2"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for host in hosts]
        outputs = [p.communicate(timeout=400) for p in procs]
    finally:
        server.close()
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    out = outputs[0][0]
    start = next(line for line in out.splitlines() if line.startswith("start "))
    assert f"processes=2 hosts=2 devices=4 " in start and start.endswith(f" sharding={sharding}"), start
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^step=(\d+) loss=(\S+)", out, re.M)}


@pytest.mark.slow  # three 2-process JAX runs on 2 cores: about 3 minutes
def test_fsdp_on_two_hosts_trains_resumes_and_matches_data_parallelism(tmp_path):
    pytest.importorskip("jax")
    from tpuctl.templates.gpt2 import prepare

    data = tmp_path / "data"
    prepare.prepare([str(write_corpus(tmp_path / "corpus.txt", documents=300, seed=5))], data,
                    prepare.PrepareOptions(vocab_size=VOCAB, seq_len=32, shard_sequences=64))
    data_losses = _two_hosts(data, tmp_path / "data-parallel", sharding="data", max_steps=STEPS)
    fsdp_dir = tmp_path / "fsdp"
    fsdp_losses = _two_hosts(data, fsdp_dir, sharding="fsdp", max_steps=HALF)
    # The same directory told to go on: it resumes from its own checkpoint, whose arrays were gathered from both hosts.
    fsdp_losses.update(_two_hosts(data, fsdp_dir, sharding="fsdp", max_steps=STEPS))
    assert sorted(fsdp_losses) == sorted(data_losses) == [5, 10, 15, 20]
    for step, loss in data_losses.items():
        assert fsdp_losses[step] == pytest.approx(loss, abs=2e-3), (step, fsdp_losses, data_losses)
    a = np.load(tmp_path / "data-parallel" / "checkpoints" / f"ckpt-{STEPS}.npz")
    b = np.load(fsdp_dir / "checkpoints" / f"ckpt-{STEPS}.npz")
    assert sorted(a.files) == sorted(b.files)
    assert int(b["data/examples"]) == STEPS * TRAINER["per_replica_batch_size"] * 4
    for name in a.files:
        assert np.allclose(a[name], b[name], rtol=1e-3, atol=1e-4), name
