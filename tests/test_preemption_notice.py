"""A Spot TPU's preemption notice, as a guest sees it on the local cloud, and the worker agent acting on it (a whole
run resuming from the notice's save: test_run.py's preemption test).

Google: the guest's metadata server says `instance/preempted` TRUE (a `wait_for_change` request returns then),
its OS shuts down (SIGTERM to every process) and the power goes off 30 s later (localcloud/README.md,
"Preemption notice").
"""

from __future__ import annotations

import time

from google.cloud import tpu_v2

from test_jobs_harness import storage  # noqa: F401 - the emulated bucket fixture
from conftest import process_alive
from test_localcloud_tpu import _create

from localcloud.workers import TERM_GRACE_S

# A guest program: reads instance/preempted, then waits for it to change; notes SIGTERM and keeps running.
GUEST = r'''#!/bin/bash
python - <<'EOF' &
import os, signal, time, urllib.request
log = open("LOG", "a", buffering=1)
signal.signal(signal.SIGTERM, lambda *_: log.write(f"sigterm {time.time()}\n"))
base = "http://" + os.environ["GCE_METADATA_HOST"] + "/computeMetadata/v1/instance/preempted"
def get(query=""):
    request = urllib.request.Request(base + query, headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(request) as r:
        return r.read().decode(), r.headers["ETag"]
value, etag = get()
log.write(f"ready {os.getpid()} {value}\n")
value, _ = get(f"?wait_for_change=true&last_etag={etag}")
log.write(f"changed {value} {time.time()}\n")
while True:
    time.sleep(0.05)
EOF
'''


def _line(path, word: str, deadline: float) -> list[str]:
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines() if path.exists() else []:
            if line.startswith(word + " "):
                return line.split()
        time.sleep(0.05)
    raise AssertionError(f"no {word!r} line in {path}: {path.read_text() if path.exists() else ''}")


def test_a_preempted_guest_reads_the_notice_gets_sigterm_and_runs_until_the_power_off(clients, cloud, tmp_path):
    log = tmp_path / "notice.log"
    node = _create(clients, "notice", metadata={"startup-script": GUEST.replace("LOG", str(log))},
                   scheduling_config=tpu_v2.SchedulingConfig(spot=True))
    _, pid, value = _line(log, "ready", time.monotonic() + 20)
    assert value == "FALSE"
    noticed = time.time()
    cloud.preempt(node.name)
    assert clients.tpu.get_node(name=node.name).state == tpu_v2.Node.State.PREEMPTED
    changed = _line(log, "changed", time.monotonic() + 5)
    term = _line(log, "sigterm", time.monotonic() + 5)
    assert changed[1] == "TRUE" and float(changed[2]) - noticed < 1.0 and float(term[1]) - noticed < 1.0
    # The notice period: still running a while after SIGTERM, killed at the power off.
    time.sleep(TERM_GRACE_S / 2)
    assert process_alive(int(pid))
    deadline = time.monotonic() + 2 * TERM_GRACE_S + 5
    while process_alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(int(pid))


def test_the_agent_turns_the_metadata_notice_into_a_save_and_loses_no_step_to_the_shutdown(tmp_path, storage):
    """The worker agent (bundled, run as on a worker) follows instance/preempted: when it turns TRUE the program
    checkpoints at its next step (checkpoint_every is far beyond the run); the shutdown's SIGTERM then gets a
    checkpoint of the very last step, which the agent syncs to the bucket before it ends."""
    import os
    import signal
    import subprocess
    import tarfile

    from test_jobs import PYTHON, _blob_text, _job, _ship
    from tpuctl.jobs import bundle as bundles

    from localcloud.metadata import MetadataServer, guest_tree

    notice = {"preempted": False}
    server = MetadataServer()
    host = server.attach("node", 1, lambda index: guest_tree(
        project="test-project", number="123", zone="us-central1-a", name="t1v-n-0-w-0", instance_id="1",
        attributes={}, service_account=("sa@test-project.iam.gserviceaccount.com", ["cloud-platform"]),
        preempted=notice["preempted"]))[0]
    run = "notice"
    b = _ship(tmp_path, storage, _job(run, storage, workers=1, trainer={
        "max_steps": 100000, "checkpoint_every": 100000, "step_seconds": 0.05}))
    home = tmp_path / "w0"
    with tarfile.open(b.path) as tar:
        tar.extractall(home / "bundle", filter="data")
    log = home / "job.log"
    proc = subprocess.Popen([PYTHON, "-m", bundles.AGENT_PACKAGE, "run", "--bundle",
                             str(home / "bundle"), "--worker", "0"], start_new_session=True,
                            env={**os.environ, "STORAGE_EMULATOR_HOST": storage.host, "GCE_METADATA_HOST": host,
                                 "GCE_METADATA_IP": host, "PYTHONPATH": str(home / "bundle")},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        reached = int(_line(log, "step=5", deadline)[0].split("=")[1])
        notice["preempted"] = True
        saved = int(_line(log, "checkpoint", deadline)[1].split("=")[1])
        assert saved >= reached
        assert "tpuctl agent: notice: instance/preempted=TRUE" in log.read_text()
        _line(log, f"step={saved + 3}", deadline)
        os.killpg(proc.pid, signal.SIGTERM)  # the guest's shutdown: every process
        assert proc.wait(timeout=30) == 143
    finally:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        server.close()
    lines = log.read_text().splitlines()
    trained = max(int(line.split()[0].split("=")[1]) for line in lines if line.startswith("step="))
    last = [line for line in lines if line.startswith("checkpoint step=")][-1]
    assert last.startswith(f"checkpoint step={trained} ")  # steps lost: 0
    assert _blob_text(storage, f"runs/{run}/model/checkpoint") == f"ckpt-{trained}.json"

