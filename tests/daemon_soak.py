"""The local cloud daemon soak (bench/localcloud_soak.py is its command line; test_localcloud_cli runs it short).

One cycle is what a `tpuctl run` asks of the daemon: a TPU node created and deleted (its SSH worker started and
stopped), a bucket created, checkpoint-sized objects uploaded concurrently (several workers write at once; below
8 MiB the client sends them as multipart uploads, which the storage proxy buffers), read back, and the bucket
deleted. The daemon's RSS is read from /proc after each reporting interval, right after the cycle, garbage of
the last requests included (the daemon trims its heap every 2 s; `settle_s` waits for that, to see only what it
keeps). Goal: flat after warm-up (growth from the first report to the last < 25 MB) and below 200 MB.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from google.api_core.client_options import ClientOptions
from google.api_core.future import polling
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage, tpu_v2

from tpuctl.localcloud import daemon

ZONE = "us-central1-b"
POLLING = polling.DEFAULT_POLLING.with_delay(initial=0.01, maximum=0.05).with_timeout(60)
GROWTH_LIMIT_MB = 25.0
RSS_LIMIT_MB = 200.0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cycle(info: dict, project: str, index: int, uploads: int, payload: bytes) -> None:
    opts = ClientOptions(api_endpoint=info["endpoint"])
    tpu = tpu_v2.TpuClient(transport="rest", credentials=AnonymousCredentials(), client_options=opts)
    gcs = storage.Client(project=project, credentials=AnonymousCredentials(),
                         client_options=ClientOptions(api_endpoint=info["storage_host"]))
    parent = f"projects/{project}/locations/{ZONE}"
    tpu.create_node(parent=parent, node_id=f"soak-{index}", node=tpu_v2.Node(
        accelerator_type="v2-8", runtime_version="tpu-vm-tf-2.14.1")).result(polling=POLLING)
    bucket = gcs.create_bucket(f"soak-{uuid.uuid4().hex[:12]}", location="us-central1")

    def upload(i: int) -> None:
        blob = bucket.blob(f"ckpt/ckpt-{index}-{i}.data")
        blob.upload_from_string(payload)
        assert len(blob.download_as_bytes()) == len(payload)

    with ThreadPoolExecutor(uploads) as pool:
        list(pool.map(upload, range(uploads)))
    tpu.delete_node(name=f"{parent}/nodes/soak-{index}").result(polling=POLLING)
    bucket.delete(force=True)
    for client in (tpu.transport, gcs._http):  # each tpuctl command is a process that closes its connections
        client.close()


def run(cycles: int, uploads: int, upload_mb: float, every: int, speed: float = 1000.0, settle_s: float = 0.0) -> dict:
    payload = os.urandom(int(upload_mb * (1 << 20)))
    with tempfile.TemporaryDirectory(prefix="tpuctl-soak-") as state:
        info = daemon.start(Path(state), speed, idle_stop_s=0)
        project = f"lc-soak-{uuid.uuid4().hex[:8]}"
        samples = [(0, round(rss_mb(info["pid"]), 1))]
        started = time.monotonic()
        try:
            for i in range(1, cycles + 1):
                cycle(info, project, i, uploads, payload)
                if i % every == 0 or i == cycles:
                    time.sleep(settle_s)
                    samples.append((i, round(rss_mb(info["pid"]), 1)))
        finally:
            daemon.stop(Path(state))
    warm = samples[1][1] if len(samples) > 1 else samples[0][1]
    last = samples[-1][1]
    return {"cycles": cycles, "uploads_per_cycle": uploads, "upload_mb": upload_mb,
            "seconds": round(time.monotonic() - started, 1), "rss_mb": samples,
            "growth_after_warmup_mb": round(last - warm, 1), "peak_mb": max(mb for _, mb in samples),
            "ok": last - warm < GROWTH_LIMIT_MB and max(mb for _, mb in samples) < RSS_LIMIT_MB}
