"""bert-tiny on every TensorFlow runtime family the catalog offers, each on its own image's interpreter.

    .venv/bin/python bench/runtime_matrix.py [--steps 40] [--runtimes tpu-vm-tf-2.15.0-pjrt,...] [--cache DIR]

For each runtime (by default one per TensorFlow minor version among the catalog's v3-8 runtimes: 2.15, 2.16,
2.17, 2.18), a whole `tpuctl run` of the real BERT template (preset bert-tiny) on an in-process local cloud
(speed 1000) whose workers run the runtime image's software: a venv with that `tensorflow-cpu==X.Y.Z` and
the image's Keras, built once under --cache (default `$TPUCTL_RUNTIME_CACHE`, else ~/.tpuctl/localcloud/
runtimes), the bootstrap then pinning the Keras the template is tested with. The run is killed halfway
(the spot node is preempted once a checkpoint exists) and resumed from the checkpoint by tpuctl's
recovery, to `--steps`. Prints one line per runtime:

    RUNTIME tf=X keras=Y steps_per_sec=Z ok|ERROR

(TensorFlow and Keras as the worker's agent reported them; steps/s from worker 0's last progress line,
examples/s over the global batch). Exit 1 if any runtime failed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOFTWARE = re.compile(r"tpuctl agent: python=(\S+) tensorflow=(\S+) keras=(\S+)")


def default_runtimes(accelerator: str = "v3-8") -> list[str]:
    """One single-host TensorFlow runtime per TF minor version the catalog lists for the type, from 2.15 (the
    first the template's Keras 3 runs on)."""
    from tpuctl import catalog

    t = catalog.load().accelerator(accelerator)
    families: dict[tuple[int, int], str] = {}
    for r in t.runtimes:
        m = re.match(r"^tpu-vm-tf-(\d+)\.(\d+)\.\d+(?!.*-pod)", r)
        if m and (int(m.group(1)), int(m.group(2))) >= (2, 15):
            families.setdefault((int(m.group(1)), int(m.group(2))), r)
    return [families[k] for k in sorted(families)]


def one(runtime: str, *, steps: int, cache: Path, work: Path) -> dict:
    from google.auth.credentials import AnonymousCredentials

    from tpuctl import spec as spec_mod
    from tpuctl.jobs.pipeline import Pipeline, RunOptions
    from tpuctl.localcloud.cloud import LocalCloud
    from tpuctl.provision.clients import build

    name = "rt-" + re.sub(r"[^a-z0-9]+", "-", runtime.removeprefix("tpu-vm-tf-"))[:30].strip("-")
    state = work / name
    with LocalCloud(speed=1000, strict=True, state_dir=state, worker_python="runtime", runtime_cache=cache) as cloud:
        os.environ["STORAGE_EMULATOR_HOST"] = cloud.storage_host
        clients = build(project="tpuctl-matrix", credentials=AnonymousCredentials(), endpoint=cloud.endpoint,
                        storage_host=cloud.storage_host, local=True)
        every = max(steps // 4, 1)
        spec = spec_mod.from_mapping({
            "name": name, "zone": "europe-west4-a", "accelerator": "v3-8", "provisioning": "spot",
            "runtime_version": runtime,
            "job": {"template": "bert", "preset": "bert-tiny", "max_recoveries": 1,
                    "config": {"trainer": {"max_steps": steps, "checkpoint_every": every, "log_every": every,
                                           "steps_per_execution": every, "warmup_steps": every}},
                    "data": {"corpus": [str(REPO / "examples" / "data" / "corpus.txt")], "vocab_size": 2000}}})
        p = Pipeline(clients, spec, options=RunOptions(yes=True, poll_s=1.0))
        done = threading.Event()

        def kill_halfway() -> None:
            # Preempt once worker 0 reported a step past the first checkpoint: the resume must restore it.
            while not done.is_set():
                if (p.outcome.step or 0) >= steps // 2 and p.node:
                    cloud.preempt(f"projects/{p.project}/locations/{p.zone}/nodes/{p.node}")
                    return
                time.sleep(0.1)

        killer = threading.Thread(target=kill_halfway, daemon=True)
        killer.start()
        started = time.monotonic()
        try:
            o = p.run()
            error = None
        except Exception as exc:  # recorded per runtime: the matrix goes on
            o, error = p.outcome, f"{type(exc).__name__}: {exc}"
        finally:
            done.set()
        wall = time.monotonic() - started
        software = [SOFTWARE.search(f.read_text(errors="replace")) for f in sorted(state.rglob("agent.log"))]
        found = next((m for m in software if m), None)
        logs = sorted(state.rglob("w0/job.log*"))
        text = "\n".join(f.read_text(errors="replace") for f in logs)
        batch = re.findall(r"global_batch=(\d+)", text)
        rate = float(o.examples_per_sec) / int(batch[-1]) if o.examples_per_sec and batch else None
        # The resumed incarnation starts from the checkpoint: its `start ... step=S` line has S > 0.
        resumed = any(int(s) > 0 for s in re.findall(r"(?m)^start .*?\bstep=(\d+)", text))
        if error is None and o.state != "succeeded":
            tail = [line for line in (o.tail or text.splitlines()) if line.strip()][-1:]
            error = f"run {o.state}: {o.error or (tail[0] if tail else 'no output')}"
        if error is None and (o.step != steps or o.recoveries < 1 or not resumed):
            error = f"step {o.step}/{steps}, {o.recoveries} recoveries: the kill-and-resume did not happen"
        return {"runtime": runtime, "tf": found.group(2) if found else "?", "keras": found.group(3) if found else "?",
                "python": found.group(1) if found else "?", "steps_per_sec": rate, "wall_s": round(wall, 1),
                "recoveries": o.recoveries, "error": error}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--runtimes", help="comma-separated runtime versions (default: one per TF family, 2.15 on)")
    ap.add_argument("--cache", type=Path, help="where image venvs are built and kept")
    a = ap.parse_args(argv)
    runtimes = a.runtimes.split(",") if a.runtimes else default_runtimes()
    cache = a.cache or Path(os.environ.get("TPUCTL_RUNTIME_CACHE") or Path.home() / ".tpuctl/localcloud/runtimes")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="runtime-matrix-") as tmp:
        os.environ["TPUCTL_HOME"] = str(Path(tmp) / "home")
        for runtime in runtimes:
            r = one(runtime, steps=a.steps, cache=cache, work=Path(tmp))
            failed += r["error"] is not None
            rate = f"{r['steps_per_sec']:.3f}" if r["steps_per_sec"] else "-"
            print(f"{runtime} tf={r['tf']} keras={r['keras']} python={r['python']} steps_per_sec={rate} "
                  f"wall_s={r['wall_s']} recoveries={r['recoveries']} " + ("ok" if r["error"] is None
                                                                           else f"ERROR {r['error']}"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
