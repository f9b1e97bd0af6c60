"""The GPT-2 program's configuration: the BERT template's file shape, trainer and runtime sections; its own task.

    {"preset": "gpt2-tiny", "task": {...}, "trainer": {...}, "runtime": {...}}

Resolution: dataclass defaults (GPT-2 small shaped task; trainer/runtime defaults of bert/config.py), then the
named preset (`presets` in template.json), then the file's sections. Unknown keys are refused.

Pure stdlib: imported on TPU workers and by tpuctl on a laptop without TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .shared import bert

_bert_config = bert("config")
ConfigError = bert("errors").ConfigError
TrainerConfig, RuntimeConfig = _bert_config.TrainerConfig, _bert_config.RuntimeConfig


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
class Gpt2Config:
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    preset: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    name: {k: v for k, v in preset.items() if k != "description"}
    for name, preset in json.loads((Path(__file__).parent / "template.json").read_text(encoding="utf-8"))[
        "presets"].items()
}
_SECTIONS = {"task": TaskConfig, "trainer": TrainerConfig, "runtime": RuntimeConfig}


def build(data: dict[str, Any]) -> Gpt2Config:
    """Defaults, then `data["preset"]`, then the sections of `data`; validated. Raises ConfigError (with
    `field` and `rule`: tpuctl runs this on the same config before it creates anything)."""
    if not isinstance(data, dict):
        raise ConfigError("", "expected a JSON object")
    for key in data:
        if key not in ("preset", *_SECTIONS):
            raise ConfigError(str(key), _bert_config._unknown("key", str(key), ("preset", *_SECTIONS)))
    preset = data.get("preset") or ""
    if not isinstance(preset, str):
        raise ConfigError("preset", f"expected str, got {preset!r}")
    if preset and preset not in PRESETS:
        raise ConfigError("preset", _bert_config._unknown(f"preset {preset!r}", preset, PRESETS))
    sections = {name: _bert_config._section(cls, name, {**PRESETS.get(preset, {}).get(name, {}),
                                                         **_object(name, data.get(name) or {})})
                for name, cls in _SECTIONS.items()}
    cfg = Gpt2Config(preset=preset, **sections)
    validate(cfg)
    return cfg


def _object(name: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(name, "expected an object")
    return value


def load(path: str | Path) -> Gpt2Config:
    return build(_bert_config.read_json(path))


def with_overrides(cfg: Gpt2Config, **sections: dict[str, Any]) -> Gpt2Config:
    """A copy with some fields of some sections replaced, validated."""
    data = cfg.to_dict()
    for name, values in sections.items():
        data[name] = {**data[name], **values}
    out = Gpt2Config(preset=cfg.preset, **{n: _bert_config._section(c, n, data[n]) for n, c in _SECTIONS.items()})
    validate(out)
    return out


def validate(cfg: Gpt2Config) -> None:
    """Static, TPU-friendly shapes. Trainer and runtime follow BERT's rules (checked by its validator)."""
    t = cfg.task
    checks = [
        (t.seq_len >= 8 and t.seq_len % 8 == 0, "task.seq_len", "must be a positive multiple of 8 (1024 for GPT-2)"),
        (t.vocab_size >= 0, "task.vocab_size", "must be >= 0 (0 takes it from the data manifest)"),
        (t.num_heads > 0 and t.hidden_size > 0 and t.hidden_size % t.num_heads == 0,
         "task.hidden_size", "must be a positive multiple of task.num_heads (> 0)"),
        (t.num_layers > 0, "task.num_layers", "must be > 0"),
        (t.intermediate_size > 0, "task.intermediate_size", "must be > 0"),
        (0.0 <= t.dropout < 1.0, "task.dropout", "must be in [0, 1)"),
        (t.layer_norm_epsilon > 0, "task.layer_norm_epsilon", "must be > 0"),
    ]
    for ok, name, rule in checks:
        if not ok:
            raise ConfigError(name, rule)
    _bert_config.validate(_bert_config.BertConfig(trainer=cfg.trainer, runtime=cfg.runtime))


def parameter_count(preset: str, vocab_size: int = 50257) -> int:
    """Weights of `preset` (tied embeddings, no output bias: GPT-2's own count), for `tpuctl templates`."""
    t = build({"preset": preset}).task
    h, i = t.hidden_size, t.intermediate_size
    layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * i + i) + (i * h + h)
    return (t.vocab_size or vocab_size) * h + t.seq_len * h + t.num_layers * layer + 2 * h
