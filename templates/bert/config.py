"""The BERT program's configuration: lmkit's file shape (lmkit/config.py), trainer and runtime sections; its own task.

    {"preset": "bert-tiny", "task": {...}, "trainer": {...}, "runtime": {...}}

Resolution: the dataclass defaults (BERT-base shaped task; lmkit's trainer/runtime defaults), then the named
preset (`presets` in template.json, which the jobs side reads too), then the file's sections. Unknown keys are
refused so typos fail loudly.

`task` is *what* is learned: the encoder's shape, the sequence length and the masking rate. `vocab_size` left at
0 is taken from the prepared data's manifest; set explicitly it must match the manifest.
`max_predictions_per_seq` left at 0 is seq_len x mask_rate rounded up to a multiple of 4 (20 at seq 128, 80 at
seq 512: google-research/bert's values).

Pure stdlib: this module is imported on TPU workers and by tpuctl on a laptop without TensorFlow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .shared import lmkit

_config = lmkit("config")
ConfigError = _config.ConfigError
TrainerConfig, RuntimeConfig = _config.TrainerConfig, _config.RuntimeConfig


@dataclass(frozen=True)
class TaskConfig:
    """The model and the masked-LM objective. Defaults are BERT-base."""

    seq_len: int = 128
    vocab_size: int = 0  # 0: from the data manifest
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    dropout: float = 0.1
    mask_rate: float = 0.15  # of maskable tokens; of those 80% [MASK], 10% random, 10% unchanged
    # The vocabulary projection runs only at this many (gathered) positions per sequence, the masked ones plus
    # weight-0 padding, as google-research/bert's run_pretraining.py; 0: derived (see `predictions_per_seq`).
    max_predictions_per_seq: int = 0

    @property
    def predictions_per_seq(self) -> int:
        """Masked positions per sequence (static): the set value, else seq_len x mask_rate up to a multiple of 4."""
        if self.max_predictions_per_seq:
            return self.max_predictions_per_seq
        return min(self.seq_len, 4 * math.ceil(self.seq_len * self.mask_rate / 4))


@dataclass(frozen=True)
class BertConfig(_config.SectionedConfig):
    task: TaskConfig = field(default_factory=TaskConfig)


PRESETS = _config.read_presets(Path(__file__).parent)


def build(data: dict[str, Any]) -> BertConfig:
    """Defaults, then `data["preset"]`, then the sections of `data`; validated. Raises ConfigError.

    This is the config's one schema: the worker runs it on the file it is given, and tpuctl runs it (named
    by `config.validate` in template.json) on the same config before it creates anything."""
    return _config.build_sections(BertConfig, data, PRESETS, validate)


def load(path: str | Path) -> BertConfig:
    return build(_config.read_json(path))


def with_overrides(cfg: BertConfig, **sections: dict[str, Any]) -> BertConfig:
    """A copy with some fields of some sections replaced, validated (tests and the CLI use this)."""
    return _config.override(cfg, sections, validate)


def validate(cfg: BertConfig) -> None:
    """The task's rules, then lmkit's trainer and runtime rules. Raises ConfigError naming the field."""
    t = cfg.task
    _config.check([
        (t.seq_len in (128, 256, 512), "task.seq_len", "must be 128, 256 or 512"),
        *_config.transformer_checks(t),
        (0.0 < t.mask_rate < 1.0, "task.mask_rate", "must be in (0, 1)"),
        (0 <= t.max_predictions_per_seq <= t.seq_len, "task.max_predictions_per_seq",
         f"must be in [1, task.seq_len ({t.seq_len})], or 0 to derive it from seq_len x mask_rate"),
        *_config.trainer_runtime_checks(cfg.trainer, cfg.runtime),
    ])


def parameter_count(preset: str, vocab_size: int = 30522) -> int:
    """Weights of `preset` at `vocab_size` (BERT's own 30522 by default), for listings (`tpuctl templates`)."""
    t = build({"preset": preset}).task
    h, i = t.hidden_size, t.intermediate_size
    embeddings = (vocab_size + t.seq_len) * h + 2 * h  # tied output projection; LayerNorm
    layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 4 * h  # attention, feed-forward, two LayerNorms
    head = h * h + h + 2 * h + vocab_size  # transform, LayerNorm, output bias
    return embeddings + t.num_layers * layer + head
