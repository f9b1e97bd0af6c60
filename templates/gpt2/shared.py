"""The BERT template's pieces GPT-2 shares rather than copies: trainer/runtime config schema, errors, manifest,
strategy (TPU/GPU/CPU and the TPU VM guest), the progress/checkpoint callback and the learning-rate schedule.

Installed, they are `tpuctl.templates.bert`; in a job bundle `bert` ships beside `gpt2` (template.json `uses`),
so the same code is imported by either name.
"""

from __future__ import annotations

import importlib


def bert(module: str):
    """The BERT template's `module` (e.g. "config"), imported the way this package itself was."""
    base = "tpuctl.templates.bert" if __package__.startswith("tpuctl.") else "bert"
    return importlib.import_module(f"{base}.{module}")
