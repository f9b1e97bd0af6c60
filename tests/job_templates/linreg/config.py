"""linreg's config file: {"preset": NAME, "task": {...}, "trainer": {...}, "runtime": {...}}.

Defaults, then the preset (template.json), then the file's sections; unknown keys and wrong types are refused
with the field named (tpuctl runs `build` on the same config before it creates anything).
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULTS = {
    "task": {"features": 8, "noise": 0.01},
    "trainer": {"max_steps": 40, "batch_size": 32, "learning_rate": 0.05, "checkpoint_every": 10, "seed": 0},
    # tpuctl fills in the run's bucket locations and the framework the TPU's runtime was chosen for.
    "runtime": {"data_dir": "", "model_dir": "", "export_dir": "", "framework": ""},
}
PRESETS = json.loads((Path(__file__).parent / "template.json").read_text())["presets"]


class ConfigError(ValueError):
    def __init__(self, field: str, rule: str):
        super().__init__(f"{field}: {rule}")
        self.field, self.rule = field, rule


def build(data: dict) -> dict:
    """The resolved config as {section: {field: value}}. Raises ConfigError naming the field."""
    if not isinstance(data, dict):
        raise ConfigError("", "expected a JSON object")
    for key in data:
        if key not in ("preset", *DEFAULTS):
            raise ConfigError(key, f"unknown key; expected preset, {', '.join(DEFAULTS)}")
    preset = data.get("preset") or ""
    if preset and preset not in PRESETS:
        raise ConfigError("preset", f"unknown preset {preset!r}; one of {', '.join(PRESETS)}")
    cfg = {name: dict(values) for name, values in DEFAULTS.items()}
    for name, values in DEFAULTS.items():
        for source in (PRESETS.get(preset, {}).get(name, {}), data.get(name) or {}):
            for key, value in source.items():
                if key not in values:
                    raise ConfigError(f"{name}.{key}", f"unknown field; expected one of {', '.join(values)}")
                want = type(values[key])
                if not (type(value) is want or (want is float and type(value) is int)):
                    raise ConfigError(f"{name}.{key}", f"expected {want.__name__}, got {value!r}")
                cfg[name][key] = value
    tr = cfg["trainer"]
    if tr["max_steps"] <= 0 or tr["checkpoint_every"] <= 0 or tr["max_steps"] % tr["checkpoint_every"]:
        raise ConfigError("trainer.checkpoint_every", "must be > 0 and divide trainer.max_steps")
    return cfg
