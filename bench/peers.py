"""tpuctl against its peers on this machine, in one run: training steps/s vs keras-hub, data prep vs run_clm.

    .venv/bin/python bench/peers.py [--mb 100] [--steps 60] [--rounds 5] [--only train|prepare]

(a) Training steps/s, fed one repeated in-memory batch (the input side is not measured): tpuctl's bert-tiny
    and gpt2-tiny models vs keras-hub's `BertMaskedLM` and `GPT2CausalLM` built from `BertBackbone` /
    `GPT2Backbone` at the same sizes (layers, heads, hidden, intermediate, dropout, vocab 8000, seq 128), random
    init, the preset's batch, the same optimizer (AdamW at 1e-4), the same loss and metric (sparse cross-entropy
    and top-1 accuracy, weighted by the mask) and steps_per_execution, on the TensorFlow backend, without and
    with XLA (`jit_compile`). Each side computes them as its own training does: keras-hub with what its
    `MaskedLM` and `CausalLM` `compile()` default to (Keras' `SparseCategoricalCrossentropy(from_logits=True)`,
    `SparseCategoricalAccuracy` and `AdamW`), tpuctl with what its templates train and compile (the objective's
    `trainer`: BERT's model with lmkit/layers.py's `SparseSoftmaxCrossEntropy`, GPT-2's `CausalLMTrainer` whose
    loss differentiates straight into the tied embedding; `TopOneAccuracy` and `AdamW`: the same values,
    gradients and updates in fewer passes; tested equal to Keras' in tests/test_template_layers.py and
    tests/test_gpt2.py). Both masked LMs project to the vocabulary
    at 20 gathered positions per sequence (keras-hub's `mask_positions`). Per family and XLA setting, one fresh
    process (the peers' interpreter) builds both models and trains them in alternating
    windows (`--rounds` each, after a warm-up window each); a window's steady-state rate is timed between its
    first and last executions (`train_worker` says why), and the figure is the median window. A third model,
    tpuctl's without its transformer layers (embeddings, head, loss and optimizer only), bounds what any layer
    implementation could gain at this size.
(b) Data preparation of one generated corpus (`--mb`, English + Korean words, blank-line documents) for a
    GPT-2 causal LM with blocks of 1024 tokens and GPT-2's vocabulary size (50257):
    - tpuctl: `tpuctl data prepare CORPUS --template gpt2` end to end (byte-level BPE training included);
    - recipe: Hugging Face's `run_clm` preprocessing: `datasets.load_dataset("text")`, `map(tokenize_function,
      batched=True, num_proc=cores)` with a fast GPT-2 tokenizer (`PreTrainedTokenizerFast`) of the vocabulary
      tpuctl trained, then `map(group_texts, batched=True, num_proc=cores)` into 1024-token blocks with labels;
    - floor: `tokenizers` `encode_batch` alone over the same text, in memory, same vocabulary.
    Per method: wall time, disk bytes of what it leaves (tpuctl's output directory; the recipe's datasets
    cache) vs the raw text, and peak memory of the whole process tree (sum over the tree of PSS, which counts a
    page shared by forked workers once, and of RSS, sampled every 0.1 s from /proc).

The peers (keras-hub, datasets, transformers) live in their own virtualenv, `$TPUCTL_BENCH_PEERS` or
~/.cache/tpuctl-bench/peers, created here with pip on first use; it sees this interpreter's site-packages (a
.pth file), so TensorFlow, Keras and tokenizers are the very same builds on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import venv
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PEERS = Path(os.environ.get("TPUCTL_BENCH_PEERS", Path.home() / ".cache" / "tpuctl-bench" / "peers"))
# keras-hub without its dependencies: it requires tensorflow-text (and with it the full `tensorflow` wheel) for
# its tokenizer layers, which these from-scratch models never use; the rest of its dependencies follow.
PEER_NO_DEPS = ["keras-hub==0.32.0"]
PEER_REQUIREMENTS = ["absl-py", "regex", "rich", "kagglehub", "kagglesdk==0.1.28", "datasets==5.2.0",
                     "transformers==5.23.0"]
VOCAB, SEQ, PREDICTIONS, STEPS_PER_EXECUTION = 8000, 128, 20, 10
GPT2_VOCAB, GPT2_BLOCK = 50257, 1024


# ---------------------------------------------------------------------------------------------- peers' venv

def peers_python() -> Path:
    """The peers' interpreter, creating and filling its virtualenv if it is not there yet (idempotent)."""
    python = PEERS / "bin" / "python"
    stamp = PEERS / "tpuctl-bench-requirements.json"
    wanted = json.dumps([PEER_NO_DEPS, PEER_REQUIREMENTS])
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    venv.create(PEERS, with_pip=True, clear=True)
    site = next((PEERS / "lib").glob("python3*/site-packages"))
    ours = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (site / "_tpuctl_bench_base.pth").write_text("\n".join(ours) + "\n")
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--no-deps", *PEER_NO_DEPS], check=True)
    subprocess.run([*pip, *PEER_REQUIREMENTS], check=True)
    stamp.write_text(wanted)
    return python


# ------------------------------------------------------------------------------------------ process trees

class TreeSampler:
    """Peak PSS and RSS summed over a process and its descendants, sampled from /proc every `interval` s."""

    def __init__(self, pid: int, interval: float = 0.1):
        self.pid, self.interval = pid, interval
        self.peak_pss = self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    stat = Path(f"/proc/{entry.name}/stat").read_text()
                except OSError:
                    continue
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
        tree, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo += children.get(pid, [])
        return tree

    def _run(self) -> None:
        while not self._stop.is_set():
            pss = rss = 0
            for pid in self._tree():
                try:
                    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                        if line.startswith("Pss:"):
                            pss += int(line.split()[1]) << 10
                        elif line.startswith("Rss:"):
                            rss += int(line.split()[1]) << 10
                except OSError:
                    continue
            self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_measured(cmd: list[str], *, env: dict | None = None, timeout: float = 3600) -> dict:
    """Run `cmd` to completion: wall seconds, peak tree PSS/RSS, and its stdout's last line parsed as JSON if
    it is JSON. Raises RuntimeError with its stderr tail if it fails."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    sampler = TreeSampler(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        sampler.stop()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])}... exit {proc.returncode}: {err.strip()[-2000:]}")
    last = out.strip().splitlines()[-1] if out.strip() else ""
    try:
        reported = json.loads(last)
    except ValueError:
        reported = {}
    return {"wall_s": wall, "peak_pss": sampler.peak_pss, "peak_rss": sampler.peak_rss, "reported": reported}


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ------------------------------------------------------------------------------------------------ training

def _build(model: str, family: str, cfg, rng, *, layers: int | None = None):
    """(model, inputs, labels, weights) of `model` at `cfg`'s sizes (`layers` transformer layers if given), on
    one random batch."""
    import dataclasses

    import numpy as np

    task, batch = cfg.task, cfg.trainer.per_replica_batch_size
    task = task if layers is None else dataclasses.replace(task, num_layers=layers)
    ids = rng.integers(5, VOCAB, size=(batch, SEQ)).astype("int32")
    if family == "bert":
        positions = np.sort(rng.permuted(np.tile(np.arange(1, SEQ, dtype="int32"), (batch, 1)), axis=1)
                            [:, :PREDICTIONS], axis=1)
        labels, weights = np.take_along_axis(ids, positions, axis=1), np.ones((batch, PREDICTIONS), "float32")
    else:
        labels, weights = np.roll(ids, -1, axis=1), np.ones((batch, SEQ), "float32")
    sizes = dict(num_layers=task.num_layers, num_heads=task.num_heads, hidden_dim=task.hidden_size,
                 intermediate_dim=task.intermediate_size, dropout=task.dropout, max_sequence_length=SEQ)
    if model == "tpuctl-bert":
        from bert.model import build_model

        assert task.predictions_per_seq == PREDICTIONS
        return (build_model(task, vocab_size=VOCAB),
                {"input_ids": ids, "input_mask": np.ones_like(ids), "masked_positions": positions}, labels, weights)
    if model == "tpuctl-gpt2":
        from gpt2.model import build_model

        return build_model(task, vocab_size=VOCAB), {"input_ids": ids}, labels, weights
    import keras_hub

    if model == "keras-hub-bert":
        net = keras_hub.models.BertMaskedLM(keras_hub.models.BertBackbone(vocabulary_size=VOCAB, **sizes),
                                            preprocessor=None)
        return net, {"token_ids": ids, "padding_mask": np.ones_like(ids), "segment_ids": np.zeros_like(ids),
                     "mask_positions": positions}, labels, weights
    net = keras_hub.models.GPT2CausalLM(keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, **sizes),
                                        preprocessor=None)
    return net, {"token_ids": ids, "padding_mask": np.ones_like(ids)}, labels, weights


def train_worker(family: str, jit: bool, steps: int, rounds: int) -> dict:
    """In one fresh process: tpuctl's and keras-hub's `family` model (and tpuctl's without layers), trained in
    alternating windows of `steps` steps, `rounds` windows each after one warm-up window each; returns each
    one's steady-state steps/s.

    A window's rate is taken between the ends of its first and last executions (a Keras callback), so `fit`'s
    own set-up and tear-down (a new iterator, callbacks; ~0.5-2 s on this machine whatever the model) are not
    counted; alternating the models in one process makes them share whatever else the machine is doing."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, str(REPO / "templates"))
    import keras
    import numpy as np
    import tensorflow as tf

    if family == "bert":
        from bert import config

        cfg = config.build({"preset": "bert-tiny"})
    else:
        from gpt2 import config

        cfg = config.build({"preset": "gpt2-tiny"})
    assert cfg.task.seq_len == SEQ

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

        def on_train_begin(self, logs=None):
            self.ends = []

    from lmkit.layers import AdamW, TopOneAccuracy

    if family == "bert":
        from bert.train import MASKED_LM as objective
    else:
        from gpt2.train import CAUSAL_LM as objective

    runs = {}
    # "no-layers": tpuctl's model without its transformer layers (embeddings, head, loss, optimizer): how fast any
    # model of this size could train at best, whatever its layers did.
    for who in ("tpuctl", "keras-hub", "no-layers"):
        keras.utils.set_random_seed(0)
        net, x, labels, weights = _build(f"{'keras-hub' if who == 'keras-hub' else 'tpuctl'}-{family}", family, cfg,
                                         np.random.default_rng(0), layers=0 if who == "no-layers" else None)
        if who == "keras-hub":  # what keras-hub's compile(loss="auto", weighted_metrics="auto") picks
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight")
            metric, optimizer = keras.metrics.SparseCategoricalAccuracy(), keras.optimizers.AdamW(1e-4)
        else:  # what lmkit/trainer.py trains and compiles for the template: its trainer, loss, metric and optimizer
            net, loss = objective.trainer(net)
            metric, optimizer = TopOneAccuracy(), AdamW(1e-4)
        net.compile(optimizer=optimizer, loss=loss, weighted_metrics=[metric],
                    steps_per_execution=STEPS_PER_EXECUTION, jit_compile=jit)
        ds = tf.data.Dataset.from_tensors((x, labels, weights)).repeat().prefetch(2)
        net.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0)  # trace, compile, warm up
        runs[who] = {"net": net, "ds": ds, "rates": [], "params": net.count_params()}
    clock = Clock()
    for _ in range(rounds):
        for run in runs.values():
            run["net"].fit(run["ds"], steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[clock])
            run["rates"].append((len(clock.ends) - 1) * STEPS_PER_EXECUTION / (clock.ends[-1] - clock.ends[0]))
    return {"family": family, "jit": jit, "batch": cfg.trainer.per_replica_batch_size,
            **{who: {"params": r["params"], "rates": r["rates"], "steps_per_sec": statistics.median(r["rates"])}
               for who, r in runs.items()}}


def bench_training(steps: int, rounds: int) -> list[str]:
    peers = str(peers_python())
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}
    summary = []
    for family, preset in (("bert", "bert-tiny"), ("gpt2", "gpt2-tiny")):
        for jit in (False, True):
            r = run_measured([peers, str(Path(__file__)), "--worker", family, "--jit", str(int(jit)),
                              "--steps", str(steps), "--rounds", str(rounds)], env=env)["reported"]
            for who in ("tpuctl", "keras-hub", "no-layers"):
                mine = r[who]
                print(f"  {who:9} {preset:9} {'xla' if jit else 'no-xla':6} batch {r['batch']:3} params "
                      f"{mine['params']:>9,}: {mine['steps_per_sec']:6.2f} steps/s (windows "
                      f"{', '.join(f'{v:.2f}' for v in mine['rates'])})", flush=True)
            ours, theirs = r["tpuctl"]["steps_per_sec"], r["keras-hub"]["steps_per_sec"]
            summary.append(f"train {preset} {'xla' if jit else 'no-xla'}: tpuctl {ours:.2f} / keras-hub "
                           f"{theirs:.2f} steps/s = {ours / theirs:.2f}x (goal >= 1.3; tpuctl's model without its "
                           f"layers: {r['no-layers']['steps_per_sec'] / theirs:.2f}x)")
    return summary


# ------------------------------------------------------------------------------------------ data preparation

RECIPE = r"""
import json, os, sys, time
from itertools import chain
from datasets import load_dataset
from transformers import PreTrainedTokenizerFast

corpus, tokenizer_file, cache, block_size, num_proc = sys.argv[1:6]
block_size, num_proc = int(block_size), int(num_proc)
tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, eos_token="<|endoftext|>")
start = time.perf_counter()
# run_clm.py: load_dataset("text", keep_linebreaks=True), tokenize_function, group_texts
raw = load_dataset("text", data_files={"train": corpus}, cache_dir=cache, keep_linebreaks=True)


def tokenize_function(examples):
    return tokenizer(examples["text"])


tokenized = raw.map(tokenize_function, batched=True, num_proc=num_proc, remove_columns=["text"])


def group_texts(examples):
    concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
    total_length = len(concatenated[list(examples.keys())[0]])
    total_length = (total_length // block_size) * block_size
    result = {k: [t[i: i + block_size] for i in range(0, total_length, block_size)]
              for k, t in concatenated.items()}
    result["labels"] = result["input_ids"].copy()
    return result


lm = tokenized.map(group_texts, batched=True, num_proc=num_proc)
print(json.dumps({"seconds": time.perf_counter() - start, "blocks": len(lm["train"])}))
"""

FLOOR = r"""
import json, sys, time
from tokenizers import Tokenizer

corpus, tokenizer_file = sys.argv[1:3]
tok = Tokenizer.from_file(tokenizer_file)
batches, batch, size = [], [], 0
with open(corpus, encoding="utf-8") as f:
    for line in f:
        if line.strip():
            batch.append(line)
            size += len(line)
            if size >= 1 << 20:
                batches.append(batch)
                batch, size = [], 0
batches.append(batch)
start = time.perf_counter()
tokens = sum(len(e.ids) for b in batches for e in tok.encode_batch(b, add_special_tokens=False))
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}))
"""


def bench_prepare(mb: float) -> dict:
    sys.path.insert(0, str(BENCH))
    from data_bench import generate

    peers = str(peers_python())
    cores = len(os.sched_getaffinity(0))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           "TPUCTL_HOME": os.environ.get("TPUCTL_HOME", tempfile.mkdtemp(prefix="peers-home-"))}
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        tmp = Path(tmp)
        corpus = generate(tmp / "corpus.txt", mb, seed=5)
        raw = corpus.stat().st_size
        print(f"corpus: {raw / 1e6:.1f} MB, {cores} cores, load {load()}", flush=True)
        tpuctl = run_measured([sys.executable, "-m", "tpuctl", "data", "prepare", str(corpus), "--out",
                               str(tmp / "tpuctl"), "--template", "gpt2", "--vocab-size", str(GPT2_VOCAB),
                               "--seq-len", str(GPT2_BLOCK), "--json"], env=env)
        tpuctl["disk"] = disk_bytes(tmp / "tpuctl")
        tokenizer = str(tmp / "tpuctl" / "tokenizer.json")
        floor = run_measured([sys.executable, "-c", FLOOR, str(corpus), tokenizer], env=env)
        floor["wall_s"] = floor["reported"]["seconds"]  # encode_batch alone: reading the text is not counted
        floor["disk"] = 0
        recipe = run_measured([peers, "-c", RECIPE, str(corpus), tokenizer, str(tmp / "hf-cache"), str(GPT2_BLOCK),
                               str(cores)], env=env)
        recipe["disk"] = disk_bytes(tmp / "hf-cache")
        print(f"load after: {load()}")
    rows = (("tpuctl data prepare (tokenizer training included)", tpuctl), ("run_clm recipe (datasets map, "
            f"num_proc={cores})", recipe), ("floor: tokenizers encode_batch alone", floor))
    summary = []
    for label, r in rows:
        disk = f"{r['disk'] / raw:5.2f}x raw" if r["disk"] else "    (none)"
        summary.append(f"  {label:52} {r['wall_s']:6.1f} s  disk {disk}  peak PSS {r['peak_pss'] / 1e6:5.0f} MB "
                       f"(RSS {r['peak_rss'] / 1e6:5.0f} MB)")
    summary += [
        f"prepare / floor wall time: {tpuctl['wall_s'] / floor['wall_s']:.2f}x (goal <= 1.4)",
        f"recipe / prepare wall time: {recipe['wall_s'] / tpuctl['wall_s']:.2f}x (goal >= 1.5)",
        f"prepare / recipe disk: {tpuctl['disk'] / recipe['disk']:.3f} (goal <= 0.1)",
        f"prepare / recipe peak memory (PSS of the process tree): {tpuctl['peak_pss'] / recipe['peak_pss']:.2f} "
        f"(goal <= 0.33)"]
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=100.0, help="corpus size for the data preparation comparison")
    p.add_argument("--steps", type=int, default=60, help="training steps per timed window")
    p.add_argument("--rounds", type=int, default=5, help="timed windows per model, alternating")
    p.add_argument("--only", choices=["train", "prepare"])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--jit", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(train_worker(a.worker, bool(a.jit), a.steps, a.rounds)))
        return
    started = load()
    print(f"load at start: {started} ({len(os.sched_getaffinity(0))} cores, shared)", flush=True)
    summary = []
    if a.only in (None, "train"):
        summary += bench_training(a.steps, a.rounds)
    if a.only in (None, "prepare"):
        summary += bench_prepare(a.mb)
    # The summary last, in at most 12 lines: bench/report.py records a benchmark's last 12 lines.
    print(f"summary: load average at start {started}, at end {load()} ({len(os.sched_getaffinity(0))} cores shared "
          f"with other work); prepare: {a.mb:g} MB of text for GPT-2, vocab {GPT2_VOCAB}, blocks of {GPT2_BLOCK}")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
