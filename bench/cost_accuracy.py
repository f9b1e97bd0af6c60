"""How close tpuctl's cost figures are to the billing meter: a mixed fleet on the local cloud.

Starts a local cloud, creates TPUs (on-demand and spot, several generations and regions, one through a queued
resource), a Compute Engine TPU7x VM and VMs under one tpuctl run, preempts a Spot TPU in its first minute,
deletes some part-way, and compares tpuctl's accrued cost per resource (what the API and tpuctl's waits said of
when each became READY/RUNNING, the ledger, the catalog) with the local cloud's own meter at the same instants
(now, and an hour on). Prints one JSON object; exits 1 if any resource is off by more than --tolerance
(default 1%) an hour on, or if one side charges a resource the other does not.

    .venv/bin/python bench/cost_accuracy.py [--seconds 20]

A deleted resource's cost is fixed by then: tpuctl closes it when its wait saw the delete operation done (a
poll of 50 ms or more after the meter stopped), so the fleet lives long enough (20 s by default: the deleted
ones 10 s) for that to stay under the tolerance, as it does over the hours real runs last.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from google.auth.credentials import AnonymousCredentials

from tpuctl import catalog, cost
from tpuctl.ledger import Ledger, entry_of
from tpuctl.localcloud.cloud import LocalCloud
from tpuctl.provision import compute_tpu, gc, tpu, vm
from tpuctl.provision import labels as L
from tpuctl.provision.clients import build

RUNTIME = "tpu-vm-tf-2.17.0-pjrt"
# (name, zone, accelerator, spot, queued); localcloud prices v3 in europe-west4, v5e in us-east5, v6e in
# us-central1. The last one is preempted right away: in its first minute, so it costs nothing.
FLEET = (("a-v3", "europe-west4-a", "v3-8", False, False), ("b-v2-spot", "us-central1-b", "v2-8", True, False),
         ("c-v5e", "us-east5-a", "v5litepod-4", False, False), ("d-v6e-spot", "us-central1-b", "v6e-4", True, False),
         ("g-v2-queued", "us-central1-b", "v2-8", False, True), ("i-v2-preempted", "us-central1-b", "v2-8", True, False))
TPU7X = ("h-tpu7x", "us-central1-c", "tpu7x-standard-4t",
         "projects/ubuntu-os-accelerator-images/global/images/family/ubuntu-accel-2404-amd64-tpu-tpu7x")
# VMs in us-central1 only: localcloud bills one VM price in every region, tpuctl's catalog applies regional
# multipliers (europe-west4 is ~10% dearer on GCP), so elsewhere they differ by design.
VMS = (("e-driver", "us-central1-a", "e2-standard-2"), ("f-small", "us-central1-c", "e2-small"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="how long the fleet lives before the comparison")
    ap.add_argument("--tolerance", type=float, default=0.01, help="largest acceptable relative error")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LocalCloud(speed=1000, strict=True, worker_python="host") as cloud:
        clients = build(project="cost-bench", credentials=AnonymousCredentials(), endpoint=cloud.endpoint,
                        storage_host=cloud.storage_host, local=True)
        labels = L.run_labels("bench", owner_name="bench", ttl_s=3600)
        cat = catalog.load(Path(tmp) / "no-cache.json")
        ledger = Ledger(Path(tmp) / "ledger.json")
        with ThreadPoolExecutor(max_workers=8) as pool:
            jobs = [pool.submit(tpu.create_queued if q else tpu.create_node, clients, tpu.NodeRequest(
                name=n, zone=z, accelerator=a, runtime_version=RUNTIME, labels=labels, service_account="",
                spot=s, queued=q), deadline_s=60) for n, z, a, s, q in FLEET]
            jobs.append(pool.submit(compute_tpu.create, clients, compute_tpu.TpuVmRequest(
                name=TPU7X[0], zone=TPU7X[1], machine_type=TPU7X[2], image=TPU7X[3], labels=labels,
                service_account=""), catalog=cat, deadline_s=60))
            jobs += [pool.submit(vm.create, clients, vm.VmRequest(
                name=n, zone=z, machine_type=m, disk_gb=10, image="projects/debian-cloud/global/images/family/debian-12",
                labels=labels, service_account=""), deadline_s=60) for n, z, m in VMS]
            # What `up` remembers of what it created: when its own waits saw each TPU become READY.
            ledger.record([entry_of(j.result()) for j in jobs])
        cloud.preempt(f"projects/cost-bench/locations/us-central1-b/nodes/{FLEET[-1][0]}")
        time.sleep(args.seconds / 2)
        # Half-way, delete one TPU and one VM as gc does (then close them in the ledger), so deletion times count.
        gc.cost_entries(clients, now=time.time(), ledger=ledger)
        tpu.delete_node(clients, "europe-west4-a", "a-v3", deadline_s=60)
        ledger.mark_deleted(["cost-bench/tpu/europe-west4-a/a-v3"])
        vm.delete(clients, "us-central1-c", "f-small", deadline_s=60)
        ledger.mark_deleted(["cost-bench/vm/us-central1-c/f-small"])
        time.sleep(args.seconds / 2)
        now = time.time()
        entries = [e for e in gc.cost_entries(clients, now=now, ledger=ledger) if cost.hourly(e, cat)]
        # Both sides answer for any instant: now (seconds-long lives, where scheduler jitter on this machine
        # is visible) and an hour on (the scale runs really last; deleted resources keep their cost).
        rows, worst = [], None
        for label, t in (("now", now), ("in_1h", now + 3600)):
            meter = {r["resource"].rsplit("/", 1)[-1]: r["usd"] for r in cloud.meter.report(t=t)["resources"]}
            for e in entries:
                ours, theirs = cost.accrued(e, cat, now=t), meter.get(e.name)
                # Both charging nothing (the preempted Spot TPU) is exact; one side alone charging is not.
                err = abs(ours / theirs - 1) if theirs else (0.0 if theirs == 0 and ours == 0 else float("inf"))
                rows.append({"at": label, "resource": e.name, "kind": e.kind, "deleted": e.deleted is not None,
                             "tpuctl_usd": ours, "meter_usd": theirs, "rel_error": err})
                if label == "in_1h" and err is not None:
                    worst = max(worst or 0.0, err)
        print(json.dumps({"seconds": args.seconds, "resources": rows,
                          "max_rel_error_in_1h": worst, "tolerance": args.tolerance,
                          "ok": worst is not None and worst <= args.tolerance},
                         indent=2))
        return 0 if worst is not None and worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
