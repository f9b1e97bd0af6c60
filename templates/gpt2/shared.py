"""The BERT template's pieces GPT-2 shares rather than copies: the training program (bert/train.py's loop, for
which gpt2/train.py is an Objective), the config file's builder with its trainer/runtime schema, errors, the
manifest, the shard reader, the prepare pipeline (reading, sampling, streaming, shard writing, upload), the
learning-rate schedule; and through it lmkit's layers, strategy (TPU/GPU/CPU, TensorFlow or JAX, and the TPU VM
guest), checkpoints and progress callback.

Installed, they are `tpuctl.templates.bert`; in a job bundle `bert` ships beside `gpt2` (template.json `uses`),
so the same code is imported by either name.
"""

from __future__ import annotations

import importlib


def bert(module: str):
    """The BERT template's `module` (e.g. "config"), imported the way this package itself was."""
    base = "tpuctl.templates.bert" if __package__.startswith("tpuctl.") else "bert"
    return importlib.import_module(f"{base}.{module}")


def lmkit(module: str):
    """lmkit's `module` (templates/lmkit: the layers, strategy, checkpoints, ... both templates share)."""
    return bert("shared").lmkit(module)
