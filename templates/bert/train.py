"""BERT masked-LM pretraining: `python -m bert.train --config CONFIG.json [--replicas N]`.

lmkit's training program (lmkit/trainer.py: strategy on TensorFlow or JAX, TPU VM / pod slice / GPU / CPU
rehearsal, resume from the latest backend-neutral checkpoint, progress lines, TensorBoard, export) training
BERT's objective: the masked LM of model.py on the dynamically masked batches of data.py, refusing data that
disagrees with the config or with `model_dir`'s checkpoints. Safe to kill at any moment; a rerun with the same
config resumes exactly.

Output lines on stdout are lmkit/trainer.py's (start, step, checkpoint, done, stopped, idle), with
`mlm_accuracy` the accuracy at the masked positions:

    step=120 loss=6.1234 mlm_accuracy=0.0412 learning_rate=0.00012 examples_per_sec=812.3
    done step=200 loss=5.9876 mlm_accuracy=0.0833 export_dir=/model/export

Artifacts in `export_dir` (default `model_dir/export`): model.keras, vocab.txt, tokenizer.json,
manifest.json, config.json (the resolved config), metrics.json (final step, loss, accuracy, throughput).
Exit status: 0 done, 2 bad config or data (one `error: ...` line on stderr), 1 anything else.
"""

from __future__ import annotations

import math
import sys

from .shared import lmkit

_trainer = lmkit("trainer")
SHARD = _trainer.SHARD


class MaskedLM(_trainer.Objective):
    """BERT's part of the program: its config, model, masked batches and tokenizer files."""

    package = __package__  # "bert" on a worker
    accuracy = "mlm_accuracy"
    # runtime.sharding fsdp: lmkit's embeddings and attention, and BERT's feed-forward and MLM transform.
    fsdp_layout = {**_trainer.Objective.fsdp_layout, r"layer\d+_intermediate/kernel": (SHARD, None),
                   r"layer\d+_output/kernel": (None, SHARD), "mlm_transform/kernel": (SHARD, None)}

    def trainer(self, model):
        """The model with its MLM head's hidden states beside the logits (lmkit's TiedHeadTrainer): on a TPU under a
        remat policy the loss and accuracy come from the tied head's fused kernels, bias and all, so the
        [B, predictions, vocab] logits and their gradient never reach HBM; elsewhere the same cross-entropy of the
        logits. Without remat the kernels save bytes but not HBM (bert-128 on v5e at 32 a chip: 2.9% more;
        bench/RESULTS.md, tpu_compile), so they wait for a batch that needs remat."""
        layers = lmkit("layers")
        return layers.TiedHeadTrainer(model, "mlm_norm", fused_under_remat_only=True), layers.TokenLoss()

    def dataset(self, cfg, manifest, batch_size: int, input_context, skip: int):
        return self.module("data").make_dataset(
            cfg.runtime.data_dir, manifest, batch_size, mask_rate=cfg.task.mask_rate,
            max_predictions=cfg.task.predictions_per_seq, shuffle_buffer=cfg.trainer.shuffle_buffer,
            input_context=input_context, seed=cfg.runtime.seed, skip=skip)

    def data_files(self) -> tuple[str, ...]:
        from .manifest import TOKENIZER_NAME, VOCAB_NAME

        return VOCAB_NAME, TOKENIZER_NAME, lmkit("manifest").MANIFEST_NAME

    def flop_params(self, trainer, task) -> float:
        """The weights a matmul applies per token: the layers' for every token, and the MLM head's (its transform,
        and the token embedding as its tied decoder, with its output bias) for the predicted positions only,
        predictions_per_seq of seq_len; the embeddings are lookups. Counting the head over every token made
        bert-tiny's estimated MFU 98% on a v2-8 (a vocabulary of 8,000 is 70% of its weights)."""
        share = task.predictions_per_seq / task.seq_len
        total = 0.0
        for v in trainer.trainable_variables:
            size = math.prod(v.shape)
            if v.path.startswith(("mlm_", "token_embedding/")):
                total += size * share
            elif not v.path.startswith("position_embedding/"):
                total += size
        return total

    def batch_shapes(self, task, batch: int):
        """data.make_dataset's element: ids and mask [B, L], the gathered positions, their labels and weights [B, P]."""
        seq, predictions = (batch, task.seq_len), (batch, task.predictions_per_seq)
        return ({"input_ids": (seq, "int32"), "input_mask": (seq, "int32"),
                 "masked_positions": (predictions, "int32")}, (predictions, "int32"), (predictions, "float32"))


MASKED_LM = MaskedLM()
main, run, fit_target = MASKED_LM.main, MASKED_LM.run, MASKED_LM.fit_target  # the program, the library's call, `fit`


if __name__ == "__main__":
    sys.exit(main())
