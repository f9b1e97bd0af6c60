"""Exact resume: N steps straight and N/2 + resume + N/2 give the same weights, bitwise, for both built-in
templates on both Keras backends. The resumed run starts from the straight run's checkpoint at N/2 in a model
directory of its own (what a preempted run finds), so the data order, the masks, dropout's random state and the
optimizer must all continue where they were: the checkpoint holds them (lmkit/checkpoints.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from conftest import on_jax  # noqa: E402
from test_data_prepare import write_corpus  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.timeout(300)]

STEPS = 20  # N; the checkpoint at N/2 is the resumed run's start
TASK = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
SEQ_LEN = {"bert": 128, "gpt2": 32}  # the shortest each template prepares
TRAINER = {"max_steps": STEPS, "per_replica_batch_size": 8, "steps_per_execution": 5, "log_every": 5,
           "checkpoint_every": STEPS // 2, "keep_checkpoints": 5, "warmup_steps": 5, "learning_rate": 3e-3,
           "shuffle_buffer": 64}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """Both templates' data from one small corpus, in $TPUCTL_RESUME_DATA/{bert,gpt2} (read by a JAX process too)."""
    from tpuctl.templates.bert import prepare as bert_prep
    from tpuctl.templates.gpt2 import prepare as gpt2_prep

    tmp = tmp_path_factory.mktemp("exact-resume")
    corpus = str(write_corpus(tmp / "corpus.txt", documents=300, seed=5))
    bert_prep.prepare([corpus], tmp / "bert", bert_prep.PrepareOptions(vocab_size=400, seq_len=SEQ_LEN["bert"],
                                                                        strip_accents=False, shard_sequences=64))
    gpt2_prep.prepare([corpus], tmp / "gpt2", gpt2_prep.PrepareOptions(vocab_size=400, seq_len=SEQ_LEN["gpt2"],
                                                                        shard_sequences=64))
    return tmp


def straight_and_resumed() -> str:
    """For each template: train STEPS straight, then from the checkpoint at STEPS/2 in a fresh model_dir on to
    STEPS; raise unless every array of the two final checkpoints is equal. Returns the Keras backend."""
    import importlib

    import keras

    base = Path(os.environ["TPUCTL_RESUME_DATA"])
    backend = keras.backend.backend()
    for name in ("bert", "gpt2"):
        config = importlib.import_module(f"tpuctl.templates.{name}.config")
        train = importlib.import_module(f"tpuctl.templates.{name}.train")

        def run(model_dir: Path) -> None:
            train.run(config.build({"preset": f"{name}-tiny", "task": {**TASK, "seq_len": SEQ_LEN[name]}, "trainer": TRAINER,
                                    "runtime": {"data_dir": str(base / name), "model_dir": str(model_dir),
                                                "seed": 7, "framework": backend}}), log=lambda line: None)

        straight, resumed = base / f"{name}-{backend}-straight", base / f"{name}-{backend}-resumed"
        run(straight)
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copy(straight / "run.json", resumed / "run.json")
        half = f"ckpt-{STEPS // 2}.npz"
        shutil.copy(straight / "checkpoints" / half, resumed / "checkpoints" / half)
        (resumed / "checkpoints" / "checkpoint").write_text(f'model_checkpoint_path: "{half}"\n')
        run(resumed)
        final = f"ckpt-{STEPS}.npz"
        a, b = np.load(straight / "checkpoints" / final), np.load(resumed / "checkpoints" / final)
        assert sorted(a.files) == sorted(b.files), (name, backend)
        assert int(a["data/examples"]) == STEPS * TRAINER["per_replica_batch_size"]
        differ = [k for k in a.files if not np.array_equal(a[k], b[k])]
        assert not differ, f"{name} on {backend}: {len(differ)} arrays differ after the resume, e.g. {differ[:3]}"
    return backend


def test_a_resumed_run_ends_bitwise_where_the_straight_one_does_on_tensorflow(prepared, monkeypatch):
    monkeypatch.setenv("TPUCTL_RESUME_DATA", str(prepared))
    assert straight_and_resumed() == "tensorflow"


@pytest.mark.slow  # four JAX runs compiled in a fresh interpreter: about 2 minutes on 2 busy cores
@pytest.mark.timeout(600)
def test_a_resumed_run_ends_bitwise_where_the_straight_one_does_on_jax(prepared, monkeypatch):
    pytest.importorskip("jax")
    monkeypatch.setenv("TPUCTL_RESUME_DATA", str(prepared))
    assert on_jax("test_exact_resume", "straight_and_resumed", timeout=560) == "jax"
