"""linreg: `python -m linreg.train --config CONFIG.json`.

Fits w in y = X w + noise (a synthetic problem fixed by `trainer.seed`) by minibatch SGD. Every
`checkpoint_every` steps it writes `model_dir/checkpoints/ckpt-STEP.npz`, then the `checkpoint` pointer naming
it (so a pointer always names a complete file); a rerun resumes from the pointer's checkpoint. Paths may be
gs:// URLs: tf.io.gfile reads and writes both. Lines: `step=N loss=X`, `checkpoint step=N path=P`, `done ...`.
Exit status 2 with one `error: ...` line for a bad config.
"""

from __future__ import annotations

import argparse
import io
import json
import sys

import numpy as np

from .config import ConfigError, build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linreg.train")
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    try:
        with open(args.config, encoding="utf-8") as f:
            cfg = build(json.load(f))
    except (OSError, ValueError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    train(cfg)
    return 0


def train(cfg: dict) -> None:
    from tensorflow.io import gfile

    task, tr, rt = cfg["task"], cfg["trainer"], cfg["runtime"]
    ckpt_dir = rt["model_dir"].rstrip("/") + "/checkpoints"
    export_dir = rt["export_dir"] or rt["model_dir"].rstrip("/") + "/export"
    true_w = np.random.default_rng(tr["seed"]).normal(size=task["features"])
    w, step, loss = np.zeros(task["features"]), 0, float("nan")
    pointer = f"{ckpt_dir}/checkpoint"
    if gfile.exists(pointer):
        with gfile.GFile(pointer) as f:
            name = f.read().strip()
        with gfile.GFile(f"{ckpt_dir}/{name}", "rb") as f:
            state = np.load(io.BytesIO(f.read()))
            w, step, loss = state["w"], int(state["step"]), float(state["loss"])
    print(f"start step={step} max_steps={tr['max_steps']} features={task['features']}", flush=True)
    gfile.makedirs(ckpt_dir)
    while step < tr["max_steps"]:
        step += 1
        batch = np.random.default_rng([tr["seed"], step])  # the same batches after a resume
        x = batch.normal(size=(tr["batch_size"], task["features"]))
        y = x @ true_w + task["noise"] * batch.normal(size=tr["batch_size"])
        error = x @ w - y
        loss = float(np.mean(error ** 2))
        w = w - tr["learning_rate"] * 2 * x.T @ error / tr["batch_size"]
        print(f"step={step} loss={loss:.6f}", flush=True)
        if step % tr["checkpoint_every"] == 0:
            name = f"ckpt-{step}.npz"
            buffer = io.BytesIO()
            np.savez(buffer, w=w, step=step, loss=loss)
            with gfile.GFile(f"{ckpt_dir}/{name}", "wb") as f:
                f.write(buffer.getvalue())
            with gfile.GFile(f"{pointer}.tmp", "w") as f:
                f.write(name)
            gfile.rename(f"{pointer}.tmp", pointer, overwrite=True)
            print(f"checkpoint step={step} path={ckpt_dir}/{name}", flush=True)
    gfile.makedirs(export_dir)
    with gfile.GFile(f"{export_dir}/weights.json", "w") as f:
        f.write(json.dumps({"step": step, "loss": loss, "w": w.tolist(), "error": float(np.abs(w - true_w).max())}))
    print(f"done step={step} loss={loss:.6f} export_dir={export_dir}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
