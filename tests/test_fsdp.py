"""runtime.sharding fsdp (issue 30, "Models bigger than a chip"): the weights, their gradients and the optimizer's
slots split over the devices with Keras' ModelParallel (lmkit strategy.shard_weights), checkpoints that hold
whole arrays whatever the mesh, and a rehearsal of 2 processes x 2 CPU devices that trains gpt2-tiny with fsdp,
resumes, and matches data parallelism's loss over the same steps. And zero1 (issue 28: half bert-base's state
a chip at data parallelism's bytes): only AdamW's slots split (lmkit strategy.split_slot), the same training."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
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
    with pytest.raises(ConfigError, match="must be data, zero1 or fsdp"):
        config.build({"preset": "gpt2-tiny", "runtime": {"sharding": "zero3", "framework": "jax"}})
    assert config.build({"preset": "gpt2-tiny", "runtime": {"sharding": "fsdp", "framework": "jax"}}).runtime.sharding \
        == "fsdp"


def a_checkpoint_moves_between_meshes() -> str:
    """gpt2-tiny's weights and AdamW slots written under data parallelism on 1 device resume under fsdp on 2, split
    there, and under zero1 on 2, only the slots split (each on its first dimension the device count divides); and
    written again from fsdp's split arrays resume whole on 1 device. Needs 2 JAX CPU devices."""
    import tempfile

    import jax
    import keras

    from tpuctl.templates.gpt2 import config, model as gpt2_model, train
    from tpuctl.templates.lmkit import checkpoints, layers, strategy

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
    for whole in (sharded.get_layer("final_norm").gamma, sharded.get_layer("token_embedding").embeddings):
        assert whole.value.sharding.is_fully_replicated, whole.path
    for a, b in zip([*model.weights, *optimizer.variables], [*sharded.weights, *sharded_optimizer.variables]):
        assert np.array_equal(checkpoints.host_value(a), checkpoints.host_value(b)), a.path

    # zero1 (the optimizer a run builds with strategy.slot_layouts): the same checkpoint, only the slots split
    keras.distribution.set_distribution(data_parallel(devices).strategy)
    replicated = gpt2_model.build_model(task, vocab_size=VOCAB)
    split_optimizer = layers.AdamW(learning_rate=1e-3, split_slots=strategy.slot_layouts(data_parallel(devices)))
    split_optimizer.build(replicated.trainable_variables)
    assert checkpoints.restore(checkpoints.latest(first), replicated, split_optimizer) == 56
    slots = {v.path.split("/", 1)[1]: v for v in split_optimizer.variables}
    for name, whole, half in (("layer0_mlp_in_kernel_momentum", (128, 512), (64, 512)),
                              ("layer0_mlp_in_bias_velocity", (512,), (256,)),
                              ("token_embedding_embeddings_momentum", (VOCAB, 128), (VOCAB // 2, 128))):
        assert slots[name].value.sharding.shard_shape(whole) == half, name
    assert all(w.value.sharding.is_fully_replicated for w in replicated.weights)
    assert split_optimizer.iterations.value.sharding.is_fully_replicated
    for a, b in zip([*model.weights, *optimizer.variables], [*replicated.weights, *split_optimizer.variables]):
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


def zero1_trains_as_data_parallelism_and_resumes() -> str:
    """gpt2-tiny on 2 CPU devices: a run trained to 8 steps under zero1, resumed from its step-4 checkpoint
    (written from the split slots), splits its slots (the layouts strategy.slot_layouts gave its optimizer), logs
    data parallelism's losses and ends with its arrays (to float32 rounding: the update's sums run in another
    order)."""
    import tempfile

    import jax
    import keras

    from tpuctl.templates.gpt2 import config, prepare, train
    from tpuctl.templates.lmkit import strategy

    assert len(jax.devices()) == 2, jax.devices()
    placed = []  # each slot's layout, as the run's optimizer asked for it
    own_layouts = strategy.slot_layouts

    def recorded(resolved):
        layout = own_layouts(resolved)
        return lambda shape: placed.append(layout(shape)) or placed[-1]

    strategy.slot_layouts = recorded
    work = Path(tempfile.mkdtemp())
    prepare.prepare([str(write_corpus(work / "corpus.txt", documents=200, seed=5))], work / "data",
                    prepare.PrepareOptions(vocab_size=VOCAB, seq_len=32, shard_sequences=64))
    lines: dict[str, list[str]] = {}

    def run(sharding: str, max_steps: int) -> None:
        cfg = config.build({"preset": "gpt2-tiny", "task": {"seq_len": 32},
                            "trainer": {**TRAINER, "max_steps": max_steps, "checkpoint_every": 4, "log_every": 2,
                                        "steps_per_execution": 2},
                            "runtime": {"data_dir": str(work / "data"), "model_dir": str(work / sharding),
                                        "seed": 7, "framework": "jax", "sharding": sharding}})
        train.run(cfg, log=lines.setdefault(sharding, []).append)

    run("data", 8)
    assert placed == []
    run("zero1", 4)
    assert len(placed) > 20 and all(p is not None and "batch" in p.axes for p in placed), placed
    run("zero1", 8)  # resumes from step 4
    starts = [line for line in lines["zero1"] if line.startswith("start ")]
    assert [s.endswith("sharding=zero1") for s in starts] == [True, True] and " step=4 " in starts[1], starts

    def losses(sharding: str) -> dict[int, float]:
        return {int(m[1]): float(m[2]) for m in re.finditer(r"^step=(\d+) loss=(\S+)", "\n".join(lines[sharding]),
                                                             re.M)}

    assert sorted(losses("zero1")) == sorted(losses("data")) == [2, 4, 6, 8], lines
    for step, value in losses("data").items():
        assert losses("zero1")[step] == pytest.approx(value, abs=1e-4), (step, lines)
    a, b = (np.load(work / s / "checkpoints" / "ckpt-8.npz") for s in ("data", "zero1"))
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
        assert np.allclose(a[name], b[name], rtol=1e-4, atol=1e-6), name
    return keras.backend.backend()


@pytest.mark.slow  # three in-process JAX runs: ~1 minute on 2 cores
def test_zero1_trains_as_data_parallelism_and_resumes(monkeypatch):
    pytest.importorskip("jax")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert on_jax("test_fsdp", "zero1_trains_as_data_parallelism_and_resumes", timeout=500) == "jax"


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
        stem = model_dir.parent / f"{model_dir.name}-{max_steps}"
        procs = []
        for i, host in enumerate(hosts):  # files, not pipes: a host stuck on a full pipe would stall the other
            with open(f"{stem}-{i}.out", "w") as out, open(f"{stem}-{i}.err", "w") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tpuctl.templates.gpt2.train", "--config", str(config)],
                    env={**os.environ, "GCE_METADATA_HOST": host, "LOCALCLOUD_TPU_REHEARSAL": "cpu",
                         "TF_CPP_MIN_LOG_LEVEL": "2"}, stdout=out, stderr=err))
        deadline = time.monotonic() + 900  # minutes where other work loads the 2 cores
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):  # one failed: the other would wait for it forever
                time.sleep(5)
                break
            time.sleep(1)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    finally:
        server.close()
    for i, p in enumerate(procs):
        assert p.returncode == 0, Path(f"{stem}-{i}.err").read_text()[-3000:]
    out = Path(f"{stem}-0.out").read_text()
    start = next(line for line in out.splitlines() if line.startswith("start "))
    assert "processes=2 hosts=2 devices=4 " in start and start.endswith(f" sharding={sharding}"), start
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^step=(\d+) loss=(\S+)", out, re.M)}


@pytest.mark.slow  # three 2-process JAX runs: 3 minutes on 2 quiet cores, 15 where other work loads them
@pytest.mark.timeout(2700)
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
        assert fsdp_losses[step] == pytest.approx(loss, abs=1e-3), (step, fsdp_losses, data_losses)
    a = np.load(tmp_path / "data-parallel" / "checkpoints" / f"ckpt-{STEPS}.npz")
    b = np.load(fsdp_dir / "checkpoints" / f"ckpt-{STEPS}.npz")
    assert sorted(a.files) == sorted(b.files)
    assert int(b["data/examples"]) == STEPS * TRAINER["per_replica_batch_size"] * 4
    for name in a.files:
        assert np.allclose(a[name], b[name], rtol=1e-4, atol=1e-5), name


# gpt2-xl (1.5B weights, 25 GB of float32 weights, gradients and Adam slots) at 128-token blocks on a v5e slice:
# its state alone is over one chip's 16 GB, an eighth of it (fsdp over 8 chips) is not.
XL = {"name": "xl", "zone": "us-west4-a", "accelerator": "v5litepod-8",
      "job": {"template": "gpt2", "preset": "gpt2-xl", "config": {"task": {"seq_len": 128}}}}


def _xl_file(tmp_path: Path, **job) -> Path:
    import yaml

    path = tmp_path / "xl.yaml"
    path.write_text(yaml.safe_dump({**XL, "job": {**XL["job"], **job}}))
    return path


def test_fit_answers_per_sharding_and_auto_takes_the_least_split_that_fits(monkeypatch, tmp_path):
    import tpuctl
    from click.testing import CliRunner

    from tpuctl.cli import cli

    monkeypatch.setitem(sys.modules, "libtpu", None)  # the analytic estimate: no compile on this machine
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))

    # On JAX: on a v5e `framework: auto` trains with TensorFlow, which splits nothing (the last test here).
    def xl_on_jax(tmp_path, **job) -> Path:
        return _xl_file(tmp_path, framework="jax", **job)

    data = tpuctl.fit(xl_on_jax(tmp_path, sharding="data"))
    fsdp = tpuctl.fit(xl_on_jax(tmp_path, sharding="fsdp"))
    assert (data.sharding, data.fits, fsdp.sharding, fsdp.fits) == ("data", False, "fsdp", True)
    # 7/8 of the 16 bytes a weight of state gone from each chip, but for the replicated token embedding; every
    # weight may be gathered there in bfloat16
    split = data.params - 50257 * 1600
    assert data.hbm_per_chip_bytes - fsdp.hbm_per_chip_bytes == pytest.approx(16 * 7 / 8 * split - 2 * data.params,
                                                                              rel=1e-6)
    auto = tpuctl.fit(xl_on_jax(tmp_path))
    assert auto == fsdp  # zero1 does not fit either: 9 of the 16 bytes a weight stay on each chip
    # gpt2-large at 16 sequences a chip: over the chip's HBM under data, within it with the slots split
    large = {"preset": "gpt2-large", "config": {"task": {"seq_len": 128}, "trainer": {"per_replica_batch_size": 16}}}
    data, zero1 = (tpuctl.fit(xl_on_jax(tmp_path, sharding=split, **large)) for split in ("data", "zero1"))
    assert (data.fits, zero1.fits) == (False, True)
    assert data.hbm_per_chip_bytes - zero1.hbm_per_chip_bytes == pytest.approx(8 * 7 / 8 * data.params, rel=1e-6)
    assert zero1.est_step_s == data.est_step_s  # its bytes, estimated, are data's (fitting._analytic_bytes)
    assert tpuctl.fit(xl_on_jax(tmp_path, **large)) == zero1
    small = tpuctl.fit(xl_on_jax(tmp_path, preset="gpt2-tiny", config={}))
    assert (small.sharding, small.fits) == ("data", True)  # auto: data wherever it fits
    one_chip = tpuctl.fit(xl_on_jax(tmp_path), accelerator="v5litepod-1")
    assert (one_chip.sharding, one_chip.fits) == ("data", False)  # one device: nothing to split over

    out = CliRunner().invoke(cli, ["fit", str(xl_on_jax(tmp_path, sharding="data")), "--sharding", "fsdp", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["sharding"] == "fsdp"  # the flag wins over the file
    from rich.console import Console

    from tpuctl import console

    shown = io.StringIO()  # the console holds its own streams, bound when it was imported
    monkeypatch.setattr(console, "err", Console(file=shown, width=1000, no_color=True))
    out = CliRunner().invoke(cli, ["fit", str(_xl_file(tmp_path, framework="tensorflow")), "--sharding", "fsdp"])
    assert out.exit_code == 2
    assert "error: job.sharding: fsdp splits the weights with Keras' distribution API, which runs on JAX" in \
        shown.getvalue()


def test_fsdp_makes_the_plan_jax_and_reaches_the_template_config(monkeypatch, tmp_path):
    from jobs import bundle
    from tpuctl import provision, spec as spec_mod
    from tpuctl.errors import BadInput

    on_v5p = {**XL, "accelerator": "v5p-8", "zone": "us-east5-a"}  # TensorFlow runs there: auto would pick it
    assert provision.plan(spec_mod.from_mapping(on_v5p), project="p").framework == "tensorflow"
    fsdp = spec_mod.with_sharding(spec_mod.from_mapping(on_v5p), "fsdp")
    assert provision.plan(fsdp, project="p").framework == "jax"
    with pytest.raises(BadInput) as err:
        provision.plan(spec_mod.with_framework(fsdp, "tensorflow"), project="p")
    assert err.value.field == "job.sharding"
    # runtime.sharding only when split: a template without the field (tests/job_templates) is never sent it
    assert "sharding" not in bundle.job_config({}, preset=None, bucket="b", run="r", data_url=None)["runtime"]
    for split in ("zero1", "fsdp"):
        assert provision.plan(spec_mod.with_sharding(spec_mod.from_mapping(on_v5p), split), project="p").framework \
            == "jax"
        assert bundle.job_config({}, preset=None, bucket="b", run="r", data_url=None,
                                 sharding=split)["runtime"]["sharding"] == split
    # auto before the fit check (its answer is shipped): the template checks data's config
    assert "sharding" not in bundle.job_config({}, preset=None, bucket="b", run="r", data_url=None,
                                               sharding="auto")["runtime"]


def test_a_run_takes_auto_sharding_from_its_fit_check(monkeypatch, tmp_path):
    """`run` validates before it creates anything: the fit check's answer for auto is the sharding it ships."""
    from jobs.pipeline import Pipeline
    from tpuctl import spec as spec_mod

    monkeypatch.setitem(sys.modules, "libtpu", None)
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    def validated(**job) -> Pipeline:
        pipeline = Pipeline(None, spec_mod.from_mapping({**XL, "job": {**XL["job"], **job}}), project="p",
                            spec_dir=tmp_path)
        pipeline.validate()
        return pipeline

    sharded = validated(framework="jax")
    assert (sharded.plan.framework, sharded.sharding) == ("jax", "fsdp")
    # framework auto takes TensorFlow on v5e, where only data runs: the run does not fit, and says so (a compiled
    # check refuses it; this analytic one only notes it)
    on_tensorflow = validated()
    assert (on_tensorflow.plan.framework, on_tensorflow.sharding) == ("tensorflow", "data")
    assert validated(framework="jax", preset="gpt2-tiny", config={}).sharding == "data"
