"""GPT-2 causal-LM pretraining: `python -m gpt2.train --config CONFIG.json [--replicas N]`.

The BERT template's program shape (bert/train.py) with a causal LM: one config file (config.py), the prepared
data's manifest (refusing data that disagrees with the config or with `model_dir`'s checkpoints), the shared
strategy (TPU VM / pod slice / GPU / CPU rehearsal), resume from the latest checkpoint, train to
`trainer.max_steps`, export. Safe to kill at any moment; a rerun with the same config resumes.

Output lines on stdout (as bert.train's, with `accuracy`, the next-token accuracy, for `mlm_accuracy`):

    start strategy=cpu replicas=8 hosts=1 global_batch=64 step=0 max_steps=200 vocab_size=8000 seq_len=128
    step=120 loss=6.1234 accuracy=0.0412 learning_rate=0.00012 examples_per_sec=812.3
    checkpoint step=200 path=/model/checkpoints/ckpt-200
    done step=200 loss=5.9876 accuracy=0.0833 export_dir=/model/export
    idle worker=3 reason=pod-slice-driven-by-worker-0

TensorBoard scalars in `model_dir/tensorboard`; checkpoints in `model_dir/checkpoints`; export in `export_dir`
(default `model_dir/export`): model.keras, vocab.json, merges.txt, tokenizer.json, manifest.json, config.json,
metrics.json. Exit status: 0 done, 2 bad config or data (one `error: ...` line on stderr), 1 anything else.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

from . import config as config_mod
from .config import Gpt2Config
from .shared import bert

ConfigError, TemplateError = bert("errors").ConfigError, bert("errors").TemplateError
RUN_STATE = "run.json"
ACCURACY = "accuracy"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpt2.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="JSON config file (see gpt2/config.py)")
    parser.add_argument("--replicas", type=int, default=None,
                        help="rehearse an N-core TPU on the CPU with N logical devices")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        cfg = config_mod.load(args.config)
        if args.replicas is not None:
            cfg = config_mod.with_overrides(cfg, runtime={"replicas": args.replicas})
        run(cfg)
    except TemplateError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


def run(cfg: Gpt2Config, *, log=None) -> dict:
    """Train per `cfg` to max_steps (resuming if checkpoints exist) and export; returns the final metrics.
    Blocks for the whole training; `log(line)` gets the progress lines. Returns {} at once on workers 1..N-1 of
    a multi-host slice. Raises ConfigError / DataError / AcceleratorError."""
    emit = log or (lambda line: print(line, flush=True))
    rt = cfg.runtime
    if not rt.data_dir or not rt.model_dir:
        raise ConfigError("runtime", "data_dir and model_dir are required")
    strategy_mod = bert("strategy")
    worker = strategy_mod.follower()
    if worker is not None:
        emit(f"idle worker={worker} reason=pod-slice-driven-by-worker-0")
        return {}
    resolved = strategy_mod.resolve(rt)  # first: the CPU split must precede any other TF device use

    import keras
    import tensorflow as tf

    from .data import join, make_dataset, read_manifest
    from .model import build_model

    Monitor, WarmupLinearDecay, checkpoints = bert("callbacks").Monitor, bert("model").WarmupLinearDecay, bert("checkpoints")
    manifest = read_manifest(rt.data_dir)
    cfg = _bind_model_dir(tf, cfg, manifest)
    tr = cfg.trainer
    global_batch = tr.per_replica_batch_size * resolved.replicas
    ratio = global_batch / tr.base_batch_size
    peak = tr.learning_rate * {"sqrt": math.sqrt(ratio), "linear": ratio}.get(tr.lr_scaling, 1.0)
    schedule = WarmupLinearDecay(peak, tr.warmup_steps, tr.max_steps, peak * tr.end_learning_rate_fraction)
    precision = rt.mixed_precision if rt.mixed_precision != "auto" else (
        "mixed_bfloat16" if resolved.kind == "tpu" else "float32")
    keras.config.set_dtype_policy(precision)
    keras.utils.set_random_seed(rt.seed)

    strategy = resolved.strategy
    with strategy.scope():
        model = build_model(cfg.task, vocab_size=manifest.vocab_size)
        optimizer = keras.optimizers.AdamW(
            learning_rate=schedule, weight_decay=tr.weight_decay, beta_1=tr.adam_beta_1, beta_2=tr.adam_beta_2,
            epsilon=tr.adam_epsilon, global_clipnorm=tr.clipnorm)
        optimizer.exclude_from_weight_decay(var_names=["bias", "gamma", "beta", "positions"])
        model.compile(
            optimizer=optimizer,
            # Mean over the weighted (predictable) positions: the last one of each block weighs 0.
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight"),
            weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name=ACCURACY)],
            steps_per_execution=tr.steps_per_execution, jit_compile=rt.jit_compile and resolved.kind != "tpu")
        optimizer.build(model.trainable_variables)  # slots exist before restore: restored, not deferred
        # BERT's portable .npz checkpoints: readable without TensorFlow (the Hugging Face export reads them).
        ckpt_dir = join(rt.model_dir, "checkpoints")
        checkpoints.restore(checkpoints.latest(ckpt_dir), model, optimizer)
    start = int(optimizer.iterations.numpy())
    export_dir = rt.export_dir or join(rt.model_dir, "export")
    metrics_path = join(export_dir, "metrics.json")
    if start >= tr.max_steps and tf.io.gfile.exists(metrics_path):
        with tf.io.gfile.GFile(metrics_path) as f:
            metrics = json.loads(f.read())
        _done(emit, metrics, export_dir)
        return metrics
    emit(f"start strategy={resolved.kind} replicas={resolved.replicas} hosts={resolved.hosts} "
         f"global_batch={global_batch} step={start} max_steps={tr.max_steps} "
         f"vocab_size={manifest.vocab_size} seq_len={cfg.task.seq_len}")
    monitor = Monitor(lambda step: checkpoints.save(ckpt_dir, step, model, optimizer, keep=tr.keep_checkpoints), schedule, global_batch, tr.log_every, tr.checkpoint_every,
                      tf.summary.create_file_writer(join(rt.model_dir, "tensorboard")), emit, start, accuracy=ACCURACY)
    if start < tr.max_steps:
        dataset = strategy.distribute_datasets_from_function(
            lambda ctx: make_dataset(rt.data_dir, manifest, ctx.get_per_replica_batch_size(global_batch),
                                     shuffle_buffer=tr.shuffle_buffer, input_context=ctx, seed=rt.seed or None))
        model.fit(dataset, epochs=1, steps_per_epoch=tr.max_steps - start, callbacks=[monitor], verbose=0,
                  shuffle=False)
        if monitor.saved_step != tr.max_steps:
            monitor.save(tr.max_steps)
    metrics = {"final_step": int(optimizer.iterations.numpy()), "loss": None, ACCURACY: None, **monitor.last,
               "global_batch": global_batch, "replicas": resolved.replicas, "strategy": resolved.kind}
    _export(tf, model, cfg, rt.data_dir, export_dir, metrics)
    _done(emit, metrics, export_dir)
    return metrics


def _bind_model_dir(tf, cfg: Gpt2Config, manifest) -> Gpt2Config:
    """Check the data against the config and against what model_dir was trained with (`run.json`, written on
    first use); returns `cfg` with the manifest's vocab_size. Raises DataError / ConfigError before writing."""
    from .data import join

    rt = cfg.runtime
    state_path = join(rt.model_dir, RUN_STATE)
    previous = None
    if tf.io.gfile.exists(state_path):
        with tf.io.gfile.GFile(state_path) as f:
            previous = json.loads(f.read())
    manifest.check_compatible(seq_len=cfg.task.seq_len, vocab_size=cfg.task.vocab_size,
                              vocab_sha256=previous["vocab_sha256"] if previous else None, where=rt.data_dir)
    cfg = config_mod.with_overrides(cfg, task={"vocab_size": manifest.vocab_size})
    task = dataclasses.asdict(cfg.task)
    if previous and previous["task"] != task:
        changed = sorted(k for k in task if previous["task"].get(k) != task[k])
        raise ConfigError("task", f"{changed} differ from the checkpoints in {rt.model_dir}; "
                                  "use a new model_dir or the original task settings")
    tf.io.gfile.makedirs(rt.model_dir)
    if not previous:
        with tf.io.gfile.GFile(state_path, "w") as f:
            f.write(json.dumps({"vocab_sha256": manifest.vocab_sha256, "task": task}, indent=2))
    return cfg


def _done(emit, metrics: dict, export_dir: str) -> None:
    fmt = lambda v: "nan" if v is None else f"{v:.4f}"  # noqa: E731
    emit(f"done step={metrics['final_step']} loss={fmt(metrics['loss'])} {ACCURACY}={fmt(metrics[ACCURACY])} "
         f"export_dir={export_dir}")


def _export(tf, model, cfg: Gpt2Config, data_dir: str, export_dir: str, metrics: dict) -> None:
    from .data import join
    from .prepare import FILES, MANIFEST_NAME

    tf.io.gfile.makedirs(export_dir)
    model.save(join(export_dir, "model.keras"))
    for name in (*FILES, MANIFEST_NAME):
        tf.io.gfile.copy(join(data_dir, name), join(export_dir, name), overwrite=True)
    for name, doc in (("config.json", cfg.to_dict()), ("metrics.json", metrics)):
        with tf.io.gfile.GFile(join(export_dir, name), "w") as f:
            f.write(json.dumps(doc, indent=2, sort_keys=True))


if __name__ == "__main__":
    sys.exit(main())
