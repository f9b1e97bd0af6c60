"""The language-model templates' training program, for an `Objective` (what a template trains: its config, model,
batches and tokenizer files): `python -m TEMPLATE.train --config CONFIG.json [--replicas N]` is `main` with the
template's objective (bert/train.py, gpt2/train.py).

Reads one config file (config.py), the prepared data's manifest (refusing data that disagrees with the
config or with the checkpoints already in `model_dir`), resolves the strategy (strategy.py), restores the
latest checkpoint if any, trains to `trainer.max_steps` and exports. Safe to kill at any moment: checkpoints
are written atomically every `trainer.checkpoint_every` steps, at the end, and at the next step boundary after
a notice (the file `TPUCTL_SAVE_REQUEST` names appears: save and go on; SIGTERM: save, then end by SIGTERM;
templates/README.md "Save on notice"), and a rerun with the same
config resumes from the latest one exactly: step counter, optimizer state, dropout's random state and the data
order continue where they stopped (the checkpoint holds the sequences consumed; shards.py skips them), so N steps
straight and N/2 + resume + N/2 give the same weights. A rerun after completion only re-exports.

Output lines on stdout, one event per line, `key=value` fields separated by single spaces (values have no
spaces); the first word says what the line is (ACCURACY: the objective's `accuracy`, e.g. mlm_accuracy):

    start backend=jax strategy=tpu processes=2 hosts=2 devices=16 per_replica_batch=8 global_batch=128 step=0 max_steps=200 vocab_size=8000 seq_len=128
    step=120 loss=6.1234 ACCURACY=0.0412 learning_rate=0.00012 examples_per_sec=812.3
    checkpoint step=200 path=/model/checkpoints/ckpt-200
    done step=200 loss=5.9876 ACCURACY=0.0833 export_dir=/model/export
    stopped step=130 reason=sigterm     (after the checkpoint a SIGTERM asked for; the process then ends by SIGTERM)
    idle worker=3 reason=pod-slice-driven-by-worker-0     (TF: workers 1..N-1 of a multi-host TPU slice; exit 0)

`runtime.framework` picks the Keras backend (tensorflow: one TF client drives the slice; jax: every host runs
a process, process 0 alone writes checkpoints, summaries and the export). Checkpoints are backend-neutral
(checkpoints.py): either backend resumes the other's.

`step=` lines come every `trainer.log_every` steps; loss and accuracy there are averages over the steps since
the previous line; examples_per_sec counts global-batch examples over that window's wall time (the first
window includes tracing and compilation). TensorBoard scalars (loss, ACCURACY, learning_rate,
examples_per_sec) go to `model_dir/tensorboard` at the same steps.

Artifacts in `export_dir` (default `model_dir/export`): model.keras, the objective's `data_files()` (tokenizer,
manifest), config.json (the resolved config), metrics.json (final step, loss, accuracy, throughput).
Exit status: 0 done, 2 bad config or data (one `error: ...` line on stderr), 1 anything else.

Light to import (the standard library and strategy.py): Keras may be imported only once run() has set its backend.
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
import importlib
import json
import math
import os
import sys

from . import strategy as strategy_mod
from .config import SectionedConfig
from .errors import ConfigError, TemplateError

RUN_STATE = "run.json"
SHARD = strategy_mod.SHARD  # in an Objective's fsdp_layout: the dimension split over the devices


class Objective(abc.ABC):
    """What a language-model template trains. run() does the rest (strategy on either backend, resume,
    checkpoints, progress lines, TensorBoard, export) for every template whose objective this is: BERT's masked
    LM (bert/train.py) and GPT-2's causal LM (gpt2/train.py) subclass it. The template's `data` and `model`
    modules are imported when first used: Keras may be imported only once run() has set its backend."""

    package = ""  # the template's package, as imported there (its __package__): "bert" on a worker
    accuracy = "accuracy"  # the compiled accuracy metric, as the progress lines and metrics.json name it
    no_weight_decay = ("bias", "gamma", "beta")  # variables AdamW leaves undecayed (biases, LayerNorm)
    # runtime.sharding fsdp: per weight (Keras path regex), the dimension split over the devices
    # (strategy.shard_weights); a template adds its feed-forward's to the embeddings' and attention's.
    fsdp_layout = strategy_mod.TRANSFORMER_LAYOUT

    @property
    def name(self) -> str:
        """The template's name: `python -m NAME.train`."""
        return self.package.rpartition(".")[2]

    @property
    def config(self):
        """The template's config module: load(), build() and with_overrides()."""
        return self.module("config")

    def module(self, name: str):
        return importlib.import_module(f"{self.package}.{name}")

    def read_manifest(self, data_dir: str):
        return self.module("data").read_manifest(data_dir)

    def build_model(self, task, vocab_size: int):
        return self.module("model").build_model(task, vocab_size=vocab_size)

    def trainer(self, model):
        """(what `fit` trains, its loss): by default the model itself, with the vocabulary cross-entropy of its
        logits. Either way the variables are the model's, and the model is what is checkpointed and exported."""
        from .layers import SparseSoftmaxCrossEntropy

        # Per-token loss x weight, summed, / sum of weights: the mean over the predicted tokens only.
        return model, SparseSoftmaxCrossEntropy(reduction="mean_with_sample_weight")

    @abc.abstractmethod
    def dataset(self, cfg, manifest, batch_size: int, input_context, skip: int):
        """Batches of `batch_size` for `input_context`'s pipeline, after its first `skip` sequences (a resume's)."""

    @abc.abstractmethod
    def data_files(self) -> tuple[str, ...]:
        """The prepared data's files the export carries (tokenizer, manifest)."""

    @abc.abstractmethod
    def batch_shapes(self, task, batch: int):
        """One element of `dataset` as (shape, dtype) leaves: what the step is compiled for without data."""

    def flop_params(self, trainer, task) -> float:
        """The N of the model's FLOPs, 6·N·tokens (+ attention; `tpuctl fit`): the weights a matmul applies per
        token of the sequence. Every trainable weight of `trainer`, by default, as PaLM counts a causal LM whose
        tied head multiplies every token by the token embedding (its position embedding, a lookup, counted too:
        under 1% of gpt2-small)."""
        return float(sum(math.prod(v.shape) for v in trainer.trainable_variables))

    # The template's train module exports these three: its program (`python -m NAME.train`), the library's call
    # and template.json `fit`.
    def main(self, argv: list[str] | None = None) -> int:
        return main(argv, self)

    def run(self, cfg, *, log=None) -> dict:
        """Train per `cfg` to max_steps (resuming if checkpoints exist) and export; returns the final metrics.
        Blocks; see the module's run() for what it raises and returns."""
        return run(cfg, log=log, objective=self)

    def fit_target(self, config: dict, *, devices, vocab_size: int) -> dict:
        """template.json `fit`: this objective's step, as compile_target describes it."""
        return compile_target(config, devices=devices, vocab_size=vocab_size, objective=self)


def main(argv: list[str] | None, objective: Objective) -> int:
    """`python -m NAME.train` for `objective` (its `main`): one config file, trained by run(). Returns the exit
    status. `--help` says the first line of the template's train module's docstring."""
    doc = sys.modules[type(objective).__module__].__doc__ or ""  # "__main__" under `python -m`: that module
    parser = argparse.ArgumentParser(prog=f"python -m {objective.name}.train", description=doc.partition("\n")[0])
    parser.add_argument("--config", required=True, help=f"JSON config file (see {objective.name}/config.py)")
    parser.add_argument("--replicas", type=int, default=None,
                        help="rehearse an N-core TPU on the CPU with N logical devices")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep stdout/stderr parseable; before TF is imported
    try:
        cfg = objective.config.load(args.config)
        if args.replicas is not None:
            cfg = objective.config.with_overrides(cfg, runtime={"replicas": args.replicas})
        run(cfg, objective=objective)
    except TemplateError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


def run(cfg: SectionedConfig, *, log=None, objective: Objective) -> dict:
    """Train `objective` per `cfg` to max_steps (resuming if checkpoints exist) and export. Returns the final metrics.

    Blocks for the whole training. `log(line)` receives the progress lines (default: print to stdout).
    On workers 1..N-1 of a multi-host TPU slice it returns {} at once (worker 0 drives the slice).
    Raises ConfigError / DataError for a config or data that cannot work, AcceleratorError if the
    requested accelerator is missing. Keras' dtype policy, which training sets process-wide (mixed_bfloat16 on
    TPU), is put back as it was when it returns or raises: a caller that goes on in the same process (a
    notebook, the tests) keeps its own numerics.
    """
    keras = sys.modules.get("keras")  # not imported here: _train sets KERAS_BACKEND before Keras' first import
    policy = keras.config.dtype_policy() if keras else None
    try:
        return _train(cfg, log, objective)
    finally:
        keras = sys.modules.get("keras")
        if keras is not None:
            keras.config.set_dtype_policy(policy or keras.config.floatx())  # floatx: Keras' default policy


def _train(cfg: SectionedConfig, log, objective: Objective) -> dict:
    """run's training, which leaves its dtype policy set."""
    emit = log or (lambda line: print(line, flush=True))
    rt = cfg.runtime
    if not rt.data_dir or not rt.model_dir:
        raise ConfigError("runtime", "data_dir and model_dir are required")

    jax_backend = rt.framework == "jax"
    if not jax_backend:
        worker = strategy_mod.follower()
        if worker is not None:
            emit(f"idle worker={worker} reason=pod-slice-driven-by-worker-0")
            return {}
    os.environ["KERAS_BACKEND"] = rt.framework  # Keras reads it once, at its first import
    # First: TF's CPU split / JAX's forced host devices must precede any other device use.
    resolved = strategy_mod.resolve_jax(rt) if jax_backend else strategy_mod.resolve(rt)

    import keras
    import tensorflow as tf

    if keras.backend.backend() != rt.framework:
        raise ConfigError("runtime.framework", f"{rt.framework} asked, but Keras was already imported with "
                          f"the {keras.backend.backend()} backend in this process; run the trainer in a fresh one")
    from . import checkpoints, layers
    from .callbacks import Monitor, Profile, notices
    from .shards import join

    manifest = objective.read_manifest(rt.data_dir)
    writer = resolved.process == 0  # JAX: every host trains, only process 0 writes
    cfg = _bind_model_dir(tf, cfg, manifest, objective, write=writer)

    if rt.sharding == "fsdp":
        resolved = _shard_weights(resolved, cfg.task, objective)
    tr = cfg.trainer
    global_batch = tr.per_replica_batch_size * resolved.replicas
    peak = _peak_learning_rate(tr, global_batch)
    schedule = layers.WarmupLinearDecay(peak, tr.warmup_steps, tr.max_steps, peak * tr.end_learning_rate_fraction)
    precision = rt.mixed_precision if rt.mixed_precision != "auto" else (
        "mixed_bfloat16" if resolved.kind == "tpu" else "float32")
    keras.config.set_dtype_policy(precision)
    keras.utils.set_random_seed(rt.seed)

    strategy = resolved.strategy
    if jax_backend and resolved.kind == "tpu":
        layers.use_tpu_kernels(strategy.device_mesh.backend_mesh)
    with strategy.scope():
        model = objective.build_model(cfg.task, manifest.vocab_size)
        trainer, loss = objective.trainer(model)
        if jax_backend:
            layers.use_remat(trainer, tr.remat_policy)
        # JAX always compiles the step (eager JAX is op by op); TF compiles on TPU by itself.
        optimizer = _compile(keras, trainer, loss, tr, schedule, objective,
                             jit_compile=jax_backend or (rt.jit_compile and resolved.kind != "tpu"),
                             split_slots=strategy_mod.slot_layouts(resolved) if rt.sharding == "zero1" else None)
        ckpt_dir = join(rt.model_dir, "checkpoints")
        consumed = checkpoints.restore(checkpoints.latest(ckpt_dir), model, optimizer, processes=resolved.processes)
    start = int(checkpoints.host_value(optimizer.iterations))
    # The sequences the run consumed before: the checkpoint's count (one from before the count: every step took a
    # global batch, this one).
    consumed = consumed if consumed is not None and consumed >= 0 else start * global_batch
    export_dir = rt.export_dir or join(rt.model_dir, "export")
    metrics_path = join(export_dir, "metrics.json")
    if checkpoints.process0(start >= tr.max_steps and tf.io.gfile.exists(metrics_path), resolved.processes):
        metrics = json.loads(_read(tf, metrics_path))  # finished and exported before: nothing to do
        _done(emit, metrics, export_dir, objective.accuracy)
        return metrics
    # A multislice says its slices beside its processes (`processes=4 slices=2`); one slice says nothing more.
    emit(f"start backend={resolved.backend} strategy={resolved.kind} processes={resolved.processes} "
         + (f"slices={resolved.slices} " if resolved.slices > 1 else "") +
         f"hosts={resolved.hosts} devices={resolved.replicas} per_replica_batch={tr.per_replica_batch_size} "
         f"global_batch={global_batch} step={start} max_steps={tr.max_steps} "
         f"vocab_size={manifest.vocab_size} seq_len={cfg.task.seq_len} sharding={rt.sharding}")

    def save(step: int) -> str | None:  # on every process: split weights are gathered collectively
        return checkpoints.save(ckpt_dir, step, model, optimizer, keep=tr.keep_checkpoints,
                                examples=consumed + (step - start) * global_batch, write=writer)

    monitor = Monitor(save, schedule, global_batch, tr.log_every, tr.checkpoint_every,
                      tf.summary.create_file_writer(join(rt.model_dir, "tensorboard")) if writer else None,
                      emit, start, accuracy=objective.accuracy, processes=resolved.processes)
    callbacks = [monitor]
    if rt.profile_steps and writer:  # worker 0's trace (runtime.profile)
        callbacks.append(Profile(rt.profile_steps, join(rt.model_dir, "tensorboard"), start, tr.steps_per_execution,
                                 emit))
    if start < tr.max_steps:
        def dataset_for(ctx):  # each pipeline took an equal share of every global batch
            return objective.dataset(cfg, manifest, ctx.get_per_replica_batch_size(global_batch), ctx,
                                     skip=consumed // ctx.num_input_pipelines)

        if jax_backend:  # this process's share: its hosts' files, its local devices' part of the global batch
            dataset = dataset_for(tf.distribute.InputContext(resolved.processes, resolved.process,
                                                             resolved.processes))
        else:
            dataset = strategy.distribute_datasets_from_function(dataset_for)
        with notices():
            trainer.fit(dataset, epochs=1, steps_per_epoch=tr.max_steps - start, callbacks=callbacks, verbose=0,
                        shuffle=False)
    if monitor.saved_step != tr.max_steps and start < tr.max_steps:
        monitor.save(tr.max_steps)
    # loss/accuracy are None only when a previous process trained to the end but died before exporting.
    metrics = {"final_step": int(checkpoints.host_value(optimizer.iterations)), "loss": None,
               objective.accuracy: None, **monitor.last, "global_batch": global_batch,
               "replicas": resolved.replicas, "strategy": resolved.kind, "backend": resolved.backend}
    # Keras saves via numpy, which cannot read arrays spanning other hosts: this host's copy, gathered on every
    # process (a collective where runtime.sharding splits the weights).
    weights = [checkpoints.host_value(v) for v in model.weights] if resolved.processes > 1 else None
    if writer:
        if weights is not None:
            model = _local_copy(keras, weights, cfg, manifest.vocab_size, objective)
        _export(tf, model, cfg, rt.data_dir, export_dir, metrics, objective.data_files())
    _done(emit, metrics, export_dir, objective.accuracy)
    return metrics


def compile_target(config: dict, *, devices, vocab_size: int, objective: Objective) -> dict:
    """The training step as run() builds it, for compiling ahead of time for a slice that need not be here
    (`tpuctl fit`, template.json `fit`): the same model, trainer, loss, optimizer, precision and data-parallel
    sharding (state replicated, the batch split over `devices`, a mesh axis "batch" as Keras' DataParallel; under
    runtime.sharding fsdp the weights and their optimizer slots split as shard_weights splits them, under zero1
    the slots as strategy.split_slot splits them), with abstract
    state and batch in place of arrays. Needs KERAS_BACKEND=jax; builds the model on the host. Under
    runtime.framework tensorflow, TensorFlow's step, which TensorFlow compiles for a TPU only on one: the same Keras
    model's XLA program, built here through JAX without the TPU kernels and remat that run() gives JAX alone.

    Returns {"step": the jitted Keras train step (state donated, as Keras' JAX trainer jits it) under the
    config's trainer.remat_policy, "step_for": remat policy -> that step under it, "remat_policy", "remat_policies"
    (the names a config may give, most HBM first), "state":
    its abstract state, "batch": per-device batch -> abstract batch, "per_device_batch", "max_steps", "params"
    (trainable weights), "flop_params" (Objective.flop_params), "layers", "hidden", "seq_len", "precision"}."""
    import jax
    import keras
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from . import layers

    if keras.backend.backend() != "jax":
        raise ConfigError("runtime.framework", "compile_target needs Keras' JAX backend (KERAS_BACKEND=jax)")
    cfg = objective.config.with_overrides(objective.config.build(config), task={"vocab_size": vocab_size})
    tr, rt = cfg.trainer, cfg.runtime
    precision = "mixed_bfloat16" if rt.mixed_precision == "auto" else rt.mixed_precision  # "auto" on a TPU
    keras.config.set_dtype_policy(precision)
    global_batch = tr.per_replica_batch_size * len(devices)
    peak = _peak_learning_rate(tr, global_batch)
    schedule = layers.WarmupLinearDecay(peak, tr.warmup_steps, tr.max_steps, peak * tr.end_learning_rate_fraction)
    model = objective.build_model(cfg.task, vocab_size)
    trainer, loss = objective.trainer(model)
    _compile(keras, trainer, loss, tr, schedule, objective, jit_compile=True)
    mesh = Mesh(np.array(devices), ("batch",))
    tensorflow = rt.framework == "tensorflow"
    layers.use_tpu_kernels(None if tensorflow else mesh)  # compiled for a TPU, whatever this host's own devices are
    replicated, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("batch"))

    def batch(per_device: int):
        return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf[0], leaf[1], sharding=split),
                            objective.batch_shapes(cfg.task, per_device * len(devices)),
                            is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[1], str))

    trainer._symbolic_build(data_batch=batch(tr.per_replica_batch_size))  # metrics' variables, as fit() builds them
    groups = (trainer.trainable_variables, trainer.non_trainable_variables, trainer.optimizer.variables,
              trainer.metrics_variables)
    placed = (_fsdp_shardings(trainer, objective.fsdp_layout, mesh) if rt.sharding == "fsdp" else
              _zero1_shardings(trainer, mesh) if rt.sharding == "zero1" else {})
    shardings = tuple([placed.get(id(v), replicated) for v in g] for g in groups)
    state = tuple([jax.ShapeDtypeStruct(v.value.shape, v.value.dtype, sharding=s) for v, s in zip(g, gs)]
                  for g, gs in zip(groups, shardings))

    def step_for(remat_policy: str):  # a fresh function each: jit would reuse a trace made under another policy
        layers.use_remat(trainer, remat_policy)
        return jax.jit(lambda *a: trainer.train_step(*a), donate_argnums=0, out_shardings=(None, shardings))

    return {"step": step_for(tr.remat_policy), "step_for": step_for, "remat_policy": tr.remat_policy,
            "remat_policies": [tr.remat_policy] if tensorflow else list(layers.REMAT),
            "state": state, "batch": batch, "per_device_batch": tr.per_replica_batch_size,
            "max_steps": tr.max_steps,
            "params": int(sum(np.prod(v.value.shape) for v in trainer.trainable_variables)),
            "flop_params": objective.flop_params(trainer, cfg.task),
            "layers": cfg.task.num_layers, "hidden": cfg.task.hidden_size, "seq_len": cfg.task.seq_len,
            "precision": precision}


def _fsdp_shardings(trainer, layout: dict, mesh) -> dict:
    """id(variable) -> NamedSharding on `mesh` of each weight `layout` splits, as strategy.shard_weights places
    it on a run's devices, and of its optimizer slots, which take their weight's (Keras names a slot
    `OPTIMIZER/WEIGHT_PATH_SLOT`, with the path's "/" as "_")."""
    import re

    from jax.sharding import NamedSharding, PartitionSpec

    placed, by_slot_name = {}, {}
    for v in trainer.trainable_variables:
        dims = next((d for pattern, d in layout.items() if re.fullmatch(pattern, v.path)), None)
        if dims is not None:
            placed[id(v)] = by_slot_name[v.path.replace("/", "_")] = NamedSharding(
                mesh, PartitionSpec(*("batch" if d == SHARD else d for d in dims)))
    for slot in trainer.optimizer.variables:
        weight = slot.path.split("/", 1)[-1].rsplit("_", 1)[0]
        if weight in by_slot_name:
            placed[id(slot)] = by_slot_name[weight]
    return placed


def _zero1_shardings(trainer, mesh) -> dict:
    """id(slot) -> NamedSharding on `mesh` of each optimizer slot strategy.split_slot splits (runtime.sharding
    zero1), as the run's AdamW places it."""
    from jax.sharding import NamedSharding, PartitionSpec

    placed = {}
    for slot in trainer.optimizer.variables:
        dims = strategy_mod.split_slot(tuple(slot.shape), mesh.devices.size)
        if dims is not None:
            placed[id(slot)] = NamedSharding(mesh, PartitionSpec(*("batch" if d == SHARD else None for d in dims)))
    return placed


def _shard_weights(resolved, task, objective: Objective):
    """runtime.sharding fsdp: `resolved` with the weights split over its devices. Each split dimension (the
    hidden and feed-forward sizes) must divide evenly: JAX places no uneven split. Raises ConfigError."""
    devices = resolved.replicas
    for name in ("hidden_size", "intermediate_size"):
        size = getattr(task, name)
        if size % devices:
            raise ConfigError("runtime.sharding", f"fsdp splits task.{name} ({size}) over the {devices} devices, "
                                                  f"so it must be a multiple of {devices}; or use sharding data")
    return strategy_mod.shard_weights(resolved, objective.fsdp_layout)


def _peak_learning_rate(tr, global_batch: int) -> float:
    """`learning_rate` is tuned for `base_batch_size`; scale it to the global batch (see TrainerConfig)."""
    ratio = global_batch / tr.base_batch_size
    if tr.lr_scaling == "sqrt":
        return tr.learning_rate * math.sqrt(ratio)
    return tr.learning_rate * (ratio if tr.lr_scaling == "linear" else 1.0)


def _bind_model_dir(tf, cfg: SectionedConfig, manifest, objective: Objective, *,
                    write: bool = True) -> SectionedConfig:
    """Check the data against the config and against what model_dir was trained with; record that on first use.

    Returns `cfg` with the manifest's vocab_size. Raises DataError / ConfigError before anything is written.
    """
    from .shards import join

    rt = cfg.runtime
    state_path = join(rt.model_dir, RUN_STATE)
    previous = json.loads(_read(tf, state_path)) if tf.io.gfile.exists(state_path) else None
    manifest.check_compatible(seq_len=cfg.task.seq_len, vocab_size=cfg.task.vocab_size,
                              vocab_sha256=previous["vocab_sha256"] if previous else None, where=rt.data_dir)
    cfg = objective.config.with_overrides(cfg, task={"vocab_size": manifest.vocab_size})
    task = dataclasses.asdict(cfg.task)
    # A field newer than the model_dir's record (e.g. max_predictions_per_seq) changes no weight: not a change.
    changed = sorted(k for k in task if previous and previous["task"].get(k, task[k]) != task[k])
    if changed:
        raise ConfigError("task", f"{changed} differ from the checkpoints in {rt.model_dir}; "
                                  "use a new model_dir or the original task settings")
    if not write:
        return cfg
    tf.io.gfile.makedirs(rt.model_dir)
    if not previous:
        _write(tf, state_path, json.dumps({"vocab_sha256": manifest.vocab_sha256, "task": task}, indent=2))
    return cfg


def _compile(keras, model, loss, tr, schedule, objective: Objective, *, jit_compile: bool, split_slots=None):
    """AdamW (no decay on biases and LayerNorm), `loss` (the objective's trainer's) and accuracy weighted by the
    examples' weights (BERT: the mask; GPT-2: all but each block's last position); slots built (placed by
    `split_slots` under zero1). In scope. The accuracy is Keras' on logits, computed in fewer passes, and the
    optimizer Keras' AdamW, in one kernel per variable without XLA (layers.py)."""
    from .layers import AdamW, TopOneAccuracy

    optimizer = AdamW(
        learning_rate=schedule, weight_decay=tr.weight_decay, beta_1=tr.adam_beta_1, beta_2=tr.adam_beta_2,
        epsilon=tr.adam_epsilon, global_clipnorm=tr.clipnorm, split_slots=split_slots)
    optimizer.exclude_from_weight_decay(var_names=list(objective.no_weight_decay))
    model.compile(
        optimizer=optimizer,
        loss=loss,
        weighted_metrics=[TopOneAccuracy(name=objective.accuracy)],
        steps_per_execution=tr.steps_per_execution, jit_compile=jit_compile)
    optimizer.build(model.trainable_variables)  # slots exist before restore: restored, not deferred
    return optimizer


def _local_copy(keras, weights: list, cfg: SectionedConfig, vocab_size: int, objective: Objective):
    """The model with `weights` (this host's whole copies), outside the slice-wide distribution."""
    keras.distribution.set_distribution(None)  # training is over: variables on this host's default device
    local = objective.build_model(cfg.task, vocab_size)
    local.set_weights(weights)
    return local


def _done(emit, metrics: dict, export_dir: str, accuracy: str) -> None:
    emit(f"done step={metrics['final_step']} loss={_fmt(metrics['loss'])} "
         f"{accuracy}={_fmt(metrics[accuracy])} export_dir={export_dir}")


def _fmt(value: float | None) -> str:
    return "nan" if value is None else f"{value:.4f}"


def _read(tf, path: str) -> str:
    with tf.io.gfile.GFile(path, "r") as f:
        return f.read()


def _write(tf, path: str, text: str) -> None:
    with tf.io.gfile.GFile(path, "w") as f:
        f.write(text)


def _export(tf, model, cfg: SectionedConfig, data_dir: str, export_dir: str, metrics: dict,
            data_files: tuple[str, ...]) -> None:
    from .shards import join

    tf.io.gfile.makedirs(export_dir)
    model.save(join(export_dir, "model.keras"))
    for name in data_files:
        tf.io.gfile.copy(join(data_dir, name), join(export_dir, name), overwrite=True)
    _write(tf, join(export_dir, "config.json"), json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
    _write(tf, join(export_dir, "metrics.json"), json.dumps(metrics, indent=2, sort_keys=True))

