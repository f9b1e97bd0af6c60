"""tpuctl's cost figures against the local cloud's billing meter: within 1%, live and after deletion.

The meter is localcloud's own (its own price table, wall-clock resource-seconds from READY/RUNNING to the
end of deletion); tpuctl computes from API times, what its waits saw, the ledger and its catalog.
"""

from __future__ import annotations

import time
import uuid

import pytest
from google.auth.credentials import AnonymousCredentials

from tpuctl import catalog, cost
from tpuctl.ledger import Ledger, key_of
from tpuctl.provision import gc, tpu, vm
from tpuctl.provision import labels as L
from tpuctl.provision.clients import build

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def clients(cloud):
    return build(project=f"cost-test-{uuid.uuid4().hex[:10]}", credentials=AnonymousCredentials(),
                 endpoint=cloud.endpoint, storage_host=cloud.storage_host, local=True)


@pytest.fixture
def cat(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    return catalog.load()


def metered(cloud, clients, t: float) -> dict[str, float]:
    """The meter's USD per resource of this test's project at time `t`, by short resource name."""
    return {row["resource"].rsplit("/", 1)[-1]: row["usd"] for row in cloud.meter.report(t=t)["resources"]
            if row["resource"].startswith(f"projects/{clients.project}/")}


def test_accrued_cost_matches_the_meter_within_1_percent(cloud, clients, cat, tmp_path):
    labels = L.run_labels("metered", owner_name="ann", ttl_s=3600)
    tpu.create_node(clients, tpu.NodeRequest(name="big", zone="us-central1-a", accelerator="v3-8",
                                             runtime_version="tpu-vm-tf-2.17.0-pjrt", labels=labels,
                                             service_account=""), deadline_s=30)
    tpu.create_node(clients, tpu.NodeRequest(name="cheap", zone="us-central1-b", accelerator="v2-8",
                                             runtime_version="tpu-vm-tf-2.17.0-pjrt", labels=labels,
                                             service_account="", spot=True), deadline_s=30)
    # A multi-host v2 slice bills the pod SKU's per-chip price on both sides, not the v2-8's.
    tpu.create_node(clients, tpu.NodeRequest(name="pod", zone="us-central1-a", accelerator="v2-32",
                                             runtime_version="tpu-vm-tf-2.17.0-pod-pjrt", labels=labels,
                                             service_account=""), deadline_s=30)
    vm.create(clients, vm.VmRequest(name="driver", zone="us-central1-a", machine_type="e2-standard-2", disk_gb=10,
                                    image="projects/debian-cloud/global/images/family/debian-12", labels=labels,
                                    service_account=""), deadline_s=30)
    ledger = Ledger(tmp_path / "ledger.json")

    # Both sides can be asked about any instant. Asking an hour into the run's life compares what matters
    # (rates, what bills, from when) at the scale runs really last, rather than scheduler jitter on a
    # loaded 2-core test machine, which over a few seconds is itself about 1%.
    now = time.time()
    later = now + 3600
    ours = {e.name: cost.accrued(e, cat, now=later) for e in gc.cost_entries(clients, now=now, ledger=ledger)}
    meter = metered(cloud, clients, later)
    assert set(ours) == {"big", "cheap", "pod", "driver"} and set(meter) == set(ours)
    for name in ours:
        assert ours[name] == pytest.approx(meter[name], rel=0.01), name

    # Delete the big slice as gc does (closing it in the ledger); its cost stops on both sides.
    time.sleep(1.0)
    big = next(r for r in gc.scan(clients) if r.name == "big")
    tpu.delete_node(clients, big.location, big.name, deadline_s=30)
    ledger.mark_deleted([key_of(big)])
    now = time.time()
    later = now + 3600
    entries = gc.cost_entries(clients, now=now, ledger=ledger)
    meter = metered(cloud, clients, later)
    ours = {e.name: cost.accrued(e, cat, now=later) for e in entries}
    for name in ("cheap", "pod", "driver"):
        assert ours[name] == pytest.approx(meter[name], rel=0.01), name
    # The deleted slice lived about a second: compare billed seconds. tpuctl closes it when the delete
    # operation is seen done, the meter when deletion finished: a poll interval apart at most.
    rate = cat.tpu_price_per_hour("v3-8", "us-central1", spot=False) / 3600
    assert abs(ours["big"] - meter["big"]) / rate < 0.5
    assert meter["big"] / rate > 1.0
    rep = cost.report(entries, cat, since=now - 3600, now=later, by="run")
    assert [r.key for r in rep.rows] == ["metered"] and rep.rows[0].live == 3
    assert rep.total_usd == pytest.approx(sum(meter.values()), rel=0.01)


def test_cost_includes_what_an_interrupted_up_rolled_back(cloud, tmp_path):
    """An `up` whose first zone ran out of capacity and which was then interrupted while its TPU was being
    created leaves nothing live. Both nodes existed, and `tpuctl cost` counts them, marked as rolled back, but
    neither became READY: they cost nothing, as on the meter."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from conftest import new_project

    project = new_project()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPUCTL_", "CLOUDSDK_", "GOOGLE_"))}
    env.update(TPUCTL_API_ENDPOINT=cloud.endpoint, STORAGE_EMULATOR_HOST=cloud.storage_host, TPUCTL_PROJECT=project,
               TPUCTL_HOME=str(tmp_path / "home"), HOME=str(tmp_path), NO_COLOR="1", PYTHONUNBUFFERED="1")
    cloud.faults.add("capacity", service="tpu", zone="us-central1-a", count=1)
    cloud.faults.add("stuck", service="tpu", method="nodes.create", zone="us-central1-b")
    up = subprocess.Popen([sys.executable, "-m", "tpuctl", "up", "--name", "rolled", "--accelerator", "v3-8",
                           "--zone", "us-central1-a,us-central1-b", "--yes"], env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(n["name"].startswith(f"projects/{project}/locations/us-central1-b/nodes/")
                      for n in cloud.inventory()["nodes"]):
            assert time.monotonic() < deadline, "the second zone's node was never requested"
            time.sleep(0.05)
        time.sleep(1.0)  # CREATING all along: it does not bill
        up.send_signal(signal.SIGINT)
        _, err = up.communicate(timeout=60)
    finally:
        up.kill()
    assert up.returncode == 130, err
    cloud.faults.clear()

    report = subprocess.run([sys.executable, "-m", "tpuctl", "cost", "--since", "1h", "--json"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    rep = json.loads(report.stdout)
    now = time.time()
    meter = [row for row in cloud.meter.report(t=now)["resources"] if row["resource"].startswith(f"projects/{project}/")]
    assert not any(row["running"] for row in meter)
    assert not [row for row in meter if "/nodes/" in row["resource"]]  # never READY: never metered
    [row] = rep["rows"]  # both nodes and the bucket
    assert row["key"] == "rolled" and row["live"] == 0 and row["rolled_back"] == row["resources"] == 3
    assert row["usd"] == row["rolled_back_usd"] == rep["total_usd"] == 0, rep


def test_a_tpu_its_supervisor_deleted_while_nobody_watched_costs_what_the_meter_says(cloud, clients, cat):
    """A detached run's supervisor tears its TPU down while the laptop sleeps (here an hour): the laptop's next
    `tpuctl cost` finds it gone. It billed until the run's teardown moved on (its timeline), not until that scan:
    as on the meter, and the summary says what `tpuctl cost RUN` says."""
    from tpuctl import api, ledger
    from tpuctl.jobs import timeline
    from tpuctl.provision import bucket

    run, zone = "slept", "us-central1-a"
    labels = L.run_labels(run, owner_name="ann", ttl_s=3600)
    bucket_name = L.auto_bucket(clients.project, run)
    bucket.ensure(clients, bucket_name, "us-central1", labels)
    record = timeline.Timeline()
    record.mark("up", at=time.time())
    node = tpu.create_node(clients, tpu.NodeRequest(name=run, zone=zone, accelerator="v3-8", labels=labels,
                                                    runtime_version="tpu-vm-tf-2.17.0-pjrt", service_account=""),
                           deadline_s=30)
    supervisor = vm.create(clients, vm.VmRequest(name=f"{run}-supervisor", zone=zone, machine_type="e2-small",
                                                 disk_gb=10, labels={**labels, L.ROLE: L.SUPERVISOR},
                                                 image="projects/debian-cloud/global/images/family/debian-12",
                                                 service_account=""), deadline_s=30)
    ledger.remember([node, supervisor])  # as `run --detach` does before the laptop goes
    for what in ("launch", "detached", "attach", "watch", "teardown"):
        record.mark(what, at=time.time())
    tpu.delete_node(clients, zone, run, deadline_s=30)
    for what in ("collect", "done"):
        record.mark(what, at=time.time())
    record.save(clients, bucket_name, run)
    vm.delete(clients, zone, supervisor.name, deadline_s=30)  # the supervisor deletes itself last

    later = time.time() + 3600
    entries = api.cost_entries(clients, now=later)
    gone = {e.name: e.deleted for e in entries if e.kind != "bucket"}
    at = {m.what: m.at for m in record.marks}
    assert gone == {run: at["collect"], supervisor.name: at["done"]}
    assert not any(e.closed_by_scan for e in ledger.Ledger().entries())  # settled, once
    rate = cat.tpu_price_per_hour("v3-8", "us-central1", spot=False) / 3600
    ours = {e.name: cost.accrued(e, cat, now=later) for e in entries}
    assert abs(ours[run] - metered(cloud, clients, later)[run]) / rate < 0.5  # a poll interval apart at most
    summary = cost.report(entries, cat, since=later - 7200, now=later)
    phases = timeline.account(record, now=later, entries=entries, catalog=cat)
    assert summary.total_usd == pytest.approx(sum(phases.usd.values()))
