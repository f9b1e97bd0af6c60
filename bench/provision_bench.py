"""Provisioning benchmark on the local cloud at realistic latencies, scaled (default speed 20: a TPU
create that takes ~3 min on GCP takes ~9 s here).

Prints `up` wall time over the slowest single create and `down` wall time over the slowest single delete.
The baselines are each resource created (then deleted) alone with the official client and a 10 ms poll,
i.e. the emulator's own latency; a ratio of 1.00 means tpuctl adds nothing on top of the slowest step.
Target: <= 1.10 for both.

    .venv/bin/python bench/provision_bench.py [--speed 20] [--vms 1] [--accelerator v3-8] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1, tpu_v2

from tpuctl import provision as prov
from tpuctl import spec
from tpuctl.localcloud.cloud import LocalCloud
from tpuctl.provision.clients import build

ZONE = "europe-west4-a"
POLL_S = 0.01


def _timed(fn) -> float:
    t = time.monotonic()
    fn()
    return time.monotonic() - t


def _poll(done) -> None:
    while not done():
        time.sleep(POLL_S)


def baseline_tpu(pc, accelerator: str, runtime: str) -> tuple[float, float]:
    """Create then delete one node alone with the raw client: (create s, delete s)."""
    parent = f"projects/{pc.project}/locations/{ZONE}"
    name = f"{parent}/nodes/base-tpu"
    node = tpu_v2.Node(accelerator_type=accelerator, runtime_version=runtime)

    def create():
        op = pc.tpu.create_node(parent=parent, node_id="base-tpu", node=node)
        _poll(lambda: op.done(retry=None))
        _poll(lambda: pc.tpu.get_node(name=name).state == tpu_v2.Node.State.READY)

    def delete():
        op = pc.tpu.delete_node(name=name)
        _poll(lambda: op.done(retry=None))

    return _timed(create), _timed(delete)


def baseline_vm(pc, machine_type: str) -> tuple[float, float]:
    inst = compute_v1.Instance(
        name="base-vm", machine_type=f"zones/{ZONE}/machineTypes/{machine_type}",
        disks=[compute_v1.AttachedDisk(boot=True, auto_delete=True, initialize_params=compute_v1.AttachedDiskInitializeParams(
            source_image="projects/debian-cloud/global/images/family/debian-12", disk_size_gb=20))],
        network_interfaces=[compute_v1.NetworkInterface(network="global/networks/default")])

    def wait(op):
        _poll(lambda: pc.zone_operations.get(project=pc.project, zone=ZONE, operation=op.name).status
              == compute_v1.Operation.Status.DONE)

    c = _timed(lambda: wait(pc.instances.insert_unary(project=pc.project, zone=ZONE, instance_resource=inst)))
    d = _timed(lambda: wait(pc.instances.delete_unary(project=pc.project, zone=ZONE, instance="base-vm")))
    return c, d


def baseline_bucket(pc) -> tuple[float, float]:
    name = f"base-{uuid.uuid4().hex[:10]}"
    c = _timed(lambda: pc.storage.create_bucket(name, location="europe-west4"))
    d = _timed(lambda: pc.storage.bucket(name).delete())
    return c, d


def run(speed: float, accelerator: str, vms: int) -> dict:
    with LocalCloud(speed=speed, strict=True, worker_python="host") as cloud:
        pc = build(project=f"lc-bench-{uuid.uuid4().hex[:8]}", credentials=AnonymousCredentials(),
                   endpoint=cloud.endpoint, storage_host=cloud.storage_host, local=True)
        plan = prov.plan(spec.from_mapping({"name": "bench", "accelerator": accelerator, "zone": ZONE,
                                            "vms": [{"name": f"vm{i}"} for i in range(vms)]}), project=pc.project)
        creates, deletes = {}, {}
        creates["tpu"], deletes["tpu"] = baseline_tpu(pc, accelerator, plan.runtime_version)
        if vms:
            creates["vm"], deletes["vm"] = baseline_vm(pc, "e2-standard-2")
        creates["bucket"], deletes["bucket"] = baseline_bucket(pc)

        up_s = _timed(lambda: prov.apply(pc, plan))
        down_s = _timed(lambda: prov.down(pc, "bench", delete_bucket=True))
        left = prov.list_resources(pc, "bench")
    slow_c, slow_d = max(creates.values()), max(deletes.values())
    return {"speed": speed, "accelerator": accelerator, "vms": vms, "resources_left": len(left),
            "baseline_create_s": {k: round(v, 3) for k, v in creates.items()},
            "baseline_delete_s": {k: round(v, 3) for k, v in deletes.items()},
            "up_s": round(up_s, 3), "down_s": round(down_s, 3),
            "up_ratio": round(up_s / slow_c, 3), "down_ratio": round(down_s / slow_d, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--speed", type=float, default=20.0)
    ap.add_argument("--accelerator", default="v3-8")
    ap.add_argument("--vms", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    r = run(args.speed, args.accelerator, args.vms)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"speed {r['speed']:g}, {r['accelerator']} + {r['vms']} VM(s) + bucket + IAM")
        print(f"up   {r['up_s']:.2f} s / slowest single create {max(r['baseline_create_s'].values()):.2f} s "
              f"= {r['up_ratio']:.3f}  (target <= 1.10)")
        print(f"down {r['down_s']:.2f} s / slowest single delete {max(r['baseline_delete_s'].values()):.2f} s "
              f"= {r['down_ratio']:.3f}  (target <= 1.10)")
        print(f"resources left after down: {r['resources_left']}")
    return 0 if r["up_ratio"] <= 1.10 and r["down_ratio"] <= 1.10 and not r["resources_left"] else 1


if __name__ == "__main__":
    sys.exit(main())
