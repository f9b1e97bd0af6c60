"""TPU quota in the zone: Cloud Quotas `quotaInfos.get` as localcloud serves it from a project's shape, Google's
429 for a create past it, and tpuctl's preflight, which refuses such a slice before creating anything (exit 3,
naming the quota and where to raise it) and never stops a run when the quota cannot be read.
"""

from __future__ import annotations

import json

import pytest
from conftest import FAST_POLLING, new_project, tpuctl
from google.api_core import exceptions as gexc
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import tpu_v2

from tpuctl import catalog
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
    assert preflight.zone_limit(info, ZONE) == 8 and preflight.zone_limit(info, OTHER_ZONE) > 8
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
    p = tpuctl(env, "up", "--accelerator", "v6e-8", "--zone", f"{ZONE},{OTHER_ZONE}", "--name", "q1", "--yes")
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
    p = tpuctl(env, "doctor", "--zone", ZONE, "--accelerator", "v6e-8", "--json")
    assert p.returncode == 3, p.stderr
    quota = next(c for c in json.loads(p.stdout)["checks"] if c["name"] == "tpu-quota")
    assert not quota["ok"] and quota["missing"] == [V6E] and f"{ZONE} 0" in quota["detail"]
    p = tpuctl(env, "doctor", "--zone", OTHER_ZONE, "--accelerator", "v6e-8")
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

    from tpuctl.errors import QuotaError, from_google, quota_violation

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
