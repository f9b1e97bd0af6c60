"""The BERT template's config schema, presets, template.json contract and strategy choice (no TensorFlow)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tpuctl.templates.bert import config, strategy
from tpuctl.templates.bert.errors import ConfigError

TEMPLATE = Path(config.__file__).parent


def test_presets_have_the_published_shapes():
    tiny = config.build({"preset": "bert-tiny"})
    assert (tiny.task.num_layers, tiny.task.hidden_size, tiny.task.seq_len) == (2, 128, 128)
    base = config.build({"preset": "bert-base"})
    assert (base.task.num_layers, base.task.hidden_size, base.task.num_heads) == (12, 768, 12)
    assert base.trainer.per_replica_batch_size == 128
    large = config.build({"preset": "bert-large"})
    assert (large.task.num_layers, large.task.hidden_size, large.task.num_heads) == (24, 1024, 16)


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
])
def test_bad_configs_name_the_field(data, message):
    with pytest.raises(ConfigError, match=message):
        config.build(data)


def test_template_json_declares_the_entry_module_data_contract_and_progress_format():
    meta = json.loads((TEMPLATE / "template.json").read_text())
    assert meta["entry_module"] == "bert.train" and (TEMPLATE / "train.py").is_file()
    assert meta["data"]["manifest_format"] == "tpuctl-bert-mlm/1"
    assert meta["config"]["validate"] == "config:build"  # the host checks configs with the worker's schema
    assert set(meta["presets"]) == set(config.PRESETS) == {"bert-tiny", "bert-base", "bert-large"}
    step = re.compile(meta["progress"]["step_line"])
    assert step.match("step=120 loss=6.1234 mlm_accuracy=0.0412 learning_rate=0.00012 examples_per_sec=812.3")
    assert (TEMPLATE / meta["requirements"]).is_file()


def test_template_code_imports_only_relatively():
    """Shipped as a bare `bert` package: no `tpuctl` imports, no absolute `bert.` imports."""
    for path in TEMPLATE.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import) (tpuctl|bert)\b", text, re.M), path.name


@pytest.mark.parametrize("env, devices, expected", [
    ({"COLAB_TPU_ADDR": "10.0.0.2:8470"}, False, "grpc://10.0.0.2:8470"),
    ({"TPU_NAME": "grpc://10.0.0.3:8470"}, False, "grpc://10.0.0.3:8470"),
    ({"TPU_NAME": "tpuctl-r1", "TPU_WORKER_HOSTNAMES": "a,b"}, False, ""),  # emulated TPU VM: no chips here
    ({"TPU_NAME": "tpuctl-r1", "TPU_WORKER_HOSTNAMES": "a"}, True, "local"),
    ({"TPU_NAME": "tpuctl-r1", "TPU_WORKER_HOSTNAMES": "a,b,c,d"}, True, "tpuctl-r1"),
    ({}, False, ""),
])
def test_tpu_is_found_from_the_environment(monkeypatch, env, devices, expected):
    for name in ("COLAB_TPU_ADDR", "TPU_NAME", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    fake = ["/dev/accel0"] if devices else []
    monkeypatch.setattr(strategy.glob, "glob", lambda pattern: fake if "accel" in pattern else [])
    assert strategy._tpu_from_env() == expected


@pytest.mark.parametrize("worker, hosts, devices, follower", [
    ("0", "a,b,c,d", True, False),
    ("2", "a,b,c,d", True, True),
    ("2", "a,b,c,d", False, False),  # emulated slice: every worker trains on its own CPU
    ("0", "a", True, False),
])
def test_only_worker_0_drives_a_multi_host_tpu_slice(monkeypatch, worker, hosts, devices, follower):
    monkeypatch.setenv("TPU_WORKER_ID", worker)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", hosts)
    fake = ["/dev/accel0"] if devices else []
    monkeypatch.setattr(strategy.glob, "glob", lambda pattern: fake if "accel" in pattern else [])
    assert strategy.is_follower() is follower


@pytest.mark.parametrize("tpu, libtpu, expected", [
    ("tpuctl-r1", True, {"TPU_LOAD_LIBRARY": "0"}),
    ("local", True, {"NEXT_PLUGGABLE_DEVICE_USE_C_API": "true", "TF_PLUGGABLE_DEVICE_LIBRARY_PATH": "/lib/libtpu.so"}),
    ("local", False, {}),  # a stream-executor runtime: TF finds the chips itself
    ("grpc://10.0.0.2:8470", True, {}),
])
def test_tf_load_time_variables_follow_the_tpu_vm_recipes(monkeypatch, tpu, libtpu, expected):
    env: dict[str, str] = {}  # what the code sets must not leak into later tests' subprocesses
    monkeypatch.setattr(os, "environ", env)
    monkeypatch.setattr(strategy.glob, "glob", lambda pattern: ["/dev/accel0"] if "accel" in pattern else [])
    monkeypatch.setattr(strategy.os.path, "exists", lambda path: libtpu and path == strategy.PJRT_LIBTPU)
    strategy.set_tpu_environment(tpu)
    assert env == expected
