"""A stand-in training program for fast jobs tests: "trains" max_steps steps, checkpoints to model_dir
every checkpoint_every steps (data file first, then the `checkpoint` index naming it) and resumes from the
latest checkpoint. Same command line and config shape as the BERT template:
`python -m standin.train --config CONFIG.json [ARGS...]`.

Echoes its extra arguments and TPUCTL_TEST_* environment as JSON so tests can check they arrived verbatim,
and HOME, where a shell that wrongly ran a hostile `$(touch PWNED)` would have left its file.
`trainer.fail_at_step` + `trainer.fail_worker` make one worker exit 3 at that step.
`trainer.hold_at_step` + `trainer.release_file`: the job waits before that step until the file (a path on this
machine) exists, so a test can pace a run against the faults it injects.
Honours the template contract's save on notice (templates/README.md): the file TPUCTL_SAVE_REQUEST names, or
SIGTERM, gets a checkpoint at the next step boundary; after SIGTERM's it ends by SIGTERM.
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    known, extra = parser.parse_known_args()
    config = json.loads(Path(known.config).read_text())
    trainer = config.get("trainer", {})
    model_dir = Path(config["runtime"]["model_dir"])
    model_dir.mkdir(parents=True, exist_ok=True)
    worker = int(os.environ.get("TPUCTL_WORKER", "0"))
    print("args=" + json.dumps(extra), flush=True)
    print("env=" + json.dumps({k: v for k, v in sorted(os.environ.items()) if k.startswith("TPUCTL_TEST_")}), flush=True)
    print("home=" + os.environ.get("HOME", ""), flush=True)
    step = 0
    index = model_dir / "checkpoint"
    if index.exists():
        step = json.loads((model_dir / index.read_text().strip()).read_text())["step"]
        print(f"restored step={step}", flush=True)
    max_steps = int(trainer.get("max_steps", 20))
    every = int(trainer.get("checkpoint_every", 5))
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    request = os.environ.get("TPUCTL_SAVE_REQUEST")
    for step in range(step + 1, max_steps + 1):
        while step == trainer.get("hold_at_step") and not os.path.exists(trainer["release_file"]) and not stop:
            time.sleep(0.05)
        time.sleep(float(trainer.get("step_seconds", 0.05)))
        if step == trainer.get("fail_at_step") and worker == int(trainer.get("fail_worker", 0)):
            print(f"worker {worker}: boom at step {step}", flush=True)
            return 3
        print(f"step={step} loss={10.0 / step:.3f} examples_per_sec=100.0 time={time.time():.3f}", flush=True)
        requested = bool(request) and os.path.exists(request)
        if requested:
            os.remove(request)
        if step % every == 0 or step == max_steps or requested or stop:
            name = f"ckpt-{step}.json"
            (model_dir / name).write_text(json.dumps({"step": step}))
            tmp = model_dir / "checkpoint.tmp"
            tmp.write_text(name)
            tmp.replace(index)
            print(f"checkpoint step={step} path={model_dir / name}", flush=True)  # as the BERT template does
        if stop:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
    export = Path(config["runtime"].get("export_dir") or model_dir / "export")
    export.mkdir(parents=True, exist_ok=True)
    (export / "final.json").write_text(json.dumps({"step": max_steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
