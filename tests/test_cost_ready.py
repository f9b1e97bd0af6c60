"""Billing from READY: the local cloud's meter and `tpuctl cost` count only the time a TPU was READY (a Compute
instance RUNNING), never the time it was queued, being created, or a Spot TPU preempted in its first minute.

The slow cases run on their own local cloud at speed 40, where a TPU create takes 4.5 s and a Compute insert
0.6 s, so the time excluded is far above scheduler jitter. Billed seconds are compared (USD / rate): the meter
at the instant its resource changed state, tpuctl from what the API and its own waits told it.
"""

from __future__ import annotations

import time
import uuid

import pytest
from google.auth.credentials import AnonymousCredentials

from tpuctl import catalog, cost, ledger
from tpuctl.localcloud import tpu as lc_tpu
from tpuctl.localcloud.cloud import LocalCloud
from tpuctl.provision import compute_tpu, gc, tpu
from tpuctl.provision import labels as L
from tpuctl.provision.clients import build

pytestmark = pytest.mark.timeout(180)

SPEED = 40.0
RUNTIME = "tpu-vm-tf-2.17.0-pjrt"
CREATING_S = lc_tpu.CREATE_S / SPEED


@pytest.fixture(scope="module")
def slow_cloud():
    with LocalCloud(speed=SPEED, strict=True, worker_python="host") as cloud:
        yield cloud


@pytest.fixture
def cat(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))  # the default ledger `up` remembers into, too
    return catalog.load()


def _clients(cloud):
    return build(project=f"ready-{uuid.uuid4().hex[:10]}", credentials=AnonymousCredentials(),
                 endpoint=cloud.endpoint, storage_host=cloud.storage_host, local=True)


def _billed_seconds(cloud, clients, cat, now: float) -> tuple[dict[str, float], dict[str, float]]:
    """(meter, tpuctl) billed seconds per TPU or VM of this project at `now`, by short name."""
    entries = [e for e in gc.cost_entries(clients, now=now) if cost.hourly(e, cat)]
    ours = {e.name: cost.accrued(e, cat, now=now) / cost.hourly(e, cat) * 3600 for e in entries}
    meter = {r["resource"].rsplit("/", 1)[-1]: r["seconds"] for r in cloud.meter.report(t=now)["resources"]
             if r["resource"].startswith(f"projects/{clients.project}/")}
    return meter, ours


@pytest.mark.slow  # fast tier: billing from ready: test_a_compute_tpu7x_vm_bills_from_running
def test_a_node_slow_to_create_and_a_queued_one_bill_from_ready(slow_cloud, cat):
    """A node CREATING for 4.5 s, and a queued resource WAITING_FOR_RESOURCES (capacity refused on its first
    ticks) then creating its node: neither side counts the wait or the creation; both agree to a poll."""
    clients = _clients(slow_cloud)
    labels = L.run_labels("ready", owner_name="ann", ttl_s=3600)
    slow_cloud.faults.add("capacity", service="tpu", method="queuedResources.create", zone="us-central1-b", count=8)
    asked = time.time()
    node = tpu.create_node(clients, tpu.NodeRequest(name="slow", zone="europe-west4-a", accelerator="v3-8",
                                                    runtime_version=RUNTIME, labels=labels, service_account=""),
                           deadline_s=60)
    queued = tpu.create_queued(clients, tpu.NodeRequest(name="queued", zone="us-central1-b", accelerator="v2-8",
                                                        runtime_version=RUNTIME, labels=labels, service_account="",
                                                        queued=True), deadline_s=60)
    ledger.remember([node, queued])  # what `up` does with what it created
    time.sleep(0.5)
    now = time.time()
    meter, ours = _billed_seconds(slow_cloud, clients, cat, now)
    assert set(ours) == set(meter) == {"slow", "queued"}
    for name in ours:
        assert ours[name] == pytest.approx(meter[name], abs=0.5), name
    assert meter["slow"] < now - asked - CREATING_S  # never while CREATING
    # The queued one waited 8 ticks and then created its node after the first node was READY.
    assert meter["queued"] < now - asked - CREATING_S - 8 * lc_tpu.QR_TICK_S / SPEED - CREATING_S
    # An hour on, both still agree within the 1% `tpuctl cost` promises.
    later = now + 3600
    meter, ours = _billed_seconds(slow_cloud, clients, cat, later)
    for name in ours:
        assert ours[name] == pytest.approx(meter[name], rel=0.01), name


def test_a_compute_tpu7x_vm_bills_from_running(slow_cloud, cat):
    """Compute bills uptime, from RUNNING: the TPU VM's PENDING and PROVISIONING are free, and tpuctl reads
    when it started from `lastStartTimestamp`, even for a VM it sees for the first time."""
    clients = _clients(slow_cloud)
    asked = time.time()
    compute_tpu.create(clients, compute_tpu.TpuVmRequest(
        name="x7", zone="us-central1-c", machine_type="tpu7x-standard-4t",
        image="projects/ubuntu-os-accelerator-images/global/images/family/ubuntu-accel-2404-amd64-tpu-tpu7x",
        labels=L.run_labels("x7", owner_name="ann", ttl_s=3600), service_account=""), catalog=cat, deadline_s=60)
    time.sleep(0.5)
    now = time.time()
    meter, ours = _billed_seconds(slow_cloud, clients, cat, now)
    assert set(ours) == set(meter) == {"x7"}
    assert ours["x7"] == pytest.approx(meter["x7"], abs=0.05)  # both from the same timestamp
    assert meter["x7"] < now - asked - 25.0 / SPEED  # localcloud's insert takes 25 simulated seconds


def test_a_spot_tpu_preempted_in_its_first_minute_costs_nothing(cloud, cat):
    """tpu/docs/preemptible: "You are not charged for TPUs if they are preempted in the first minute after you
    create them." The meter charges 0; tpuctl, seeing it PREEMPTED within that minute, too."""
    clients = _clients(cloud)
    node = tpu.create_node(clients, tpu.NodeRequest(name="brief", zone="us-central1-b", accelerator="v2-8",
                                                    runtime_version=RUNTIME, service_account="", spot=True,
                                                    labels=L.run_labels("brief", owner_name="ann", ttl_s=3600)),
                           deadline_s=30)
    ledger.remember([node])
    time.sleep(0.5)  # it bills meanwhile
    cloud.preempt(f"projects/{clients.project}/locations/us-central1-b/nodes/brief")
    now = time.time()
    [row] = [r for r in cloud.meter.report(t=now + 3600)["resources"]
             if r["resource"].startswith(f"projects/{clients.project}/")]
    assert row["usd"] == 0 and not row["running"]
    [entry] = gc.cost_entries(clients, now=now)
    assert entry.name == "brief" and cost.accrued(entry, cat, now=now + 3600) == 0
