"""BERT masked-LM pretraining: `python -m bert.train --config CONFIG.json [--replicas N]`.

lmkit's training program (lmkit/trainer.py: strategy on TensorFlow or JAX, TPU VM / pod slice / GPU / CPU
rehearsal, resume from the latest backend-neutral checkpoint, progress lines, TensorBoard, export) training
BERT's objective: the masked LM of model.py on the dynamically masked batches of data.py, refusing data that
disagrees with the config or with `model_dir`'s checkpoints. Safe to kill at any moment; a rerun with the same
config resumes exactly.

Output lines on stdout (lmkit/trainer.py says what each means), with `mlm_accuracy` the accuracy at the masked
positions:

    start backend=jax strategy=tpu processes=2 hosts=2 devices=16 per_replica_batch=8 global_batch=128 step=0 max_steps=200 vocab_size=8000 seq_len=128
    step=120 loss=6.1234 mlm_accuracy=0.0412 learning_rate=0.00012 examples_per_sec=812.3
    checkpoint step=200 path=/model/checkpoints/ckpt-200
    done step=200 loss=5.9876 mlm_accuracy=0.0833 export_dir=/model/export
    stopped step=130 reason=sigterm     (after the checkpoint a SIGTERM asked for; the process then ends by SIGTERM)
    idle worker=3 reason=pod-slice-driven-by-worker-0     (TF: workers 1..N-1 of a multi-host TPU slice; exit 0)

Artifacts in `export_dir` (default `model_dir/export`): model.keras, vocab.txt, tokenizer.json,
manifest.json, config.json (the resolved config), metrics.json (final step, loss, accuracy, throughput).
Exit status: 0 done, 2 bad config or data (one `error: ...` line on stderr), 1 anything else.
"""

from __future__ import annotations

import sys

from . import config as config_mod
from .config import BertConfig
from .shared import lmkit

_trainer = lmkit("trainer")
SHARD = _trainer.SHARD


class MaskedLM(_trainer.Objective):
    """BERT's part of the program: its config, model, masked batches and tokenizer files."""

    package = __package__  # "bert" on a worker
    name = "bert"
    accuracy = "mlm_accuracy"
    config = config_mod
    # runtime.sharding fsdp: lmkit's embeddings and attention, and BERT's feed-forward and MLM transform.
    fsdp_layout = {**_trainer.Objective.fsdp_layout, r"layer\d+_intermediate/kernel": (SHARD, None),
                   r"layer\d+_output/kernel": (None, SHARD), "mlm_transform/kernel": (SHARD, None)}

    def dataset(self, cfg, manifest, batch_size: int, input_context, skip: int):
        return self.module("data").make_dataset(
            cfg.runtime.data_dir, manifest, batch_size, mask_rate=cfg.task.mask_rate,
            max_predictions=cfg.task.predictions_per_seq, shuffle_buffer=cfg.trainer.shuffle_buffer,
            input_context=input_context, seed=cfg.runtime.seed, skip=skip)

    def data_files(self) -> tuple[str, ...]:
        from .manifest import TOKENIZER_NAME, VOCAB_NAME

        return VOCAB_NAME, TOKENIZER_NAME, lmkit("manifest").MANIFEST_NAME

    def batch_shapes(self, task, batch: int):
        """data.make_dataset's element: ids and mask [B, L], the gathered positions, their labels and weights [B, P]."""
        seq, predictions = (batch, task.seq_len), (batch, task.predictions_per_seq)
        return ({"input_ids": (seq, "int32"), "input_mask": (seq, "int32"),
                 "masked_positions": (predictions, "int32")}, (predictions, "int32"), (predictions, "float32"))


MASKED_LM = MaskedLM()


def main(argv: list[str] | None = None) -> int:
    return _trainer.main(argv, MASKED_LM, description=__doc__.splitlines()[0])


def run(cfg: BertConfig, *, log=None) -> dict:
    """Train per `cfg` to max_steps (resuming if checkpoints exist) and export; returns the final metrics.
    Blocks; see lmkit/trainer.py run for what it raises and returns."""
    return _trainer.run(cfg, log=log, objective=MASKED_LM)


def fit_target(config: dict, *, devices, vocab_size: int) -> dict:
    """template.json `fit`: the masked LM's step, as lmkit/trainer.py compile_target describes it."""
    return _trainer.compile_target(config, devices=devices, vocab_size=vocab_size, objective=MASKED_LM)


if __name__ == "__main__":
    sys.exit(main())
