"""Provisioning against the strict local cloud with the official clients: create, adopt, fail over, retry,
roll back, tear down — and count what is left in the project afterwards."""

from __future__ import annotations

import threading
import time

import pytest
from google.cloud import compute_v1, tpu_v2

from tpuctl import spec
from tpuctl import provision as prov
from tpuctl.errors import BadInput, CapacityError, Interrupted, NotFound, QuotaError
from tpuctl.provision import bucket as B
from tpuctl.provision import labels as L

FAST_DEADLINE = 60.0


def make_plan(pc, **fields):
    raw = {"name": "run1", "accelerator": "v3-8", "zone": "europe-west4-a", "ttl": "2h", **fields}
    return prov.plan(spec.from_mapping(raw), project=pc.project, owner="tester")


def everything(pc) -> list[str]:
    """Every node, queued resource, VM and bucket in the project, labelled or not, straight from the APIs."""
    parent = f"projects/{pc.project}/locations/-"
    out = [n.name for n in pc.tpu.list_nodes(parent=parent)]
    out += [q.name for q in pc.tpu.list_queued_resources(parent=parent)]
    for _zone, scoped in pc.instances.aggregated_list(project=pc.project):
        out += [i.name for i in scoped.instances]
    out += [b.name for b in pc.storage.list_buckets(project=pc.project)]
    return out


def default_sa(pc) -> str:
    number = pc.projects.get_project(name=f"projects/{pc.project}").name.rsplit("/", 1)[-1]
    return f"{number}-compute@developer.gserviceaccount.com"


def test_single_host_spot_tpu_vm_bucket_and_iam_then_down(pc):
    other = pc.storage.create_bucket(f"unrelated-{pc.project}", location="europe-west4")
    plan = make_plan(pc, provisioning="spot", vms=[{"name": "driver"}])
    seen: list[tuple[str, str]] = []
    result = prov.apply(pc, plan, progress=lambda k, s, d: seen.append((k, s)), deadline_s=FAST_DEADLINE)

    node = result.get(prov.Kind.TPU)
    assert node.state is prov.State.READY and node.spot and node.accelerator == "v3-8"
    assert node.location == "europe-west4-a" and len(node.workers) == 1 and node.workers[0].port > 0
    assert node.labels[L.RUN] == "run1" and node.labels[L.OWNER] == "tester"
    assert int(node.labels[L.EXPIRES]) - int(node.labels[L.CREATED]) == 7200
    raw = pc.tpu.get_node(name=f"projects/{pc.project}/locations/europe-west4-a/nodes/run1")
    assert raw.service_account.email == default_sa(pc) and raw.scheduling_config.spot
    vm = result.get(prov.Kind.VM)
    assert vm.name == "run1-driver" and vm.state is prov.State.READY and vm.labels[L.RUN] == "run1"
    assert ("tpu/europe-west4-a/run1", "ready") in seen

    b = pc.storage.get_bucket(plan.bucket)
    assert b.location.lower() == "europe-west4" == node.location.rsplit("-", 1)[0]  # bucket region == TPU region
    assert b.iam_configuration.uniform_bucket_level_access_enabled
    assert b.iam_configuration.public_access_prevention == "enforced"
    assert b.labels[L.RUN] == "run1"
    # The binding exists on this bucket, for the TPU's service account, and nowhere else.
    assert B.bindings(pc, plan.bucket).count((B.ROLE, f"serviceAccount:{default_sa(pc)}")) == 1
    assert all(default_sa(pc) not in m for _r, m in B.bindings(pc, other.name))

    (status,) = prov.status(pc, "run1", price=lambda r: 1.0)
    assert status.state is prov.State.READY and status.zone == "europe-west4-a" and status.workers == 1
    assert {r.kind for r in status.resources} == set(prov.Kind) - {prov.Kind.QUEUED}

    kept = prov.down(pc, "run1")
    assert [r.kind for r in kept.kept if r.kind is prov.Kind.BUCKET] == [prov.Kind.BUCKET]
    assert sorted(everything(pc)) == sorted([plan.bucket, other.name])
    prov.down(pc, "run1", delete_bucket=True)
    assert prov.list_resources(pc, "run1") == []
    assert everything(pc) == [other.name]


def test_down_deletes_the_bucket_only_after_the_tpu_and_vms_are_gone(pc):
    """A teardown killed half-way must never leave compute running without the bucket it writes to."""
    prov.apply(pc, make_plan(pc, vms=[{"name": "driver"}]), deadline_s=FAST_DEADLINE)
    events: list[tuple[str, str]] = []
    prov.down(pc, "run1", delete_bucket=True, progress=lambda k, s, d: events.append((k.split("/")[0], s)))
    first_bucket_event = next(i for i, (kind, _s) in enumerate(events) if kind == prov.Kind.BUCKET.value)
    compute_done = [i for i, e in enumerate(events) if e in (("tpu", "deleted"), ("vm", "deleted"))]
    assert len(compute_done) == 2 and max(compute_done) < first_bucket_event, events
    assert everything(pc) == []


def test_multi_host_slice_has_one_worker_per_host_with_host_keys(pc):
    plan = make_plan(pc, accelerator="v4-32", zone="us-central2-b")
    result = prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    node = result.get(prov.Kind.TPU)
    assert len(node.workers) == 4 and len({w.port for w in node.workers}) == 4
    workers = prov.workers(pc, "us-central2-b", "run1")
    assert [w.index for w in workers] == [0, 1, 2, 3] and all(w.host_key for w in workers)
    prov.down(pc, "run1", delete_bucket=True)
    assert everything(pc) == []


def test_queued_resource(pc):
    plan = make_plan(pc, provisioning="queued", valid_until="1h")
    result = prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    assert result.get(prov.Kind.TPU).state is prov.State.READY
    kinds = {r.kind for r in prov.list_resources(pc, "run1")}
    assert {prov.Kind.QUEUED, prov.Kind.TPU} <= kinds
    prov.down(pc, "run1", delete_bucket=True)
    assert everything(pc) == []


def test_re_up_adopts_and_creates_only_what_is_missing(pc):
    plan = make_plan(pc, vms=[{"name": "a"}])
    first = prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    assert len(first.created) == 4 and first.adopted == ()
    prov.vm.delete(pc, "europe-west4-a", "run1-a")
    second = prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    assert second.created == ("vm/europe-west4-a/run1-a",)
    assert set(second.adopted) == {"tpu/europe-west4-a/run1", f"bucket/europe-west4/{plan.bucket}"}
    assert second.get(prov.Kind.TPU).created == first.get(prov.Kind.TPU).created
    assert len(everything(pc)) == 3
    prov.down(pc, "run1", delete_bucket=True)


def test_a_name_taken_by_another_run_is_refused(pc):
    prov.apply(pc, make_plan(pc), deadline_s=FAST_DEADLINE)
    other = make_plan(pc, bucket=f"b-{pc.project}")
    stolen = type(other)(**{**other.__dict__, "labels": {**other.labels, L.RUN: "someone-else"}})
    with pytest.raises(BadInput) as e:
        prov.apply(pc, stolen, deadline_s=FAST_DEADLINE)
    assert e.value.field == "name"
    assert pc.storage.lookup_bucket(f"b-{pc.project}") is None  # rolled back
    prov.down(pc, "run1", delete_bucket=True)


def test_zone_failover_on_capacity_errors(pc, cloud):
    cloud.faults.add("capacity", service="tpu", method="nodes.create", zone="us-central1-a")
    plan = make_plan(pc, zone=["us-central1-a", "us-central1-b"])
    seen: list[tuple[str, str]] = []
    result = prov.apply(pc, plan, progress=lambda k, s, d: seen.append((k, s)), deadline_s=FAST_DEADLINE)
    assert result.zone == "us-central1-b"
    assert ("tpu/us-central1-a/run1", "failed") in seen
    assert f"projects/{pc.project}/locations/us-central1-a/nodes/run1" not in everything(pc)
    assert "tpu/us-central1-a/run1" not in result.created
    prov.down(pc, "run1", delete_bucket=True)
    assert everything(pc) == []


def test_vm_fails_over_on_zone_resource_pool_exhausted(pc, cloud):
    cloud.faults.add("capacity", service="compute", method="instances.insert", zone="us-central1-a")
    plan = make_plan(pc, zone=["us-central1-a", "us-central1-b"], vms=[{"name": "d"}])
    result = prov.apply(pc, plan, deadline_s=FAST_DEADLINE)
    assert result.get(prov.Kind.VM).location == "us-central1-b" and result.zone == "us-central1-a"
    assert "vm/us-central1-a/run1-d" not in result.created
    prov.down(pc, "run1", delete_bucket=True)
    assert everything(pc) == []


def test_keep_on_failure_keeps_what_was_created(pc, cloud):
    cloud.faults.add("capacity", service="tpu")
    plan = make_plan(pc)
    with pytest.raises(CapacityError) as e:
        prov.apply(pc, plan, deadline_s=FAST_DEADLINE, keep_on_failure=True)
    assert "tpuctl down run1" in e.value.message
    assert everything(pc) == [plan.bucket]
    prov.down(pc, "run1", delete_bucket=True)
    assert everything(pc) == []


def test_no_capacity_anywhere_rolls_everything_back(pc, cloud):
    cloud.faults.add("capacity", service="tpu")
    plan = make_plan(pc, zone=["us-central1-a", "us-central1-b"], vms=[{"name": "d"}])
    removed: list[list[str]] = []
    with pytest.raises(CapacityError) as e:
        prov.apply(pc, plan, deadline_s=FAST_DEADLINE, on_rollback=removed.append)
    assert e.value.exit_code == 3 and "us-central1-a" in e.value.message and "removed" in e.value.message
    assert f"bucket/us-central1/{plan.bucket}" in removed[0] and "vm/us-central1-a/run1-d" in removed[0]
    assert everything(pc) == []


def test_503_and_429_storms_are_retried(pc, cloud):
    cloud.faults.add("unavailable", service="tpu", count=6)
    cloud.faults.add("unavailable", service="compute", count=4)
    cloud.faults.add("quota", service="tpu", method="nodes.get", count=2, quota="ReadRequestsPerMinutePerProject")
    result = prov.apply(pc, make_plan(pc, vms=[{"name": "d"}]), deadline_s=FAST_DEADLINE)
    assert result.get(prov.Kind.TPU).state is prov.State.READY
    assert not cloud.faults.list()  # every injected failure was met and retried
    prov.down(pc, "run1", delete_bucket=True)
    assert everything(pc) == []


def test_quota_error_names_the_quota_and_leaves_nothing(pc, cloud):
    cloud.faults.add("quota", service="tpu", method="nodes.create", quota="TPUV3sPerProjectPerZoneForTPUAPI")
    with pytest.raises(QuotaError) as e:
        prov.apply(pc, make_plan(pc), deadline_s=FAST_DEADLINE)
    assert "TPUV3sPerProjectPerZoneForTPUAPI" in e.value.message and e.value.exit_code == 3
    assert everything(pc) == []


def test_existing_bucket_in_another_region_is_refused_before_anything_is_created(pc):
    pc.storage.create_bucket(f"us-{pc.project}", location="us-central1")
    with pytest.raises(BadInput) as e:
        prov.apply(pc, make_plan(pc, bucket=f"us-{pc.project}"), deadline_s=FAST_DEADLINE)
    assert e.value.field == "bucket" and "per GB" in e.value.message
    assert everything(pc) == [f"us-{pc.project}"]
    result = prov.apply(pc, make_plan(pc, bucket=f"us-{pc.project}", allow_cross_region=True),
                        deadline_s=FAST_DEADLINE)
    assert result.get(prov.Kind.BUCKET).location == "us-central1"
    prov.down(pc, "run1", delete_bucket=True)


def test_cancel_during_create_deletes_what_was_created(pc, cloud):
    cloud.faults.add("stuck", service="tpu", method="nodes.create")
    cancel = threading.Event()
    plan = make_plan(pc)

    def cancel_once_the_node_exists():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(n.endswith("/nodes/run1") for n in everything(pc)):
            time.sleep(0.05)
        cancel.set()

    t = threading.Thread(target=cancel_once_the_node_exists)
    t.start()
    with pytest.raises(Interrupted) as e:
        prov.apply(pc, plan, deadline_s=FAST_DEADLINE, cancel=cancel)
    t.join()
    assert e.value.exit_code == 130 and "tpu/europe-west4-a/run1" in e.value.message
    cloud.faults.clear()
    assert everything(pc) == []


def test_preempted_node_shows_as_such_and_recreate_brings_it_back(pc, cloud):
    prov.apply(pc, make_plan(pc, provisioning="spot"), deadline_s=FAST_DEADLINE)
    before = prov.get_node(pc, "europe-west4-a", "run1")
    prov.add_ssh_key(pc, "europe-west4-a", "run1", "me", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE me@laptop")
    cloud.preempt(f"projects/{pc.project}/locations/europe-west4-a/nodes/run1")
    deadline = time.monotonic() + 10
    while prov.get_node(pc, "europe-west4-a", "run1").state is not prov.State.PREEMPTED:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (status,) = prov.status(pc, "run1")
    assert status.state is prov.State.PREEMPTED
    after = prov.recreate_node(pc, "europe-west4-a", "run1", deadline_s=FAST_DEADLINE)
    assert after.state is prov.State.READY and after.labels == before.labels and after.spot
    raw = pc.tpu.get_node(name=f"projects/{pc.project}/locations/europe-west4-a/nodes/run1")
    assert "me:ssh-ed25519" in raw.metadata["ssh-keys"]
    assert prov.recreate_node(pc, "europe-west4-a", "run1").created == after.created  # READY: left alone
    prov.down(pc, "run1", delete_bucket=True)
    assert everything(pc) == []


def test_ssh_key_is_added_once(pc):
    prov.apply(pc, make_plan(pc), deadline_s=FAST_DEADLINE)
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIF me@laptop"
    assert prov.add_ssh_key(pc, "europe-west4-a", "run1", "me", key) is True
    assert prov.add_ssh_key(pc, "europe-west4-a", "run1", "me", key) is False
    raw = pc.tpu.get_node(name=f"projects/{pc.project}/locations/europe-west4-a/nodes/run1")
    assert raw.metadata["ssh-keys"].count("me:ssh-ed25519") == 1
    prov.down(pc, "run1", delete_bucket=True)


def test_down_of_an_unknown_run_is_a_no_op_and_status_says_not_found(pc):
    assert prov.down(pc, "ghost").deleted == ()
    with pytest.raises(NotFound) as e:
        prov.status(pc, "ghost")
    assert e.value.field == "run"


def test_state_table_covers_every_api_enum():
    from tpuctl.provision import states

    assert set(states.NODE) == set(tpu_v2.Node.State)
    assert set(states.QUEUED) == set(tpu_v2.QueuedResourceState.State)
    assert set(states.INSTANCE) == {s.name for s in compute_v1.Instance.Status} - {"UNDEFINED_STATUS"}


@pytest.mark.parametrize("health, expected", [("HEALTHY", "ready"), ("HEALTH_UNSPECIFIED", "ready"),
                                              ("TIMEOUT", "ready"), ("UNHEALTHY_MAINTENANCE", "repairing")])
def test_a_ready_node_under_maintenance_counts_as_repairing(health, expected):
    """Google's Node.Health UNHEALTHY_MAINTENANCE: "under maintenance ... will resume running once rescheduled",
    whatever the state; a READY slice reporting it is waited for (recreate_node, the run's watch), not lost."""
    from tpuctl.provision import states

    node = tpu_v2.Node(state=tpu_v2.Node.State.READY, health=tpu_v2.Node.Health[health])
    assert states.node_state(node).value == expected
    assert states.node_state(tpu_v2.Node(state=tpu_v2.Node.State.PREEMPTED)) is prov.State.PREEMPTED
