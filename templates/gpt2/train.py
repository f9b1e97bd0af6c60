"""GPT-2 causal-LM pretraining: `python -m gpt2.train --config CONFIG.json [--replicas N]`.

lmkit's training program (lmkit/trainer.py: strategy on TensorFlow or JAX, TPU VM / pod slice / GPU / CPU
rehearsal, resume from the latest backend-neutral checkpoint, progress lines, TensorBoard, export) training
GPT-2's objective: the causal LM of model.py on the next-token batches of data.py, refusing data that
disagrees with the config or with `model_dir`'s checkpoints. Safe to kill at any moment; a rerun with the same
config resumes.

Output lines on stdout (lmkit/trainer.py says what each means), with `accuracy` the next-token accuracy:

    start backend=jax strategy=cpu processes=1 hosts=1 devices=8 per_replica_batch=8 global_batch=64 step=0 max_steps=200 vocab_size=8000 seq_len=128
    step=120 loss=6.1234 accuracy=0.0412 learning_rate=0.00012 examples_per_sec=812.3
    checkpoint step=200 path=/model/checkpoints/ckpt-200.npz
    done step=200 loss=5.9876 accuracy=0.0833 export_dir=/model/export
    idle worker=3 reason=pod-slice-driven-by-worker-0

TensorBoard scalars in `model_dir/tensorboard`; checkpoints in `model_dir/checkpoints`; export in `export_dir`
(default `model_dir/export`): model.keras, vocab.json, merges.txt, tokenizer.json, manifest.json, config.json,
metrics.json. Exit status: 0 done, 2 bad config or data (one `error: ...` line on stderr), 1 anything else.
"""

from __future__ import annotations

import sys

from . import config as config_mod
from .config import Gpt2Config
from .shared import lmkit

_trainer = lmkit("trainer")
SHARD = _trainer.SHARD


class CausalLM(_trainer.Objective):
    """GPT-2's part of the program: its config, model, next-token batches and tokenizer files."""

    package = __package__  # "gpt2" on a worker
    name = "gpt2"
    accuracy = "accuracy"
    no_weight_decay = (*_trainer.Objective.no_weight_decay, "positions")
    config = config_mod
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


def main(argv: list[str] | None = None) -> int:
    return _trainer.main(argv, CAUSAL_LM, description=__doc__.splitlines()[0])


def run(cfg: Gpt2Config, *, log=None) -> dict:
    """Train per `cfg` to max_steps (resuming if checkpoints exist) and export; returns the final metrics.
    Blocks; see lmkit/trainer.py run for what it raises and returns."""
    return _trainer.run(cfg, log=log, objective=CAUSAL_LM)


def fit_target(config: dict, *, devices, vocab_size: int) -> dict:
    """template.json `fit`: the causal LM's step, as lmkit/trainer.py compile_target describes it."""
    return _trainer.compile_target(config, devices=devices, vocab_size=vocab_size, objective=CAUSAL_LM)


if __name__ == "__main__":
    sys.exit(main())
