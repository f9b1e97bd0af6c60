"""tpuctl's templates against keras-hub's models as the TPU compiler sees them, on this CPU machine.

    .venv/bin/python bench/tpu_compile.py [--accelerators v5litepod-4,v6e-4] [--models gpt2-small,bert-128,bert-512]
                                          [--layers N] [--dropout R] [--remat P] [--sharding S] [--largest [N]]

For each model and accelerator, the training step of tpuctl's template (its `fit` target: the model, trainer,
loss, AdamW, mixed_bfloat16 and data-parallel sharding the workers run) and that of keras-hub's model of the same
sizes (`GPT2CausalLM`, `BertMaskedLM`, built from config, nothing downloaded: keras-hub's layers, attention and
its loss, Keras' `SparseCategoricalCrossentropy`, with the same optimizer, precision, batch and sharding, via the
template's `compile_target`) is compiled by libtpu for the slice's topology (templates/aot.py: the TPU is only a
compile target), tpuctl's and keras-hub's under the compiler flags the templates' workers give libtpu
(lmkit/strategy.py LIBTPU_FLAGS). Per chip: HBM the program needs (arguments + temporaries + outputs - aliases),
bytes accessed and FLOPs (the compiler's cost analysis, plus the operands and results of a Pallas kernel that
declares no cost, e.g. splash attention: templates/aot.py), and tpuctl/fitting.py's roofline step-time estimate
(the compiled FLOPs where more than the model's) and MFU (model FLOPs: the template's 6·N·tokens plus attention,
the same for both sides); beside the roofline, the ratio of the two programs' sums of the compiler's own
per-instruction cycle estimates (templates/aot.py estimated_cycles; one chip, so the clock cancels out), where
tpuctl's Pallas kernels, which carry no estimate, count nothing. `--largest [N]` also searches the largest
per-chip batch that fits (fitting's search, by compiling N more batches, 2 by default: minutes a point;
"compiled" when the batch a step above it was compiled and does not fit, "predicted" when it was not compiled,
"at least" when nothing larger was ruled out). Dropout 0 on both sides (GPT-2 practice since nanoGPT) unless
`--dropout R` (the presets' 0.1): then keras-hub drops out hidden states
and attention probabilities (its attention is the XLA path then), tpuctl hidden states only (on a TPU its
attention is the splash kernel, which has no dropout: templates/lmkit/layers.py, use_tpu_kernels). `--remat P`
compiles tpuctl's side under its remat policy P (trainer.remat_policy; keras-hub's has none), `--sharding zero1`
with its optimizer state split over the devices, `--sharding fsdp` its weights, gradients and optimizer state
(runtime.sharding; keras-hub's stay data-parallel, Keras' DataParallel: what `keras_hub` users run). `--layers N`
compiles N-layer variants: minutes fewer per compile, to iterate; the figures to quote are the full models'.

Compiles are cached in ~/.cache/tpuctl-bench/tpu_compile by side, model, topology, batch, the template's source
(tpuctl's side) and the jax/libtpu/keras versions. keras-hub lives in bench/peers.py's virtualenv (it sees this
interpreter's packages: the same jax, libtpu and Keras).

`--maxtext` (gpt2 models) adds MaxText's step of the same GPT-2 (its `gpt3` decoder block: pre-LayerNorm with
biases, tanh GELU, learned positions, tied embeddings; AdamW, gradient clipping 1.0, bfloat16 with float32
weights, splash attention, pure data parallelism, asked for no remat: `scan_layers=false remat_policy=none`; its
program still recomputes each layer in the backward pass, as under `full`: bench/RESULTS.md, tpu_compile),
compiled by MaxText's own `train_compile` in a virtualenv of its own (maxtext 0.2.5 needs Python >= 3.12 and newer
jax and libtpu than the templates pin: a `python3.12`/`python3.13` on PATH, in pyenv's versions, or
MAXTEXT_PYTHON), and beside it tpuctl's template compiled by that same jax and libtpu, so the two rows it is
compared with come from one compiler.

`--ablate NAME,...` (BERT) also compiles tpuctl's side with one part of the step taken out, to show where its bytes
go by the compiler's own count: each NAME is a patch in bench/tpu_ablations/ (its first lines say what it
removes: attention, ffn, norms, adamw, splash), applied to a copy of the templates; a row per ablation, and what
the step loses without it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
CACHE = Path.home() / ".cache" / "tpuctl-bench" / "tpu_compile"
PROTOCOL = "tpu-compile-result "

# name: (template, its config, vocabulary, per-chip batch). BERT's predictions per sequence as keras-hub's
# masked-LM preprocessor picks them at mask rate 0.15 (20 at 128; 76 at 512).
MODELS = {
    "gpt2-small": ("gpt2", {"preset": "gpt2-small", "task": {"dropout": 0.0}}, 50257, 8),
    # gpt2-tiny (2 layers, hidden 128, seq 128) at a batch where its activations show: minutes a compile, to try
    # a change (e.g. a remat policy) before the hours the full models take on this machine.
    "gpt2-tiny": ("gpt2", {"preset": "gpt2-tiny", "task": {"dropout": 0.0}}, 8000, 64),
    "bert-128": ("bert", {"preset": "bert-base", "task": {"seq_len": 128, "max_predictions_per_seq": 20,
                                                          "dropout": 0.0}}, 30522, 32),
    "bert-512": ("bert", {"preset": "bert-base", "task": {"seq_len": 512, "max_predictions_per_seq": 76,
                                                          "dropout": 0.0}}, 30522, 16),
}
SIDES = ("tpuctl", "keras-hub")
# MaxText's side and tpuctl's compiled by MaxText's jax and libtpu (`--maxtext`), in MaxText's virtualenv.
MAXTEXT_SIDES = ("maxtext", "tpuctl (maxtext's compiler)")
MAXTEXT_VERSION = "0.2.5"
MAXTEXT_VENV = CACHE.parent / "maxtext" / "venv"
MAXTEXT_STAMP = MAXTEXT_VENV / "tpuctl-bench-maxtext.json"  # what maxtext_python() installed: its versions
ABLATIONS = BENCH / "tpu_ablations"  # --ablate: NAME.patch, a diff against the repository's templates/


# ------------------------------------------------------------------------------------ the compiling process

def _keras_hub_objective(template: str):
    """The template's objective with keras-hub's model of the same sizes, its inputs and Keras' loss."""
    import keras
    import keras_hub

    base = (__import__("gpt2.train").train.CAUSAL_LM if template == "gpt2" else
            __import__("bert.train").train.MASKED_LM)

    class KerasHub(type(base)):
        def build_model(self, task, vocab_size):
            sizes = dict(vocabulary_size=vocab_size, num_layers=task.num_layers, num_heads=task.num_heads,
                         hidden_dim=task.hidden_size, intermediate_dim=task.intermediate_size,
                         dropout=task.dropout, max_sequence_length=task.seq_len)
            if template == "gpt2":
                return keras_hub.models.GPT2CausalLM(keras_hub.models.GPT2Backbone(**sizes), preprocessor=None)
            return keras_hub.models.BertMaskedLM(keras_hub.models.BertBackbone(**sizes), preprocessor=None)

        def trainer(self, model):  # what keras-hub's compile(loss="auto") picks
            return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                     reduction="mean_with_sample_weight")

        def batch_shapes(self, task, batch):
            x, labels, weights = base.batch_shapes(task, batch)
            seq = x["input_ids"]
            x = {"token_ids": seq, "padding_mask": seq}
            if template == "bert":
                x.update(segment_ids=seq, mask_positions=base.batch_shapes(task, batch)[0]["masked_positions"])
            return x, labels, weights

    return KerasHub()


def worker(side: str, model: str, topology: str, options: dict, batch: int, layers: int, templates: str,
           variant: dict | None = None, accelerator: str = "") -> dict:
    """Build `side`'s `model` and compile its step for `topology` (`accelerator`'s) at per-device `batch` (this
    process), the templates' code (tpuctl's sides; keras-hub's uses its training program) from `templates`."""
    sys.path.insert(0, str(REPO / "templates"))
    import aot

    sys.path.insert(0, templates)
    aot.compile_only()
    if side not in MAXTEXT_SIDES:
        # The templates' compiler flags, checked in the pinned libtpu; MaxText's virtualenv has a newer one, and its
        # comparison is data-parallel, whose programs the flags leave as they are.
        from lmkit.strategy import use_libtpu_flags

        use_libtpu_flags()
    if side == "maxtext":
        return maxtext_worker(model, accelerator, batch, layers)
    from jax.experimental import topologies

    template, config, vocab, _ = MODELS[model]
    config = json.loads(json.dumps(config))
    if layers:
        config["task"]["num_layers"] = layers
    variant = variant or {}
    config["task"]["dropout"] = variant.get("dropout", 0.0)
    # Both sides' JAX steps (a config's default framework is TensorFlow, whose step compile_target builds without
    # the TPU kernels: what `tpuctl fit` answers for a TensorFlow run).
    config["runtime"] = {"framework": "jax"}
    if side == "tpuctl" and variant.get("remat"):
        config["trainer"] = {"remat_policy": variant["remat"]}
    if side == "tpuctl" and variant.get("sharding"):
        config["runtime"]["sharding"] = variant["sharding"]
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu", **options).devices
    from lmkit.trainer import compile_target

    objective = _keras_hub_objective(template) if side == "keras-hub" else (
        __import__("gpt2.train").train.CAUSAL_LM if template == "gpt2" else __import__("bert.train").train.MASKED_LM)
    target = compile_target(config, devices=devices, vocab_size=vocab, objective=objective)
    state_bytes = sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize  # a device's
                      for group in target["state"] for leaf in group)
    point = aot.compile_point(target, batch)
    return {**point, "state_bytes": int(state_bytes),
            "model": {k: target[k] for k in ("params", "layers", "hidden", "seq_len")}}


def maxtext_worker(model: str, accelerator: str, batch: int, layers: int) -> dict:
    """Compile MaxText's training step of `model`'s GPT-2 (the template config's sizes) for `accelerator` at
    per-device `batch` by MaxText's own train_compile (this process: MaxText's virtualenv), measured as the
    templates' steps are (aot.measured). Called by worker(), which has set the process up."""
    import aot

    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # MaxText's own CPU CI: no metadata server to ask
    _, config, vocab, _ = MODELS[model]
    task = __import__("gpt2.train").train.CAUSAL_LM.config.build(config).task
    from maxtext.trainers.pre_train import train_compile

    overrides = {
        # MaxText names v5e by chips ("v5e-4"), the others as Cloud does (cores for v4 and v5p)
        "compile_topology": accelerator.replace("v5litepod-", "v5e-"), "compile_topology_num_slices": 1,
        "per_device_batch_size": batch, "max_target_length": task.seq_len, "decoder_block": "gpt3",
        "base_emb_dim": task.hidden_size, "base_num_query_heads": task.num_heads, "base_num_kv_heads": task.num_heads,
        "base_mlp_dim": task.intermediate_size, "base_num_decoder_layers": layers or task.num_layers,
        "head_dim": task.hidden_size // task.num_heads, "vocab_size": vocab, "trainable_position_size": task.seq_len,
        "mlp_activations": '["gelu"]', "fused_qkv": True, "logits_via_embedding": True,
        "normalize_embedding_logits": False, "normalization_layer_epsilon": 1e-5, "dtype": "bfloat16",
        "weight_dtype": "float32", "opt_type": "adamw", "gradient_clipping_threshold": 1.0,
        "ici_data_parallelism": -1, "ici_fsdp_parallelism": 1, "dcn_data_parallelism": 1,
        "scan_layers": False, "remat_policy": "none", "dropout_rate": 0.0, "enable_dropout": False,
        "attention": "flash", "enable_checkpointing": False, "dataset_type": "synthetic"}
    compiled = {}
    own = train_compile.jit_and_compile

    def keep(*args, **kwargs):  # main() compiles through it: keep what it compiled to measure it
        compiled["step"] = own(*args, **kwargs)
        return compiled["step"]

    def compile_step():
        train_compile.jit_and_compile = keep
        train_compile.main(["", *(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                                  for k, v in overrides.items())])
        return compiled["step"]

    point = aot.measured(compile_step, batch)
    # Its state is replicated on every device (data parallelism): the arguments, less a batch's few ids.
    return {**point, "state_bytes": int(point.get("memory", {}).get("argument_size_in_bytes", 0))}


def maxtext_python() -> Path | None:
    """MaxText's interpreter, creating and filling its virtualenv if it is not there yet (idempotent): maxtext
    (whose wheel declares no dependencies) and the TPU requirements it ships, less those only a URL names. None
    without a Python >= 3.12 to create it with."""
    python = MAXTEXT_VENV / "bin" / "python"
    if python.exists() and MAXTEXT_STAMP.exists() and maxtext_versions()["maxtext"] == MAXTEXT_VERSION:
        return python
    candidates = [os.environ.get("MAXTEXT_PYTHON"), shutil.which("python3.13"), shutil.which("python3.12"),
                  *map(str, sorted(Path.home().glob(".pyenv/versions/3.1[2-9]*/bin/python")))]
    found = next((c for c in candidates if c and subprocess.run(  # a pyenv shim of a version not selected fails
        [c, "-c", "import sys; sys.exit(sys.version_info < (3, 12))"], capture_output=True).returncode == 0), None)
    if found is None:
        return None
    subprocess.run([found, "-m", "venv", "--clear", str(MAXTEXT_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"maxtext=={MAXTEXT_VERSION}"], check=True)
    shipped = next(MAXTEXT_VENV.glob("lib/python3*/site-packages/dependencies/requirements/"
                                     "generated_requirements/tpu-requirements.txt"))
    requirements = MAXTEXT_VENV / "tpu-requirements-from-the-index.txt"
    requirements.write_text("".join(line for line in shipped.read_text().splitlines(keepends=True)
                                    if "://" not in line))
    subprocess.run([*pip, "-r", str(requirements)], check=True)
    # MaxText asks for libtpu >= 0.0.46, so pip takes the newest, not the one the jax it took names in its `tpu`
    # extra (jax 0.12.0.1 names 0.0.50.*; pip took 0.0.52): the one jax was released with.
    jax_version = subprocess.run([str(python), "-c", "import jax; print(jax.__version__)"], check=True,
                                 capture_output=True, text=True).stdout.strip()
    subprocess.run([*pip, f"jax[tpu]=={jax_version}"], check=True)
    versions = subprocess.run([str(python), "-c", "import importlib.metadata as m, json; print(json.dumps("
                               "{p: m.version(p) for p in ('maxtext', 'jax', 'libtpu', 'keras')}))"],
                              check=True, capture_output=True, text=True).stdout
    MAXTEXT_STAMP.write_text(versions)
    return python


def maxtext_versions() -> dict:
    """The maxtext, jax, libtpu and keras versions in MaxText's virtualenv (once maxtext_python() made it)."""
    return json.loads(MAXTEXT_STAMP.read_text())


# --------------------------------------------------------------------------------------------- the parent

def _source_hash(templates: str, pattern: str = "*.py") -> str:
    h = hashlib.sha256()
    for f in sorted(Path(templates).rglob(pattern)):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def compiled(side: str, model: str, accelerator: str, per_device_batch: int, layers: int, templates: str,
             variant: dict) -> dict:
    """The worker's answer, from the cache or a fresh process (keras-hub's in the peers' virtualenv)."""
    from tpuctl import catalog
    from tpuctl.fitting import _version, compiler_versions, topology_of

    topology, options = topology_of(catalog.load().accelerator(accelerator))
    python = sys.executable
    versions = [compiler_versions(), _version("keras")]
    if side in MAXTEXT_SIDES:
        python = str(maxtext_python())
        versions = [maxtext_versions()]
    key = json.dumps([side, MODELS[model], topology, options, per_device_batch, layers, *versions,
                      _source_hash(templates) if side.startswith("tpuctl") else None,
                      _source_hash(str(REPO / "templates"), "aot.py")]  # how it measures
                     + ([variant] if variant else [])  # a key without it: the defaults' figures cached before
                     # keras-hub's step is built by the templates' trainer, with lmkit's metrics
                     + ([_source_hash(templates, "lmkit/*.py")] if side == "keras-hub" else []))
    path = CACHE / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    if path.exists():
        return json.loads(path.read_text())
    if side == "keras-hub":
        sys.path.insert(0, str(BENCH))
        from peers import peers_python

        python = str(peers_python())
    print(f"  compiling {side} {model} for {topology} at per-device batch {per_device_batch}...", flush=True)
    proc = subprocess.run([python, __file__, "--worker", json.dumps([side, model, topology, options,
                                                                      per_device_batch, layers, templates,
                                                                      variant, accelerator])],
                          capture_output=True, text=True,
                          # Importing libtpu sets TPU_LIBRARY_PATH to its own library (compiler_versions did it
                          # here), and a child would load that one: MaxText's virtualenv has another libtpu.
                          env={**{k: v for k, v in os.environ.items() if k != "TPU_LIBRARY_PATH"},
                               "TF_CPP_MIN_LOG_LEVEL": "3"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith(PROTOCOL)]
    if proc.returncode or not lines:
        raise SystemExit(f"{side} {model} {topology} failed:\n{proc.stderr[-3000:]}")
    answer = json.loads(lines[-1][len(PROTOCOL):])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(answer))
    return answer


def measure(side: str, model: str, accelerator: str, layers: int, largest: int, templates: str,
            variant: dict) -> dict:
    """One side's row: per-chip figures at the model's batch, the roofline estimate, the largest batch."""
    from tpuctl import catalog
    from tpuctl.fitting import CHIPS, _largest, _need, roofline

    accel = catalog.load().accelerator(accelerator)
    chip = CHIPS[accel.generation]
    per_device = MODELS[model][3] // chip.devices_per_chip
    point = compiled(side, model, accelerator, per_device, layers, templates, variant)
    need, compiled_ok = _need(point, point["state_bytes"])
    cap = chip.hbm_bytes / chip.devices_per_chip
    fits = compiled_ok and need <= cap
    cost = point.get("cost") or {"flops": 0.0, "bytes": need}
    # Model FLOPs from tpuctl's model for both sides (the same architecture; keras-hub's BERT also carries a
    # pooler and segment embeddings that the masked-LM loss never trains).
    tpuctl_model = compiled("tpuctl", model, accelerator, per_device, layers, templates, variant)["model"]
    per_chip = per_device * chip.devices_per_chip
    flops, step_s = roofline(chip, accel.chips, tpuctl_model, per_chip, cost["bytes"] * chip.devices_per_chip,
                             sharding=variant.get("sharding", "data") if side == "tpuctl" else "data",
                             compiled_flops_per_chip=cost["flops"] * chip.devices_per_chip)
    row = {"side": side, "batch": per_chip, "fits": fits, "hbm": need * chip.devices_per_chip,
           "bytes": cost["bytes"] * chip.devices_per_chip, "flops": cost["flops"] * chip.devices_per_chip,
           "model_flops": flops, "step_s": step_s, "mfu": flops / (step_s * chip.peak_bf16_flops),
           "cycles": cost.get("estimated_cycles"), "largest": None}
    if largest:
        def at(batch: int) -> tuple[float, bool]:
            p = compiled(side, model, accelerator, batch, layers, templates, variant)
            return _need(p, p["state_bytes"])

        best, how = _largest(at, per_device, cap, point["state_bytes"], largest, grow=True)
        row["largest"] = f"{best * chip.devices_per_chip} ({how})"
    return row


def cycles_ratio(ours: dict, theirs: dict) -> str:
    """The two rows' sums of the compiler's own cycle estimates (templates/aot.py estimated_cycles), as a ratio:
    a second view beside the roofline's, where tpuctl's Pallas kernels count nothing (they carry no estimate),
    so tpuctl's figure is a floor. Empty for a row cached before the compiles reported it."""
    if not (ours.get("cycles") and theirs.get("cycles")):
        return ""
    return f", compiler's cycles {ours['cycles'] / theirs['cycles']:.2f}x (tpuctl's Pallas kernels uncounted)"


def ablated_templates(templates: str, name: str) -> str:
    """A copy of `templates` with bench/tpu_ablations/NAME.patch applied (fresh each call, under the cache's
    parent): the templates directory to compile. Exits naming the patch where it no longer applies."""
    patch = ABLATIONS / f"{name}.patch"
    if not patch.is_file():
        raise SystemExit(f"--ablate {name}: no {patch}; there are: "
                         f"{', '.join(sorted(p.stem for p in ABLATIONS.glob('*.patch')))}")
    root = CACHE.parent / "ablated" / name
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(templates, root / "templates", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(["git", "apply", str(patch)], cwd=root, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"--ablate {name}: {patch} does not apply to {templates} (the templates changed since "
                         f"it was written: update it):\n{proc.stderr}")
    return str(root / "templates")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerators", default="v5litepod-4",
                        help="comma-separated types, e.g. v5litepod-4,v5p-8,v6e-4,tpu7x-8,v4-8")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--layers", type=int, default=0, help="compile N-layer variants (to iterate); 0: all")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="task.dropout on both sides (the presets' is 0.1); default 0")
    parser.add_argument("--remat", default="", help="tpuctl's trainer.remat_policy (e.g. minimal); default none")
    parser.add_argument("--sharding", default="", help="tpuctl's runtime.sharding (zero1, fsdp); default data")
    parser.add_argument("--largest", type=int, nargs="?", const=2, default=0, metavar="N",
                        help="also search the largest per-chip batch that fits, in N compiles more (default 2)")
    parser.add_argument("--templates", default=str(REPO / "templates"),
                        help="tpuctl's templates from this directory (e.g. an earlier commit's, for a before/after)")
    parser.add_argument("--maxtext", action="store_true",
                        help="also MaxText's step of the gpt2 models, and tpuctl's by MaxText's compiler")
    parser.add_argument("--ablate", default="", metavar="NAME,...",
                        help="BERT: also tpuctl's step without each named part (bench/tpu_ablations/NAME.patch)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(PROTOCOL + json.dumps(worker(*json.loads(args.worker))), flush=True)
        return 0
    print(f"command: bench/tpu_compile.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print("| model | accelerator | side | batch/chip | HBM/chip GB | bytes/step GB | compiled TFLOP | model TFLOP "
          "| est. step ms | est. MFU | largest batch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    variant = {k: v for k, v in (("dropout", args.dropout), ("remat", args.remat), ("sharding", args.sharding))
               if v}
    if args.maxtext and variant:
        parser.error("--maxtext compares the models as MaxText's configuration above has them: no --dropout, "
                     "--remat or --sharding with it")
    if args.maxtext and maxtext_python() is None:
        parser.error("--maxtext needs a Python >= 3.12 for MaxText's virtualenv: none on PATH nor in pyenv's "
                     "versions; name one with MAXTEXT_PYTHON")
    ablations = [name for name in args.ablate.split(",") if name]
    if ablations and any(MODELS[model][0] != "bert" for model in args.models.split(",")):
        parser.error("--ablate: the patches in bench/tpu_ablations change BERT's template; --models bert-128,bert-512")
    for model in args.models.split(","):
        for accelerator in args.accelerators.split(","):
            sides = SIDES + (MAXTEXT_SIDES if args.maxtext and MODELS[model][0] == "gpt2" else ())
            rows = {side: measure(side, model, accelerator, args.layers, args.largest, args.templates,
                                  variant)
                    for side in sides}
            for name in ablations:
                rows[f"tpuctl without {name}"] = {**measure("tpuctl", model, accelerator, args.layers, 0,
                                                            ablated_templates(args.templates, name), variant),
                                                  "side": f"tpuctl without {name}"}
            for r in rows.values():
                label = ", ".join([f"{args.layers} layers"] * bool(args.layers)
                                  + [f"{k} {v}" for k, v in variant.items()])
                print(f"| {model}{f' ({label})' if label else ''} | {accelerator} | {r['side']} "
                      f"| {r['batch']} | {r['hbm'] / 1e9:.2f}{'' if r['fits'] else ' (no fit)'} "
                      f"| {r['bytes'] / 1e9:.1f} | {r['flops'] / 1e12:.2f} | {r['model_flops'] / 1e12:.2f} "
                      f"| {r['step_s'] * 1e3:.1f} | {r['mfu']:.0%} | {r['largest'] or '-'} |", flush=True)
            ours, theirs = rows["tpuctl"], rows["keras-hub"]
            ratios.append(f"{model} {accelerator}: HBM {ours['hbm'] / theirs['hbm']:.2f}x (goal <= 0.6), est. step "
                          f"{ours['step_s'] / theirs['step_s']:.2f}x (goal <= 0.75), bytes "
                          f"{ours['bytes'] / theirs['bytes']:.2f}x, compiled FLOPs "
                          f"{ours['flops'] / theirs['flops']:.2f}x" + cycles_ratio(ours, theirs))
            for name in ablations:
                cut = rows[f"tpuctl without {name}"]
                ratios.append(f"{model} {accelerator} without {name}: bytes {cut['bytes'] / 1e9:.2f} GB, "
                              f"{cut['bytes'] / ours['bytes'] - 1:+.0%} against tpuctl's {ours['bytes'] / 1e9:.2f}; "
                              f"HBM {cut['hbm'] / 1e9:.2f} GB; compiled FLOPs {cut['flops'] / ours['flops']:.2f}x")
            if "maxtext" in rows:
                ours, theirs = rows[MAXTEXT_SIDES[1]], rows["maxtext"]
                ratios.append(f"{model} {accelerator}, against MaxText (one compiler: {maxtext_versions()}): est. step "
                              f"{ours['step_s'] / theirs['step_s']:.2f}x (goal within 10%), HBM "
                              f"{ours['hbm'] / theirs['hbm']:.2f}x, bytes {ours['bytes'] / theirs['bytes']:.2f}x, "
                              f"compiled FLOPs {ours['flops'] / theirs['flops']:.2f}x")
    print("\ntpuctl / keras-hub (and MaxText):")
    print("\n".join(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
