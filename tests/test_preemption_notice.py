"""A Spot TPU's preemption notice, as a guest sees it on the local cloud.

Google: the guest's metadata server says `instance/preempted` TRUE (a `wait_for_change` request returns then),
its OS shuts down (SIGTERM to every process) and the power goes off 30 s later (localcloud/README.md,
"Preemption notice").
"""

from __future__ import annotations

import time

from google.cloud import tpu_v2

from test_localcloud_tpu import _alive, _create

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
    assert _alive(int(pid))
    deadline = time.monotonic() + 2 * TERM_GRACE_S + 5
    while _alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(int(pid))
