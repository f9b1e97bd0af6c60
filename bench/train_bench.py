"""The BERT model's own training speed on this machine, fed from memory (no input pipeline).

    .venv/bin/python bench/train_bench.py [--preset bert-tiny] [--batch 64] [--steps 30] [--vocab 8000]
        [--precision float32|mixed_bfloat16] [--jit]

Prints steps/s and examples/s after a warm-up execution (tracing excluded). data_bench.py prints this next
to the tf.data pipeline's examples/s, to show how far ahead of the model the input side runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "templates"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def measure(*, preset: str = "bert-tiny", batch: int = 64, steps: int = 30, vocab: int = 8000,
            precision: str = "float32", jit: bool = False, steps_per_execution: int = 10) -> dict:
    """Train `steps` steps on one repeated random batch after one warm-up execution; returns the rates."""
    import keras
    import numpy as np
    import tensorflow as tf

    from bert import config
    from bert.data import mask_tokens
    from lmkit.layers import AdamW, SparseSoftmaxCrossEntropy
    from bert.model import build_model

    cfg = config.build({"preset": preset})
    keras.config.set_dtype_policy(precision)
    model = build_model(cfg.task, vocab_size=vocab)
    model.compile(optimizer=AdamW(1e-4), loss=SparseSoftmaxCrossEntropy(),  # the template's optimizer and loss
                  steps_per_execution=steps_per_execution, jit_compile=jit)
    ids = tf.constant(np.random.default_rng(0).integers(5, vocab, size=(batch, cfg.task.seq_len)), tf.int32)
    masked, positions, labels, weights = mask_tokens(ids, vocab_size=vocab, special_ids=[0, 1, 2, 3, 4], mask_id=4,
                                                     rate=0.15, max_predictions=cfg.task.predictions_per_seq,
                                                     seed=[0, 0])
    features = {"input_ids": masked, "input_mask": tf.ones_like(ids), "masked_positions": positions}
    ds = tf.data.Dataset.from_tensors((features, labels, weights))
    ds = ds.repeat().prefetch(2)
    model.fit(ds, steps_per_epoch=steps_per_execution, epochs=1, verbose=0, shuffle=False)  # trace + compile
    start = time.perf_counter()
    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False)
    elapsed = time.perf_counter() - start
    return {"preset": preset, "batch": batch, "seq_len": cfg.task.seq_len, "vocab": vocab, "precision": precision,
            "jit": jit, "steps_per_sec": steps / elapsed, "examples_per_sec": steps * batch / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="bert-tiny")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--precision", default="float32", choices=["float32", "mixed_bfloat16"])
    p.add_argument("--jit", action="store_true")
    a = p.parse_args()
    r = measure(preset=a.preset, batch=a.batch, steps=a.steps, vocab=a.vocab, precision=a.precision, jit=a.jit)
    print(f"model {r['preset']} batch={r['batch']} seq={r['seq_len']} vocab={r['vocab']} {r['precision']}"
          f"{' xla' if r['jit'] else ''}: {r['steps_per_sec']:.2f} steps/s, {r['examples_per_sec']:.1f} examples/s")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
