"""Compute Engine v1, Resource Manager v3 and Cloud Billing v1 emulation through the official REST clients."""

from __future__ import annotations

import asyncio

import asyncssh
import pytest
from google.api_core import exceptions as gexc
from google.cloud import compute_v1

from tpuctl.localcloud import facts

ZONE = "us-central1-a"


def _instance(name: str, machine: str = "e2-small", zone: str = ZONE, **extra) -> compute_v1.Instance:
    return compute_v1.Instance(
        name=name, machine_type=f"zones/{zone}/machineTypes/{machine}",
        disks=[compute_v1.AttachedDisk(boot=True, auto_delete=True, initialize_params=compute_v1.AttachedDiskInitializeParams(
            source_image="projects/debian-cloud/global/images/family/debian-12", disk_size_gb=10))],
        network_interfaces=[compute_v1.NetworkInterface(network="global/networks/default",
                                                        access_configs=[compute_v1.AccessConfig(name="External NAT")])],
        **extra)


def _insert(clients, name: str, zone: str = ZONE, **extra) -> compute_v1.Operation:
    op = clients.instances.insert_unary(project=clients.project, zone=zone, instance_resource=_instance(name, zone=zone, **extra))
    assert op.id.isdigit() if isinstance(op.id, str) else op.id > 0
    return clients.wait_compute(zone, op)


def test_instance_lifecycle(clients, cloud):
    done = _insert(clients, "vm1", labels={"tpuctl-run": "r1"})
    assert not done.error.errors
    vm = clients.instances.get(project=clients.project, zone=ZONE, instance="vm1")
    assert vm.status == "RUNNING" and vm.labels["tpuctl-run"] == "r1"
    assert vm.network_interfaces[0].network_i_p == "127.0.0.1"
    assert vm.network_interfaces[0].access_configs[0].nat_i_p == "127.0.0.1"
    assert vm.machine_type.endswith(f"/zones/{ZONE}/machineTypes/e2-small")

    op = clients.instances.set_labels(project=clients.project, zone=ZONE, instance="vm1",
                                      instances_set_labels_request_resource=compute_v1.InstancesSetLabelsRequest(
                                          labels={"tpuctl-run": "r1", "x": "y"}, label_fingerprint=vm.label_fingerprint))
    clients.wait_compute(ZONE, op)
    relabelled = clients.instances.get(project=clients.project, zone=ZONE, instance="vm1")
    assert dict(relabelled.labels) == {"tpuctl-run": "r1", "x": "y"}
    with pytest.raises(gexc.PreconditionFailed):  # stale fingerprint
        clients.instances.set_labels(project=clients.project, zone=ZONE, instance="vm1",
                                     instances_set_labels_request_resource=compute_v1.InstancesSetLabelsRequest(
                                         labels={}, label_fingerprint=vm.label_fingerprint))

    clients.wait_compute(ZONE, clients.instances.stop(project=clients.project, zone=ZONE, instance="vm1"))
    assert clients.instances.get(project=clients.project, zone=ZONE, instance="vm1").status == "TERMINATED"
    clients.wait_compute(ZONE, clients.instances.start(project=clients.project, zone=ZONE, instance="vm1"))
    assert clients.instances.get(project=clients.project, zone=ZONE, instance="vm1").status == "RUNNING"

    clients.wait_compute(ZONE, clients.instances.delete_unary(project=clients.project, zone=ZONE, instance="vm1"))
    with pytest.raises(gexc.NotFound):
        clients.instances.get(project=clients.project, zone=ZONE, instance="vm1")
    meter = {r["resource"]: r for r in cloud.meter_report()["resources"]}
    row = meter[f"projects/{clients.project}/zones/{ZONE}/instances/vm1"]
    assert row["kind"] == "vm" and row["sku"] == f"vm/e2-small/{ZONE}" and not row["running"]


def test_list_aggregated_list_and_filters(clients):
    _insert(clients, "a1", labels={"tpuctl-run": "one"})
    _insert(clients, "a2", labels={"tpuctl-run": "two"})
    _insert(clients, "b1", zone="europe-west4-a")
    names = [i.name for i in clients.instances.list(project=clients.project, zone=ZONE)]
    assert names == ["a1", "a2"]
    filtered = clients.instances.list(request={"project": clients.project, "zone": ZONE, "filter": "labels.tpuctl-run = two"})
    assert [i.name for i in filtered] == ["a2"]
    paged = clients.instances.list(request={"project": clients.project, "zone": ZONE, "max_results": 1})
    assert [i.name for i in paged] == ["a1", "a2"]
    agg = {zone: [i.name for i in scoped.instances]
           for zone, scoped in clients.instances.aggregated_list(project=clients.project) if scoped.instances}
    assert agg == {f"zones/{ZONE}": ["a1", "a2"], "zones/europe-west4-a": ["b1"]}
    labelled = clients.instances.aggregated_list(request={"project": clients.project, "filter": "labels.tpuctl-run:*"})
    assert sorted(i.name for _, s in labelled for i in s.instances) == ["a1", "a2"]


def test_vm_worker_accepts_ssh_keys_from_metadata(clients, cloud):
    key = asyncssh.generate_private_key("ssh-ed25519")
    line = f"bob:{key.export_public_key().decode().strip()} bob"
    _insert(clients, "sshvm", metadata=compute_v1.Metadata(items=[compute_v1.Items(key="ssh-keys", value=line)]))
    guest_attributes = {"project": clients.project, "zone": ZONE, "instance": "sshvm", "query_path": "hostkeys/"}
    with pytest.raises(gexc.NotFound, match="The resource 'hostkeys/' of type 'Guest Attribute' was not found."):
        clients.instances.get_guest_attributes(request=guest_attributes)  # off unless enable-guest-attributes
    _insert(clients, "sshvm2", metadata=compute_v1.Metadata(items=[compute_v1.Items(key="ssh-keys", value=line),
                                                                   compute_v1.Items(key="enable-guest-attributes",
                                                                                    value="TRUE")]))
    ga = clients.instances.get_guest_attributes(request={
        "project": clients.project, "zone": ZONE, "instance": "sshvm2", "query_path": "hostkeys/"})
    host_key = asyncssh.import_public_key(f"{ga.query_value.items[0].key} {ga.query_value.items[0].value}")
    vm = next(i for i in cloud.inventory()["instances"] if i["name"] == "sshvm2" and i["project"] == clients.project)
    port = vm["workers"][0]["port"]

    async def run() -> str:
        async with asyncssh.connect("127.0.0.1", port, username="bob", client_keys=[key],
                                    known_hosts=([host_key], [], [])) as conn:
            return (await conn.run(f"echo $GOOGLE_CLOUD_PROJECT; {md}/instance/name; echo; {md}/project/project-id",
                                   check=True, timeout=20)).stdout.split()

    # The VM's metadata server knows it too (header required, as on Google).
    md = "curl -sf -H 'Metadata-Flavor: Google' http://$GCE_METADATA_HOST/computeMetadata/v1"
    assert asyncio.run(run()) == [clients.project, "sshvm2", clients.project]


@pytest.mark.parametrize("change,match", [
    ({"machine_type": "e2-small"}, "Must be a URL"),
    ({"machine_type": f"zones/{ZONE}/machineTypes/e2-giant"}, "does not exist"),
    ({"machine_type": "zones/europe-west4-a/machineTypes/e2-small"}, "must be in zone"),
    ({"name": "Bad_Name"}, "resource.name"),
    ({"disks": []}, "Boot disk"),
    ({"labels": {"tpuctl-run": "x" * 64}}, "label value"),
])
def test_invalid_inserts_are_rejected(clients, change, match):
    inst = _instance("ok")
    for k, v in change.items():
        setattr(inst, k, v)
    with pytest.raises(gexc.BadRequest, match=match):
        clients.instances.insert_unary(project=clients.project, zone=ZONE, instance_resource=inst)


def test_duplicate_and_missing_instances(clients):
    _insert(clients, "dup")
    with pytest.raises(gexc.Conflict):
        clients.instances.insert_unary(project=clients.project, zone=ZONE, instance_resource=_instance("dup"))
    with pytest.raises(gexc.NotFound):
        clients.instances.delete_unary(project=clients.project, zone=ZONE, instance="nope")
    with pytest.raises(gexc.NotFound):
        clients.zone_operations.get(project=clients.project, zone=ZONE, operation="operation-1-2")


def test_zones_and_machine_types(clients):
    zones = {z.name: z for z in clients.zones.list(project=clients.project)}
    assert set(zones) == set(facts.all_zones()) and zones[ZONE].status == "UP"
    assert zones[ZONE].region.endswith("/regions/us-central1")
    mt = clients.machine_types.get(project=clients.project, zone=ZONE, machine_type="e2-standard-2")
    assert (mt.guest_cpus, mt.memory_mb) == (2, 8192)
    with pytest.raises(gexc.NotFound):
        clients.machine_types.get(project=clients.project, zone=ZONE, machine_type="e2-giant")


def test_project_number_is_deterministic_and_feeds_the_default_service_account(clients):
    p1 = clients.projects.get_project(name=f"projects/{clients.project}")
    p2 = clients.projects.get_project(name=f"projects/{clients.project}")
    assert p1.name == p2.name and p1.name.split("/")[1].isdigit() and p1.project_id == clients.project
    assert p1.state == p1.State.ACTIVE
    other = clients.projects.get_project(name="projects/some-other-proj")
    assert other.name != p1.name


def test_billing_catalog_lists_tpu_and_compute_skus(clients):
    services = {s.service_id: s.display_name for s in clients.billing.list_services()}
    assert services["E000-3F24-B8AA"] == "Cloud TPU" and services["6F81-5844-456A"] == "Compute Engine"
    tpu = list(clients.billing.list_skus(parent="services/E000-3F24-B8AA"))
    v3 = next(s for s in tpu if s.description == "Tpu-v3 chip running in europe-west4")
    price = v3.pricing_info[0].pricing_expression.tiered_rates[0].unit_price
    assert price.units + price.nanos / 1e9 == pytest.approx(2.20)
    assert v3.service_regions == ["europe-west4"] and v3.category.usage_type == "OnDemand"
    assert any(s.description.startswith("Preemptible Tpu-v2") for s in tpu)
    compute = [s.description for s in clients.billing.list_skus(parent="services/6F81-5844-456A")]
    assert any(d.startswith("TpuV5e") for d in compute) and any(d.startswith("Preemptible TpuV6e") for d in compute)
    assert any(d.startswith("e2-small") for d in compute)
    with pytest.raises(gexc.NotFound):
        list(clients.billing.list_skus(parent="services/NOPE-NOPE-NOPE"))


def test_two_writers_with_one_fingerprint_cannot_both_win(clients):
    """Fingerprints are optimistic locks ("You must always provide an up-to-date fingerprint hash ... otherwise
    the request will fail with error 412 conditionNotMet"): once one write is accepted, the fingerprint both
    writers read is stale, even before that write's operation is done, so the other write cannot overwrite it."""
    _insert(clients, "race")
    vm = clients.instances.get(project=clients.project, zone=ZONE, instance="race")
    first = clients.instances.set_metadata(project=clients.project, zone=ZONE, instance="race", metadata_resource=(
        compute_v1.Metadata(fingerprint=vm.metadata.fingerprint, items=[compute_v1.Items(key="a", value="1")])))
    with pytest.raises(gexc.PreconditionFailed):
        clients.instances.set_metadata(project=clients.project, zone=ZONE, instance="race", metadata_resource=(
            compute_v1.Metadata(fingerprint=vm.metadata.fingerprint, items=[compute_v1.Items(key="b", value="2")])))
    labels = clients.instances.set_labels(project=clients.project, zone=ZONE, instance="race",
                                          instances_set_labels_request_resource=compute_v1.InstancesSetLabelsRequest(
                                              labels={"x": "1"}, label_fingerprint=vm.label_fingerprint))
    with pytest.raises(gexc.PreconditionFailed):
        clients.instances.set_labels(project=clients.project, zone=ZONE, instance="race",
                                     instances_set_labels_request_resource=compute_v1.InstancesSetLabelsRequest(
                                         labels={"y": "2"}, label_fingerprint=vm.label_fingerprint))
    clients.wait_compute(ZONE, first)
    clients.wait_compute(ZONE, labels)
    after = clients.instances.get(project=clients.project, zone=ZONE, instance="race")
    assert [(i.key, i.value) for i in after.metadata.items] == [("a", "1")] and dict(after.labels) == {"x": "1"}
    again = clients.instances.set_metadata(project=clients.project, zone=ZONE, instance="race", metadata_resource=(
        compute_v1.Metadata(fingerprint=after.metadata.fingerprint, items=[])))  # a fresh read writes again
    clients.wait_compute(ZONE, again)


def test_set_metadata_replaces_items_and_feeds_ssh_keys(clients, cloud):
    _insert(clients, "meta")
    vm = clients.instances.get(project=clients.project, zone=ZONE, instance="meta")
    key = asyncssh.generate_private_key("ssh-ed25519")
    items = [compute_v1.Items(key="ssh-keys", value=f"carol:{key.export_public_key().decode().strip()} carol")]
    op = clients.instances.set_metadata(project=clients.project, zone=ZONE, instance="meta",
                                        metadata_resource=compute_v1.Metadata(fingerprint=vm.metadata.fingerprint, items=items))
    clients.wait_compute(ZONE, op)
    updated = clients.instances.get(project=clients.project, zone=ZONE, instance="meta")
    assert [i.key for i in updated.metadata.items] == ["ssh-keys"]
    assert updated.metadata.fingerprint != vm.metadata.fingerprint
    with pytest.raises(gexc.PreconditionFailed):
        clients.instances.set_metadata(project=clients.project, zone=ZONE, instance="meta",
                                       metadata_resource=compute_v1.Metadata(fingerprint=vm.metadata.fingerprint, items=[]))
    port = next(i for i in cloud.inventory()["instances"] if i["name"] == "meta" and i["project"] == clients.project)["workers"][0]["port"]

    async def run() -> str:
        async with asyncssh.connect("127.0.0.1", port, username="carol", client_keys=[key], known_hosts=None) as conn:
            return (await conn.run("echo hi", check=True, timeout=20)).stdout.strip()

    assert asyncio.run(run()) == "hi"
