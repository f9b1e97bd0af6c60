"""GPT-2 causal-LM pretraining: `python -m gpt2.train --config CONFIG.json [--replicas N]`.

lmkit's training program (lmkit/trainer.py: strategy on TensorFlow or JAX, TPU VM / pod slice / GPU / CPU
rehearsal, resume from the latest backend-neutral checkpoint, progress lines, TensorBoard, export) training
GPT-2's objective: the causal LM of model.py on the next-token batches of data.py, refusing data that
disagrees with the config or with `model_dir`'s checkpoints. Safe to kill at any moment; a rerun with the same
config resumes.

Output lines on stdout are lmkit/trainer.py's (start, step, checkpoint, done, stopped, idle), with
`accuracy` the next-token accuracy:

    step=120 loss=6.1234 accuracy=0.0412 learning_rate=0.00012 examples_per_sec=812.3
    done step=200 loss=5.9876 accuracy=0.0833 export_dir=/model/export

TensorBoard scalars in `model_dir/tensorboard`; checkpoints in `model_dir/checkpoints`; export in `export_dir`
(default `model_dir/export`): model.keras, vocab.json, merges.txt, tokenizer.json, manifest.json, config.json,
metrics.json. Exit status: 0 done, 2 bad config or data (one `error: ...` line on stderr), 1 anything else.
"""

from __future__ import annotations

import sys

from .config import Gpt2Config
from .shared import lmkit

_trainer = lmkit("trainer")
SHARD = _trainer.SHARD


class CausalLM(_trainer.Objective):
    """GPT-2's part of the program: its config, model, next-token batches and tokenizer files."""

    package = __package__  # "gpt2" on a worker
    no_weight_decay = (*_trainer.Objective.no_weight_decay, "positions")
    # runtime.sharding fsdp: lmkit's embeddings and attention, and GPT-2's MLP, split on the hidden dimension.
    fsdp_layout = {**_trainer.Objective.fsdp_layout, r"layer\d+_mlp_in/kernel": (SHARD, None),
                   r"layer\d+_mlp_out/kernel": (None, SHARD)}

    def trainer(self, model):
        """The model with its final hidden states beside the logits, whose loss differentiates straight into them
        and the tied embedding (model.CausalLMTrainer): the same loss and gradients, one pass over [tokens,
        vocab] fewer each way."""
        model_mod = self.module("model")
        return model_mod.CausalLMTrainer(model), model_mod.TokenLoss()

    def dataset(self, cfg: Gpt2Config, manifest, batch_size: int, input_context, skip: int):
        return self.module("data").make_dataset(
            cfg.runtime.data_dir, manifest, batch_size, shuffle_buffer=cfg.trainer.shuffle_buffer,
            input_context=input_context, seed=cfg.runtime.seed, skip=skip)

    def data_files(self) -> tuple[str, ...]:
        from .prepare import FILES, MANIFEST_NAME

        return (*FILES, MANIFEST_NAME)

    def batch_shapes(self, task, batch: int):
        """data.make_dataset's element: the block's ids, its next-token labels and their weights, all [B, L]."""
        block = (batch, task.seq_len)
        return {"input_ids": (block, "int32")}, (block, "int32"), (block, "float32")


CAUSAL_LM = CausalLM()
main, run, fit_target = CAUSAL_LM.main, CAUSAL_LM.run, CAUSAL_LM.fit_target  # the program, the library's call, `fit`


if __name__ == "__main__":
    sys.exit(main())
