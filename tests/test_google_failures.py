"""Google's real failure shapes, emulated by the strict local cloud and handled by tpuctl.

Each test injects one shape as Google sends it (localcloud/README.md, "Faults", cites the source of each)
and checks both halves: the official client sees Google's shape, and tpuctl does the right thing with it.
"""

from __future__ import annotations

import threading
import time

import pytest
from conftest import FAST_POLLING
from google.api_core import exceptions as gexc
from google.cloud import tpu_v2
from google.protobuf import field_mask_pb2

from tpuctl import provision as prov
from tpuctl import spec
from tpuctl.errors import QUOTAS_PAGE, CapacityError, NameTaken, QuotaError
from tpuctl.provision import tpu as ptpu
from tpuctl.provision import vm as pvm
from tpuctl.provision import waits

FAST_DEADLINE = 60.0
TF = "tpu-vm-tf-2.17.0-pjrt"


def make_plan(pc, **fields):
    raw = {"name": "run1", "accelerator": "v3-8", "zone": "europe-west4-a", "ttl": "2h", **fields}
    return prov.plan(spec.from_mapping(raw), project=pc.project, owner="tester")


def node_name(pc, zone: str = "europe-west4-a", name: str = "run1") -> str:
    return f"projects/{pc.project}/locations/{zone}/nodes/{name}"


def live(pc) -> list[str]:
    parent = f"projects/{pc.project}/locations/-"
    return [n.name for n in pc.tpu.list_nodes(parent=parent)] + [q.name for q in pc.tpu.list_queued_resources(parent=parent)]


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
    return value


# -- capacity -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code, exc_type", [(8, gexc.ResourceExhausted), (9, gexc.FailedPrecondition),
                                            (13, gexc.InternalServerError)])
def test_stockout_codes_reach_the_client_as_google_sends_them(pc, cloud, code, exc_type):
    cloud.faults.add("capacity", service="tpu", method="nodes.create", zone="us-central1-a", code=code)
    op = pc.tpu.create_node(parent=f"projects/{pc.project}/locations/us-central1-a", node_id="n1",
                            node=tpu_v2.Node(accelerator_type="v3-8", runtime_version=TF))
    with pytest.raises(exc_type) as e:
        op.result(polling=FAST_POLLING)
    assert {8: "no more capacity", 9: "Insufficient reserved capacity", 13: "internal error"}[code] in e.value.message
    assert live(pc) == []


@pytest.mark.parametrize("code", [8, 9, 13])
def test_every_stockout_code_fails_over_to_the_next_zone(pc, cloud, code):
    cloud.faults.add("capacity", service="tpu", method="nodes.create", zone="us-central1-a", code=code)
    result = prov.apply(pc, make_plan(pc, zone=["us-central1-a", "us-central1-b"]), deadline_s=FAST_DEADLINE)
    assert result.zone == "us-central1-b"
    assert live(pc) == [node_name(pc, "us-central1-b")]
    prov.down(pc, "run1", delete_bucket=True)


def test_stockouts_in_every_zone_exit_3_naming_each_code(pc, cloud):
    cloud.faults.add("capacity", service="tpu", zone="us-central1-a", code=9)
    cloud.faults.add("capacity", service="tpu", zone="us-central1-b", code=13)
    with pytest.raises(CapacityError) as e:
        prov.apply(pc, make_plan(pc, zone=["us-central1-a", "us-central1-b"]), deadline_s=FAST_DEADLINE)
    assert e.value.exit_code == 3 and "code 9" in e.value.message and "code 13" in e.value.message
    assert live(pc) == []


# -- quota --------------------------------------------------------------------------------------------------


def test_tpu_429_with_quota_failure_is_reported_at_once_with_where_to_raise_it(pc, cloud):
    cloud.faults.add("quota", service="tpu", method="nodes.create", quota="TPUV3sPerProjectPerZoneForTPUAPI")
    t0 = time.monotonic()
    with pytest.raises(QuotaError) as e:
        prov.apply(pc, make_plan(pc), deadline_s=FAST_DEADLINE)
    assert time.monotonic() - t0 < 10
    assert e.value.exit_code == 3 and "TPUV3sPerProjectPerZoneForTPUAPI" in e.value.message
    assert QUOTAS_PAGE in e.value.hint and "role" not in e.value.hint
    assert live(pc) == []


def test_tpu_429_without_details_is_a_quota_after_a_short_bounded_retry(pc, cloud, monkeypatch):
    monkeypatch.setattr(waits, "BARE_429_S", 1.0)  # production: 20 s, never minutes
    cloud.faults.add("quota", service="tpu", method="nodes.create", details=False,
                     quota="TPUV2sPodPerProjectPerRegionForTPUAPI")
    with pytest.raises(gexc.TooManyRequests) as raw:
        pc.tpu.create_node(parent=f"projects/{pc.project}/locations/europe-west4-a", node_id="x",
                           node=tpu_v2.Node(accelerator_type="v3-8", runtime_version=TF))
    assert not raw.value.details and "Quota limit 'TPUV2sPodPerProjectPerRegionForTPUAPI' has been exceeded" in raw.value.message
    t0 = time.monotonic()
    with pytest.raises(QuotaError) as e:
        prov.apply(pc, make_plan(pc), deadline_s=FAST_DEADLINE)
    assert time.monotonic() - t0 < 15
    assert e.value.exit_code == 3 and "TPUV2sPodPerProjectPerRegionForTPUAPI" in e.value.message
    assert QUOTAS_PAGE in e.value.hint
    assert live(pc) == []


def test_compute_quota_as_403_is_a_quota_not_a_missing_role(pc, cloud):
    cloud.faults.add("quota", service="compute", method="instances.insert", quota="CPUS")
    with pytest.raises(gexc.Forbidden) as raw:
        pc.instances.insert(project=pc.project, zone="europe-west4-a", instance_resource={"name": "x"})
    assert raw.value.errors[0]["reason"] == "quotaExceeded"
    # The user-facing text as AIP-193 carries it: a google.rpc.LocalizedMessage detail.
    assert {"@type": "type.googleapis.com/google.rpc.LocalizedMessage", "locale": "en-US",
            "message": "Quota 'CPUS' exceeded.  Limit: 0.0 in region europe-west4."} in raw.value.details
    cloud.faults.add("quota", service="compute", method="instances.insert", quota="CPUS")
    t0 = time.monotonic()
    with pytest.raises(QuotaError) as e:
        prov.apply(pc, make_plan(pc, vms=[{"name": "d"}]), deadline_s=FAST_DEADLINE)
    assert time.monotonic() - t0 < 20
    assert e.value.exit_code == 3 and "'CPUS'" in e.value.message and QUOTAS_PAGE in e.value.hint
    assert live(pc) == []


def test_compute_quota_as_a_403_operation_error_is_a_quota(pc, cloud):
    cloud.faults.add("quota", service="compute", method="instances.insert", quota="CPUS", in_operation=True)
    with pytest.raises(QuotaError) as e:
        prov.apply(pc, make_plan(pc, vms=[{"name": "d"}]), deadline_s=FAST_DEADLINE)
    assert e.value.exit_code == 3 and "CPUS" in e.value.message and QUOTAS_PAGE in e.value.hint
    # The operation's errorDetails name the quota structurally (quotaInfo) and carry a localizedMessage.
    assert "quota CPUS-per-project-region exceeded" in e.value.message
    assert live(pc) == []


# -- node states --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["REPAIRING", "RESTARTING"])
def test_maintenance_passes_and_the_node_is_waited_for_not_recreated(pc, cloud, state):
    prov.apply(pc, make_plan(pc), deadline_s=FAST_DEADLINE)
    before = pc.tpu.get_node(name=node_name(pc))
    cloud.repair(node_name(pc), state=state, seconds=1500)  # 1.5 s at the tests' speed
    during = pc.tpu.get_node(name=node_name(pc))
    assert during.state == tpu_v2.Node.State[state]
    assert during.health == tpu_v2.Node.Health.UNHEALTHY_MAINTENANCE
    assert prov.get_node(pc, "europe-west4-a", "run1").state is prov.State.REPAIRING
    after = prov.recreate_node(pc, "europe-west4-a", "run1", deadline_s=FAST_DEADLINE)
    assert after.state is prov.State.READY and after.workers
    again = pc.tpu.get_node(name=node_name(pc))
    assert again.id == before.id and again.create_time == before.create_time  # the same node, not a new one
    assert again.health == tpu_v2.Node.Health.HEALTHY
    prov.down(pc, "run1", delete_bucket=True)


# -- guest attributes, patches, 409s ------------------------------------------------------------------------


def test_guest_attributes_returning_nothing_leaves_host_keys_to_first_use(pc, cloud):
    prov.apply(pc, make_plan(pc), deadline_s=FAST_DEADLINE)
    cloud.faults.add("no-guest-attributes", service="tpu", count=1)
    assert not pc.tpu.get_guest_attributes(request={"name": node_name(pc)}).guest_attributes
    cloud.faults.add("no-guest-attributes", service="tpu", count=1)
    workers = prov.workers(pc, "europe-west4-a", "run1")
    assert workers and all(w.host_key is None for w in workers)
    # A key trusted on first use is recorded under the node's id, as gcloud's HostKeyAlias is, not the address.
    node = pc.tpu.get_node(name=node_name(pc))
    assert [w.host_key_alias for w in workers] == [f"tpu.{node.id}-{w.index}" for w in workers]
    prov.down(pc, "run1", delete_bucket=True)


def test_guest_attributes_failing_does_not_fail_the_run(pc, cloud, monkeypatch):
    monkeypatch.setattr(ptpu, "HOST_KEYS_DEADLINE_S", 0.5)  # production: 10 s
    prov.apply(pc, make_plan(pc), deadline_s=FAST_DEADLINE)
    cloud.faults.add("unavailable", service="tpu", method="nodes.getGuestAttributes")
    workers = prov.workers(pc, "europe-west4-a", "run1")
    assert workers and all(w.host_key is None for w in workers) and all(w.port for w in workers)
    cloud.faults.clear()
    prov.down(pc, "run1", delete_bucket=True)


def test_a_preempted_node_refuses_updates_and_tpuctl_says_why(pc, cloud):
    prov.apply(pc, make_plan(pc, provisioning="spot"), deadline_s=FAST_DEADLINE)
    cloud.preempt(node_name(pc))
    wait_for(lambda: pc.tpu.get_node(name=node_name(pc)).state == tpu_v2.Node.State.PREEMPTED)
    with pytest.raises(gexc.BadRequest) as refused:  # code 3 INVALID_ARGUMENT, in Google's words
        pc.tpu.update_node(node=tpu_v2.Node(name=node_name(pc), metadata={"a": "b"}),
                           update_mask=field_mask_pb2.FieldMask(paths=["metadata"]))
    assert "update is not supported while in state PREEMPTED" in refused.value.message
    assert refused.value.response.json()["error"]["status"] == "INVALID_ARGUMENT"
    with pytest.raises(CapacityError) as e:
        prov.add_ssh_key(pc, "europe-west4-a", "run1", "me", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE me@laptop")
    assert "preempted" in e.value.message and "recreate" in e.value.hint
    prov.down(pc, "run1", delete_bucket=True)


def test_a_concurrent_metadata_update_gets_409_and_tpuctl_retries_keeping_both(pc, cloud):
    prov.apply(pc, make_plan(pc), deadline_s=FAST_DEADLINE)
    name = node_name(pc)
    other = {"ssh-keys": "other:ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIO other@box"}
    cloud.faults.add("stuck", service="tpu", method="nodes.patch", count=1)  # the other writer's update is slow
    other_op = pc.tpu.update_node(node=tpu_v2.Node(name=name, metadata=other),
                                  update_mask=field_mask_pb2.FieldMask(paths=["metadata"]))
    with pytest.raises(gexc.Conflict):
        pc.tpu.update_node(node=tpu_v2.Node(name=name, metadata={"x": "y"}),
                           update_mask=field_mask_pb2.FieldMask(paths=["metadata"]))
    result: list = []
    adder = threading.Thread(target=lambda: result.append(prov.add_ssh_key(
        pc, "europe-west4-a", "run1", "me", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE me@laptop")))
    adder.start()
    time.sleep(3)  # the other update holds the node for seconds (localcloud: 5 simulated s), not a blink
    # The other update completes as localcloud's own scheduled transition would have done without the fault.
    cloud.world.later(0, "tpu.update_done", node=name, op=other_op.operation.name, changes={"metadata": other})
    adder.join(timeout=30)
    assert result == [True]
    keys = pc.tpu.get_node(name=name).metadata["ssh-keys"]
    assert "other:ssh-ed25519" in keys and "me:ssh-ed25519" in keys
    prov.down(pc, "run1", delete_bucket=True)


# -- spot and queued resources ------------------------------------------------------------------------------


def test_a_spot_node_cannot_be_stopped(pc, cloud):
    prov.apply(pc, make_plan(pc, provisioning="spot"), deadline_s=FAST_DEADLINE)
    with pytest.raises(gexc.BadRequest) as e:  # FAILED_PRECONDITION
        pc.tpu.stop_node(request={"name": node_name(pc)})
    assert "Spot" in e.value.message
    assert pc.tpu.get_node(name=node_name(pc)).state == tpu_v2.Node.State.READY
    prov.down(pc, "run1", delete_bucket=True)


def test_queued_resource_leaves_active_once_its_node_is_deleted_and_up_recreates_it(pc, cloud):
    plan = make_plan(pc, provisioning="queued")
    prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    qr = f"projects/{pc.project}/locations/europe-west4-a/queuedResources/run1"
    assert pc.tpu.get_queued_resource(name=qr).state.state == tpu_v2.QueuedResourceState.State.ACTIVE
    pc.tpu.delete_node(name=node_name(pc)).result(polling=FAST_POLLING)
    got = pc.tpu.get_queued_resource(name=qr).state
    assert got.state == tpu_v2.QueuedResourceState.State.SUSPENDED
    assert got.state_initiator == tpu_v2.QueuedResourceState.StateInitiator.USER
    result = prov.apply(pc, plan, deadline_s=FAST_DEADLINE)  # `up` again: the run comes back
    assert result.get(prov.Kind.TPU).state is prov.State.READY
    assert pc.tpu.get_queued_resource(name=qr).state.state == tpu_v2.QueuedResourceState.State.ACTIVE
    prov.down(pc, "run1", delete_bucket=True)
    assert live(pc) == []


def test_queued_resource_valid_until_duration_is_stored_as_a_time_and_delete_follows_googles_rule(pc, cloud):
    parent = f"projects/{pc.project}/locations/europe-west4-a"
    body = tpu_v2.QueuedResource(
        tpu=tpu_v2.QueuedResource.Tpu(node_spec=[tpu_v2.QueuedResource.Tpu.NodeSpec(
            parent=parent, node_id="qn", node=tpu_v2.Node(accelerator_type="v3-8", runtime_version=TF))]),
        queueing_policy=tpu_v2.QueuedResource.QueueingPolicy(valid_until_duration={"seconds": 3600}),
        spot=tpu_v2.QueuedResource.Spot())
    created = pc.tpu.create_queued_resource(parent=parent, queued_resource_id="q1", queued_resource=body)
    qr = created.result(polling=FAST_POLLING)
    assert qr.queueing_policy.valid_until_time and not qr.queueing_policy.valid_until_duration
    wait_for(lambda: pc.tpu.get_queued_resource(name=qr.name).state.state
             == tpu_v2.QueuedResourceState.State.ACTIVE)
    with pytest.raises(gexc.BadRequest):  # ACTIVE with a live node: only force deletes it
        pc.tpu.delete_queued_resource(name=qr.name)
    cloud.preempt(f"{parent}/nodes/qn")
    wait_for(lambda: pc.tpu.get_queued_resource(name=qr.name).state.state
             == tpu_v2.QueuedResourceState.State.SUSPENDED)
    pc.tpu.delete_queued_resource(name=qr.name).result(polling=FAST_POLLING)  # SUSPENDED: no force needed
    assert live(pc) == []


# -- a create retried after Google committed it -------------------------------------------------------------


def test_a_create_answers_with_its_operation_as_it_was_then(pc, cloud):
    """The clock thread may finish an operation while the server still encodes the create's answer (at speed
    1000 a queued resource is accepted 2 ms later): the answer is a snapshot, never the stored operation."""
    parent = f"projects/{pc.project}/locations/europe-west4-a"
    live(pc)  # the project exists for the local cloud
    body = {"tpu": {"nodeSpec": [{"parent": parent, "nodeId": "snap",
                                  "node": {"acceleratorType": "v3-8", "runtimeVersion": TF}}]}}
    params = {"projectsId": pc.project, "locationsId": "europe-west4-a"}
    answer = cloud.tpu.queued_create(params, {"queuedResourceId": "snap"}, body)
    cloud.tpu._qr_accept(f"{parent}/queuedResources/snap", answer["name"])
    assert answer["done"] is False and "response" not in answer
    assert pc.tpu.get_queued_resource(name=f"{parent}/queuedResources/snap").state.state != \
        tpu_v2.QueuedResourceState.State.CREATING  # the stored one moved on
    ptpu.delete_queued(pc, "europe-west4-a", "snap", deadline_s=FAST_DEADLINE)


@pytest.mark.parametrize("provisioning, method", [("on-demand", "create_node"), ("queued", "create_queued_resource")])
def test_a_create_whose_answer_was_lost_after_google_committed_it_is_adopted(pc, cloud, monkeypatch, provisioning,
                                                                             method):
    """Google commits the create, then the answer is a 5xx (or never arrives): tpuctl retries, Google answers
    409 ALREADY_EXISTS, and the run's own resource is adopted instead of failing the run (and rolling it back)."""
    real = getattr(pc.tpu, method)
    calls = []

    def committed_then_500(*args, **kwargs):
        calls.append(method)
        if len(calls) == 1:
            real(*args, **kwargs)
            raise gexc.InternalServerError("the answer was lost after the create was committed")
        return real(*args, **kwargs)

    monkeypatch.setattr(pc.tpu, method, committed_then_500)
    result = prov.apply(pc, make_plan(pc, provisioning=provisioning), deadline_s=FAST_DEADLINE)
    assert len(calls) == 2 and result.get(prov.Kind.TPU).state is prov.State.READY
    prov.down(pc, "run1", delete_bucket=True)
    assert live(pc) == []


def test_a_409_for_someone_elses_node_is_not_adopted(pc, cloud, monkeypatch):
    """The same 409 when the name was taken by a node of another run between tpuctl's read and its create."""
    real = pc.tpu.create_node

    def someone_else_first(*args, **kwargs):
        real(parent=kwargs["parent"], node_id=kwargs["node_id"],
             node=tpu_v2.Node(accelerator_type="v3-8", runtime_version=TF, labels={"tpuctl-run": "other"}))
        return real(*args, **kwargs)

    monkeypatch.setattr(pc.tpu, "create_node", someone_else_first)
    with pytest.raises(NameTaken, match="does not belong to run 'run1'"):
        prov.apply(pc, make_plan(pc), deadline_s=FAST_DEADLINE)
    assert pc.tpu.get_node(name=node_name(pc)).labels["tpuctl-run"] == "other"  # the rollback left it alone
    ptpu.delete_node(pc, "europe-west4-a", "run1", deadline_s=FAST_DEADLINE)


def test_a_409_for_someone_elses_vm_is_not_adopted(pc, cloud, monkeypatch):
    """The VM path: an insert refused with 409 for an instance of another run is neither adopted nor rolled back."""
    plan = make_plan(pc, vms=[{"name": "driver"}])
    vm_name = plan.vm_name(plan.vms[0])
    real = pc.instances.insert_unary

    def someone_else_first(*args, **kwargs):
        theirs = type(kwargs["instance_resource"])(kwargs["instance_resource"])
        if theirs.name == vm_name:
            theirs.labels["tpuctl-run"] = "other"
            real(project=kwargs["project"], zone=kwargs["zone"], instance_resource=theirs)
        return real(*args, **kwargs)

    monkeypatch.setattr(pc.instances, "insert_unary", someone_else_first)
    with pytest.raises(NameTaken, match="does not belong to run 'run1'"):
        prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    zone = plan.zones[0]
    assert pc.instances.get(project=pc.project, zone=zone, instance=vm_name).labels["tpuctl-run"] == "other"
    monkeypatch.undo()
    prov.down(pc, "run1", delete_bucket=True)
    assert live(pc) == []
    pvm.delete(pc, zone, vm_name, deadline_s=FAST_DEADLINE)


def test_a_spot_node_preempted_while_creating_fails_over_like_a_stockout(pc, cloud):
    # Google's shape: the create operation fails with code 3, as a bad request would, and the node is PREEMPTED.
    cloud.faults.add("preempt-creating", service="tpu", zone="us-central1-a", count=1)
    op = pc.tpu.create_node(parent=f"projects/{pc.project}/locations/us-central1-a", node_id="n1",
                            node=tpu_v2.Node(accelerator_type="v3-8", runtime_version=TF,
                                             scheduling_config=tpu_v2.SchedulingConfig(spot=True)))
    with pytest.raises(gexc.InvalidArgument) as e:
        op.result(polling=FAST_POLLING)
    assert "update is not supported while in state PREEMPTED" in e.value.message
    assert pc.tpu.get_node(name=node_name(pc, "us-central1-a", "n1")).state == tpu_v2.Node.State.PREEMPTED
    pc.tpu.delete_node(name=node_name(pc, "us-central1-a", "n1")).result(polling=FAST_POLLING)
    # tpuctl takes it for reclaimed capacity: the next zone, and nothing left where it was preempted.
    cloud.faults.add("preempt-creating", service="tpu", zone="us-central1-a")
    zones = ["us-central1-a", "us-central1-b"]
    result = prov.apply(pc, make_plan(pc, zone=zones, provisioning="spot"), deadline_s=FAST_DEADLINE)
    assert result.zone == "us-central1-b" and live(pc) == [node_name(pc, "us-central1-b")]
    prov.down(pc, "run1", delete_bucket=True)
    # With no other zone it is a capacity failure (exit 3), not a bad request (exit 2); an on-demand node is
    # never preempted.
    with pytest.raises(CapacityError) as e:
        prov.apply(pc, make_plan(pc, zone="us-central1-a", provisioning="spot"), deadline_s=FAST_DEADLINE)
    assert e.value.exit_code == 3 and "reclaimed" in e.value.message and live(pc) == []
    prov.apply(pc, make_plan(pc, zone="us-central1-a"), deadline_s=FAST_DEADLINE)
    assert live(pc) == [node_name(pc, "us-central1-a")]
    prov.down(pc, "run1", delete_bucket=True)


def test_a_stopped_node_takes_a_metadata_update(pc, cloud):
    # No source shows Google refusing an update of a STOPPED node (only of a PREEMPTED one).
    prov.apply(pc, make_plan(pc), deadline_s=FAST_DEADLINE)
    pc.tpu.stop_node(request=tpu_v2.StopNodeRequest(name=node_name(pc))).result(polling=FAST_POLLING)
    assert prov.add_ssh_key(pc, "europe-west4-a", "run1", "me", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE me@laptop")
    assert "me:ssh-ed25519" in pc.tpu.get_node(name=node_name(pc)).metadata["ssh-keys"]
    prov.down(pc, "run1", delete_bucket=True)
