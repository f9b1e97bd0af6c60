"""The BERT training program on the CPU: loss falls, resume continues, XLA compiles, 8 replicas rehearse a TPU.

bert-tiny on a generated English + Korean corpus. In-process runs use TF's default strategy; the
8-logical-replica run needs a fresh process (the CPU split must precede TF's runtime start), so it runs
`python -m bert.train` exactly as a TPU worker would, from the template directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tf = pytest.importorskip("tensorflow")

from test_data_prepare import write_corpus  # noqa: E402

from tpuctl.templates.bert import config, train  # noqa: E402
from tpuctl.templates.bert import prepare as prep  # noqa: E402
from tpuctl.templates.lmkit.errors import ConfigError, DataError  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.timeout(300)]

TEMPLATES = Path(config.__file__).resolve().parents[1]
STEP = re.compile(r"^step=(\d+) loss=(\S+) mlm_accuracy=(\S+) learning_rate=(\S+) examples_per_sec=(\S+) time=[\d.]+$")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("bert-train")
    corpus = write_corpus(tmp / "corpus.txt", documents=1500, seed=7)
    out = tmp / "prepared"
    prep.prepare([str(corpus)], out, prep.PrepareOptions(vocab_size=800, strip_accents=False, shard_sequences=128))
    return str(out)


def tiny(data_dir: str, model_dir: Path, **trainer) -> config.BertConfig:
    values = {"max_steps": 60, "per_replica_batch_size": 16, "steps_per_execution": 10, "log_every": 10,
              "checkpoint_every": 30, "warmup_steps": 10, "learning_rate": 2e-3, "shuffle_buffer": 256, **trainer}
    return config.build({"preset": "bert-tiny", "trainer": values,
                         "runtime": {"data_dir": data_dir, "model_dir": str(model_dir), "seed": 1}})


def steps(lines: list[str]) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in map(STEP.match, lines) if m}


@pytest.fixture(scope="module")
def first_run(data_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("model")
    lines: list[str] = []
    metrics = train.run(tiny(data_dir, model_dir), log=lines.append)
    return model_dir, lines, metrics


def test_bert_tiny_loss_falls(first_run):
    _, lines, metrics = first_run
    losses = steps(lines)
    assert sorted(losses) == [10, 20, 30, 40, 50, 60]
    assert losses[60] < losses[10] - 0.5, losses
    assert metrics["final_step"] == 60 and metrics["loss"] == pytest.approx(losses[60], abs=1e-4)
    assert lines[0].startswith("start backend=tensorflow strategy=cpu processes=1 hosts=1 devices=1 per_replica_batch=16 "
                           "global_batch=16 step=0 max_steps=60")
    assert lines[-1].startswith("done step=60 ")


def test_export_has_model_vocab_config_and_metrics(first_run, data_dir):
    import keras
    import numpy as np

    model_dir, _, metrics = first_run
    export = model_dir / "export"
    assert json.loads((export / "metrics.json").read_text()) == metrics
    vocab_size = json.loads((Path(data_dir) / "manifest.json").read_text())["vocab_size"]
    assert json.loads((export / "config.json").read_text())["task"]["vocab_size"] == vocab_size
    assert (export / "vocab.txt").read_bytes() == (Path(data_dir) / "vocab.txt").read_bytes()
    model = keras.saving.load_model(export / "model.keras")
    assert np.abs(model.get_layer("token_embedding").output_bias.numpy()).max() > 0, "trained bias, not the init"
    ids = np.full((2, 128), 5, dtype="int32")
    positions = np.tile(np.arange(20, dtype="int32"), (2, 1))
    logits = model.predict({"input_ids": ids, "input_mask": np.ones_like(ids), "masked_positions": positions},
                           verbose=0)
    assert logits.shape == (2, 20, vocab_size), "the vocabulary projection runs at the 20 masked slots only"


def test_resume_continues_step_count_and_loss_curve(first_run, data_dir, tmp_path):
    # A copy: training on to step 80 in first_run's own model_dir would change its export under the tests that
    # share it, which then passed only when they ran before this one.
    model_dir = Path(shutil.copytree(first_run[0], tmp_path / "model"))
    first_lines = first_run[1]
    assert {p.name for p in (model_dir / "checkpoints").glob("ckpt-*.npz")} == {"ckpt-30.npz", "ckpt-60.npz"}
    lines: list[str] = []
    metrics = train.run(tiny(data_dir, model_dir, max_steps=80), log=lines.append)
    before, after = steps(first_lines), steps(lines)
    assert "step=60 max_steps=80" in lines[0]
    assert sorted(after) == [70, 80] and metrics["final_step"] == 80
    assert after[70] < before[10] - 0.5, "restored weights, not a fresh model"
    assert abs(after[70] - before[60]) < 0.5, (before, after)
    events = _tensorboard_steps(model_dir / "tensorboard", "loss")
    assert events == [10, 20, 30, 40, 50, 60, 70, 80]
    # Finished and exported: a rerun does nothing but report.
    again: list[str] = []
    assert train.run(tiny(data_dir, model_dir, max_steps=80), log=again.append) == metrics
    assert again == [lines[-1]]


def _tensorboard_steps(logdir: Path, tag: str) -> list[int]:
    found = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            found += [event.step for v in event.summary.value if v.tag == tag]
    return sorted(found)


def test_a_model_dir_from_another_model_or_vocabulary_is_refused(first_run, data_dir, tmp_path):
    model_dir, _, _ = first_run
    wider = config.with_overrides(tiny(data_dir, model_dir), task={"hidden_size": 256})
    with pytest.raises(ConfigError, match=r"\['hidden_size'\] differ from the checkpoints"):
        train.run(wider, log=lambda _: None)
    other = tmp_path / "other"
    corpus = write_corpus(tmp_path / "c.txt", documents=300, seed=99)
    prep.prepare([str(corpus)], other, prep.PrepareOptions(vocab_size=800, strip_accents=False))
    with pytest.raises(DataError, match="different vocab.txt"):
        train.run(tiny(str(other), model_dir), log=lambda _: None)


def test_data_prepared_for_another_sequence_length_is_refused(data_dir, tmp_path):
    cfg = config.with_overrides(tiny(data_dir, tmp_path / "m"), task={"seq_len": 512})
    with pytest.raises(DataError, match="seq_len: data has 128, config wants 512"):
        train.run(cfg, log=lambda _: None)
    assert not (tmp_path / "m").exists()


@pytest.mark.slow  # ~15-50 s of XLA compiling; the XLA paths in the fast tier: test_template_layers
def test_xla_compiles_the_train_step_under_the_tpu_numeric_policy(data_dir, tmp_path):
    cfg = tiny(data_dir, tmp_path / "xla", max_steps=4, steps_per_execution=2, log_every=2, checkpoint_every=4)
    cfg = config.with_overrides(cfg, runtime={"jit_compile": True, "mixed_precision": "mixed_bfloat16"})
    lines: list[str] = []
    metrics = train.run(cfg, log=lines.append)
    assert metrics["final_step"] == 4 and 0 < metrics["loss"] < 10


def test_bad_config_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"preset": "bert-tiny", "trainer": {"per_replica_batch_size": 12}}))
    assert train.main(["--config", str(path)]) == 2
    assert capsys.readouterr().err == "error: config.trainer.per_replica_batch_size: must be a positive multiple of 8\n"


def _worker_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(TEMPLATES)}  # the template as a bare `bert` package, as shipped


@pytest.mark.slow
def test_killed_at_any_moment_it_resumes_from_the_last_checkpoint(data_dir, tmp_path):
    cfg = tmp_path / "config.json"
    model_dir = tmp_path / "model"
    trainer = {"max_steps": 60, "per_replica_batch_size": 16, "steps_per_execution": 10, "log_every": 10,
               "checkpoint_every": 20, "warmup_steps": 10}
    cfg.write_text(json.dumps({"preset": "bert-tiny", "trainer": trainer,
                               "runtime": {"data_dir": data_dir, "model_dir": str(model_dir)}}))
    proc = subprocess.Popen([sys.executable, "-m", "bert.train", "--config", str(cfg)], cwd=tmp_path,
                            env=_worker_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("checkpoint step=20"):
                proc.kill()  # SIGKILL: no handler, no final save
                break
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
    lines: list[str] = []
    metrics = train.run(config.load(cfg), log=lines.append)
    resumed_at = int(re.search(r" step=(\d+) ", lines[0])[1])
    assert resumed_at in (20, 40) and min(steps(lines)) == resumed_at + 10
    assert metrics["final_step"] == 60


@pytest.mark.slow
def test_eight_logical_replicas_rehearse_a_tpu_v3_8(data_dir, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({
        "preset": "bert-tiny",
        "trainer": {"max_steps": 10, "per_replica_batch_size": 8, "steps_per_execution": 5, "log_every": 5,
                    "checkpoint_every": 10, "warmup_steps": 2},
        "runtime": {"data_dir": data_dir, "model_dir": str(tmp_path / "model")}}))
    proc = subprocess.run([sys.executable, "-m", "bert.train", "--config", str(cfg), "--replicas", "8"],
                          cwd=tmp_path, env=_worker_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("start backend=tensorflow strategy=cpu processes=1 hosts=1 devices=8 per_replica_batch=8 "
                           "global_batch=64 step=0")
    assert sorted(steps(lines)) == [5, 10] and lines[-1].startswith("done step=10 ")
