"""Every fault kind, injected from Python and over the admin API, observed through the official clients."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import asyncssh
import pytest
from google.api_core import exceptions as gexc
from google.cloud import tpu_v2

from conftest import FAST_POLLING, tpuctl
from test_localcloud_compute import _instance
from test_provision import everything
from tpuctl.errors import CapacityError, QuotaError, from_google
from tpuctl.localcloud.core import Faults

ZONE = "europe-west4-a"
TF = "tpu-vm-tf-2.14.1"


def _node(**extra) -> tpu_v2.Node:
    return tpu_v2.Node(accelerator_type="v3-8", runtime_version=TF, **extra)


def _admin(cloud, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"{cloud.endpoint}/_localcloud/{path}", method=method,
                                 data=json.dumps(body).encode() if body is not None else None)
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_tpu_capacity_fault_fails_the_create_operation_with_code_8(clients, cloud):
    cloud.faults.add("capacity", service="tpu", zone=ZONE, count=1)
    op = clients.tpu.create_node(parent=clients.parent(ZONE), node_id="c1", node=_node())
    with pytest.raises(gexc.ResourceExhausted, match="There is no more capacity in the zone") as info:
        op.result(polling=FAST_POLLING)
    assert isinstance(from_google(info.value, what="create"), CapacityError)
    assert list(clients.tpu.list_nodes(parent=clients.parent(ZONE))) == []
    # count=1: the next create in the zone succeeds
    ok = clients.tpu.create_node(parent=clients.parent(ZONE), node_id="c1", node=_node()).result(polling=FAST_POLLING)
    assert ok.state == tpu_v2.Node.State.READY


def test_capacity_fault_is_scoped_to_its_zone(clients, cloud):
    cloud.faults.add("capacity", zone="us-central1-a")
    node = clients.tpu.create_node(parent=clients.parent(ZONE), node_id="elsewhere", node=_node()).result(polling=FAST_POLLING)
    assert node.state == tpu_v2.Node.State.READY


def test_compute_capacity_fault_is_zone_resource_pool_exhausted_503(clients, cloud):
    cloud.faults.add("capacity", service="compute", zone="us-central1-a")
    op = clients.instances.insert_unary(project=clients.project, zone="us-central1-a",
                                        instance_resource=_instance("full"))
    done = clients.wait_compute("us-central1-a", op)
    assert done.error.errors[0].code == "ZONE_RESOURCE_POOL_EXHAUSTED"
    assert done.http_error_status_code == 503
    with pytest.raises(gexc.NotFound):
        clients.instances.get(project=clients.project, zone="us-central1-a", instance="full")


def test_quota_fault_is_a_429_naming_the_quota(clients, cloud):
    cloud.faults.add("quota", service="tpu", method="nodes.create", quota="tpu.googleapis.com/tpu_v3_cores", count=1)
    with pytest.raises(gexc.TooManyRequests) as info:
        clients.tpu.create_node(parent=clients.parent(ZONE), node_id="q", node=_node())
    assert "tpu_v3_cores" in info.value.message
    err = from_google(info.value, what="create")
    assert isinstance(err, QuotaError) and "tpu_v3_cores" in err.message
    # a get is a different method: unaffected; and count=1 is spent
    clients.tpu.create_node(parent=clients.parent(ZONE), node_id="q", node=_node()).result(polling=FAST_POLLING)


def test_unavailable_storm_is_count_limited(clients, cloud):
    node = clients.tpu.create_node(parent=clients.parent(ZONE), node_id="storm", node=_node()).result(polling=FAST_POLLING)
    cloud.faults.add("unavailable", service="tpu", method="nodes.get", count=3)
    for _ in range(3):  # the TPU client does not retry 503 on get: each call sees one
        with pytest.raises(gexc.ServiceUnavailable):
            clients.tpu.get_node(name=node.name)
    assert clients.tpu.get_node(name=node.name).state == tpu_v2.Node.State.READY


def test_probability_faults_are_reproducible_with_a_seed():
    def pattern(seed: int) -> list[bool]:
        faults = Faults()
        faults.add("unavailable", probability=0.5, seed=seed)
        return [faults.take("unavailable", "tpu", "nodes.get", ZONE) is not None for _ in range(40)]

    assert pattern(7) == pattern(7)
    assert 5 < sum(pattern(7)) < 35


def test_stuck_operation_never_finishes(clients, cloud):
    cloud.faults.add("stuck", service="tpu", method="nodes.create")
    op = clients.tpu.create_node(parent=clients.parent(ZONE), node_id="stuck", node=_node())
    time.sleep(0.5)  # > 2x the create latency at speed 1000
    assert not clients.tpu.get_operation(request={"name": op.operation.name}).done
    assert clients.tpu.get_node(name=f"{clients.parent(ZONE)}/nodes/stuck").state == tpu_v2.Node.State.CREATING
    cloud.faults.clear()
    clients.tpu.delete_node(name=f"{clients.parent(ZONE)}/nodes/stuck").result(polling=FAST_POLLING)


def test_a_stuck_delete_is_finished_by_a_repeated_delete(clients, cloud):
    """A delete stuck once must not leave the node DELETING forever: the retry (tpuctl down again) ends it."""
    node = clients.tpu.create_node(parent=clients.parent(ZONE), node_id="stuck-del", node=_node()).result(
        polling=FAST_POLLING)
    clients.wait_compute(ZONE, clients.instances.insert_unary(project=clients.project, zone=ZONE,
                                                              instance_resource=_instance("stuck-del", zone=ZONE)))
    cloud.faults.add("stuck", service="tpu", method="nodes.delete", count=1)
    cloud.faults.add("stuck", service="compute", method="instances.delete", count=1)
    stuck = clients.tpu.delete_node(name=node.name)
    clients.instances.delete_unary(project=clients.project, zone=ZONE, instance="stuck-del")
    time.sleep(0.5)
    assert not clients.tpu.get_operation(request={"name": stuck.operation.name}).done
    assert clients.tpu.get_node(name=node.name).state == tpu_v2.Node.State.DELETING
    clients.tpu.delete_node(name=node.name).result(polling=FAST_POLLING)
    clients.wait_compute(ZONE, clients.instances.delete_unary(project=clients.project, zone=ZONE, instance="stuck-del"))
    with pytest.raises(gexc.NotFound):
        clients.tpu.get_node(name=node.name)
    with pytest.raises(gexc.NotFound):
        clients.instances.get(project=clients.project, zone=ZONE, instance="stuck-del")


def test_preempt_spot_node_at_a_chosen_time_and_refuse_on_demand(clients, cloud):
    spot = clients.tpu.create_node(parent=clients.parent(ZONE), node_id="spot",
                                   node=_node(scheduling_config=tpu_v2.SchedulingConfig(preemptible=True))).result(polling=FAST_POLLING)
    plain = clients.tpu.create_node(parent=clients.parent(ZONE), node_id="plain", node=_node()).result(polling=FAST_POLLING)
    with pytest.raises(ValueError, match="not spot or preemptible"):
        cloud.preempt(plain.name)
    cloud.preempt(spot.name, at=time.time() + 0.3)
    assert clients.tpu.get_node(name=spot.name).state == tpu_v2.Node.State.READY
    time.sleep(0.6)
    preempted = clients.tpu.get_node(name=spot.name)
    assert preempted.state == tpu_v2.Node.State.PREEMPTED and all(not ep.port for ep in preempted.network_endpoints)
    row = next(r for r in cloud.meter_report()["resources"] if r["resource"] == spot.name)
    assert not row["running"] and row["sku"] == f"tpu/v3-8/{ZONE}/spot"
    with pytest.raises(gexc.BadRequest):
        clients.tpu.start_node(request={"name": spot.name})


def test_admin_api_preempt_and_fault_registry(clients, cloud):
    spot = clients.tpu.create_node(parent=clients.parent(ZONE), node_id="adm",
                                   node=_node(scheduling_config=tpu_v2.SchedulingConfig(spot=True))).result(polling=FAST_POLLING)
    assert _admin(cloud, "POST", "preempt", {"node": spot.name})[0] == 200
    assert clients.tpu.get_node(name=spot.name).state == tpu_v2.Node.State.PREEMPTED

    code, body = _admin(cloud, "POST", "faults", {"kind": "quota", "service": "compute", "count": 2})
    assert code == 200 and body["fault"]["kind"] == "quota"
    assert [f["id"] for f in _admin(cloud, "GET", "faults")[1]["faults"]] == [body["fault"]["id"]]
    assert _admin(cloud, "POST", "faults", {"kind": "meteor"})[0] == 400
    assert _admin(cloud, "POST", "faults", {"kind": "quota", "colour": "red"})[0] == 400
    assert _admin(cloud, "DELETE", "faults")[1] == {"cleared": 1}
    assert _admin(cloud, "GET", "nothing-here")[0] == 404


def test_odd_response_leaves_a_field_out_or_answers_an_empty_list_and_stays_schema_valid(clients, cloud):
    # A test device, not a Google behaviour: a well-formed answer (the strict schema check still passes) that
    # lacks what a client counts on. `count` bounds it as for every fault; a dotted path reaches into lists.
    zone = "us-central1-a"
    cloud.faults.add("odd-response", service="compute", method="zones.get", field="region", count=1)
    assert clients.zones.get(project=clients.project, zone=zone).region == ""
    assert clients.zones.get(project=clients.project, zone=zone).region.endswith("/regions/us-central1")
    cloud.faults.add("odd-response", service="compute", method="zones.list", field="items", empty=True, count=1)
    assert list(clients.zones.list(project=clients.project)) == []
    cloud.faults.add("odd-response", service="compute", method="zones.list", field="items.region", count=1)
    listed = list(clients.zones.list(project=clients.project))
    assert zone in {z.name for z in listed} and {z.region for z in listed} == {""}
    assert _admin(cloud, "POST", "faults", {"kind": "odd-response"})[0] == 400  # which field, it must say
    assert cloud.faults.list() == []


def test_an_unexpected_exception_in_up_rolls_back_and_is_one_error_line(env, pc, cloud):
    # The create's answer without its operation name: the TPU client's operation poll raises ValueError, no
    # TpuctlError. What `up` created (the bucket, the node) must still be deleted, and the user reads one line.
    cloud.faults.add("odd-response", service="tpu", method="nodes.create", field="name", count=1)
    p = tpuctl(env, "up", "--accelerator", "v3-8", "--zone", ZONE, "--name", "odd", "--yes")
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert len(errors) == 1 and "unexpected ValueError" in errors[0], p.stderr
    assert "removed what this run created: " in errors[0] and "tpu/europe-west4-a/odd" in errors[0]
    assert everything(pc) == []


async def _connect(port: int, key: asyncssh.SSHKey):
    return await asyncssh.connect("127.0.0.1", port, username="alice", client_keys=[key], known_hosts=None)


def _ssh_node(clients, node_id: str, accelerator: str = "v3-8"):
    key = asyncssh.generate_private_key("ssh-ed25519")
    line = f"alice:{key.export_public_key().decode().strip()} alice"
    runtime = TF if accelerator == "v3-8" else "tpu-vm-tf-2.14.1-pod"
    node = clients.tpu.create_node(parent=clients.parent(ZONE), node_id=node_id, node=tpu_v2.Node(
        accelerator_type=accelerator, runtime_version=runtime, metadata={"ssh-keys": line})).result(polling=FAST_POLLING)
    return node, key


def test_kill_worker_makes_that_worker_unreachable(clients, cloud):
    node, key = _ssh_node(clients, "kw", "v3-32")
    cloud.faults.add("kill-worker", node=node.name, worker=1)
    ports = [ep.port for ep in node.network_endpoints]

    async def probe() -> list[bool]:
        out = []
        for port in ports:
            try:
                conn = await asyncio.wait_for(_connect(port, key), 10)
                conn.close()
                out.append(True)
            except (OSError, asyncssh.Error, asyncio.TimeoutError):
                out.append(False)
        return out

    assert asyncio.run(probe()) == [True, False, True, True]


def test_drop_ssh_closes_live_sessions(clients, cloud):
    node, key = _ssh_node(clients, "drop")

    async def scenario() -> str:
        async with await _connect(node.network_endpoints[0].port, key) as conn:
            proc = await conn.create_process("sleep 30")
            await asyncio.sleep(0.2)
            cloud.faults.add("drop-ssh", node=node.name)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except (asyncssh.Error, OSError) as exc:
                return type(exc).__name__
            return "closed"

    assert asyncio.run(scenario()) in ("closed", "ConnectionLost", "ChannelOpenError", "DisconnectError")


def _meter_row(cloud, key: str) -> dict:
    return next(r for r in cloud.meter_report()["resources"] if r["resource"] == key)


def test_preempt_a_spot_compute_instance_as_compute_does(clients, cloud):
    """A Spot VM is preempted by a `compute.instances.preempted` operation from `system` (the one Google's
    preemption-history sample lists), its guest dies, and its termination action follows: STOP (the default)
    leaves it TERMINATED with lastStopTimestamp and no bill; DELETE deletes it. On-demand VMs are refused."""
    from google.cloud import compute_v1

    from test_localcloud_compute import _insert

    zone = "us-central1-a"
    _insert(clients, "plain-vm", zone)
    _insert(clients, "spot-stop", zone, scheduling=compute_v1.Scheduling(provisioning_model="SPOT"))
    _insert(clients, "spot-del", zone, scheduling=compute_v1.Scheduling(provisioning_model="SPOT",
                                                                        instance_termination_action="DELETE"))
    key = f"projects/{clients.project}/zones/{zone}/instances/spot-stop"
    with pytest.raises(ValueError, match="not a Spot or preemptible VM"):
        cloud.preempt(f"projects/{clients.project}/zones/{zone}/instances/plain-vm")
    assert [w["port"] for w in next(i for i in cloud.inventory()["instances"] if i["name"] == "spot-stop")["workers"]]
    cloud.preempt(key)  # the session cloud's other projects may hold the same short names
    assert _admin(cloud, "POST", "preempt", {"node": key.replace("spot-stop", "spot-del")})[0] == 200
    vm = clients.instances.get(project=clients.project, zone=zone, instance="spot-stop")
    assert vm.status in ("STOPPING", "TERMINATED")
    assert not next(i for i in cloud.inventory()["instances"] if i["name"] == "spot-stop"
                    and i["project"] == clients.project)["workers"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        vm = clients.instances.get(project=clients.project, zone=zone, instance="spot-stop")
        try:
            clients.instances.get(project=clients.project, zone=zone, instance="spot-del")
        except gexc.NotFound:
            if vm.status == "TERMINATED":
                break
        time.sleep(0.05)
    assert vm.status == "TERMINATED" and vm.last_stop_timestamp
    assert not _meter_row(cloud, key)["running"]
    ops = list(clients.zone_operations.list(request=compute_v1.ListZoneOperationsRequest(
        project=clients.project, zone=zone,
        filter='operationType="compute.instances.preempted" AND targetLink:instances/spot-')))
    assert sorted(op.target_link.rsplit("/", 1)[-1] for op in ops) == ["spot-del", "spot-stop"]
    assert all(op.user == "system" and op.status == compute_v1.Operation.Status.DONE and not op.error.errors
               for op in ops)
