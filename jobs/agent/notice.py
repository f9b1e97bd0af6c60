"""Preemption and maintenance notices: the guest's metadata server, followed; a notice becomes the save request
file the program finds through `TPUCTL_SAVE_REQUEST` (templates/README.md, "Save on notice")."""

from __future__ import annotations

import os
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

# The guest's notices (metadata path -> its value while nothing is coming): a Spot preemption sets `preempted`
# TRUE (compute/docs/instances/create-use-spot, "Detect preemption"); `maintenance-event` leaves NONE before host
# maintenance (compute/docs/metadata/getting-live-migration-notice; TPU VMs are Compute Engine VMs,
# tpu/docs/prepare-for-maintenance). Read with `?wait_for_change=true` (compute/docs/metadata/querying-metadata).
NOTICES = {"instance/preempted": "FALSE", "instance/maintenance-event": "NONE"}
SAVE_REQUEST_VAR = "TPUCTL_SAVE_REQUEST"  # the template contract's save request file (templates/README.md)
SAVE_REQUEST = "save-request"
WAIT_S = 300  # one wait_for_change request's timeout_sec: the watch asks again after it


def watch(path: str, quiet: str, stop: threading.Event, on_notice: Callable[[str], None]) -> None:
    """Follow metadata `path` until `stop` is set; a value other than `quiet` is a notice (`on_notice("PATH=VALUE")`).
    An unreachable metadata server (briefly, or none at all off Google Cloud) is asked again, backing off up to a
    minute."""
    # Where google-auth (GCE_METADATA_HOST) or JAX (GCE_METADATA_IP) would look; a real VM sets neither.
    host = os.environ.get("GCE_METADATA_HOST") or os.environ.get("GCE_METADATA_IP") or "metadata.google.internal"
    url = f"http://{host}/computeMetadata/v1/{path}"
    etag, delay = None, 1.0  # None: not read yet (the first read answers at once)
    while not stop.is_set():
        query = "" if etag is None else \
            f"?wait_for_change=true&timeout_sec={WAIT_S}" + (f"&last_etag={etag}" if etag else "")
        request = urllib.request.Request(url + query, headers={"Metadata-Flavor": "Google"})
        try:
            with urllib.request.urlopen(request, timeout=WAIT_S + 30) as answer:
                value, etag = answer.read().decode().strip(), answer.headers.get("ETag") or ""
        except (OSError, ValueError):
            stop.wait(delay)
            delay = min(2 * delay, 60.0)
            continue
        delay = 1.0
        if value != quiet:
            on_notice(f"{path}={value}")


def start_watching(stop: threading.Event, on_notice: Callable[[str], None]) -> None:
    """One daemon thread per notice path, until `stop` is set."""
    for path, quiet in NOTICES.items():
        threading.Thread(target=watch, args=(path, quiet, stop, on_notice), daemon=True, name=f"watch {path}").start()


def request_save(request: Path, what: str) -> None:
    """Ask the program for a checkpoint at its next step boundary (the contract's request file)."""
    tmp = request.with_suffix(".tmp")
    tmp.write_text(what + "\n")
    tmp.replace(request)  # whole, never half-written, when the program looks
