"""One BERT program, two Keras backends: JAX trains with DataParallel, and checkpoints cross backends both ways.

Every run is a fresh `python -m bert.train` (Keras fixes its backend at import, and the CPU split of both
backends must precede device use), from the template directory exactly as a worker starts it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("jax")

from test_bert_train import _worker_env, steps  # noqa: E402
from test_data_prepare import write_corpus  # noqa: E402

from tpuctl.templates.bert import prepare as prep  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("bert-backends")
    corpus = write_corpus(tmp / "corpus.txt", documents=600, seed=3)
    out = tmp / "prepared"
    prep.prepare([str(corpus)], out, prep.PrepareOptions(vocab_size=600, strip_accents=False, shard_sequences=64))
    return str(out)


def train(data_dir: str, model_dir: Path, framework: str, max_steps: int, replicas: int = 2) -> list[str]:
    cfg = model_dir.parent / f"{model_dir.name}-{framework}-{max_steps}.json"
    cfg.write_text(json.dumps({
        "preset": "bert-tiny",
        "trainer": {"max_steps": max_steps, "per_replica_batch_size": 8, "steps_per_execution": 10,
                    "log_every": 10, "checkpoint_every": 10, "warmup_steps": 5, "learning_rate": 3e-3,
                    "shuffle_buffer": 128},
        "runtime": {"data_dir": data_dir, "model_dir": str(model_dir), "framework": framework, "seed": 1}}))
    proc = subprocess.run([sys.executable, "-m", "bert.train", "--config", str(cfg), "--replicas", str(replicas)],
                          cwd=model_dir.parent, env=_worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


@pytest.mark.slow
def test_a_model_trained_on_one_backend_resumes_on_the_other_both_ways(data_dir, tmp_path):
    model_dir = tmp_path / "model"
    tf_lines = train(data_dir, model_dir, "tensorflow", 20)
    jax_lines = train(data_dir, model_dir, "jax", 40)
    back_lines = train(data_dir, model_dir, "tensorflow", 50)

    assert tf_lines[0].startswith("start backend=tensorflow strategy=cpu processes=1 hosts=1 devices=2 "
                                  "per_replica_batch=8 global_batch=16 step=0 ")
    assert jax_lines[0].startswith("start backend=jax strategy=cpu processes=1 hosts=1 devices=2 "
                                   "per_replica_batch=8 global_batch=16 step=20 max_steps=40 ")
    assert re.match(r"start backend=tensorflow .* step=40 max_steps=50 ", back_lines[0]), back_lines[0]
    first, second, third = steps(tf_lines), steps(jax_lines), steps(back_lines)
    assert sorted(second) == [30, 40] and sorted(third) == [50]
    # Restored weights and optimizer state, not a fresh model (~first[10]): the loss goes on falling from where
    # the other backend left it, never jumping back up.
    assert second[30] < first[10] - 0.3 and second[30] < first[20] + 0.1, (first, second)
    assert third[50] < first[10] - 0.3 and third[50] < second[40] + 0.1, (second, third)
    names = {p.name for p in (model_dir / "checkpoints").iterdir()}
    assert {"ckpt-40.npz", "ckpt-50.npz", "checkpoint"} <= names and not any(n.endswith(".tmp") for n in names)
    metrics = json.loads((model_dir / "export" / "metrics.json").read_text())
    assert metrics["backend"] == "tensorflow" and metrics["final_step"] == 50
