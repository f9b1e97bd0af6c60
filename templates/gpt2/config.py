"""The GPT-2 program's configuration: lmkit's file shape (lmkit/config.py), trainer and runtime sections; its own task.

    {"preset": "gpt2-tiny", "task": {...}, "trainer": {...}, "runtime": {...}}

Resolution: dataclass defaults (GPT-2 small shaped task; lmkit's trainer/runtime defaults), then the
named preset (`presets` in template.json), then the file's sections. Unknown keys are refused.

Pure stdlib: imported on TPU workers and by tpuctl on a laptop without TensorFlow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .shared import lmkit

_config = lmkit("config")
ConfigError = _config.ConfigError
TrainerConfig, RuntimeConfig = _config.TrainerConfig, _config.RuntimeConfig


@dataclass(frozen=True)
class TaskConfig:
    """The causal LM. Defaults are GPT-2 small; `vocab_size` 0 is taken from the data manifest."""

    seq_len: int = 1024  # context; the prepared blocks have exactly this many tokens
    vocab_size: int = 0
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    dropout: float = 0.1
    layer_norm_epsilon: float = 1e-5


@dataclass(frozen=True)
class Gpt2Config(_config.SectionedConfig):
    task: TaskConfig = field(default_factory=TaskConfig)


PRESETS = _config.read_presets(Path(__file__).parent)


def build(data: dict[str, Any]) -> Gpt2Config:
    """Defaults, then `data["preset"]`, then the sections of `data`; validated. Raises ConfigError (with
    `field` and `rule`: tpuctl runs this on the same config before it creates anything)."""
    return _config.build_sections(Gpt2Config, data, PRESETS, validate)


def load(path: str | Path) -> Gpt2Config:
    return build(_config.read_json(path))


def with_overrides(cfg: Gpt2Config, **sections: dict[str, Any]) -> Gpt2Config:
    """A copy with some fields of some sections replaced, validated."""
    return _config.override(cfg, sections, validate)


def validate(cfg: Gpt2Config) -> None:
    """Static, TPU-friendly shapes: the task's rules, then lmkit's trainer and runtime rules. Raises ConfigError."""
    t = cfg.task
    _config.check([
        (t.seq_len >= 8 and t.seq_len % 8 == 0, "task.seq_len", "must be a positive multiple of 8 (1024 for GPT-2)"),
        *_config.transformer_checks(t),
        (t.layer_norm_epsilon > 0, "task.layer_norm_epsilon", "must be > 0"),
        *_config.trainer_runtime_checks(cfg.trainer, cfg.runtime),
    ])


def parameter_count(preset: str, vocab_size: int = 50257) -> int:
    """Weights of `preset` (tied embeddings, no output bias: GPT-2's own count), for `tpuctl templates`."""
    t = build({"preset": preset}).task
    h, i = t.hidden_size, t.intermediate_size
    layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * i + i) + (i * h + h)
    return (t.vocab_size or vocab_size) * h + t.seq_len * h + t.num_layers * layer + 2 * h
