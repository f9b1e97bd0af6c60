"""The BERT template's config schema, presets, template.json contract and strategy choice (no TensorFlow)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

from tpuctl.templates import contract
from tpuctl.templates.bert import config
from tpuctl.templates.lmkit import guest, strategy
from tpuctl.templates.lmkit.errors import AcceleratorError, ConfigError

TEMPLATE = Path(config.__file__).parent


def test_presets_have_the_published_shapes():
    tiny = config.build({"preset": "bert-tiny"})
    assert (tiny.task.num_layers, tiny.task.hidden_size, tiny.task.seq_len) == (2, 128, 128)
    base = config.build({"preset": "bert-base"})
    assert (base.task.num_layers, base.task.hidden_size, base.task.num_heads) == (12, 768, 12)
    assert base.trainer.per_replica_batch_size == 128
    large = config.build({"preset": "bert-large"})
    assert (large.task.num_layers, large.task.hidden_size, large.task.num_heads) == (24, 1024, 16)


def test_masked_predictions_per_sequence_default_to_google_research_berts_values():
    assert config.build({"preset": "bert-tiny"}).task.predictions_per_seq == 20
    assert config.build({"task": {"seq_len": 512}}).task.predictions_per_seq == 80
    assert config.build({"task": {"seq_len": 256, "mask_rate": 0.2}}).task.predictions_per_seq == 52
    assert config.build({"task": {"max_predictions_per_seq": 7}}).task.predictions_per_seq == 7


def test_file_sections_override_the_preset(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"preset": "bert-tiny", "trainer": {"max_steps": 50, "learning_rate": 1},
                                "runtime": {"data_dir": "gs://b/d", "model_dir": "gs://b/m"}}))
    cfg = config.load(path)
    assert cfg.trainer.max_steps == 50 and cfg.trainer.learning_rate == 1.0 and cfg.task.hidden_size == 128
    assert cfg.runtime.model_dir == "gs://b/m"


@pytest.mark.parametrize("data, message", [
    ({"preset": "bert-huge"}, "config.preset: unknown preset 'bert-huge'"),
    ({"trainr": {}}, r"config.trainr: unknown key; did you mean trainer\?"),
    ({"task": {"hidden": 3}}, r"config.task.hidden: unknown field; did you mean hidden_size\?"),
    ({"task": {"colour": 3}}, r"config.task.colour: unknown field; expected one of dropout, hidden_size, "),
    ({"trainer": {"max_step": 30}}, r"config.trainer.max_step: unknown field; did you mean max_steps\?"),
    ({"trainer": "fast"}, "config.trainer: expected an object"),
    ({"trainer": {"max_steps": "10"}}, "config.trainer.max_steps: expected int, got '10'"),
    ({"trainer": {"per_replica_batch_size": 12}}, "multiple of 8"),
    ({"task": {"seq_len": 100}}, "config.task.seq_len: must be 128, 256 or 512"),
    ({"task": {"hidden_size": 130, "num_heads": 4}}, "config.task.hidden_size: must be a positive multiple"),
    ({"trainer": {"steps_per_execution": 7}}, "config.trainer.max_steps: must be a positive multiple"),
    ({"preset": "bert-tiny", "trainer": {"log_every": 15}},
     r"config.trainer.log_every: must be a positive multiple of trainer.steps_per_execution \(10\)"),
    ({"runtime": {"mixed_precision": "float16"}}, "config.runtime.mixed_precision"),
    ({"task": {"max_predictions_per_seq": 129}},
     r"config.task.max_predictions_per_seq: must be in \[1, task.seq_len \(128\)\], or 0 to derive it"),
])
def test_bad_configs_name_the_field(data, message):
    with pytest.raises(ConfigError, match=message):
        config.build(data)


def test_template_json_declares_the_entry_module_data_contract_and_progress_format():
    meta = json.loads((TEMPLATE / "template.json").read_text())
    assert meta["entry_module"] == "bert.train" and (TEMPLATE / "train.py").is_file()
    assert meta["config"]["validate"] == "config:build"  # the host checks configs with the worker's schema
    assert set(meta["presets"]) == set(config.PRESETS) == {"bert-tiny", "bert-base", "bert-large"}
    progress = contract.find("bert").progress
    assert progress.step_line.match("step=120 loss=6.1234 mlm_accuracy=0.0412 learning_rate=0.00012 examples_per_sec=812.3")
    start = progress.start_line.match("start backend=jax strategy=cpu processes=1 hosts=1 devices=8 per_replica_batch=8 "
                                      "global_batch=64 step=0 max_steps=200 vocab_size=8000 seq_len=128")
    assert start["max_steps"] == "200"


def test_template_code_imports_only_relatively():
    """Shipped as bare `bert` and `lmkit` packages: no `tpuctl` imports, no absolute `bert.` imports."""
    for path in [*TEMPLATE.glob("*.py"), *(TEMPLATE.parent / "lmkit").glob("*.py")]:
        text = path.read_text()
        assert not re.search(r"^\s*(from|import) (tpuctl|bert)\b", text, re.M), path.name


POD = guest.TpuVm(node="tpuctl-r1", worker=0, hosts=("10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"),
                  accelerator_type="v3-32")
ONE_HOST = guest.TpuVm(node="tpuctl-r1", worker=0, hosts=("10.0.0.2",), accelerator_type="v3-8")


def _machine(monkeypatch, *, vm: guest.TpuVm | None = None, devices: bool = False) -> None:
    """This machine as the strategy sees it: a metadata server that describes `vm`, chips or not."""
    monkeypatch.setattr(guest, "tpu_vm", lambda: vm)
    fake = ["/dev/accel0"] if devices else []
    monkeypatch.setattr(strategy.glob, "glob", lambda pattern: fake if "accel" in pattern else [])


@pytest.mark.parametrize("env, vm, devices, expected", [
    ({"COLAB_TPU_ADDR": "10.0.0.2:8470"}, None, False, "grpc://10.0.0.2:8470"),
    ({"TPU_NAME": "grpc://10.0.0.3:8470"}, None, False, "grpc://10.0.0.3:8470"),
    ({}, ONE_HOST, True, "local"),
    ({}, POD, True, "tpuctl-r1"),  # the node's name comes from tpu-env NODE_ID
    ({}, POD, False, "tpuctl-r1"),  # a TPU VM without chips is still a TPU VM: resolve() then refuses it
    ({}, None, True, "local"),  # chips but no metadata server
    # GKE's variables are not a TPU VM's: without metadata or chips they mean nothing here.
    ({"TPU_NAME": "tpuctl-r1", "TPU_WORKER_HOSTNAMES": "a,b,c,d", "TPU_WORKER_ID": "0"}, None, False, ""),
    ({}, None, False, ""),
])
def test_tpu_is_found_from_the_machine(monkeypatch, env, vm, devices, expected):
    for name in ("COLAB_TPU_ADDR", "TPU_NAME", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _machine(monkeypatch, vm=vm, devices=devices)
    assert strategy._tpu_from_env(vm) == expected


@pytest.mark.parametrize("vm, follower", [
    (POD, None),
    (dataclasses.replace(POD, worker=2), 2),
    (ONE_HOST, None),
    (None, None),
])
def test_only_worker_0_drives_a_multi_host_tpu_slice(monkeypatch, vm, follower):
    monkeypatch.setenv("TPU_WORKER_ID", "3")  # GKE's variable: ignored
    _machine(monkeypatch, vm=vm)
    assert strategy.follower() == follower


@pytest.mark.parametrize("tpu, libtpu, expected", [
    ("tpuctl-r1", "/lib/libtpu.so", {"TPU_LOAD_LIBRARY": "0"}),
    ("local", "/lib/libtpu.so", {"NEXT_PLUGGABLE_DEVICE_USE_C_API": "true",
                                 "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": "/lib/libtpu.so"}),
    ("local", "/venv/site-packages/libtpu/libtpu.so", {}),  # a stream-executor runtime: TF loads it itself
    ("grpc://10.0.0.2:8470", "/lib/libtpu.so", {}),
])
def test_tf_load_time_variables_follow_the_tpu_vm_recipes(monkeypatch, tpu, libtpu, expected):
    env: dict[str, str] = {}  # what the code sets must not leak into later tests' subprocesses
    monkeypatch.setattr(os, "environ", env)
    strategy.set_tpu_environment(tpu, libtpu)
    assert env == expected


@pytest.fixture
def without_pip_libtpu(monkeypatch):
    """A TPU VM image without the pip libtpu package (this machine may have it: the test extra installs the TPU
    compiler for `tpuctl fit`). Returns the real find_spec, to put the package lookup back."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "libtpu" else real(name, *args))
    return real


def test_libtpu_is_looked_up_where_tf_and_jax_look(monkeypatch, tmp_path, without_pip_libtpu):
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    monkeypatch.setattr(strategy, "SYSTEM_LIBTPU", (str(tmp_path / "lib" / "libtpu.so"),))
    path, tried = strategy.find_libtpu()
    assert path is None
    assert tried == ["TPU_LIBRARY_PATH (unset)", "pip package libtpu (not installed)",
                     f"{tmp_path}/lib/libtpu.so (missing)"]

    package = tmp_path / "site" / "libtpu"  # the pip package: libtpu/__init__.py next to libtpu/libtpu.so
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "libtpu.so").write_bytes(b"")
    monkeypatch.setattr(importlib.util, "find_spec", without_pip_libtpu)
    monkeypatch.delitem(sys.modules, "libtpu", raising=False)  # loaded already (the compiler): find_spec answers it
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert strategy.find_libtpu()[0] == str(package / "libtpu.so")

    override = tmp_path / "custom.so"
    override.write_bytes(b"")
    monkeypatch.setenv("TPU_LIBRARY_PATH", str(override))
    assert strategy.find_libtpu() == (str(override), [])


def test_a_tpu_vm_without_chips_fails_loudly_unless_a_cpu_rehearsal_is_asked_for(monkeypatch, tmp_path,
                                                                               without_pip_libtpu):
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    monkeypatch.setattr(strategy, "SYSTEM_LIBTPU", (str(tmp_path / "libtpu.so"),))
    monkeypatch.delenv(strategy.CPU_REHEARSAL_VAR, raising=False)
    _machine(monkeypatch, vm=POD, devices=False)
    with pytest.raises(AcceleratorError) as e:
        strategy.resolve(config.RuntimeConfig())
    message = str(e.value)
    assert "TPU VM tpuctl-r1 (v3-32) worker 0" in message and "no TPU chips" in message
    assert "/dev/accel*" in message and "/dev/vfio/[0-9]*" in message and "TPU_LIBRARY_PATH" in message
    assert "Not falling back to the CPU" in message

    monkeypatch.setenv(strategy.CPU_REHEARSAL_VAR, "cpu")
    assert strategy._check_tpu_host(POD, "tpuctl-r1") is True


def test_tpu_chips_without_libtpu_fail_loudly(monkeypatch, tmp_path, without_pip_libtpu):
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    monkeypatch.setattr(strategy, "SYSTEM_LIBTPU", (str(tmp_path / "libtpu.so"),))
    _machine(monkeypatch, vm=ONE_HOST, devices=True)
    with pytest.raises(AcceleratorError, match=r"has TPU chips but no libtpu.so: tried TPU_LIBRARY_PATH \(unset\); "
                                               r"pip package libtpu \(not installed\); .*libtpu.so \(missing\)"):
        strategy.resolve(config.RuntimeConfig())


def test_guest_reads_its_identity_from_a_metadata_server(monkeypatch):
    """guest.py against localcloud's metadata server: identity from metadata alone, the header sent."""
    from tpuctl.localcloud.metadata import MetadataServer

    hosts = ",".join(f"t1v-n-abc-w-{i}:1:10.0.0.{i}" for i in range(4))
    tree = {"instance": {"attributes": {
        "accelerator-type": "v4-32", "agent-worker-number": "2", "worker-network-endpoints": hosts,
        "tpu-env": "ACCELERATOR_TYPE: 'v4-32'\nNODE_ID: 'my-slice'\nWORKER_ID: '2'\n"}}}
    server = MetadataServer()
    try:
        (host,) = server.attach("n", 1, lambda index: tree)
        monkeypatch.setenv("GCE_METADATA_HOST", host)
        guest.tpu_vm.cache_clear()
        vm = guest.tpu_vm()
        assert vm == guest.TpuVm(node="my-slice", worker=2, hosts=tuple(f"10.0.0.{i}" for i in range(4)),
                                 accelerator_type="v4-32", endpoints=hosts)
        tree["instance"]["attributes"] = {}  # a plain Compute Engine VM: no agent-worker-number
        guest.tpu_vm.cache_clear()
        assert guest.tpu_vm() is None
        # A Compute Engine TPU VM (TPU7x) serves what JAX reads and its machine type, and no tpu-env: the
        # guest finds its slice from them and rehearses 8 devices (4 chips of 2 TensorCores).
        tree["instance"] = {"machine-type": "projects/123/machineTypes/tpu7x-standard-4t", "attributes": {
            "agent-worker-number": "1", "worker-network-endpoints": "x1-a:7:10.0.0.1,x1-b:8:10.0.0.2"}}
        guest.tpu_vm.cache_clear()
        vm = guest.tpu_vm()
        assert (vm.node, vm.worker, vm.hosts, vm.machine_type) == (None, 1, ("10.0.0.1", "10.0.0.2"), "tpu7x-standard-4t")
        assert strategy._devices_per_host(vm) == 8
        assert strategy.jax_cluster(vm, rehearsal=True)["coordinator_address"].startswith("10.0.0.1:")
        with pytest.raises(AcceleratorError, match="TPUClusterResolver"):
            strategy._tpu_from_env(vm)
    finally:
        guest.tpu_vm.cache_clear()
        server.close()


@pytest.mark.parametrize("endpoints, addresses", [
    ("t1v-n-abc-w-0:1:10.0.0.1,t1v-n-abc-w-1:2:10.0.0.2", ("10.0.0.1", "10.0.0.2")),  # name:id:ip triples
    ("t1v-n-abc-w-0,t1v-n-abc-w-1\n", ("t1v-n-abc-w-0", "t1v-n-abc-w-1")),  # the newer format: hostnames
])
def test_both_formats_of_worker_network_endpoints(endpoints, addresses):
    """JAX's cloud_tpu_cluster.py: "worker-network-endpoints can have one of two formats"."""
    assert guest.worker_addresses(endpoints) == addresses
    with pytest.raises(AcceleratorError, match="neither a hostname nor name:id:ip"):
        guest.worker_addresses("a:b")


def test_guest_does_not_call_the_network_off_google_cloud(monkeypatch, tmp_path):
    monkeypatch.delenv("GCE_METADATA_HOST", raising=False)
    monkeypatch.delenv("GCE_METADATA_ROOT", raising=False)
    monkeypatch.setattr(guest, "PRODUCT_NAME", tmp_path / "product_name")
    monkeypatch.setattr(guest, "get", lambda *a: pytest.fail("asked a metadata server"))
    guest.tpu_vm.cache_clear()
    try:
        assert guest.tpu_vm() is None
        (tmp_path / "product_name").write_text("Google Compute Engine\n")
        assert guest.metadata_host() == "metadata.google.internal"
    finally:
        guest.tpu_vm.cache_clear()


def test_jax_meets_its_peers_through_worker_0_and_counts_devices_per_host_like_jax():
    """The coordinator and process id come from the metadata server (guest.TpuVm), never from TPU_* variables."""
    second = guest.TpuVm(node="tpuctl-r1", worker=1, hosts=("10.0.0.2", "10.0.0.3"), accelerator_type="v5litepod-16")
    assert strategy.jax_cluster(second, rehearsal=False) == {
        "coordinator_address": "10.0.0.2:8482", "num_processes": 2, "process_id": 1}
    rehearsed = strategy.jax_cluster(second, rehearsal=True)
    assert rehearsed["coordinator_address"] != "10.0.0.2:8482" and rehearsed["process_id"] == 1
    assert rehearsed == strategy.jax_cluster(second, rehearsal=True)  # every worker derives the same port
    assert strategy.jax_cluster(ONE_HOST, rehearsal=False) is None and strategy.jax_cluster(None, rehearsal=True) is None
    per_host = {t: strategy._devices_per_host(guest.TpuVm(node="n", worker=0, hosts=("h",) * h, accelerator_type=t))
                for t, h in
                (("v5litepod-16", 2), ("v3-8", 1), ("v4-32", 4), ("v5p-16", 2), ("v6e-8", 1), ("v2-32", 4))}
    assert per_host == {"v5litepod-16": 8, "v3-8": 8, "v4-32": 4, "v5p-16": 4, "v6e-8": 8, "v2-32": 8}
