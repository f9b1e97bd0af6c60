"""The BERT template on its two Keras backends, on this CPU: same data, same config, same seed.

    .venv/bin/python bench/backends.py [--steps 200] [--batch 16] [--replicas 1]

Prepares one generated corpus, then runs `python -m bert.train` once per backend (a fresh process each:
Keras fixes its backend at import), exactly as a worker would. Prints one JSON document: per backend the
steps/s of the last `log_every` window (tracing and compilation fall in the first window, which is left out)
and the loss after `--steps` steps (the mean over that last window); then the JAX/TensorFlow steps/s ratio and
the relative loss difference, which must stay within 2 % (the runs differ in dropout and masking draws,
not in the model or the data). Exit status 1 when the losses disagree by more.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
STEP = re.compile(r"^step=(\d+) loss=(\S+) mlm_accuracy=\S+ learning_rate=\S+ examples_per_sec=(\S+) time=[\d.]+$")
TOLERANCE = 0.02


def train(data_dir: str, work: Path, framework: str, *, steps: int, batch: int, replicas: int) -> dict:
    window = steps // 2
    cfg = work / f"{framework}.json"
    cfg.write_text(json.dumps({
        "preset": "bert-tiny",
        "trainer": {"max_steps": steps, "per_replica_batch_size": batch, "steps_per_execution": 10,
                    "log_every": window, "checkpoint_every": steps, "warmup_steps": steps // 10,
                    "learning_rate": 2e-3, "shuffle_buffer": 512},
        "runtime": {"data_dir": data_dir, "model_dir": str(work / f"model-{framework}"), "framework": framework,
                    "seed": 1}}))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "bert.train", "--config", str(cfg), "--replicas", str(replicas)],
                          cwd=REPO / "templates", env={**os.environ, "PYTHONPATH": str(REPO / "templates")},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{framework} run failed:\n{proc.stderr[-3000:]}")
    lines = proc.stdout.splitlines()
    windows = [m for m in map(STEP.match, lines) if m]
    last = windows[-1]
    global_batch = batch * replicas
    return {"first_line": lines[0], "loss": float(last[2]), "steps_per_sec": round(float(last[3]) / global_batch, 3),
            "wall_s": round(time.monotonic() - started, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="a multiple of 20")
    parser.add_argument("--batch", type=int, default=16, help="per-replica batch, a multiple of 8")
    parser.add_argument("--replicas", type=int, default=1, help="CPU devices per backend")
    args = parser.parse_args()
    from test_data_prepare import write_corpus

    from tpuctl.templates.bert import prepare as prep

    with tempfile.TemporaryDirectory(prefix="backends-") as tmp:
        work = Path(tmp)
        corpus = write_corpus(work / "corpus.txt", documents=3000, seed=11)
        data = work / "prepared"
        prep.prepare([str(corpus)], data, prep.PrepareOptions(vocab_size=2000, strip_accents=False))
        runs = {fw: train(str(data), work, fw, steps=args.steps, batch=args.batch, replicas=args.replicas)
                for fw in ("tensorflow", "jax")}
    tf_run, jax_run = runs["tensorflow"], runs["jax"]
    loss_diff = abs(jax_run["loss"] - tf_run["loss"]) / tf_run["loss"]
    doc = {"steps": args.steps, "per_replica_batch": args.batch, "replicas": args.replicas, **{
        f"{fw}_{k}": v for fw, r in runs.items() for k, v in r.items() if k != "first_line"},
        "jax_over_tf_steps_per_sec": round(jax_run["steps_per_sec"] / tf_run["steps_per_sec"], 3),
        "loss_rel_diff": round(loss_diff, 4), "tolerance": TOLERANCE, "ok": loss_diff <= TOLERANCE,
        "first_lines": [r["first_line"] for r in runs.values()]}
    print(json.dumps(doc, indent=1))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
