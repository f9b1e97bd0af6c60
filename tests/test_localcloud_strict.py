"""Strict schema mode: the discovery documents decide what a request or response may contain."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from google.api_core import exceptions as gexc
from google.cloud import tpu_v2

from test_localcloud_compute import _instance
from tpuctl.localcloud.cloud import LocalCloud
from tpuctl.localcloud.schema import Validator, validator

ZONE = "europe-west4-a"


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_misspelled_tpu_field_is_rejected_with_its_path(cloud):
    url = f"{cloud.endpoint}/v2/projects/lc-strict/locations/{ZONE}/nodes?nodeId=typo&%24alt=json%3Benum-encoding%3Dint"
    code, body = _post(url, {"acceleratorType": "v3-8", "runtimeVersion": "tpu-vm-tf-2.14.1",
                             "schedulingConfig": {"spott": True}})
    assert code == 400
    assert body["error"]["status"] == "INVALID_ARGUMENT"
    assert "node.schedulingConfig: unknown field(s) spott" in body["error"]["message"]


def test_misspelled_compute_field_is_rejected(cloud):
    inst = {"name": "typo", "machineTyp": "zones/us-central1-a/machineTypes/e2-small",
            "disks": [{"boot": True, "initializeParams": {"sourceImage": "projects/debian-cloud/global/images/family/debian-12"}}]}
    code, body = _post(f"{cloud.endpoint}/compute/v1/projects/lc-strict/zones/us-central1-a/instances", inst)
    assert code == 400 and "instance: unknown field(s) machineTyp" in body["error"]["message"]
    assert body["error"]["errors"][0]["reason"] == "invalid"


def test_output_only_field_in_a_request_is_rejected_through_the_official_client(clients):
    node = tpu_v2.Node(accelerator_type="v3-8", runtime_version="tpu-vm-tf-2.14.1", state=tpu_v2.Node.State.READY)
    with pytest.raises(gexc.BadRequest, match="node.state: output-only"):
        clients.tpu.create_node(parent=clients.parent(ZONE), node_id="ro", node=node)
    inst = _instance("ro")
    inst.id = 42
    with pytest.raises(gexc.BadRequest, match="instance.id: output-only"):
        clients.instances.insert_unary(project=clients.project, zone="us-central1-a", instance_resource=inst)
    assert list(clients.tpu.list_nodes(parent=clients.parent(ZONE))) == []


def test_bad_enum_number_is_rejected(cloud):
    url = f"{cloud.endpoint}/v2/projects/lc-strict/locations/{ZONE}/nodes?nodeId=enum&%24alt=json%3Benum-encoding%3Dint"
    code, body = _post(url, {"acceleratorConfig": {"type": 99, "topology": "2x2"}, "runtimeVersion": "tpu-vm-tf-2.14.1"})
    assert code == 400 and "node.acceleratorConfig.type" in body["error"]["message"]


def test_response_drift_is_a_500_in_strict_mode(clients, cloud, monkeypatch):
    clients.tpu.create_node(parent=clients.parent(ZONE), node_id="drift", node=tpu_v2.Node(
        accelerator_type="v3-8", runtime_version="tpu-vm-tf-2.14.1"))
    real_view = cloud.tpu.view
    monkeypatch.setattr(cloud.tpu, "view", lambda rec: {**real_view(rec), "colour": "blue"})
    with pytest.raises(gexc.InternalServerError, match="colour"):
        clients.tpu.get_node(name=f"{clients.parent(ZONE)}/nodes/drift")


def test_non_strict_mode_ignores_unknown_fields():
    with LocalCloud(speed=1000, strict=False) as loose:
        url = f"{loose.endpoint}/v2/projects/lc-loose/locations/{ZONE}/nodes?nodeId=loose"
        code, body = _post(url, {"acceleratorType": "v3-8", "runtimeVersion": "tpu-vm-tf-2.14.1", "colour": "blue"})
        assert code == 200 and body["name"].startswith("projects/lc-loose/locations/")


@pytest.mark.parametrize("doc,schema,body,problem", [
    ("storage.v1", "Bucket", {"name": "b", "locaton": "US"}, "bucket: unknown field(s) locaton"),
    ("storage.v1", "Bucket", {"name": "b", "labels": {"k": 1}}, "bucket.labels.k"),
    ("compute.v1", "AttachedDisk", {"initializeParams": {"diskSizeGb": "ten"}}, "attachedDisk.initializeParams.diskSizeGb"),
    ("cloudresourcemanager.v3", "Project", {"state": "ASLEEP"}, "project.state"),
    ("cloudbilling.v1", "Sku", {"pricingInfo": [{"pricingExpression": {"tieredRates": [{"unitPrice": {"nanos": "x"}}]}}]},
     "sku.pricingInfo[0].pricingExpression.tieredRates[0].unitPrice.nanos"),
])
def test_validator_reports_the_offending_path(doc, schema, body, problem):
    problems = Validator(doc).check_response(schema, body)
    assert len(problems) == 1 and problems[0].startswith(problem)


def test_output_only_is_allowed_in_responses_and_validators_are_cached():
    v = validator("tpu.v2")
    assert v is validator("tpu.v2")
    body = {"name": "projects/p/locations/z/nodes/n", "state": "READY", "id": "123", "labels": {"a": "b"}}
    assert v.check_response("Node", body) == []
    problems = v.check_request("Node", body)
    assert len(problems) == 1 and problems[0].endswith("output-only field is not allowed in a request")
    assert v.check_request("Node", {"labels": {"a": "b"}, "acceleratorType": "v3-8"}) == []
    with pytest.raises(KeyError):
        v.check_request("NoSuchSchema", {})
