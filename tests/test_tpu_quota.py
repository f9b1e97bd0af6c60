"""TPU quota in the zone: Cloud Quotas `quotaInfos.get` as localcloud serves it from a project's shape, Google's
429 for a create past it, and tpuctl's preflight, which refuses such a slice before creating anything (exit 3,
naming the quota and where to raise it) and never stops a run when the quota cannot be read.
"""

from __future__ import annotations

import json

import pytest
from conftest import FAST_POLLING, new_project, tpuctl_here
from google.api_core import exceptions as gexc
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import tpu_v2

from tpuctl import catalog, spec
from tpuctl import provision as prov
from tpuctl.errors import QuotaError
from tpuctl.provision import preflight
from tpuctl.provision.clients import build

ZONE, OTHER_ZONE = "us-east5-a", "us-east5-b"
V6E = "TPUV6EPerProjectPerZoneForTPUAPI"
V6E_SPOT = "TPUV6EPreemptiblePerProjectPerZoneForTPUAPI"


def quota_info(cloud, project: str, quota: str) -> dict:
    pc = build(project=project, credentials=AnonymousCredentials(), endpoint=cloud.endpoint,
               storage_host=cloud.storage_host, local=True)
    return pc.get_json("cloudquotas", f"v1/projects/{project}/locations/global/services/tpu.googleapis.com/quotaInfos/{quota}")


def create(cloud, project: str, node_id: str, accelerator: str, *, spot: bool = False) -> tpu_v2.Node:
    tpu = tpu_v2.TpuClient(transport="rest", credentials=AnonymousCredentials(),
                           client_options=ClientOptions(api_endpoint=cloud.endpoint))
    node = tpu_v2.Node(accelerator_type=accelerator, runtime_version="v2-alpha-tpuv6e",
                       scheduling_config=tpu_v2.SchedulingConfig(spot=spot))
    return tpu.create_node(parent=f"projects/{project}/locations/{ZONE}", node_id=node_id, node=node).result(
        polling=FAST_POLLING)


def test_quota_info_serves_the_shaped_limit_per_zone_most_specific_first(cloud):
    project = new_project()
    cloud.shape_project(project, tpu_quotas={V6E: {ZONE: 8}})
    info = quota_info(cloud, project, V6E)
    assert info["quotaId"] == V6E and info["service"] == "tpu.googleapis.com"
    assert info["dimensions"] == ["region", "zone"]
    first, rest = info["dimensionsInfos"]
    assert first["dimensions"] == {"region": "us-east5", "zone": ZONE} and first["details"]["value"] == "8"
    assert rest["dimensions"] == {} and ZONE not in rest["applicableLocations"]
    assert preflight.limit_in(info, {"region": "us-east5", "zone": ZONE}) == 8
    assert preflight.limit_in(info, {"region": "us-east5", "zone": OTHER_ZONE}) > 8
    with pytest.raises(gexc.NotFound):
        quota_info(cloud, project, "TPUV9sPerProjectPerZoneForTPUAPI")


def test_a_create_past_the_quota_gets_googles_429_naming_it(cloud):
    project = new_project()
    cloud.shape_project(project, tpu_quotas={V6E: {ZONE: 8}, V6E_SPOT: 0})
    create(cloud, project, "a", "v6e-4")
    with pytest.raises(gexc.TooManyRequests) as e:  # 4 in use + 8 asked > 8
        create(cloud, project, "b", "v6e-8")
    assert f"Quota '{V6E}' exhausted. Limit 8 in zone {ZONE}" in e.value.message
    # error_details.proto: the violated quota is the violation's quota_id ("limit name"), the subject the project
    from tpuctl.errors import quota_violation

    assert quota_violation(e.value) == V6E
    [violation] = [v for d in e.value.details if isinstance(d, dict) for v in d.get("violations", [])]
    assert violation["quotaId"] == V6E and violation["subject"] == f"project:{project}"
    with pytest.raises(gexc.TooManyRequests, match=f"Quota limit '{V6E_SPOT}' has been exceeded. Limit: 0"):
        create(cloud, project, "c", "v6e-4", spot=True)  # spot draws on the Preemptible quota
    create(cloud, project, "d", "v6e-4")  # 4 + 4 fits


@pytest.mark.parametrize("accelerator,spot,quota", [
    ("v2-8", False, "TPUV2sPerProjectPerZoneForTPUAPI"),
    ("v2-32", True, "TPUV2sPreemptiblePodPerProjectPerZoneForTPUAPI"),
    ("v4-16", False, "TPUV4sPodPerProjectPerZoneForTPUAPI"),
    ("v5litepod-8", False, "TPUV5sLitepodServingPerProjectPerZoneForTPUAPI"),
    ("v5litepod-16", False, "TPUV5sLitepodPerProjectPerZoneForTPUAPI"),
    ("v5p-8", True, "TPUV5PPreemptiblePerProjectPerZoneForTPUAPI"),
    ("v6e-8", False, V6E),
])
def test_each_generation_draws_on_the_quota_google_names(accelerator, spot, quota):
    assert preflight.tpu_quota_id(catalog.load().accelerator(accelerator), spot) == quota


def test_up_past_the_quota_in_every_zone_exits_3_naming_it_and_creates_nothing(cloud, env):
    project = env["TPUCTL_PROJECT"]
    cloud.shape_project(project, tpu_quotas={V6E: 4})
    p = tpuctl_here(env, "up", "--accelerator", "v6e-8", "--zone", f"{ZONE},{OTHER_ZONE}", "--name", "q1", "--yes")
    assert p.returncode == 3, p.stderr
    assert "tpu-quota: v6e-8 needs 8 of quota " + V6E in p.stderr and "iam-admin/quotas" in p.stderr
    inv = cloud.inventory()
    assert not [r for r in inv["nodes"] + inv["queued_resources"] if f"projects/{project}/" in r["name"]]
    pc = build(project=project, credentials=AnonymousCredentials(), endpoint=cloud.endpoint,
               storage_host=cloud.storage_host, local=True)
    assert list(pc.storage.list_buckets(project=project)) == []


def test_doctor_shows_the_quota_line_and_exits_3_when_quota_is_the_only_problem(cloud, env):
    project = env["TPUCTL_PROJECT"]
    cloud.shape_project(project, tpu_quotas={V6E: {ZONE: 0}})
    p = tpuctl_here(env, "doctor", "--zone", ZONE, "--accelerator", "v6e-8", "--json")
    assert p.returncode == 3, p.stderr
    quota = next(c for c in json.loads(p.stdout)["checks"] if c["name"] == "tpu-quota")
    assert not quota["ok"] and quota["missing"] == [V6E] and f"{ZONE} 0" in quota["detail"]
    p = tpuctl_here(env, "doctor", "--zone", OTHER_ZONE, "--accelerator", "v6e-8")
    assert p.returncode == 0 and f"ok       tpu-quota: {V6E}: {OTHER_ZONE}" in p.stdout


def test_a_quota_that_cannot_be_read_warns_and_stops_nothing(cloud):
    project = new_project()
    cloud.shape_project(project, disabled_services=["cloudquotas.googleapis.com"])
    pc = build(project=project, credentials=AnonymousCredentials(), endpoint=cloud.endpoint,
               storage_host=cloud.storage_host, local=True)
    target = preflight.Target(accelerator=catalog.load().accelerator("v6e-8"), zones=(ZONE,))
    checks = preflight.require(pc, target)  # does not raise
    quota = next(c for c in checks if c.name == "tpu-quota")
    assert quota.status == "unknown" and "Cloud Quotas API" in quota.detail
    assert "gcloud services enable cloudquotas.googleapis.com" in quota.fix


def test_the_quota_is_read_from_quota_id_or_a_subject_that_names_no_caller():
    """error_details.proto: `quota_id` is the quota ("limit name"); `subject` is what the check failed on,
    e.g. "project:<Google developer project id>" (not a quota), though older refusals put the quota there."""
    from google.rpc import error_details_pb2

    from tpuctl.errors import from_google, quota_violation

    def refusal(*details):
        return gexc.TooManyRequests("Quota exceeded", details=list(details))

    violation = error_details_pb2.QuotaFailure.Violation
    assert quota_violation(refusal(error_details_pb2.QuotaFailure(violations=[
        violation(subject="project:p1", quota_id=V6E)]))) == V6E
    assert quota_violation(refusal({"@type": "type.googleapis.com/google.rpc.QuotaFailure",
                                    "violations": [{"subject": V6E, "description": "..."}]})) == V6E
    assert quota_violation(refusal(error_details_pb2.QuotaFailure(violations=[violation(subject="project:p1")]))) is None
    info = error_details_pb2.ErrorInfo(reason="RESOURCE_QUOTA_EXCEEDED", metadata={"quota_limit": V6E_SPOT})
    err = from_google(refusal(info), what="create")
    assert isinstance(err, QuotaError) and V6E_SPOT in err.message


# --- flex-start draws on preemptible quota; TPU7x on Compute Engine's (issues 26 and 32) ---
FLEX_ZONE = "us-east5-a"  # where Google sells v6e flex-start
T7X_ZONE = "us-central1-c"
FAMILY = "TPUS-PER-TPU-FAMILY-per-project-region"
T7X_SPOT = "PREEMPTIBLE-TPU7X-per-project-region"
T7X_IMAGE = "projects/ubuntu-os-accelerator-images/global/images/family/ubuntu-accel-2404-amd64-tpu-tpu7x"


@pytest.mark.parametrize("accelerator,provisioning,service,quotas,need", [
    ("v6e-8", "flex-start", "tpu.googleapis.com", [V6E_SPOT], 8),
    ("v6e-8", "queued", "tpu.googleapis.com", [V6E], 8),
    ("tpu7x-16", "on-demand", "compute.googleapis.com", [FAMILY], 8),
    ("tpu7x-8", "spot", "compute.googleapis.com", [T7X_SPOT], 4),
    ("tpu7x-8", "flex-start", "compute.googleapis.com", [T7X_SPOT, FAMILY], 4),
])
def test_each_provisioning_model_is_checked_against_the_quota_google_draws_it_from(accelerator, provisioning, service,
                                                                                   quotas, need):
    zone = T7X_ZONE if accelerator.startswith("tpu7x") else FLEX_ZONE
    [check] = preflight.quota_checks(catalog.load().accelerator(accelerator), provisioning, (zone,))
    assert (check.service, list(check.quotas), check.need) == (service, quotas, need)
    if service == "compute.googleapis.com":  # regional; the shared standard quota is picked by its TPU family
        assert check.where == "us-central1"
        assert [dict(d) for d in check.dimensions] == [
            {"region": "us-central1", **({"tpu_family": "tpu7x"} if q == FAMILY else {})} for q in quotas]


def test_up_dry_run_json_names_the_quota_each_zone_is_checked_against(env):
    p = tpuctl_here(env, "up", "--accelerator", "v6e-8", "--zone", f"{FLEX_ZONE}", "--provisioning", "flex-start",
                    "--max-run-duration", "1h", "--name", "d1", "--dry-run", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["plan"]["quotas"] == [
        {"zone": FLEX_ZONE, "service": "tpu.googleapis.com", "quota": V6E_SPOT,
         "dimensions": {"region": "us-east5", "zone": FLEX_ZONE}, "needs": 8}]
    [quota] = plan_of(env["TPUCTL_PROJECT"], accelerator="tpu7x-8", zone=T7X_ZONE, provisioning="flex-start",
                      max_run_duration="1h").to_json()["quotas"]
    assert (quota["service"], quota["quota"], quota["needs"]) == ("compute.googleapis.com", T7X_SPOT, 4)
    assert quota["fallback"] == [{"quota": FAMILY, "dimensions": {"region": "us-central1", "tpu_family": "tpu7x"}}]


def test_flex_start_runs_on_a_project_without_on_demand_quota_and_counts_as_preemptible(pc, cloud):
    """tpu/docs/request-using-flex-start: flex-start needs "sufficient preemptible quota"; on-demand quota 0
    (most projects' default) stops neither tpuctl's preflight nor Google's create, and the running TPU then
    holds preemptible quota."""
    cloud.shape_project(pc.project, tpu_quotas={V6E: 0, V6E_SPOT: 8})
    plan = plan_of(pc.project, accelerator="v6e-8", zone=FLEX_ZONE, provisioning="flex-start", max_run_duration="1h")
    try:
        prov.apply(pc, plan, deadline_s=60.0)
        with pytest.raises(gexc.TooManyRequests, match=f"Quota '{V6E_SPOT}' exhausted. Limit 8 in zone {FLEX_ZONE}"):
            pc.post_json("tpu", f"v2/projects/{pc.project}/locations/{FLEX_ZONE}/nodes?nodeId=s1",
                         {"acceleratorType": "v6e-4", "runtimeVersion": "v2-alpha-tpuv6e",
                          "schedulingConfig": {"spot": True}})
    finally:
        prov.down(pc, "f1", delete_bucket=True)
    cloud.shape_project(pc.project, tpu_quotas={V6E: 100, V6E_SPOT: 0})
    with pytest.raises(QuotaError) as exc:
        prov.apply(pc, plan, deadline_s=60.0)  # the preflight reads the preemptible quota, not the ample on-demand one
    assert f"needs 8 of quota {V6E_SPOT}" in exc.value.message
    parent = f"projects/{pc.project}/locations/{FLEX_ZONE}"
    with pytest.raises(gexc.TooManyRequests, match=f"Quota limit '{V6E_SPOT}' has been exceeded"):
        pc.post_json("tpu", f"v2alpha1/{parent}/queuedResources?queuedResourceId=f2", {
            "tpu": {"nodeSpec": [{"parent": parent, "nodeId": "f2", "node": {
                "acceleratorType": "v6e-8", "runtimeVersion": "v2-alpha-tpuv6e"}}]},
            "provisioningModel": "FLEX_START", "runDuration": {"maxRunDuration": "3600s"}})


def test_localcloud_counts_tpu7x_chips_against_compute_engines_regional_quotas(pc, cloud):
    """compute/resource-usage ("TPU quota"): on-demand TPU7x VMs draw on the TPU family quota, Spot ones on the
    preemptible one, and a flex-start VM on the preemptible one or, when that has no room, the standard one
    (compute/docs/instances/provisioning-models); Compute refuses past them with 403 quotaExceeded."""
    from tpuctl.errors import from_google
    from tpuctl.provision import compute_tpu

    cloud.shape_project(pc.project, tpu_quotas={FAMILY: {"us-central1": 4}, T7X_SPOT: 0})
    family = pc.get_json("cloudquotas", f"v1/projects/{pc.project}/locations/global/services/compute.googleapis.com/"
                                        f"quotaInfos/{FAMILY}")
    assert family["dimensions"] == ["region", "tpu_family"]
    assert preflight.limit_in(family, {"region": "us-central1", "tpu_family": "tpu7x"}) == 4
    assert preflight.limit_in(family, {"region": "europe-west4", "tpu_family": "tpu7x"}) > 4
    # The created instances stay PENDING (no worker is booted): quota counts from the insert.
    cloud.faults.add("stuck", service="compute", method="instances.insert", zone=T7X_ZONE, count=2)

    def insert(name: str, provisioning: str):
        req = compute_tpu.TpuVmRequest(name=name, zone=T7X_ZONE, machine_type="tpu7x-standard-4t", image=T7X_IMAGE,
                                       labels={}, service_account="a@b.iam.gserviceaccount.com",
                                       provisioning=provisioning,
                                       max_run_duration_s=3600 if provisioning == "flex-start" else None)
        inst = compute_tpu.instance_proto(req)
        return pc.instances.insert_unary(project=pc.project, zone=T7X_ZONE, instance_resource=inst)

    insert("a1", "on-demand")  # 4 chips of 4
    for name, provisioning, quota, limit in (("a2", "on-demand", FAMILY, 4), ("s1", "spot", T7X_SPOT, 0),
                                             ("f1", "flex-start", FAMILY, 4)):
        with pytest.raises(gexc.Forbidden) as exc:
            insert(name, provisioning)
        assert f"Quota '{quota}' exceeded.  Limit: {float(limit)} in region us-central1." in exc.value.message
        assert isinstance(from_google(exc.value, what="insert"), QuotaError)
    compute_tpu.delete(pc, T7X_ZONE, "a1", deadline_s=60.0)
    insert("f1", "flex-start")  # no preemptible room: the standard quota, now free
    assert [i.name for _, s in pc.instances.aggregated_list(project=pc.project) for i in s.instances] == ["f1"]
    # A slice's MIG meets the quota as each instance is inserted: its managed instances report QUOTA_EXCEEDED.
    req = compute_tpu.TpuVmRequest(name="m1", zone=T7X_ZONE, machine_type="tpu7x-standard-4t", image=T7X_IMAGE,
                                   labels={}, service_account="a@b.iam.gserviceaccount.com")
    try:
        with pytest.raises(QuotaError, match=FAMILY):
            compute_tpu.create_slice(pc, req, hosts=2, topology="2x2x2", catalog=catalog.load(), deadline_s=60.0)
    finally:
        compute_tpu.delete_slice(pc, T7X_ZONE, "m1", deadline_s=60.0)
    compute_tpu.delete(pc, T7X_ZONE, "f1", deadline_s=60.0)


def test_doctor_checks_tpu7x_against_compute_engine_and_every_region_of_the_failover_list(cloud, env, pc):
    project = env["TPUCTL_PROJECT"]
    cloud.shape_project(project, denied_permissions=["compute.instanceGroupManagers.create"],
                        tpu_quotas={FAMILY: {"us-central1": 4}})
    p = tpuctl_here(env, "doctor", "--zone", T7X_ZONE, "--accelerator", "tpu7x-16", "--json")
    assert p.returncode == 2, p.stderr
    checks = {c["name"]: c for c in json.loads(p.stdout)["checks"]}
    assert checks["permissions"]["missing"] == ["compute.instanceGroupManagers.create"]
    assert checks["tpu-quota"]["missing"] == [FAMILY] and f"{T7X_ZONE} 4" in checks["tpu-quota"]["detail"]

    def doctor(**fields) -> dict[str, preflight.Check]:  # what `tpuctl doctor` checks for these flags
        target = preflight.Target.of_spec(spec.from_mapping({"ttl": "2h", **fields}), catalog.load())
        return {c.name: c for c in preflight.checks(pc, target)}

    quota = doctor(accelerator="tpu7x-8", zone=T7X_ZONE, provisioning="spot")["tpu-quota"]
    assert quota.ok and quota.detail.startswith(f"{T7X_SPOT}: {T7X_ZONE}")
    # A failover zone in another region creates there: its subnetwork must exist too.
    cloud.shape_project(project, networks=["vpc1"], subnetworks=["us-east5/sub1/vpc1"])
    subnet = doctor(accelerator="v6e-8", zone=f"{FLEX_ZONE},europe-west4-a", network="vpc1", subnet="sub1")["subnetwork"]
    assert not subnet.ok and subnet.detail == "subnetwork sub1 in europe-west4 does not exist"


def plan_of(project: str, **fields):
    return prov.plan(spec.from_mapping({"name": "f1", "ttl": "2h", **fields}), project=project, owner="tester")
