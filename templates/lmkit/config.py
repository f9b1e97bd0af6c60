"""The language-model templates' config file: one JSON file, a typed schema split into task / trainer / runtime.

File shape (every section and field optional; unknown keys are refused so typos fail loudly)::

    {"preset": "bert-tiny",
     "task":    {"hidden_size": 256, ...},
     "trainer": {"max_steps": 1000, ...},
     "runtime": {"data_dir": "gs://b/data", "model_dir": "gs://b/model", "export_dir": "gs://b/export"}}

Resolution: the dataclass defaults, then the named preset (`presets` in the template's template.json, which the
jobs side reads too), then the file's sections (`build_sections`).

- `task` is *what* is learned: each template's own dataclass (bert/config.py, gpt2/config.py). `vocab_size`
  left at 0 is taken from the prepared data's manifest; set explicitly it must match the manifest.
- `trainer` is *how*: batch, steps, optimiser schedule, checkpoint and logging cadence (TrainerConfig, here).
- `runtime` is *where*: data/model/export locations, accelerator choice and numeric policy (RuntimeConfig, here).

Pure stdlib: this module is imported on TPU workers and by tpuctl on a laptop without TensorFlow.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class TrainerConfig:
    """Optimisation and bookkeeping cadence.

    The effective peak learning rate is `learning_rate` scaled from `base_batch_size` to the global batch:
    `lr_scaling="sqrt"` (default; what large-batch Adam/LAMB BERT recipes use) multiplies by
    sqrt(global/base), `"linear"` by global/base, `"none"` keeps it.
    """

    per_replica_batch_size: int = 128  # multiple of 8: TPU matrix units tile by 8
    max_steps: int = 100_000
    learning_rate: float = 1e-4
    base_batch_size: int = 256
    lr_scaling: str = "sqrt"
    warmup_steps: int = 10_000
    end_learning_rate_fraction: float = 0.0  # linear decay to this fraction of the peak at max_steps
    weight_decay: float = 0.01
    adam_beta_1: float = 0.9
    adam_beta_2: float = 0.999
    adam_epsilon: float = 1e-6
    clipnorm: float = 1.0
    steps_per_execution: int = 100
    checkpoint_every: int = 1000  # steps; a multiple of steps_per_execution
    keep_checkpoints: int = 3
    log_every: int = 100  # steps; a multiple of steps_per_execution
    shuffle_buffer: int = 10_000  # sequences
    # Activation checkpointing (JAX only), MaxText's names: lmkit/layers.py REMAT says what each saves; `tpuctl
    # fit` names the first that makes a batch fit when it does not fit without.
    remat_policy: str = "none"


@dataclass(frozen=True)
class RuntimeConfig:
    """Where the program reads and writes, and how it uses the machine.

    `tpu`: "" probes (`COLAB_TPU_ADDR` / a `grpc://` `TPU_NAME`, then the TPU VM its metadata server describes,
    then TPU device files, then GPUs, then the CPU); "local" forces this TPU VM's chips; a node name or
    `grpc://host:8470` forces that TPU.
    `replicas` > 0 forces a CPU rehearsal with that many logical devices (see strategy.py).
    `framework`: the Keras backend, "tensorflow" (TPUStrategy; Google's `tpu-vm-tf-*` runtimes, v2-v5p) or
    "jax" (`keras.distribution.DataParallel` over every device of the slice; every TPU generation). Set as
    KERAS_BACKEND before Keras is imported; the checkpoints of one resume on the other.
    """

    data_dir: str = ""
    model_dir: str = ""
    export_dir: str = ""
    tpu: str = ""
    replicas: int = 0
    mixed_precision: str = "auto"  # auto: mixed_bfloat16 on TPU, float32 elsewhere
    jit_compile: bool = False  # TPUs always compile; True on CPU/GPU rehearses XLA compatibility
    seed: int = 0
    framework: str = "tensorflow"
    # "data": every device holds all the weights (data parallelism); "zero1" (JAX): data parallelism with the
    # optimizer's slots split over the devices (lmkit strategy.split_slot: half the training state, for the update's
    # reduce-scatter and all-gather in place of the all-reduce); "fsdp" (JAX): the weights, their gradients
    # and the optimizer's slots are split over the devices (lmkit strategy.shard_weights), for a model whose
    # training state does not fit one chip's HBM. Checkpoints hold whole arrays either way: one resumes the other.
    sharding: str = "data"
    # "FIRST-LAST": a profiler trace of those training steps (the progress lines' numbering) into
    # model_dir/tensorboard/plugins/profile/, for TensorBoard's profile tab (lmkit callbacks.Profile); "": none.
    profile: str = ""

    @property
    def profile_steps(self) -> tuple[int, int] | None:
        """`profile` as (first, last) steps; None when unset or not two step numbers (validate says which)."""
        first, dash, last = self.profile.partition("-")
        if not (dash and first.strip().isdigit() and last.strip().isdigit()):
            return None
        return int(first), int(last)


@dataclass(frozen=True)
class SectionedConfig:
    """The file's shape, shared by the language-model templates: each one's own task, then this trainer and
    runtime. A template's config subclasses it with its `task` dataclass (BertConfig, gpt2's Gpt2Config)."""

    task: Any = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    preset: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_presets(template_dir: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """A template's presets from its template.json (the jobs side reads the same file), less the descriptions
    that are for people."""
    meta = json.loads((template_dir / "template.json").read_text(encoding="utf-8"))
    return {name: {k: v for k, v in preset.items() if k != "description"} for name, preset in meta["presets"].items()}


FRAMEWORKS = ("tensorflow", "jax")  # Keras backends the template runs on
SHARDINGS = ("data", "zero1", "fsdp")  # runtime.sharding, least split first
# lmkit/layers.py REMAT's, most HBM first
REMAT_POLICIES = ("none", "minimal_with_context", "minimal", "save_residuals", "full")


def build_sections(cls, data: dict[str, Any], presets: dict, check) -> SectionedConfig:
    """`cls` (a SectionedConfig) from its defaults, then `data["preset"]` out of `presets`, then the sections
    of `data`; `check(cfg)` validates it. Raises ConfigError naming the field (unknown keys included)."""
    if not isinstance(data, dict):
        raise ConfigError("", "expected a JSON object")
    sections = _sections(cls)
    for key in data:
        if key not in ("preset", *sections):
            raise ConfigError(str(key), _unknown("key", str(key), ("preset", *sections)))
    preset = data.get("preset") or ""
    if not isinstance(preset, str):
        raise ConfigError("preset", f"expected str, got {preset!r}")
    if preset and preset not in presets:
        raise ConfigError("preset", _unknown(f"preset {preset!r}", preset, presets))
    values = {}
    for name in sections:
        given = data.get(name) or {}
        if not isinstance(given, dict):
            raise ConfigError(name, "expected an object")
        values[name] = {**presets.get(preset, {}).get(name, {}), **given}
    return _typed(cls, preset, values, check)


def _sections(cls) -> dict[str, type]:
    """Section name -> its dataclass, from the config class's own defaults."""
    return {f.name: type(f.default_factory()) for f in dataclasses.fields(cls) if f.name != "preset"}


def _typed(cls, preset: str, values: dict[str, dict[str, Any]], check) -> SectionedConfig:
    cfg = cls(preset=preset, **{name: _section(c, name, values[name]) for name, c in _sections(cls).items()})
    check(cfg)
    return cfg


def read_json(path: str | Path) -> dict[str, Any]:
    """One JSON config file (local path; the jobs side copies it next to the program), as a mapping."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError("", f"cannot read {path}: {exc}") from exc


def override(cfg: SectionedConfig, sections: dict[str, dict[str, Any]], check) -> SectionedConfig:
    """A copy of `cfg` with some fields of some sections replaced; `check(copy)` validates it."""
    data = cfg.to_dict()
    for name, values in sections.items():
        data[name] = {**data[name], **values}
    return _typed(type(cfg), cfg.preset, data, check)


def _unknown(what: str, name: str, known) -> str:
    """`unknown field; did you mean max_steps?` with the closest known name, else the list of known names."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    if close:
        return f"unknown {what}; did you mean {close[0]}?"
    return f"unknown {what}; expected one of {', '.join(sorted(known))}"


def _section(cls, name: str, values: dict[str, Any]):
    if not isinstance(values, dict):
        raise ConfigError(name, "expected an object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    typed = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"{name}.{key}", _unknown("field", str(key), fields))
        want = type(fields[key].default)
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not want:
            raise ConfigError(f"{name}.{key}", f"expected {want.__name__}, got {value!r}")
        typed[key] = value
    return cls(**typed)


def trainer_runtime_checks(tr: TrainerConfig, rt: RuntimeConfig) -> list[tuple[bool, str, str]]:
    """(ok, field, rule) for the trainer and runtime sections every language-model template shares: the rules
    that keep shapes static and TPU-friendly."""
    of_spe = f"must be a positive multiple of trainer.steps_per_execution ({tr.steps_per_execution})"
    return [
        (tr.per_replica_batch_size > 0 and tr.per_replica_batch_size % 8 == 0,
         "trainer.per_replica_batch_size", "must be a positive multiple of 8"),
        (tr.max_steps > 0 and tr.max_steps % tr.steps_per_execution == 0,
         "trainer.max_steps", of_spe),
        (tr.learning_rate > 0, "trainer.learning_rate", "must be > 0"),
        (tr.base_batch_size > 0, "trainer.base_batch_size", "must be > 0"),
        (tr.lr_scaling in ("sqrt", "linear", "none"), "trainer.lr_scaling", "must be sqrt, linear or none"),
        (tr.warmup_steps >= 0, "trainer.warmup_steps", "must be >= 0"),
        (0.0 <= tr.end_learning_rate_fraction <= 1.0, "trainer.end_learning_rate_fraction", "must be in [0, 1]"),
        (tr.steps_per_execution > 0, "trainer.steps_per_execution", "must be > 0"),
        (tr.checkpoint_every > 0 and tr.checkpoint_every % tr.steps_per_execution == 0,
         "trainer.checkpoint_every", of_spe),
        (tr.log_every > 0 and tr.log_every % tr.steps_per_execution == 0,
         "trainer.log_every", of_spe),
        (tr.keep_checkpoints > 0, "trainer.keep_checkpoints", "must be > 0"),
        (tr.shuffle_buffer > 0, "trainer.shuffle_buffer", "must be > 0"),
        (tr.remat_policy in REMAT_POLICIES, "trainer.remat_policy", f"must be one of {', '.join(REMAT_POLICIES)}"),
        (tr.remat_policy == "none" or rt.framework == "jax", "trainer.remat_policy",
         "needs runtime.framework jax (or remat_policy none)"),
        (rt.replicas >= 0, "runtime.replicas", "must be >= 0"),
        (rt.framework in FRAMEWORKS, "runtime.framework", "must be tensorflow or jax"),
        (rt.sharding in SHARDINGS, "runtime.sharding", "must be data, zero1 or fsdp"),
        (rt.sharding == "data" or rt.framework == "jax", "runtime.sharding",
         f"{rt.sharding} splits the training state with Keras' distribution API, which runs on JAX: set "
         "runtime.framework to jax (job.framework: jax), or use sharding data"),
        (not rt.profile or (rt.profile_steps is not None and 1 <= rt.profile_steps[0] <= rt.profile_steps[1]
                            <= tr.max_steps), "runtime.profile",
         f"must be FIRST-LAST training steps with 1 <= FIRST <= LAST <= trainer.max_steps ({tr.max_steps}), "
         "e.g. 20-25"),
        (rt.mixed_precision in ("auto", "float32", "mixed_bfloat16"),
         "runtime.mixed_precision", "must be auto, float32 or mixed_bfloat16"),
    ]


def check(checks: list[tuple[bool, str, str]]) -> None:
    """Raise ConfigError naming the field of the first (ok, field, rule) that is not ok."""
    for ok, name, rule in checks:
        if not ok:
            raise ConfigError(name, rule)


def transformer_checks(t) -> list[tuple[bool, str, str]]:
    """(ok, field, rule) for the transformer shape fields every language-model template's task has."""
    return [
        (t.vocab_size >= 0, "task.vocab_size", "must be >= 0 (0 takes it from the data manifest)"),
        (t.num_heads > 0 and t.hidden_size > 0 and t.hidden_size % t.num_heads == 0,
         "task.hidden_size", "must be a positive multiple of task.num_heads (> 0)"),
        (t.num_layers > 0, "task.num_layers", "must be > 0"),
        (t.intermediate_size > 0, "task.intermediate_size", "must be > 0"),
        (0.0 <= t.dropout < 1.0, "task.dropout", "must be in [0, 1)"),
    ]
