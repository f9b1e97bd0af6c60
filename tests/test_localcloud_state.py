"""The billing meter and persistence across a restart of the local cloud."""

from __future__ import annotations

import asyncio
import time

import asyncssh
import pytest
from google.cloud import tpu_v2

from conftest import FAST_POLLING, official_clients
from test_localcloud_compute import _insert
from tpuctl.localcloud import facts, tpu
from tpuctl.localcloud.cloud import LocalCloud

# Who a worker is, from its metadata server: after a restart each worker still has one, with its own answers.
WORKER_NUMBER = ("curl -sf -H 'Metadata-Flavor: Google' "
                 "http://$GCE_METADATA_HOST/computeMetadata/v1/instance/attributes/agent-worker-number")


def test_meter_bills_tpu_wall_seconds_at_localclouds_own_price(clients, cloud):
    zone = "us-east5-a"
    t0 = time.time()
    node = clients.tpu.create_node(parent=clients.parent(zone), node_id="metered", node=tpu_v2.Node(
        accelerator_type="v5litepod-8", runtime_version="v2-alpha-tpuv5-lite",
        scheduling_config=tpu_v2.SchedulingConfig(spot=True))).result(polling=FAST_POLLING)
    ready_by = time.time()
    time.sleep(1.0)
    deleting = time.time()
    clients.tpu.delete_node(name=node.name).result(polling=FAST_POLLING)
    t1 = time.time()
    row = next(r for r in cloud.meter_report()["resources"] if r["resource"] == node.name)
    assert row["sku"] == f"tpu/v5litepod-8/{zone}/spot" and not row["running"]
    # Billed from READY (never while CREATING) until the deletion finished.
    assert deleting - ready_by <= row["seconds"] <= t1 - t0 - tpu.CREATE_S / cloud.speed
    assert row["usd_per_hour"] == pytest.approx(8 * facts.tpu_price("v5e", "us-east5", spot=True))
    assert row["usd"] == pytest.approx(row["seconds"] / 3600 * row["usd_per_hour"], rel=1e-9)
    report = cloud.meter_report()
    assert report["skus"][row["sku"]]["usd"] >= row["usd"]
    assert report["total_usd"] == pytest.approx(sum(r["usd"] for r in report["resources"]))


def test_meter_stops_while_a_node_is_stopped(clients, cloud):
    zone = "europe-west4-a"
    node = clients.tpu.create_node(parent=clients.parent(zone), node_id="pause", node=tpu_v2.Node(
        accelerator_type="v3-8", runtime_version="tpu-vm-tf-2.14.1")).result(polling=FAST_POLLING)
    clients.tpu.stop_node(request={"name": node.name}).result(polling=FAST_POLLING)

    def seconds() -> float:
        return next(r for r in cloud.meter_report()["resources"] if r["resource"] == node.name)["seconds"]

    before = seconds()
    time.sleep(0.3)
    assert seconds() == before


def test_meter_integrates_bucket_gigabyte_seconds(clients, cloud):
    bucket = clients.storage.create_bucket(f"{clients.project}-meter", location="us-central1")
    bucket.blob("data.bin").upload_from_string(b"x" * 2_000_000)
    deadline = time.monotonic() + 10
    row = None
    while time.monotonic() < deadline:
        rows = [r for r in cloud.meter_report()["resources"] if r["resource"] == f"buckets/{bucket.name}"]
        row = rows[0] if rows else None
        if row and row["gb_seconds"] > 0.002:
            break
        time.sleep(0.2)
    assert row is not None and row["kind"] == "bucket" and row["sku"] == "bucket/us-central1/standard"
    assert row["gb_seconds"] > 0.002 and row["usd"] > 0
    listed = next(b for b in cloud.inventory()["buckets"] if b["name"] == bucket.name)
    assert listed["objects"] == 1 and listed["bytes"] == 2_000_000


def test_restart_from_state_dir_keeps_everything_and_reboots_workers(tmp_path, monkeypatch):
    key = asyncssh.generate_private_key("ssh-ed25519")
    line = f"alice:{key.export_public_key().decode().strip()} alice"
    with LocalCloud(speed=1000, state_dir=tmp_path) as first:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", first.storage_host)
        c = official_clients(first, "lc-persist")
        create = c.tpu.create_node(parent=c.parent("europe-west4-a"), node_id="keep", node=tpu_v2.Node(
            accelerator_type="v3-32", runtime_version="tpu-vm-tf-2.14.1-pod", labels={"tpuctl-run": "p"},
            metadata={"ssh-keys": line}))
        old = create.result(polling=FAST_POLLING)
        _insert(c, "keepvm")
        c.storage.create_bucket("lc-persist-bucket", location="europe-west4").blob("a.txt").upload_from_string(b"hello")
        metered = {r["resource"] for r in first.meter_report()["resources"]}

    with LocalCloud(speed=1000, state_dir=tmp_path) as second:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", second.storage_host)
        c = official_clients(second, "lc-persist")
        node = c.tpu.get_node(name=old.name)
        assert node.state == tpu_v2.Node.State.READY and node.labels["tpuctl-run"] == "p"
        assert len(node.network_endpoints) == 4 and all(ep.port for ep in node.network_endpoints)
        assert c.tpu.get_operation(request={"name": create.operation.name}).done
        assert c.instances.get(project="lc-persist", zone="us-central1-a", instance="keepvm").status == "RUNNING"
        assert c.storage.bucket("lc-persist-bucket").blob("a.txt").download_as_bytes() == b"hello"
        assert metered <= {r["resource"] for r in second.meter_report()["resources"]}

        attrs = c.tpu.get_guest_attributes(request={"name": node.name, "query_path": "hostkeys/"}).guest_attributes
        host_keys = [asyncssh.import_public_key(f"{a.query_value.items[0].key} {a.query_value.items[0].value}") for a in attrs]

        async def run_all() -> list[str]:
            async def one(ep, hk):
                async with asyncssh.connect("127.0.0.1", ep.port, username="alice", client_keys=[key],
                                            known_hosts=([hk], [], [])) as conn:
                    return (await conn.run(WORKER_NUMBER, check=True, timeout=20)).stdout.strip()
            return await asyncio.gather(*(one(ep, hk) for ep, hk in zip(node.network_endpoints, host_keys)))

        assert asyncio.run(run_all()) == ["0", "1", "2", "3"]


def test_an_operation_pending_at_shutdown_finishes_after_restart(tmp_path):
    with LocalCloud(speed=100, state_dir=tmp_path) as first:  # a TPU create takes 1.8 s here
        c = official_clients(first, "lc-pending")
        create = c.tpu.create_node(parent=c.parent("us-central1-b"), node_id="half", node=tpu_v2.Node(
            accelerator_type="v2-8", runtime_version="tpu-vm-tf-2.14.1"))
        assert c.tpu.get_node(name=f"{c.parent('us-central1-b')}/nodes/half").state == tpu_v2.Node.State.CREATING
    with LocalCloud(speed=100, state_dir=tmp_path) as second:
        c = official_clients(second, "lc-pending")
        assert not c.tpu.get_operation(request={"name": create.operation.name}).done  # the deadline survived the restart, it did not fire early or get lost
        deadline = time.monotonic() + 20
        while not c.tpu.get_operation(request={"name": create.operation.name}).done and time.monotonic() < deadline:
            time.sleep(0.05)
        ready = c.tpu.get_node(name=f"{c.parent('us-central1-b')}/nodes/half")
        assert ready.state == tpu_v2.Node.State.READY and ready.network_endpoints[0].port
